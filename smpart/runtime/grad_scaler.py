"""`GradScaler`: torch's loss scaling for a model split over processes (``smpart.amp.GradScaler``).

fp16 training multiplies the loss by a scale so that small gradients do not underflow, divides the
gradients by it before the optimizer steps, and skips a step whose gradients overflowed, shrinking
the scale (`torch.amp.GradScaler`). Under ``torchrun`` two things break. Only the driver's rank
scales the loss (the step body runs there), so on the other ranks the scaler has no scale and
``scaler.step`` raises. And each rank sees only its own stage's gradients, so, were it to run, one
rank could skip a step that another takes.

The trick is that no scale ever needs sending. Every rank's scale starts at ``init_scale`` and then
changes only with whether an overflow was found, so ranks that agree on that keep equal scales:

- a rank that never scaled a loss makes its scale at its first unscale, from ``init_scale``, on its
  gradients' device (the gradients it holds arrived scaled by the driver's equal scale);
- unscaling ends with one all-reduce (a max, on smpart's own gloo group) of "found an inf or NaN"
  over every rank of the job, so all of them step or skip together, and `update` moves every
  scale the same way.

On threads, and in a job of one process, it is `torch.amp.GradScaler` unchanged: every stage's
gradients are in this process. Every rank must call ``scaler.step`` (or ``unscale_``) each step,
as every rank calls ``optimizer.step``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from smpart.runtime.runtime import process_setup


class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler`, with every rank of a ``torchrun`` job keeping the same scale and
    taking the same step-or-skip decision (see the module docstring)."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        if self._scale is None:  # this rank never scaled a loss: the driver's rank did
            self._lazy_init_scale_growth_tracker(_gradients_device(optimizer))
        super().unscale_(optimizer)
        self._agree_on_overflow(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        # Unscale here whatever the optimizer: a fused one would otherwise be handed the scale and
        # skip `unscale_`, and with it the agreement.
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.unscale_(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def _agree_on_overflow(self, optimizer: torch.optim.Optimizer) -> None:
        group = _job_group()
        if group is None:
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        overflow = torch.zeros(1)
        for flag in found.values():
            overflow = torch.maximum(overflow, flag.detach().float().cpu())
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)
        if not found:  # a rank with no gradient still skips or steps with the others
            found[self._scale.device] = overflow.to(self._scale.device)
        for device, flag in found.items():
            found[device] = overflow.to(flag.device, flag.dtype)


def _gradients_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """Where the optimizer's gradients are (the CPU when it has none, or they are on meta)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and param.grad.device.type != "meta":
                return param.grad.device
    return torch.device("cpu")


def _job_group() -> Any:
    """smpart's own gloo group over every rank of a ``torchrun`` job; None on threads or alone."""
    setup = process_setup()
    if setup is None or setup.world_size == 1:
        return None
    return setup.collective_group
