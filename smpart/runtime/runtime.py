"""`Runtime`: what both runtimes offer the rest of smpart, and the one this process runs.

Two runtimes implement it: `smpart.runtime.threads.ThreadRuntime` (every stage on threads of this
process, the embedded default) and `smpart.runtime.processes.runtime.ProcessRuntime` (one stage
per rank under ``torchrun``); `smpart.runtime.session.init` starts one. Code that needs to know
which asks the protocol (``runtime.setup is None`` on threads), never the type. This module also
keeps what outlives a runtime: the `set_partition` pins, and a model's partition and program.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from smpart.config import Config
from smpart.errors import SmpartError
from smpart.partitioning.result import Partition
from smpart.runtime.placement.place import make_partition, pins_for
from smpart.runtime.reference.calls import current_frame

if TYPE_CHECKING:
    from smpart.distributed.launch import Layout, Setup
    from smpart.runtime.reference.stage import StageServer
    from smpart.runtime.wire.transport import Transport


class Runtime(abc.ABC):
    """The stage servers of one configuration, the models placed on them, and how a step runs.
    (``model`` below is a `smpart.runtime.model.DistributedModel`, which sits above this module.)"""

    config: Config
    num_stages: int
    #: The stage servers this process hosts (every stage on threads, its own under torchrun).
    servers: list[StageServer]
    transport: Transport
    #: This process's rank under torch.distributed (None on threads).
    rank: int | None = None
    #: Where drivers and step coordinators live (the first stage's place).
    driver_place = 0
    #: Where tensors that reach a driver from another process land (None: where they come from;
    #: on threads they come by reference, on the device of the stage that made them).
    driver_device: torch.device | None = None
    #: Under torchrun: the launch (process groups, device), the rank layout, and every rank's gloo
    #: group for smpart's own collectives; None on threads.
    setup: Setup | None = None
    layout: Layout | None = None
    state_group: Any = None
    #: Whether `shutdown` still answers the peers (processes; off while an error propagates).
    answer_at_shutdown = True
    #: Steps this runtime has run (begun), failed ones included.
    steps_taken = 0
    _place_lock: threading.Lock

    @abc.abstractmethod
    def place_of_stage(self, stage: int) -> int:
        """Where ``stage`` lives: its index on threads, its rank (in this rank's replica) on processes."""

    @abc.abstractmethod
    def run_step(self, fn: Callable, pieces: list[tuple[tuple, dict]],
                 model: Any, samples: int | None = None) -> tuple[list[Any], Any]:
        """Run ``fn`` over ``pieces`` (one per micro-batch) for ``model``: (results, timeline).
        ``samples``: the step's batch size (what data-parallel replicas with shares check)."""

    def refuse_step(self, fn: Callable, error: SmpartError, model: Any) -> None:
        """A step whose batch could not be split into micro-batches here: raise ``error`` (where
        ranks step together, after the collectives that keep them in step)."""
        raise error

    def ensure_placed(self, model: Any, args: tuple, kwargs: dict) -> None:
        """Partition and place ``model`` at its first call (micro-batch 0 of its first step), once:
        the first of the threads that reach it places, the others find it placed."""
        if model._runtime is self:
            return
        with self._place_lock:
            if model._runtime is not self:
                self._place_first(model, args, kwargs)

    @abc.abstractmethod
    def _place_first(self, model: Any, args: tuple, kwargs: dict) -> None:
        """Partition and place ``model`` (under the placement lock, not yet placed here)."""

    @abc.abstractmethod
    def training_modes(self) -> dict[int, bytes] | None:
        """Every module's train/eval flag, for the ranks that do not run the step body (None: none)."""

    @abc.abstractmethod
    def shutdown(self, timeout_s: float = 10.0) -> list[str]:
        """Stop every thread; the names of those still busy after ``timeout_s``."""

    @contextlib.contextmanager
    def stepping(self, lock: threading.Lock) -> Iterator[None]:
        """One step at a time, never one inside another."""
        if in_a_step():
            raise SmpartError("an @smpart.step function was called inside another step (or from a module "
                              "running in one); steps do not nest: call the inner step after the outer "
                              "one returns, or make it a plain function")
        with lock:
            _in_step.active = True
            try:
                yield
            finally:
                _in_step.active = False


_runtime: Runtime | None = None
_module_pins: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_in_step = threading.local()


def partition_for(model: Any, args: tuple, kwargs: dict, config: Config) -> Partition:
    """The model's partition: the one it has if it fits this configuration's stage count, else a
    new one from tracing this call (with ``config.pin`` and the `set_partition` pins)."""
    partition = model._partition
    if partition is None or partition.num_stages != config.partition_stages or (
            partition.meta.get("ranks", config.pipeline_parallel_degree) != config.pipeline_parallel_degree):
        pins = pins_for(model.module, config.pin, dict(_module_pins.items()))
        partition = make_partition(model.module, args, kwargs, config, pins)
    return partition


def in_a_step() -> bool:
    """Whether this thread runs inside a step: the caller of one, a step body or a module in it."""
    return getattr(_in_step, "active", False) or current_frame() is not None


def current_runtime() -> Runtime:
    if _runtime is None:
        raise SmpartError("smpart is not initialised: call smpart.init(pipeline_parallel_degree=..., "
                          "microbatches=...) before running a step")
    return _runtime


def running_runtime() -> Runtime | None:
    return _runtime


def set_running(runtime: Runtime | None) -> Runtime | None:
    """Make ``runtime`` the running one (`smpart.runtime.session`); the one it replaces."""
    global _runtime
    previous, _runtime = _runtime, runtime
    return previous


def process_setup() -> Setup | None:
    """The running process runtime's launch (process groups, device); None on threads or when none runs."""
    return None if _runtime is None else _runtime.setup


def process_layout() -> Layout | None:
    """The running process runtime's layout of ranks (pp x dp x tp); None on threads or when none runs."""
    return None if _runtime is None else _runtime.layout


def set_partition(module: nn.Module, stage: int) -> None:
    """Pin ``module`` (and its sub-modules) to pipeline ``stage``; call it before the first step."""
    if not isinstance(module, nn.Module):
        raise SmpartError(f"set_partition needs an nn.Module, got {type(module).__name__}")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise SmpartError(f"set_partition: stage must be an int >= 0, got {stage!r}")
    if _runtime is not None and stage >= _runtime.config.partition_stages:
        stages = _runtime.config.partition_stages
        raise SmpartError(f"set_partition: stage {stage} does not exist, smpart runs "
                          f"{stages} pipeline stage(s) (0..{stages - 1})")
    _module_pins[module] = stage


def program_of(model: Any) -> Any:
    """The step program a `DistributedModel` runs (`smpart.runtime.program.actions.Program`): each
    rank's list of actions, ``.show()`` as a table, ``.describe()`` as text. Built at the model's
    second step (the first records it); with several kinds of step (input shapes), the last built."""
    programs = getattr(model, "_programs", None)
    program = None if programs is None else programs.last
    if program is None:
        raise SmpartError("this model has no step program yet: its first step records one and its second "
                          "builds it (or steps run on the reference runtime: out.timeline.reason says why)")
    return program


def partition_of(model: Any) -> Partition:
    """The `Partition` a `DistributedModel` runs with (known after its first step)."""
    partition = getattr(model, "_partition", None)
    if partition is None:
        raise SmpartError("this model has no partition yet: a DistributedModel is partitioned at its first "
                          "step (or pass a plain model to smpart.partition(smpart.trace(...)))")
    return partition


