"""``torch.nn.utils.clip_grad_norm_`` over the whole model while smpart splits it across processes.

On threads every gradient lives in the one process, so torch's function sees the whole model.
Under ``torchrun`` with the model split (pipeline or tensor parallelism), a rank holds only its
stages' gradients and its shards of the split layers. torch's function would scale each rank's
gradients by the norm of its own part, and the model would train unlike the unsplit one, with
nothing said. It is the clipping call training scripts make (nanoGPT, Hugging Face Accelerate and
Lightning look the name up when they clip).

So while such a runtime runs, the name ``torch.nn.utils.clip_grad_norm_`` (and
``torch.nn.utils.clip_grad.clip_grad_norm_``) is a `GlobalClip`. Given parameters of the runtime's
models only, it clips by the norm over the whole model, as `DistributedOptimizer.clip_grad_norm_`
does: a collective, which every rank reaches because every rank runs the script. Every rank sees
the same model, so every rank decides alike which way a call goes. Given anything else (another
model's parameters, a mix), it is torch's own function. ``smpart.shutdown()`` puts torch's back.

A script that bound the function before ``smpart.init`` (``from torch.nn.utils import
clip_grad_norm_``) keeps torch's: call ``optimizer.clip_grad_norm_`` there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.utils.clip_grad

from smpart.runtime.processes.grad_clip import clip_grad_norm_, model_parallel_groups

_PLACES = ((torch.nn.utils, "clip_grad_norm_"), (torch.nn.utils.clip_grad, "clip_grad_norm_"))


class GlobalClip:
    """torch's ``clip_grad_norm_`` signature; the whole model's norm for ``runtime``'s models."""

    def __init__(self, runtime: Any, torch_clip: Callable[..., torch.Tensor]) -> None:
        self.runtime = runtime
        self.torch_clip = torch_clip
        functools.update_wrapper(self, torch_clip)

    def __call__(self, parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                 norm_type: float = 2.0, error_if_nonfinite: bool = False,
                 foreach: bool | None = None) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not params or not self._of_the_models(params):
            return self.torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        groups, replicated_over = model_parallel_groups(self.runtime.setup)
        return clip_grad_norm_(params, max_norm, norm_type, groups=groups,
                               replicated_over=replicated_over, error_if_nonfinite=error_if_nonfinite)

    def _of_the_models(self, params: list[torch.Tensor]) -> bool:
        """Whether every one of ``params`` is a parameter of a model the runtime placed (those that
        are not, as a rank holds them, are the same on every rank: torch's function is right)."""
        placed = {id(p) for model in self.runtime.models.values() for p in model.module.parameters()}
        return all(id(p) in placed for p in params)


def install(runtime: Any) -> None:
    """Route torch's ``clip_grad_norm_`` names to a `GlobalClip` for ``runtime`` (until `uninstall`)."""
    current = torch.nn.utils.clip_grad.clip_grad_norm_
    clip = GlobalClip(runtime, current.torch_clip if isinstance(current, GlobalClip) else current)
    for module, name in _PLACES:
        setattr(module, name, clip)


def uninstall() -> None:
    """Put torch's own function back where a `GlobalClip` is (a name the user rebound stays theirs)."""
    for module, name in _PLACES:
        current = getattr(module, name)
        if isinstance(current, GlobalClip):
            setattr(module, name, current.torch_clip)
