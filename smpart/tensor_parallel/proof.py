"""The proof of a head split: each rank's localised copy runs with its shards, forward and
backward, the partial sums added as the all-reduces would add them, and every output and
gradient compared with the whole module's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from smpart.tensor_parallel.layers import local_shard
from smpart.tensor_parallel.lineage import ObservedRun, fresh_inputs, run_backward, tensors_of
from smpart.tensor_parallel.localize import HeadSplit, localize

#: The split must match the whole module to this, relative to the output's largest value.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def proven(whole: nn.Module, layout: HeadSplit, degree: int, args: tuple, kwargs: dict, run: ObservedRun,
            dtype: torch.dtype) -> HeadSplit | str:
    """The first localising variant whose emulated split computes what the whole module does."""
    attributes = _divided_attributes(whole, layout)
    width = whole.get_submodule(layout.columns[0][0]).in_features
    variants = [HeadSplit(**{**layout.__dict__, "attributes": attributes})]
    if width % degree == 0:
        variants.append(HeadSplit(**{**layout.__dict__, "attributes": attributes, "local_width": width}))
    failures = []
    for variant in variants:
        problem, summed = _emulate(whole, variant, degree, args, kwargs, run, _TOLERANCE[dtype])
        if not problem:
            return HeadSplit(**{**variant.__dict__, "summed": summed})
        failures.append(problem)
    return "split by heads, " + "; with its input's width localised too, ".join(dict.fromkeys(failures))


def _divided_attributes(module: nn.Module, layout: HeadSplit) -> tuple[str, ...]:
    """The module's own integer attributes that count its heads or hold a width of heads."""
    counts = {layout.q_heads, layout.kv_heads}
    widths = {layout.q_heads * layout.head_dim, layout.kv_heads * layout.head_dim} - {layout.head_dim}
    found = []
    for name, value in vars(module).items():
        if name.startswith("_") or type(value) is not int:
            continue
        lower = name.lower()
        sized = any(w in lower for w in ("dim", "size", "width"))
        head_size = "head" in lower and "all_head" not in lower and sized
        ratio = any(w in lower for w in ("rep", "group", "per_", "ratio"))
        if ratio or head_size:
            continue
        count = ("head" in lower or lower in ("nh", "n_h")) and value in counts
        width = any(w in lower for w in _WIDTH_WORDS) and value in widths
        if count or width:
            found.append(name)
    return tuple(found)


_WIDTH_WORDS = ("embd", "embed", "dim", "hidden", "width", "model", "inner", "split_size", "n_state",
                "all_head_size", "channels", "features")


def _emulate(whole: nn.Module, split: HeadSplit, degree: int, args: tuple, kwargs: dict, run: ObservedRun,
             tolerance: float) -> tuple[str, tuple[str, ...]]:
    """Run each rank's localised copy with its shards and do by hand what the layers' collectives
    do: add the output projection's partial sums (forward), add the column projections' input
    gradients (backward). Returns ("", parameters to sum) when every rank's output and gradients
    are the whole module's, else (what differs, ())."""
    ranks = []
    try:
        for rank in range(degree):
            columns = {name: _ColumnShard(whole.get_submodule(name), rank, degree, fused)
                       for name, fused in split.columns}
            row = _RowShard(whole.get_submodule(split.row), rank, degree)
            # the copy takes the shards in place of the projections, which are never copied
            shards = {**columns, split.row: row}
            local = copy.deepcopy(whole, {id(whole.get_submodule(n)): shard for n, shard in shards.items()})
            localize(local, split, degree)
            ranks.append(_Rank(local, columns, row))
        with torch.no_grad():  # first pass: what each rank feeds its output projection
            for r in ranks:
                r.module(*fresh_inputs(args, kwargs)[0], **fresh_inputs(args, kwargs)[1])
        total = torch.stack([r.row.partial for r in ranks]).sum(0)
        bias = whole.get_submodule(split.row).bias
        total = total if bias is None else total + bias.detach()
        for r in ranks:  # second pass: every rank goes on from the reduced sum, and back
            r.row.total = total
            r.args, r.kwargs = fresh_inputs(args, kwargs)
            r.output = r.module(*r.args, **r.kwargs)
            run_backward(r.output, retain_graph=True)
        for name in dict(split.columns):  # each column projection's input gradient, summed over ranks
            grads = [r.columns[name].leaf.grad for r in ranks]
            if all(g is not None for g in grads) and ranks[0].columns[name].seen.requires_grad:
                summed_grad = torch.stack(grads).sum(0)
                for r in ranks:
                    torch.autograd.backward(r.columns[name].seen, summed_grad, retain_graph=True)
    except Exception as err:  # the localised forward failed on the user's code: not splittable
        return f"it fails ({type(err).__name__}: {first_line(err)})", ()
    for rank, r in enumerate(ranks):
        problem = _difference(run.output, r.output, tolerance) or _shard_grads_differ(r, rank, degree, split,
                                                                                      run, tolerance)
        if not problem:
            input_grads = [t.grad for t in tensors_of((r.args, r.kwargs))]
            problem = next((f"the gradient of its input {i} is off" for i, (want, got)
                            in enumerate(zip(run.input_grads, input_grads, strict=True))
                            if not _close(want, got, tolerance)), "")
        if problem:
            return f"rank {rank} of {degree} computes something else ({problem})", ()
    return _replicated_grads(ranks, split, run, tolerance)


