"""The process-wide runtime: `init`, `shutdown`, `set_partition`, `partition_of`.

`init` validates a `Config`, picks each stage's device and starts one `ExecutionServer` per stage
over a `ThreadTransport`. `shutdown` joins every thread and gives placed models their plain
forwards back; `init` may then be called again with another configuration (a model is
re-partitioned at its next step). Interpreter exit shuts down too.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from smpart.config import Config
from smpart.errors import ConfigError, SmpartError
from smpart.partition.result import Partition
from smpart.runtime.placement import choose_devices, make_partition, pins_for, place, unplace
from smpart.runtime.server import ExecutionServer
from smpart.runtime.step_run import StepRun
from smpart.runtime.transport import ThreadTransport

if TYPE_CHECKING:
    from smpart.runtime.model import DistributedModel

_runtime: Runtime | None = None
_module_pins: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


class Runtime:
    """The execution servers of one configuration and the models placed on them."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.devices = choose_devices(config)
        self.transport = ThreadTransport()
        self.servers = [ExecutionServer(s, d, self.transport) for s, d in enumerate(self.devices)]
        for server in self.servers:
            server.peers = self.servers
        self.steps = itertools.count()
        self.models: weakref.WeakSet[DistributedModel] = weakref.WeakSet()
        self._step_lock = threading.Lock()
        self._place_lock = threading.Lock()

    def run_step(self, fn: Callable, pieces: list[tuple[tuple, dict]]) -> tuple[list[Any], Any]:
        with self._step_lock:
            return StepRun(self, next(self.steps), fn, pieces).execute()

    def ensure_placed(self, model: DistributedModel, args: tuple, kwargs: dict) -> None:
        """Partition and place ``model`` on its first call (micro-batch 0 of its first step)."""
        if model._runtime is self:
            return
        with self._place_lock:
            if model._runtime is self:
                return
            partition = model._partition
            if partition is None or partition.num_stages != len(self.servers):
                pins = pins_for(model.module, self.config.pin, dict(_module_pins.items()))
                partition = make_partition(model.module, args, kwargs, self.config, pins)
            place(model.module, partition, self.servers)
            model._partition = partition
            model._runtime = self
            self.models.add(model)

    def shutdown(self, timeout_s: float = 10.0) -> list[str]:
        for model in list(self.models):
            unplace(model.module, self.servers)
            model._runtime = None
        stuck: list[str] = []
        for server in self.servers:
            stuck += server.stop(timeout_s)
        return stuck


def init(config: Config | dict[str, Any] | None = None, **kwargs: Any) -> Config:
    """Start smpart with a `Config`, a dict or keyword arguments; returns the validated `Config`.

    Calling it again first shuts the running configuration down.
    """
    global _runtime
    cfg = Config.from_any(config, **kwargs)
    if cfg.tensor_parallel_degree != 1 or (cfg.data_parallel_degree or 1) != 1:
        raise ConfigError("this runtime runs pipeline parallelism only: tensor_parallel_degree and "
                          "data_parallel_degree must be 1")
    shutdown()
    _runtime = Runtime(cfg)
    return cfg


def shutdown() -> None:
    """Stop every execution server and join its threads (safe to call when not initialised)."""
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None:
        stuck = runtime.shutdown()
        if stuck:
            raise SmpartError(f"threads still busy after shutdown (a module that never returns?): {stuck}")


def current_runtime() -> Runtime:
    if _runtime is None:
        raise SmpartError("smpart is not initialised: call smpart.init(pipeline_parallel_degree=..., "
                          "microbatches=...) before running a step")
    return _runtime


def set_partition(module: nn.Module, stage: int) -> None:
    """Pin ``module`` (and its sub-modules) to pipeline ``stage``; call it before the first step."""
    if not isinstance(module, nn.Module):
        raise SmpartError(f"set_partition needs an nn.Module, got {type(module).__name__}")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise SmpartError(f"set_partition: stage must be an int >= 0, got {stage!r}")
    _module_pins[module] = stage


def partition_of(model: Any) -> Partition:
    """The `Partition` a `DistributedModel` runs with (known after its first step)."""
    partition = getattr(model, "_partition", None)
    if partition is None:
        raise SmpartError("this model has no partition yet: a DistributedModel is partitioned at its first "
                          "step (or pass a plain model to smpart.partition(smpart.trace(...)))")
    return partition


def _shutdown_at_exit() -> None:
    with contextlib.suppress(SmpartError):  # daemon threads still stuck in a module die with the process
        shutdown()


atexit.register(_shutdown_at_exit)
