"""The process-wide runtime: `init`, `shutdown`, `set_partition`, `partition_of`.

`init` validates a `Config` and starts the stage servers this process hosts: every stage, on
threads (the embedded default), or its own stage, one process per stage under ``torchrun``
(`smpart.distributed.launch`). `shutdown` joins every thread and gives placed models their
plain forwards back; `init` may then be called again with another configuration (a model is
re-partitioned at its next step). Interpreter exit shuts down too.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from smpart.config import Config
from smpart.errors import ConfigError, SmpartError
from smpart.partitioning.result import Partition
from smpart.runtime.placement import choose_devices, make_partition, pins_for, place, unplace
from smpart.runtime.program import steps, templates
from smpart.runtime.stage import StageServer
from smpart.runtime.step_run import StepRun
from smpart.runtime.transport import ThreadTransport, Transport

if TYPE_CHECKING:
    from smpart.runtime.model import DistributedModel

_runtime: Runtime | None = None
_module_pins: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_in_step = threading.local()


class Runtime:
    """The stage servers of one configuration and the models placed on them (threads)."""

    #: This process's rank under torch.distributed (None on threads).
    rank: int | None = None
    #: Where drivers and step coordinators live (the first stage's place).
    driver_place = 0
    #: Where tensors that reach a driver from another process land (None: where they come from;
    #: on threads they come by reference, on the device of the stage that made them).
    driver_device: torch.device | None = None

    def __init__(self, config: Config) -> None:
        self.config = config
        self.num_stages = config.pipeline_parallel_degree
        self.devices = choose_devices(config)
        self.transport: Transport = ThreadTransport(direct=config.direct_dispatch)
        self.servers = [StageServer(s, self.num_stages, s, d, self.transport, self.place_of_stage)
                        for s, d in enumerate(self.devices)]
        self.steps = itertools.count()
        self.models: weakref.WeakSet[DistributedModel] = weakref.WeakSet()
        self._step_lock = threading.Lock()
        self._place_lock = threading.Lock()

    def place_of_stage(self, stage: int) -> int:
        return stage

    def run_step(self, fn: Callable, pieces: list[tuple[tuple, dict]],
                 model: DistributedModel, samples: int | None = None) -> tuple[list[Any], Any]:
        """Run ``fn`` over ``pieces`` (one per micro-batch) for ``model``; ``samples``: the step's batch
        size (what data-parallel replicas with batch shares check; none on threads)."""
        if in_a_step():
            raise SmpartError("an @smpart.step function was called inside another step (or from a module "
                              "running in one); steps do not nest: call the inner step after the outer "
                              "one returns, or make it a plain function")
        with self._step_lock:
            _in_step.active = True
            try:
                return steps.run_step(self, model, fn, pieces,
                                      lambda: StepRun(self, next(self.steps), fn, pieces).execute())
            finally:
                _in_step.active = False

    def training_modes(self) -> dict[int, bytes] | None:
        """Threads: every stage's modules are the ones the step body sees; nothing to send."""
        return None

    def ensure_placed(self, model: DistributedModel, args: tuple, kwargs: dict) -> None:
        """Partition and place ``model`` on its first call (micro-batch 0 of its first step)."""
        if model._runtime is self:
            return
        with self._place_lock:
            if model._runtime is self:
                return
            partition = partition_for(model, args, kwargs, self.config)
            place(model.module, model.model_id, partition, self.servers)
            model._partition = partition
            steps.placed(model, partition)
            model._runtime = self
            self.models.add(model)
            model._placed()  # a checkpoint load that waited for the placement of a model built on meta

    def shutdown(self, timeout_s: float = 10.0) -> list[str]:
        for model in list(self.models):
            unplace(model.module, self.servers)
            templates.forget(model.model_id)
            model._runtime = None
        stuck: list[str] = []
        for thread in self.__dict__.get("program_threads", []):
            stuck += thread.stop(timeout_s)
        for server in self.servers:
            stuck += server.stop(timeout_s)
        self.transport.shutdown()
        return stuck


