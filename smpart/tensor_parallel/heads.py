"""Attention that no adapter knows: find its heads, split them, and prove the split on the spot.

nanoGPT's ``CausalSelfAttention`` (one fused ``c_attn``, ``n_head``, ``n_embd``), timm's
``Attention`` (fused ``qkv``, ``num_heads``, ``attn_dim``) and torchtitan's (``wq``/``wk``/``wv``,
``n_heads``/``n_kv_heads``) keep their head counts in plain integer attributes and reshape by
them. `find_head_split` splits such a module without knowing its class, in three steps:

1. **Find the heads.** The module runs once, alone, on a CPU copy with random weights and an
   example of its arguments (the traced call's shapes, `smpart.tracing.call_inputs`), under a
   ``TorchFunctionMode`` that follows what each of its ``nn.Linear`` children's outputs become.
   The output projection is the Linear that reads what the others made; the q/k/v projections
   are those it reads from. Each must feed a *reshape by heads*, the first reshape that cuts its
   last dimension into ``(..., heads, head_dim)``: that gives the head dimension and, with the
   projection's width, how many parts a fused projection holds (nanoGPT splits ``c_attn`` into
   three before its view; timm reshapes to ``(3, heads, head_dim)``). Fused parts must be equal:
   one projection holding q heads and fewer, grouped kv heads is kept whole.
2. **Localise.** A rank computes with its share of whole heads: the projections are split
   column-wise by heads (a fused one part by part), the output projection row-wise, and the
   module's integer attributes that count heads (``n_head``, ``num_heads``, ``n_kv_heads``) or
   hold a width of heads (``n_embd``, ``attn_dim``) are divided by the degree; head dimensions
   and ratios (``head_dim``, ``n_rep``) stay. A forward that reads its width from its input
   (nanoGPT's ``B, T, C = x.size()``, used to reshape the heads' output back) is handed its
   share instead: a narrow view of the input of the local width, while the projections are given
   the whole input itself (`_LocalWidthForward`); nothing is copied or communicated.
3. **Prove.** The split is emulated on that CPU copy, forward and backward: each rank's
   localised module runs with its shards, the output projection's partial sums are added as its
   all-reduce would, and in the backward the q/k/v projections' input gradients are added as
   theirs would. Every rank's output, input gradients and shards' gradients must be the whole
   module's. A parameter the module keeps whole (a per-head q/k norm) must get the whole
   module's gradient on every rank, or, used on the local heads only, a share of it: such
   parameters are listed (`HeadSplit.summed`) and, once split for real, read through
   `copy_to_tp` during the module's call, which sums their gradient over the group
   (`_SummedGradients`). A split that fails or differs is not made: the module stays whole, and
   the reason says what happened. Localising variants are tried in order (the attributes alone;
   then with the input's width too) and the first proven one is kept. Proofs are cached per
   class, shapes, attributes, degree and example.

The proof is about the module's code, not its weights, so a model built on the meta device is
proven as well as a real one; it runs in float64 (float32 if the module refuses float64), or,
for a module of more than `_LARGE` parameters, in float32 first: a wrong split is off by the
size of the values, far beyond float32's rounding, and the proof of a Llama-8B-sized attention
then moves half the bytes.

Why one file of ~680 lines: the three steps are one algorithm that reads top to bottom and share
its private records (the observed run `_Run`, the rank emulation `_Rank`); finding calls the
proof, and the proof localises, so apart they would import each other.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from smpart.tensor_parallel.layers import local_shard
from smpart.tracing.call_inputs import Described, example_call, tensor_shapes

#: Sizes of the input made up for a module called without a traced example: (batch, tokens).
_MADE_UP_LEADING = (2, 8)
#: Elements of the largest example the proof runs at its traced size (when shrinking fails).
_LARGEST_EXAMPLE = 2**22
#: The split must match the whole module to this, relative to the output's largest value.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
#: Parameters above which the proof runs in float32 first.
_LARGE = 2**22
_CACHE_SIZE = 256
_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class HeadSplit:
    """How to split one attention module by heads, proven at ``degree``.

    ``columns``: ``(child name, fused parts)`` of the q/k/v projections; ``row``: the output
    projection. ``attributes``: its integer attributes divided by the degree. ``local_width``:
    the width of the input its forward is handed its share of (None: it gets the whole input).
    """

    columns: tuple[tuple[str, int], ...]
    row: str
    q_heads: int
    kv_heads: int
    head_dim: int
    attributes: tuple[str, ...] = ()
    local_width: int | None = None
    #: Parameters kept whole but used on the local heads only (per-head q/k norms): each rank's
    #: gradient is its heads' part, summed over the tensor-parallel group.
    summed: tuple[str, ...] = ()


# ==================================================================== localising
class _LocalWidthForward:
    """The module's forward, handed a narrow view of each input of ``width`` features (the local
    width) while its ``columns`` projections receive the whole input: a forward that reads its
    width from its input (``B, T, C = x.size()``) then reshapes its local heads back with the
    local width. The views stand for the inputs only by identity, for the length of one call."""

    def __init__(self, module: nn.Module, columns: Iterable[str], width: int, degree: int) -> None:
        self.original = self.__wrapped__ = module.forward  # inspect.signature sees the module's own
        self.width, self.local = width, width // degree
        self.whole: dict[int, Tensor] = {}
        for path in columns:
            module.get_submodule(path).register_forward_pre_hook(self._whole_input)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        views: list[Tensor] = []

        def share(value: Any) -> Any:
            if isinstance(value, Tensor) and value.ndim and value.shape[-1] == self.width:
                view = value.narrow(-1, 0, self.local)
                self.whole[id(view)] = value
                views.append(view)
                return view
            return value

        try:
            return self.original(*map(share, args), **{k: share(v) for k, v in kwargs.items()})
        finally:
            for view in views:
                self.whole.pop(id(view), None)

    def _whole_input(self, _module: nn.Module, args: tuple) -> tuple | None:
        if args and isinstance(args[0], Tensor) and id(args[0]) in self.whole:
            return (self.whole[id(args[0])], *args[1:])
        return None


class _SummedGradients:
    """The module's forward, with each of ``names`` (parameters used on the local heads only) read
    through `copy_to_tp` for the length of the call: the same values, and a gradient summed over
    the tensor-parallel group in the backward, as a column-parallel layer's input gets. Parameters
    stay the objects optimizers hold; only the module's view of them changes during its call."""

    def __init__(self, module: nn.Module, names: Iterable[str], group: Any) -> None:
        self.original = self.__wrapped__ = module.forward
        self.module, self.group = module, group
        self.names = [name.rpartition(".") for name in names]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from smpart.tensor_parallel.collectives import copy_to_tp

        held = []
        for path, _, attr in self.names:
            owner = self.module.get_submodule(path) if path else self.module
            param = owner._parameters[attr]
            held.append((owner, attr, param))
            owner._parameters[attr] = copy_to_tp(param, self.group)
        try:
            return self.original(*args, **kwargs)
        finally:
            for owner, attr, param in held:
                owner._parameters[attr] = param


