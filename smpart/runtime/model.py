"""`DistributedModel`: the user's model, unchanged, run across pipeline stages inside steps.

It wraps the model itself (no copy): parameters, buffers and the state dict keep their original
names and objects, wherever they end up living. The model is traced, partitioned and placed at
its first call inside a step; calls made outside a step run the model inline like a plain module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from smpart.errors import SmpartError
from smpart.partition.result import Partition
from smpart.runtime.calls import current_frame
from smpart.runtime.driver import Driver

_model_ids = itertools.count()


class DistributedModel:
    """``smpart.DistributedModel(model)``: pass it to an ``@smpart.step`` function and call it there."""

    def __init__(self, module: nn.Module) -> None:
        if isinstance(module, DistributedModel):
            raise SmpartError("this model is already a DistributedModel")
        if not isinstance(module, nn.Module):
            raise SmpartError(f"DistributedModel wraps a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        #: Models are numbered in creation order: every rank builds them in the same order.
        self.model_id = next(_model_ids)
        self._partition: Partition | None = None
        self._runtime: Any = None

    # ================================================================ running
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        driver = _driver()
        if driver is not None:
            driver.wait_turn()
            driver.run.runtime.ensure_placed(self, args, kwargs)
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Backward of this micro-batch's ``loss`` through every stage; once per step body."""
        driver = _driver()
        if driver is None:
            raise SmpartError("model.backward(loss) works only inside an @smpart.step function (it starts "
                              "the pipelined backward of the current micro-batch); outside one use "
                              "loss.backward()")
        driver.backward(loss, grad)

    @property
    def partition(self) -> Partition | None:
        return self._partition

    # ================================================================ the nn.Module surface
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules(*args, **kwargs)

    def modules(self) -> Iterator[nn.Module]:
        return self.module.modules()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsplit state dict (every tensor on the CPU) that the plain model loads."""
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (from the plain model or `state_dict`); tensors land on their stage."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def train(self, mode: bool = True) -> DistributedModel:
        self.module.train(mode)
        return self

    def eval(self) -> DistributedModel:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__.get("module")
        if module is None:
            raise AttributeError(name)
        return getattr(module, name)

    def __repr__(self) -> str:
        return f"DistributedModel({self.module.__class__.__name__}, partition={self._partition!r})"


def _driver() -> Driver | None:
    frame = current_frame()
    return frame.endpoint if frame is not None and isinstance(frame.endpoint, Driver) else None
