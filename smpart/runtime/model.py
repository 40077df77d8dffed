"""`DistributedModel`: the user's model, unchanged, run across pipeline stages inside steps.

It wraps the model itself (no copy): parameters, buffers and the state dict keep their original
names and objects, wherever they end up living. The model is traced, partitioned and placed at
its first call inside a step; calls made outside a step run the model inline like a plain module.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from smpart.errors import SmpartError
from smpart.partitioning.result import Partition
from smpart.runtime.reference.calls import current_frame, holds_meta, only_inside_a_step
from smpart.runtime.reference.driver import Driver

_model_ids = itertools.count()
_models: weakref.WeakValueDictionary[int, DistributedModel] = weakref.WeakValueDictionary()


def model_by_id(model_id: int) -> DistributedModel | None:
    return _models.get(model_id)


class DistributedModel:
    """``smpart.DistributedModel(model)``: pass it to an ``@smpart.step`` function and call it there.

    ``broadcast_buffers`` (SMP's and DDP's switch, on by default): under data parallelism, each
    step begins with every replica taking the first replica's buffers (BatchNorm's running
    statistics), as DDP does before each forward, so that replicas evaluate alike.
    """

    def __init__(self, module: nn.Module, *, broadcast_buffers: bool = True) -> None:
        if isinstance(module, DistributedModel):
            raise SmpartError("this model is already a DistributedModel")
        if not isinstance(module, nn.Module):
            raise SmpartError(f"DistributedModel wraps a torch.nn.Module, got {type(module).__name__}")
        _refuse_compiled(module)
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        #: Models are numbered in creation order: every rank builds them in the same order.
        self.model_id = next(_model_ids)
        _models[self.model_id] = self
        self._partition: Partition | None = None
        self._runtime: Any = None
        #: Work waiting for the model to be placed (a checkpoint load under torchrun), run by the
        #: runtime on every rank right after placement.
        self._after_placement: list[Callable[[], None]] = []
        #: What those loads will write into tensors built on meta, readable before then: each
        #: returns ``{state dict name: value on the CPU}`` (`state_dict` serves them, later loads win).
        self._loaded_later: list[Callable[[], dict[str, torch.Tensor]]] = []
        #: State-dict names that such work fills (`load_weights`): no rank needs rank 0's values.
        self._filled_at_placement: set[str] = set()
        #: Whether every rank's copy took the first rank's values (`replicas`), or needs not: placed.
        self._agreed = False
        #: Rank 0's seed, for modules initialised at placement from the meta device (`replicas`).
        self._init_seed: int | None = None
        #: Whether a placement on processes left this rank's copy not whole: other stages' tensors
        #: released to meta, layers split into shards (`replicas.make_whole`).
        self._released = False
        #: Whether a step already said it ran this model whole (`step_function._warn_if_unsplit`).
        self._warned_unsplit = False

    # ================================================================ running
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        frame = current_frame()
        if frame is not None and frame.glue:  # a step program: every module call goes through its glue
            return self.module(*args, **kwargs)
        driver = _driver()
        if driver is not None:
            driver.wait_turn()
            driver.run.runtime.ensure_placed(self, args, kwargs)
        elif holds_meta(self.module):
            raise only_inside_a_step("this model")
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Backward of this micro-batch's ``loss`` through every stage; once per step body."""
        frame = current_frame()
        if frame is not None and frame.glue:
            frame.endpoint.backward(loss, grad)
            return
        driver = _driver()
        if driver is None:
            raise SmpartError("model.backward(loss) works only inside an @smpart.step function (it starts "
                              "the pipelined backward of the current micro-batch); outside one use "
                              "loss.backward()")
        driver.backward(loss, grad)

    def _placed(self) -> None:
        pending, self._after_placement = self._after_placement, []
        self._loaded_later = []
        self._filled_at_placement = set()
        for work in pending:
            work()

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

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's own entries (its stage's), on their device; on threads, every entry."""
        return {k: v for k, v in self.module.state_dict(keep_vars=False).items() if v.device.type != "meta"}

    def _own_state(self) -> dict[str, torch.Tensor]:
        """This rank's own entries, on the CPU."""
        return {k: v.detach().cpu() for k, v in self.local_state_dict().items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsplit state dict (every tensor on the CPU) that the plain model loads.

        Under ``torchrun``, call it on every rank, or on the first stage's rank alone
        (``if smpart.rank() == 0: torch.save(model.state_dict(), path)``, between steps or after
        the last): each other stage's rank sends its own entries when it next waits inside the step
        function, its own ``state_dict()`` or ``smpart.shutdown()``, where its parameters hold
        still. With tensor parallelism it is collective: every rank must call it.

        Before the first step of a model built on the meta device, or of one under ``torchrun``
        that ``load_weights`` waits for: the values the loads waiting for its placement will write
        (`smpart.load_checkpoint`, ``load_weights``, `load_state_dict`); a tensor on meta no load
        covers has no value yet, and asking for it raises `SmpartError`."""
        runtime = self._runtime
        if runtime is None and not self._released and (holds_meta(self.module) or self._loaded_later):
            return self._state_before_placement()  # built on meta, or a load waits: not placed
        if runtime is None or runtime.state_group is None:  # threads, or not placed: every entry is here
            return self._own_state()
        if runtime.layout.tp == 1:
            merged = {k: v for part in runtime.gather_state("model", self.model_id, self._own_state())
                      for k, v in part.items()}
            return {k: merged[k] for k in self.module.state_dict(keep_vars=True) if k in merged}
        # Tensor-parallel shards are gathered whole by a collective over each stage's shards.
        local = {k: _full(v).detach().cpu() for k, v in self.local_state_dict().items()}
        group = runtime.state_group
        gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, local, group=group)
        order = list(self.module.state_dict(keep_vars=True))
        merged = {k: v for part in gathered for k, v in part.items()}
        return {k: merged[k] for k in order if k in merged}

    def _state_before_placement(self) -> dict[str, torch.Tensor]:
        """The state dict of a model not placed yet that was built on meta or has loads waiting for
        its placement: the values those loads will write (a checkpoint's, read now), else its own,
        or an error for tensors on meta that have none."""
        served: dict[str, torch.Tensor] = {}
        for values in self._loaded_later:
            served.update(values())
        own = self.module.state_dict()
        missing = [k for k, v in own.items() if v.is_meta and k not in served]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise SmpartError(
                f"this model was built on the meta device and is not placed yet: {len(missing)} of its "
                f"tensors ({', '.join(missing[:5])}{more}) have no values until its first step, where each "
                "stage makes its own (initialised, or loaded by smpart.load_checkpoint / load_weights / "
                "load_state_dict called before it). Read the state dict after the first step (a "
                "forward-only step under torch.no_grad() places the model without changing it)")
        return {k: served[k] if k in served else v.detach().cpu() for k, v in own.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (from the plain model or `state_dict`); every rank takes its own
        entries (those of other stages are not held here), which land on their stage's device. A
        model built on the meta device takes them once it is placed, at its first step."""
        held = set(self.local_state_dict())
        every = set(self.module.state_dict(keep_vars=True))
        if strict:
            missing, unexpected = sorted(every - set(state_dict)), sorted(set(state_dict) - every)
            if missing or unexpected:
                raise SmpartError(f"load_state_dict: missing keys {missing[:10]}, unexpected keys "
                                  f"{unexpected[:10]}; is it a state dict of this model?")
        if self._runtime is None and (holds_meta(self.module) or self._filled_at_placement):
            # Built on meta: each stage's tensors are made at placement, and take their entries then
            # (so does a load after a load_weights waiting for the placement: the later one wins).
            self._after_placement.append(lambda: self.load_state_dict(state_dict, strict=False))
            self._loaded_later.append(lambda: {k: v.detach().cpu() for k, v in state_dict.items()
                                               if k in every})
            return nn.modules.module._IncompatibleKeys([], [])
        mine = {k: v for k, v in state_dict.items() if k in held}
        return self.module.load_state_dict(mine, strict=False)

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

    # ================================================================ casts and moves
    # The wrapped module's own methods return the module: after ``model = model.double()`` a step
    # would be handed a plain module, and refuse it. These return this DistributedModel.
    def to(self, *args: Any, **kwargs: Any) -> DistributedModel:
        """Cast the model (``.to(torch.float64)``); a device only before its first step."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            self._refuse_moves_once_placed(f"to({str(device)!r})")
        self.module.to(*args, **kwargs)
        return self

    def cuda(self, device: Any = None) -> DistributedModel:
        self._refuse_moves_once_placed("cuda()")
        self.module.cuda(device)
        return self

    def cpu(self) -> DistributedModel:
        self._refuse_moves_once_placed("cpu()")
        self.module.cpu()
        return self

    def float(self) -> DistributedModel:
        return self.to(torch.float32)

    def double(self) -> DistributedModel:
        return self.to(torch.float64)

    def half(self) -> DistributedModel:
        return self.to(torch.float16)

    def bfloat16(self) -> DistributedModel:
        return self.to(torch.bfloat16)

    def _refuse_moves_once_placed(self, call: str) -> None:
        if self._runtime is not None:  # placed, until smpart.shutdown gives the plain module back
            raise SmpartError(f"model.{call}: this model's stages were placed on their devices at its first "
                              "step, and moving it would undo that; choose the devices with "
                              "smpart.init(devices=[...]) (dtype casts are fine)")

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__.get("module")
        if module is None:
            raise AttributeError(name)
        return getattr(module, name)

    def __repr__(self) -> str:
        return f"DistributedModel({self.module.__class__.__name__}, partition={self._partition!r})"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel shard gathered whole (collective over its tensor-parallel group)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _refuse_compiled(module: nn.Module) -> None:
    """smpart routes module calls between stages in Python; code ``torch.compile`` made of a module
    would contain that routing, which it cannot trace (it fails deep inside dynamo)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        raise SmpartError("DistributedModel got a torch.compile'd model: smpart calls its modules across "
                          "stages from Python, which compiled code cannot contain. Pass the uncompiled "
                          "model (the compiled one's ._orig_mod)")
    compiled = [name or "the model" for name, m in module.named_modules()
                if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        raise SmpartError(f"modules compiled with Module.compile(): {', '.join(compiled[:5])}"
                          f"{' ...' if len(compiled) > 5 else ''}. smpart calls modules across stages from "
                          "Python, which compiled code cannot contain: compile inside a module's forward "
                          "instead (a torch.compile'd function it calls), or leave them uncompiled")


def _driver() -> Driver | None:
    frame = current_frame()
    return frame.endpoint if frame is not None and isinstance(frame.endpoint, Driver) else None