def localize(module: nn.Module, split: HeadSplit, degree: int,
             group: Any = None) -> dict[str, tuple[Any, Any]]:
    """Make ``module`` (its projections already split) compute with ``1/degree`` of its heads;
    returns ``{attribute: (old, new)}``. ``group``: the tensor-parallel group the gradients of
    `HeadSplit.summed` are summed over (None: they are not, as in the proof's emulation)."""
    changed = {}
    for attr in split.attributes:
        old = getattr(module, attr)
        setattr(module, attr, old // degree)
        changed[attr] = (old, old // degree)
    if split.local_width is not None:
        module.forward = _LocalWidthForward(module, (c for c, _ in split.columns), split.local_width, degree)
        changed["forward"] = (f"input width {split.local_width}", f"its share, {split.local_width // degree}")
    if split.summed and group is not None:
        module.forward = _SummedGradients(module, split.summed, group)
        changed["gradients"] = ("", f"{', '.join(split.summed)} summed over the group")
    return changed


# ==================================================================== following the projections
class _Lineage(TorchFunctionMode):
    """Follows which projections each tensor derives from, and records the reshapes of them."""

    RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten,
                torch.unflatten}

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[int, tuple[Tensor, frozenset[str]]] = {}
        #: projection -> [(shape before, shape after)] of every reshape of a tensor derived from it.
        self.reshapes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

    def of(self, value: Any) -> frozenset[str]:
        found: frozenset[str] = frozenset()
        for leaf in tree_leaves(value):
            if isinstance(leaf, Tensor) and id(leaf) in self.sources:
                found |= self.sources[id(leaf)][1]
        return found

    def mark(self, value: Any, sources: frozenset[str]) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, Tensor):
                self.sources[id(leaf)] = (leaf, sources)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sources = self.of((args, kwargs))
        if sources:
            self.mark(out, sources)
            if func in self.RESHAPES and isinstance(args[0], Tensor) and isinstance(out, Tensor):
                for source in sources:
                    self.reshapes.setdefault(source, []).append((tuple(args[0].shape), tuple(out.shape)))
        return out


