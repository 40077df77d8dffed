"""Data parallelism: every stage averages its gradients over its data-parallel group.

Each data-parallel replica runs its own pipeline on its own batch. A stage's gradients are final
once every micro-batch of the step has been released on it (all backward credit came home); the
stage server then starts `GradientSync` on its dispatcher thread, so the averaging of the last
stages overlaps the backward still running on the first ones, and the end of the step waits for
it (`GradientSync.finish`) before the optimizer may step.

Why smpart does this itself and not DDP's hooks: the runtime calls autograd stage by stage, not
through one ``loss.backward()`` on a wrapped module, so nothing would fire them.

The gradients travel in buckets: consecutive gradients of one dtype flattened into one tensor of
at most ``bucket_bytes``, one asynchronous all-reduce each, all in flight at once. Which
parameters take part is agreed first (a parameter a replica's data never reached has no gradient
there, say an expert no token was routed to): a max-reduce of "has a gradient" flags, after which
a missing gradient counts as zeros, exactly as in one process on the concatenated batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 25 * 2**20


class GradientSync:
    """The averaging of one step's gradients over ``group`` (``size`` replicas), once started."""

    def __init__(self, params: list[nn.Parameter], group: Any, size: int,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.size = size
        self.buckets: list[tuple[list[nn.Parameter], torch.Tensor, Any]] = []
        self._start(params, bucket_bytes)

    def _start(self, params: list[nn.Parameter], bucket_bytes: int) -> None:
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        taking = [p for p, flag in zip(params, flags.tolist(), strict=True) if flag]
        for p in taking:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets(taking, bucket_bytes):
            flat = _flatten_dense_tensors([_local(p.grad) for p in bucket])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.buckets.append((bucket, flat, work))

    def finish(self) -> None:
        """Wait for every bucket and write the averages back into the gradients."""
        for bucket, flat, work in self.buckets:
            work.wait()
            flat /= self.size
            averages = _unflatten_dense_tensors(flat, [_local(p.grad) for p in bucket])
            for p, averaged in zip(bucket, averages, strict=True):
                _local(p.grad).copy_(averaged)
        self.buckets.clear()


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel gradient's own shard (a DTensor's local tensor), else the gradient."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = _local(p.grad).numel() * p.grad.element_size()
        if current and (size + nbytes > bucket_bytes or p.grad.dtype != current[0].grad.dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
