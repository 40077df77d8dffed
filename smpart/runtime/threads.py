"""`ThreadRuntime`: every stage on threads of this process (``python train.py``, no torchrun).

One `StageServer` per stage over one `ThreadTransport` (messages by reference); the step body's
drivers and the coordinator live at stage 0's place. Pipeline parallelism only.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from smpart.config import Config
from smpart.runtime.placement.place import choose_devices, place, recomputed_modules, unplace
from smpart.runtime.program import steps, templates
from smpart.runtime.reference.stage import StageServer
from smpart.runtime.reference.step_run import StepRun
from smpart.runtime.runtime import Runtime, partition_for
from smpart.runtime.wire.transport import ThreadTransport, Transport

if TYPE_CHECKING:
    from smpart.runtime.model import DistributedModel


class ThreadRuntime(Runtime):
    """The stage servers of one configuration and the models placed on them (threads)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.num_stages = config.pipeline_parallel_degree
        self.devices = choose_devices(config)
        self.transport: Transport = ThreadTransport()
        self.servers = [StageServer(s, self.num_stages, s, d, self.transport, self.place_of_stage)
                        for s, d in enumerate(self.devices)]
        self.steps = itertools.count()
        self.models: weakref.WeakSet[DistributedModel] = weakref.WeakSet()
        self._step_lock = threading.Lock()
        self._place_lock = threading.Lock()
        #: The threads that run step programs (`smpart.runtime.program.steps`), made at the first.
        self.program_threads: list = []

    def place_of_stage(self, stage: int) -> int:
        return stage

    def run_step(self, fn: Callable, pieces: list[tuple[tuple, dict]],
                 model: DistributedModel, samples: int | None = None) -> tuple[list[Any], Any]:
        """Run ``fn`` over ``pieces`` (one per micro-batch) for ``model``; ``samples``: the step's batch
        size (what data-parallel replicas with batch shares check; none on threads)."""
        with self.stepping(self._step_lock):
            try:
                return steps.run_step(self, model, fn, pieces,
                                      lambda: StepRun(self, next(self.steps), fn, pieces).execute())
            finally:
                self.steps_taken += 1

    def training_modes(self) -> dict[int, bytes] | None:
        """Threads: every stage's modules are the ones the step body sees; nothing to send."""
        return None

    def _place_first(self, model: DistributedModel, args: tuple, kwargs: dict) -> None:
        """Partition and place ``model`` on every stage of this process."""
        partition = partition_for(model, args, kwargs, self.config)
        place(model.module, model.model_id, partition, self.servers)
        model._partition = partition
        one_device = len({server.device for server in self.servers}) == 1  # the stages share its buffers
        steps.placed(model, partition, recomputed_modules(model.module, partition) if one_device else ())
        model._runtime = self
        self.models.add(model)
        model._placed()  # a checkpoint load that waited for the placement of a model built on meta

    def shutdown(self, timeout_s: float = 10.0) -> list[str]:
        for model in list(self.models):
            unplace(model.module, self.servers)
            templates.forget(model.model_id)
            model._runtime = None
        stuck: list[str] = []
        for thread in self.program_threads:
            stuck += thread.stop(timeout_s)
        for server in self.servers:
            stuck += server.stop(timeout_s)
        self.transport.shutdown()
        return stuck