@dataclass
class _Run:
    """What one whole run of the module showed: projections in call order, how often each ran,
    which projections each one's input came from, its output, and the gradients a random
    cotangent on that output gives its parameters and its inputs."""

    order: list[str]
    calls: dict[str, int]
    fed_by: dict[str, frozenset[str]]
    reshapes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
    output: Any = None
    grads: dict[str, Tensor] = field(default_factory=dict)
    input_grads: list[Tensor | None] = field(default_factory=list)


def _observed_run(module: nn.Module, linears: list[str], args: tuple, kwargs: dict) -> _Run:
    lineage = _Lineage()
    run = _Run([], {}, {}, lineage.reshapes)
    handles = []
    for name in linears:
        child = module.get_submodule(name)

        def before(_m: nn.Module, inputs: tuple, name: str = name) -> None:
            run.calls[name] = run.calls.get(name, 0) + 1
            if name not in run.order:
                run.order.append(name)
            run.fed_by[name] = run.fed_by.get(name, frozenset()) | lineage.of(inputs)

        def after(_m: nn.Module, _inputs: tuple, output: Any, name: str = name) -> None:
            lineage.mark(output, frozenset({name}))

        handles += [child.register_forward_pre_hook(before), child.register_forward_hook(after)]
    args, kwargs = _fresh(args, kwargs)
    try:
        with lineage:
            run.output = module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    _backward(run.output)
    run.grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    run.input_grads = [t.grad for t in _tensors((args, kwargs))]
    run.output = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, run.output)
    return run