@dataclass
class _Rank:
    """One emulated rank: its localised module, its shards, and what its second pass gave."""

    module: nn.Module
    columns: dict[str, _ColumnShard]
    row: _RowShard
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: Any = None


def _shard_grads_differ(rank_run: _Rank, rank: int, degree: int, split: HeadSplit, run: ObservedRun,
                        tolerance: float) -> str:
    for name, fused in split.columns:
        shard = rank_run.columns[name]
        for pname in ("weight", "bias"):
            whole = run.grads.get(f"{name}.{pname}")
            mine = getattr(shard, pname)
            if whole is not None and mine is not None and \
                    not _close(local_shard(whole, 0, rank, degree, fused), mine.grad, tolerance):
                return f"the gradient of {name}.{pname} is off"
    whole = run.grads.get(f"{split.row}.weight")
    mine = rank_run.row.weight.grad
    if whole is not None and not _close(whole.chunk(degree, dim=1)[rank], mine, tolerance):
        return f"the gradient of {split.row}.weight is off"
    return ""


def _replicated_grads(ranks: list[_Rank], split: HeadSplit, run: ObservedRun,
                      tolerance: float) -> tuple[str, tuple[str, ...]]:
    """Every other parameter's gradient is the whole module's on every rank (used on whole
    activations), or summed over the ranks (used on their heads only: to be summed)."""
    projections = {name for name, _ in split.columns} | {split.row}
    summed = []
    for name, _ in ranks[0].module.named_parameters():
        if name.rpartition(".")[0] in projections:
            continue
        grads = [dict(r.module.named_parameters())[name].grad for r in ranks]
        whole = run.grads.get(name)
        if all(_close(whole, g, tolerance) for g in grads):
            continue
        if all(g is not None for g in grads) and _close(whole, torch.stack(grads).sum(0), tolerance):
            summed.append(name)
            continue
        return f"the gradient of {name}, kept whole on every rank, is neither whole nor a share of it", ()
    return "", tuple(summed)


def _close(want: Tensor | None, got: Tensor | None, tolerance: float) -> bool:
    """Equal to ``tolerance`` relative to the larger of 1 and ``want``'s largest value (None: zeros)."""
    if want is None and got is None:
        return True
    if want is None or got is None:
        present = want if want is not None else got
        return bool(present.abs().max().item() <= tolerance) if present.numel() else True
    if want.shape != got.shape:
        return False
    if not want.numel():
        return True
    return bool((want - got).abs().max().item() <= tolerance * max(1.0, want.abs().max().item()))


class _ColumnShard(nn.Module):
    """A rank's rows of a q/k/v projection (of each fused part). It computes from a leaf copy of its
    input, so that the backward can stop there, add the ranks' input gradients as the layer's
    all-reduce does, and go on from the input itself (``seen``)."""

    def __init__(self, linear: nn.Linear, rank: int, degree: int, fused: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(local_shard(linear.weight.detach(), 0, rank, degree, fused))
        self.bias = None if linear.bias is None else nn.Parameter(
            local_shard(linear.bias.detach(), 0, rank, degree, fused))
        self.seen: Tensor | None = None
        self.leaf: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.seen = x
        self.leaf = x.detach().requires_grad_(x.requires_grad)
        return F.linear(self.leaf, self.weight, self.bias)


class _RowShard(nn.Module):
    """A rank's columns of the output projection: in the first pass it keeps its partial sum; in
    the second it returns the total, its gradient flowing to its own partial sum only (as the
    all-reduce's backward does)."""

    def __init__(self, row: nn.Linear, rank: int, degree: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(row.weight.detach().chunk(degree, dim=1)[rank].clone())
        self.partial: Tensor | None = None
        self.total: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        partial = F.linear(x, self.weight)
        if self.total is None:
            self.partial = partial
            return partial
        return partial + (self.total - partial).detach()


def _difference(expected: Any, got: Any, tolerance: float) -> str:
    want, have = tree_leaves(expected), tree_leaves(got)
    if len(want) != len(have):
        return f"{len(have)} values instead of {len(want)}"
    for a, b in zip(want, have, strict=True):
        if isinstance(a, Tensor) != isinstance(b, Tensor):
            return "other kinds of values"
        if not isinstance(a, Tensor):
            if a != b:
                return f"{b!r} where the whole module returns {a!r}"
            continue
        if a.shape != b.shape:
            return f"an output of shape {tuple(b.shape)} instead of {tuple(a.shape)}"
        if a.is_floating_point() or a.is_complex():
            scale = max(1.0, a.abs().max().item()) if a.numel() else 1.0
            off = (a - b).abs().max().item() if a.numel() else 0.0
            if not off <= tolerance * scale:
                return f"its output is {off:.3g} off the whole module's"
        elif not torch.equal(a, b):
            return "its output differs from the whole module's"
    return ""


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""
