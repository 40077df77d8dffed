"""The four collectives of Megatron-style tensor parallelism, each with its own backward.

A tensor-parallel pair of layers needs communication only at its two ends, and each end is a
collective whose backward is the *conjugate* collective:

==================  =======================  ==========================
function            forward                  backward
==================  =======================  ==========================
`copy_to_tp`        identity                 all-reduce (sum)
`reduce_from_tp`    all-reduce (sum)         identity
`gather_from_tp`    all-gather, last dim     keep this rank's slice
`scatter_to_tp`     keep this rank's slice   all-gather, last dim
==================  =======================  ==========================

The trick is that the replicated activation entering a column-parallel layer feeds every rank,
so its gradient is the *sum* of the ranks' partial gradients (`copy_to_tp`), while the partial
sums leaving a row-parallel layer are added once in forward and the (replicated) gradient flows
back to every rank untouched (`reduce_from_tp`). Each is a plain ``torch.autograd.Function``
around ``torch.distributed``; with a group of one process every function returns its input.

``group`` is a ``ProcessGroup`` (None: the default group). Every rank of the group must call the
same functions in the same order, as with any collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Group = Any  # a torch.distributed ProcessGroup, or None for the default group


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (1 when torch.distributed is not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside ``group`` (0 when torch.distributed is not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# ==================================================================== raw collectives
def _all_reduce(x: Tensor, group: Group) -> Tensor:
    """Sum ``x`` over the group into a fresh tensor (the input is never written)."""
    out = x.contiguous().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _all_gather_last(x: Tensor, group: Group, fused: int) -> Tensor:
    """Every rank's ``x`` side by side along the last dim.

    With ``fused=k`` each rank's tensor holds k parts (its slices of q, k and v, say): the result
    puts part j of every rank together, so the k parts come out whole, in their original order.
    """
    pieces = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(group_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    if fused == 1:
        return torch.cat(pieces, dim=-1)
    parts = [piece.chunk(fused, dim=-1) for piece in pieces]
    return torch.cat([rank_parts[j] for j in range(fused) for rank_parts in parts], dim=-1)


def _own_slice_last(x: Tensor, group: Group, fused: int) -> Tensor:
    """This rank's slice of the last dim (of each of the ``fused`` parts): the inverse of the gather."""
    size, rank = group_size(group), group_rank(group)
    if x.size(-1) % (size * fused):
        raise ValueError(f"cannot split a last dimension of {x.size(-1)} into {fused} part(s) x {size} ranks")
    if fused == 1:
        return x.chunk(size, dim=-1)[rank].contiguous()
    return torch.cat([part.chunk(size, dim=-1)[rank] for part in x.chunk(fused, dim=-1)], dim=-1)


# ==================================================================== autograd functions
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # type: ignore[override]
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, fused: int) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.fused = group, fused
        return _all_gather_last(x, group, fused)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _own_slice_last(grad, ctx.group, ctx.fused), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, fused: int) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.fused = group, fused
        return _own_slice_last(x, group, fused)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _all_gather_last(grad, ctx.group, ctx.fused), None, None


# ==================================================================== the public functions
def copy_to_tp(x: Tensor, group: Group = None) -> Tensor:
    """Identity forward, all-reduce backward: where a replicated input enters a column split."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: Group = None) -> Tensor:
    """All-reduce forward, identity backward: where a row split's partial sums leave."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, group: Group = None, fused: int = 1) -> Tensor:
    """All-gather along the last dim forward, this rank's slice backward.

    ``fused=k``: ``x`` is k parts side by side (a fused q/k/v slice); see `_all_gather_last`.
    """
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group, fused)


def scatter_to_tp(x: Tensor, group: Group = None, fused: int = 1) -> Tensor:
    """This rank's slice of the last dim forward, all-gather backward (the inverse of the gather)."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group, fused)