def _fresh(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The same arguments, their tensors new leaves (requiring grad as before)."""
    def leaf(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.detach().clone().requires_grad_(value.requires_grad)
        return value
    return tree_map(leaf, (args, kwargs))


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, Tensor)]


def _backward(output: Any, retain_graph: bool = False) -> None:
    """Backward of the output against a fixed random cotangent (the same for every run)."""
    generator = torch.Generator().manual_seed(2)
    outputs = [t for t in _tensors(output) if t.requires_grad and t.is_floating_point()]
    cotangents = [torch.randn(t.shape, dtype=t.dtype, generator=generator) for t in outputs]
    if outputs:
        torch.autograd.backward(outputs, cotangents, retain_graph=retain_graph)


def _head_reshape(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...] | None:
    """The trailing axes ``after`` cut ``before``'s last dimension into (at least two), or None."""
    if not before or len(after) < 2:
        return None
    product = 1
    for start in range(len(after) - 1, -1, -1):
        product *= after[start]
        if product == before[-1] and len(after) - start >= 2:
            return after[start:] if math.prod(after[:start]) == math.prod(before[:-1]) else None
        if product > before[-1]:
            return None
    return None


# ==================================================================== finding and proving
def find_head_split(module: nn.Module, degree: int, example: Described | None = None) -> HeadSplit | str:
    """How ``module`` splits by heads over ``degree`` ranks, proven, or why it cannot be split.

    ``example``: the module's traced call (`smpart.tracing.call_inputs.describe_call`); without
    one it is called with a single input of its projections' width. Heads that do not divide by
    the degree are not checked here: the split is returned unproven, for the planner to refuse.
    """
    linears = [name for name, child in module.named_children()
               if type(child) is nn.Linear or (isinstance(child, nn.Linear)
                                               and type(child).forward is nn.Linear.forward)]
    if len(linears) < 2:
        return "it has fewer than two nn.Linear projections of its own"
    key = _cache_key(module, degree, example)
    if key is not None and key in _PROVEN:
        return _PROVEN[key]
    found = _find(module, linears, degree, example)
    if key is not None:
        if len(_PROVEN) >= _CACHE_SIZE:
            _PROVEN.clear()
        _PROVEN[key] = found
    return found


_PROVEN: dict[tuple, HeadSplit | str] = {}


def _find(module: nn.Module, linears: list[str], degree: int, example: Described | None) -> HeadSplit | str:
    first_error = ""
    large = sum(p.numel() for p in module.parameters()) > _LARGE
    for dtype in (torch.float32, torch.float64) if large else (torch.float64, torch.float32):
        try:
            whole = _working_copy(module, dtype)
        except Exception as err:  # it holds something deepcopy cannot copy (a lock, a process group)
            return f"it could not be copied to be run alone ({type(err).__name__}: {_first_line(err)})"
        for args, kwargs in _examples(module, linears, example, dtype):
            try:
                run = _observed_run(whole, linears, args, kwargs)
            except Exception as err:  # any failure of the user's code on a made-up input: cannot tell
                first_error = first_error or f"{type(err).__name__}: {_first_line(err)}"
                continue
            layout = _layout(whole, run)
            if isinstance(layout, str):
                return layout
            if not _divides(layout, degree):
                return layout
            return _proven(whole, layout, degree, args, kwargs, run, dtype)
    if example is None and not first_error:
        return "it could not be run alone to find its heads"
    return (f"it could not be run alone on an example of its arguments to find its heads ({first_error})"
            if first_error else "no example of its arguments could be made to find its heads")


def _layout(module: nn.Module, run: _Run) -> HeadSplit | str:
    """The projections and heads one run shows (attributes and local width not chosen yet)."""
    readers = [n for n in run.order if run.fed_by.get(n, frozenset()) - {n}]
    if not readers:
        return "none of its projections reads what another one made (no q/k/v feeding an output projection)"
    row = readers[-1]
    columns = [n for n in run.order if n in run.fed_by[row] and n != row]
    twice = [n for n in (*columns, row) if run.calls.get(n, 0) != 1]
    if twice:
        return f"its projection {twice[0]} runs {run.calls.get(twice[0], 0)} times in one call"
    head_dims, parts_of = set(), {}
    for name in columns:
        trailing = next((t for before, after in run.reshapes.get(name, ())
                         if (t := _head_reshape(before, after)) is not None), None)
        if trailing is None:
            return f"the output of its projection {name} is never reshaped by heads"
        before = next(b for b, a in run.reshapes[name] if _head_reshape(b, a) == trailing)
        width = module.get_submodule(name).out_features
        if width % before[-1]:
            return (f"its projection {name} ({width} features) is split into parts of unequal widths before "
                    "its heads are reshaped (q heads and grouped kv heads in one projection); smpart splits "
                    "fused projections of equal parts only")
        head_dims.add(trailing[-1])
        parts_of[name] = width // before[-1] * math.prod(trailing[:-2])
    if len(head_dims) != 1:
        return f"its projections reshape to different head sizes ({sorted(head_dims)})"
    (head_dim,) = head_dims
    heads = [module.get_submodule(n).out_features // (head_dim * parts_of[n]) for n in columns]
    return HeadSplit(tuple((n, parts_of[n]) for n in columns), row, heads[0], heads[-1], head_dim)


def _divides(layout: HeadSplit, degree: int) -> bool:
    return layout.q_heads % degree == 0 and layout.kv_heads % degree == 0


def _proven(whole: nn.Module, layout: HeadSplit, degree: int, args: tuple, kwargs: dict, run: _Run,
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


def _emulate(whole: nn.Module, split: HeadSplit, degree: int, args: tuple, kwargs: dict, run: _Run,
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
                r.module(*_fresh(args, kwargs)[0], **_fresh(args, kwargs)[1])
        total = torch.stack([r.row.partial for r in ranks]).sum(0)
        bias = whole.get_submodule(split.row).bias
        total = total if bias is None else total + bias.detach()
        for r in ranks:  # second pass: every rank goes on from the reduced sum, and back
            r.row.total = total
            r.args, r.kwargs = _fresh(args, kwargs)
            r.output = r.module(*r.args, **r.kwargs)
            _backward(r.output, retain_graph=True)
        for name in dict(split.columns):  # each column projection's input gradient, summed over ranks
            grads = [r.columns[name].leaf.grad for r in ranks]
            if all(g is not None for g in grads) and ranks[0].columns[name].seen.requires_grad:
                summed_grad = torch.stack(grads).sum(0)
                for r in ranks:
                    torch.autograd.backward(r.columns[name].seen, summed_grad, retain_graph=True)
    except Exception as err:  # the localised forward failed on the user's code: not splittable
        return f"it fails ({type(err).__name__}: {_first_line(err)})", ()
    for rank, r in enumerate(ranks):
        problem = _difference(run.output, r.output, tolerance) or _shard_grads_differ(r, rank, degree, split,
                                                                                      run, tolerance)
        if not problem:
            input_grads = [t.grad for t in _tensors((r.args, r.kwargs))]
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


def _shard_grads_differ(rank_run: _Rank, rank: int, degree: int, split: HeadSplit, run: _Run,
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


def _replicated_grads(ranks: list[_Rank], split: HeadSplit, run: _Run,
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


# ==================================================================== the module's copy and inputs
def _working_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` copied to the CPU in ``dtype``, in eval mode, with random weights (its buffers kept
    when it has them: masks, rotary tables); the original's tensors are never copied."""
    generator = torch.Generator().manual_seed(0)
    memo: dict[int, Any] = {}
    for p in module.parameters():
        values = _random_like(p, dtype, generator)
        memo[id(p)] = nn.Parameter(values, requires_grad=p.requires_grad and values.is_floating_point())
    for b in module.buffers():
        memo[id(b)] = _buffer_like(b, dtype, generator)
    copied = copy.deepcopy(module, memo)
    return copied.eval()


def _random_like(p: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """Uniform values (cheaper to draw than normal ones), of a matrix's fan-in scale, or near one
    for a vector (a norm's weight)."""
    if not p.is_floating_point():
        return torch.zeros(p.shape, dtype=p.dtype)
    if p.ndim >= 2:
        bound = math.sqrt(3 / p.shape[-1])
        return torch.empty(p.shape, dtype=dtype).uniform_(-bound, bound, generator=generator)
    return torch.empty(p.shape, dtype=dtype).uniform_(0.8, 1.2, generator=generator)


def _buffer_like(b: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    if b.is_meta:
        if b.is_floating_point():
            return torch.randn(b.shape, dtype=dtype, generator=generator)
        make = torch.ones if b.dtype == torch.bool else torch.zeros
        return make(b.shape, dtype=b.dtype)
    local = b.detach().to("cpu")
    return local.to(dtype) if local.is_floating_point() else local.clone()


def _examples(module: nn.Module, linears: list[str], example: Described | None,
              dtype: torch.dtype) -> Iterable[tuple[tuple, dict]]:
    """Arguments to run the module on: the traced call's, shrunk, then at their traced size (if
    not too large); without a traced call, one input of the first projection's width."""
    if example is None:
        width = module.get_submodule(linears[0]).in_features
        generator = torch.Generator().manual_seed(1)
        made_up = torch.randn((*_MADE_UP_LEADING, width), dtype=dtype, generator=generator)
        yield (made_up.requires_grad_(),), {}
        return
    sizes = [math.prod(s) for s in tensor_shapes(example)]
    for shrink in (True, False):
        if not shrink and sum(sizes) > _LARGEST_EXAMPLE:
            return
        generator = torch.Generator().manual_seed(1)
        made = example_call(example, generator=generator, floating=dtype, shrink=shrink)
        if made is not None:
            yield made


def _cache_key(module: nn.Module, degree: int, example: Described | None) -> tuple | None:
    """What decides a proof: the class, its children and their shapes, its plain attributes, the
    degree and the example's description (None when it cannot be told: no cache)."""
    try:
        plain = tuple(sorted((k, v) for k, v in vars(module).items()
                             if isinstance(v, _PLAIN) and not k.startswith("_")))
        children = tuple((n, type(c).__qualname__, tuple((pn, tuple(p.shape), str(p.dtype))
                                                          for pn, p in c.named_parameters()))
                         for n, c in module.named_children())
        own = tuple((n, tuple(t.shape)) for n, t in [*module.named_parameters(recurse=False),
                                                    *module.named_buffers(recurse=False)])
        return (type(module), degree, plain, children, own, repr(example))
    except Exception:  # noqa: BLE001 - an attribute that does not compare: simply not cached
        return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


__all__ = ["HeadSplit", "find_head_split", "localize"]
