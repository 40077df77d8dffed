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
   the whole input itself (`localize._LocalWidthForward`); nothing is copied or communicated.
3. **Prove.** The split is emulated on that CPU copy, forward and backward: each rank's
   localised module runs with its shards, the output projection's partial sums are added as its
   all-reduce would, and in the backward the q/k/v projections' input gradients are added as
   theirs would. Every rank's output, input gradients and shards' gradients must be the whole
   module's. A parameter the module keeps whole (a per-head q/k norm) must get the whole
   module's gradient on every rank, or, used on the local heads only, a share of it: such
   parameters are listed (`HeadSplit.summed`) and, once split for real, read through
   `copy_to_tp` during the module's call, which sums their gradient over the group
   (`localize._SummedGradients`). A split that fails or differs is not made: the module stays whole, and
   the reason says what happened. Localising variants are tried in order (the attributes alone;
   then with the input's width too) and the first proven one is kept. Proofs are cached per
   class, shapes, attributes, degree and example.

The proof is about the module's code, not its weights, so a model built on the meta device is
proven as well as a real one; it runs in float64 (float32 if the module refuses float64), or,
for a module of more than `_LARGE` parameters, in float32 first: a wrong split is off by the
size of the values, far beyond float32's rounding, and the proof of a Llama-8B-sized attention
then moves half the bytes.

The steps live apart: `localize` (a rank's share: `HeadSplit`, `localize`), `lineage` (the
observed run that follows each projection's output), `proof` (the split emulated and compared);
this file finds the heads and keeps what it proved.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from smpart.tensor_parallel.lineage import ObservedRun, head_reshape, observed_run
from smpart.tensor_parallel.localize import HeadSplit, localize
from smpart.tensor_parallel.proof import first_line, proven
from smpart.tracing.call_inputs import Described, example_call, tensor_shapes

#: Sizes of the input made up for a module called without a traced example: (batch, tokens).
_MADE_UP_LEADING = (2, 8)
#: Elements of the largest example the proof runs at its traced size (when shrinking fails).
_LARGEST_EXAMPLE = 2**22


#: Parameters above which the proof runs in float32 first.
_LARGE = 2**22
_CACHE_SIZE = 256
_PLAIN = (bool, int, float, str, type(None))


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
            return f"it could not be copied to be run alone ({type(err).__name__}: {first_line(err)})"
        for args, kwargs in _examples(module, linears, example, dtype):
            try:
                run = observed_run(whole, linears, args, kwargs)
            except Exception as err:  # any failure of the user's code on a made-up input: cannot tell
                first_error = first_error or f"{type(err).__name__}: {first_line(err)}"
                continue
            layout = _layout(whole, run)
            if isinstance(layout, str):
                return layout
            if not _divides(layout, degree):
                return layout
            return proven(whole, layout, degree, args, kwargs, run, dtype)
    if example is None and not first_error:
        return "it could not be run alone to find its heads"
    return (f"it could not be run alone on an example of its arguments to find its heads ({first_error})"
            if first_error else "no example of its arguments could be made to find its heads")


def _layout(module: nn.Module, run: ObservedRun) -> HeadSplit | str:
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
                         if (t := head_reshape(before, after)) is not None), None)
        if trailing is None:
            return f"the output of its projection {name} is never reshaped by heads"
        before = next(b for b, a in run.reshapes[name] if head_reshape(b, a) == trailing)
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


__all__ = ["HeadSplit", "find_head_split", "localize"]