def partition_for(model: DistributedModel, args: tuple, kwargs: dict, config: Config) -> Partition:
    """The model's partition: the one it has if it fits this configuration's stage count, else a
    new one from tracing this call (with ``config.pin`` and the `set_partition` pins)."""
    partition = model._partition
    if partition is None or partition.num_stages != config.partition_stages or (
            partition.meta.get("ranks", config.pipeline_parallel_degree) != config.pipeline_parallel_degree):
        pins = pins_for(model.module, config.pin, dict(_module_pins.items()))
        partition = make_partition(model.module, args, kwargs, config, pins)
    return partition


def init(config: Config | dict[str, Any] | None = None, **kwargs: Any) -> Config:
    """Start smpart with a `Config`, a dict or keyword arguments; returns the validated `Config`.

    Under ``torchrun`` (or with a process group already initialised) every rank calls it with
    the same configuration and runs one stage; otherwise every stage runs on threads of this
    process. Calling it again first shuts the running configuration down.
    """
    global _runtime
    cfg = Config.from_any(config, **kwargs)
    shutdown()
    from smpart.distributed.launch import launched_with_processes

    if launched_with_processes():
        from smpart.runtime.processes import ProcessRuntime

        _runtime = ProcessRuntime(cfg)  # type: ignore[assignment]
        # Exit hooks run last registered first: smpart's shutdown must run before the transport's
        # hook (registered at its import, just now) aborts the transports still open.
        atexit.unregister(_shutdown_at_exit)
        atexit.register(_shutdown_at_exit)
        return cfg
    if cfg.device_types and len(cfg.device_types) != cfg.pipeline_parallel_degree:
        stages, given = cfg.pipeline_parallel_degree, len(cfg.device_types)
        raise ConfigError(f"on threads device_types names each stage's device: give {stages} type(s), one "
                          f"per stage, not {given}")
    if cfg.tensor_parallel_degree != 1 or (cfg.data_parallel_degree or 1) != 1 or len(
            cfg.data_parallel_shares or [1]) != 1:
        raise ConfigError("on threads (no torchrun) smpart runs pipeline parallelism only: "
                          "tensor_parallel_degree and data_parallel_degree need one process per rank "
                          "(launch with torchrun --nproc-per-node <pp x tp x dp>)")
    _runtime = Runtime(cfg)
    return cfg


def shutdown() -> None:
    """Stop every execution server and join its threads (safe to call when not initialised)."""
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None:
        if sys.exc_info()[1] is not None:  # called while an error propagates: fail fast, answer nobody
            runtime.answer_at_shutdown = False
        stuck = runtime.shutdown()
        if stuck:
            raise SmpartError(f"threads still busy after shutdown (a module that never returns?): {stuck}")


def in_a_step() -> bool:
    """Whether this thread runs inside a step: the caller of one, a step body or a module in it."""
    from smpart.runtime.calls import current_frame

    return getattr(_in_step, "active", False) or current_frame() is not None


def current_runtime() -> Runtime:
    if _runtime is None:
        raise SmpartError("smpart is not initialised: call smpart.init(pipeline_parallel_degree=..., "
                          "microbatches=...) before running a step")
    return _runtime


def running_runtime() -> Runtime | None:
    return _runtime


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


def _shutdown_at_exit() -> None:
    """Flush and stop smpart (its last messages must leave), then the process group it made."""
    owned = getattr(_runtime, "setup", None) is not None and _runtime.setup.created_default_group
    if _runtime is not None and hasattr(sys, "last_value"):
        _runtime.answer_at_shutdown = False  # the script ended with an uncaught exception: fail fast
    with contextlib.suppress(SmpartError):  # daemon threads still stuck in a module die with the process
        shutdown()
    if owned:
        from smpart.distributed.launch import teardown

        teardown()


atexit.register(_shutdown_at_exit)
