"""`StepRun`: one call of a step function, coordinated from the calling thread.

The coordinator tells every stage a step begins (schedule, micro-batch count), starts one
`Driver` thread per micro-batch (each waits for a slot: never more run at once than the schedule
allows in flight), and waits on its own address for each driver's result or any stage's
failure. On the first failure it aborts the step everywhere (stages drop its work, drivers
stop waiting) and re-raises it once every driver has stopped; either way it collects each
stage's timeline spans at the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from smpart.errors import PipelineError
from smpart.runtime.baton import POLL_S, Cancelled
from smpart.runtime.driver import Driver
from smpart.runtime.gradients import PendingGradients
from smpart.runtime.messages import Abort, BeginStep, EndStep, Failed, MicrobatchFinished, StepReport
from smpart.runtime.schedule import schedule_named
from smpart.runtime.server import coordinator_address
from smpart.runtime.timeline import Timeline

if TYPE_CHECKING:
    from smpart.runtime.runtime import Runtime


class StepRun:
    def __init__(self, runtime: Runtime, step: int, fn: Callable, pieces: list[tuple[tuple, dict]]) -> None:
        config = runtime.config
        self.runtime = runtime
        self.step = step
        self.fn = fn
        self.pieces = pieces
        self.microbatches = len(pieces)
        self.transport = runtime.transport
        self.num_stages = len(runtime.servers)
        self.policy = schedule_named({"gpipe": "simple", "1f1b": "interleaved"}.get(config.pipeline, config.pipeline))
        self.in_flight = self.policy.in_flight(self.microbatches, self.num_stages, config.active_microbatches)
        self.average_grads = config.average_grads_across_microbatches
        self.timeout_s = config.timeout_s
        self.pending = PendingGradients(self.microbatches)
        self.aborted = threading.Event()
        self.turn = threading.Condition()
        self.next_turn = 0
        self.slots = threading.Condition()
        self.completed = 0  # drivers done: micro-batch i may start once i < completed + in_flight
        self.address = coordinator_address(step)

    def broadcast(self, message: Any) -> None:
        for stage in range(self.num_stages):
            self.transport.send(stage, message)

    # ================================================================ the step
    def execute(self) -> tuple[list[Any], Timeline]:
        self.transport.open(self.address)
        start = time.perf_counter()
        self.broadcast(BeginStep(self.step, self.microbatches, self.policy, self.pending, self.timeout_s))
        threads: list[threading.Thread] = []
        results: list[Any] = [None] * self.microbatches
        failures: list[BaseException] = []
        finished = 0
        try:
            threads += [self._start_driver(mb) for mb in range(self.microbatches)]
            while finished < len(threads):
                message = self._wait()
                if isinstance(message, MicrobatchFinished):
                    finished += 1
                    results[message.microbatch] = message.result
                    error = message.error
                elif isinstance(message, Failed):
                    error = message.error
                elif failures:  # aborted, yet a driver does not report back: give up on it
                    break
                else:  # nothing arrived for timeout_s
                    error = PipelineError(f"step made no progress for {self.timeout_s} s (a hang?)")
                if error is not None and not isinstance(error, Cancelled):
                    if not failures:
                        self._abort()
                    failures.append(error)
        finally:
            for thread in threads:
                thread.join(self.timeout_s)
            duration = time.perf_counter() - start
            timeline = self._collect_timeline(start, duration)
            self.transport.close(self.address)
        if failures:  # several micro-batches may fail at once: report the earliest one
            raise min(failures, key=lambda e: _microbatch_of(e, self.microbatches))
        return results, timeline

    # ================================================================ in-flight slots
    def wait_for_slot(self, microbatch: int) -> None:
        """Block the driver of ``microbatch`` until fewer than ``in_flight`` micro-batches run.

        Every driver thread starts with the step and waits here, so when a micro-batch completes
        the next one starts after one wake-up, with no thread to create on the critical path.
        """
        deadline = time.monotonic() + self.timeout_s
        with self.slots:
            while microbatch >= self.completed + self.in_flight:
                if self.aborted.is_set():
                    raise Cancelled()
                if time.monotonic() > deadline:
                    raise PipelineError(f"micro-batch {microbatch} waited more than {self.timeout_s} s for "
                                        "an earlier micro-batch to complete", microbatch=microbatch)
                self.slots.wait(POLL_S)

    def free_slot(self) -> None:
        with self.slots:
            self.completed += 1
            self.slots.notify_all()

    def _start_driver(self, microbatch: int) -> threading.Thread:
        args, kwargs = self.pieces[microbatch]
        driver = Driver(self, microbatch, args, kwargs)
        name = f"smpart-step{self.step}-mb{microbatch}"
        thread = threading.Thread(target=driver.main, name=name, daemon=True)
        thread.start()
        return thread

    def _wait(self) -> Any | None:
        deadline = time.monotonic() + self.timeout_s + 1.0
        while time.monotonic() < deadline:
            message = self.transport.receive(self.address, POLL_S)
            if message is not None:
                return message
        return None

    def _abort(self) -> None:
        self.aborted.set()
        self.broadcast(Abort(self.step))
        with self.slots:
            self.slots.notify_all()

    def _collect_timeline(self, start: float, duration: float) -> Timeline:
        self.broadcast(EndStep(self.step, self.address))
        spans: dict[int, list] = {}
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        while len(spans) < self.num_stages and time.monotonic() < deadline:
            message = self.transport.receive(self.address, POLL_S)
            if isinstance(message, StepReport) and message.step == self.step:
                spans[message.stage] = message.spans
        return Timeline.from_spans(spans, start, duration, self.num_stages, self.policy.name,
                                   self.microbatches)


def _microbatch_of(error: BaseException, last: int) -> int:
    microbatch = getattr(error, "microbatch", None)
    return last if microbatch is None else microbatch
