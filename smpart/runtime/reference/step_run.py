"""`StepRun`: one call of a step function, coordinated from the calling thread.

The coordinator tells every stage that a step begins (its schedule and micro-batch count),
starts one `Driver` thread per micro-batch and waits on its own address for each driver's result
or any stage's failure. On the first failure it aborts the step everywhere (stages drop its work,
drivers stop waiting) and re-raises it once every driver has stopped. Either way it ends the
step on every stage and builds the `Timeline` from their reports.

The order work runs in is not decided here: each stage follows its own list of actions (see
`schedule` and `scheduler`), so drivers may all start at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from smpart.errors import PipelineError, SmpartError
from smpart.runtime.ambient import capture, compute_thread
from smpart.runtime.reference.driver import Driver
from smpart.runtime.reference.scheduler import Cancelled
from smpart.runtime.reference.workers import POLL_S
from smpart.runtime.timeline import Timeline
from smpart.runtime.wire.messages import (
    STAGE,
    Abort,
    Address,
    BeginStep,
    EndStep,
    Failed,
    MicrobatchFinished,
    StageReport,
    coordinator_endpoint,
)

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
        self.place = runtime.driver_place
        self.device = runtime.driver_device
        self.rank = runtime.rank
        self.num_stages = runtime.num_stages
        self.place_of_stage = runtime.place_of_stage
        self.schedule = config.schedule
        self.active_microbatches = config.active_microbatches
        self.average_grads = config.average_grads_across_microbatches
        self.timeout_s = config.timeout_s
        self.handles = config.output_handles
        self.holding = config.gradient_holding
        self.aborted = threading.Event()
        self.turn = threading.Condition()
        self.next_turn = 0
        self.address: Address = (self.place, coordinator_endpoint(step))
        #: The caller's grad mode and autocast (``with torch.autocast(...): train_step(...)``): the
        #: drivers run the body under them, as the body would run if called directly.
        self.ambient = capture()

    def send(self, address: Address, message: Any) -> None:
        self.transport.send(self.place, address, message)

    def stage_addresses(self) -> list[Address]:
        """The address of every stage's server, in stage order."""
        return [(self.place_of_stage(stage), STAGE) for stage in range(self.num_stages)]

    def broadcast(self, message: Any, *, best_effort: bool = False) -> None:
        """Send ``message`` to every stage; ``best_effort``: skip stages whose rank is gone (an abort
        or the end of a failed step must still reach the others)."""
        for address in self.stage_addresses():
            try:
                self.send(address, message)
            except SmpartError:
                if not best_effort:
                    raise

    def report(self, finished: MicrobatchFinished) -> None:
        self.send(self.address, finished)

    # ================================================================ the step
    def execute(self) -> tuple[list[Any], Timeline]:
        self.transport.open(self.address)
        start = time.time()
        self.broadcast(BeginStep(self.step, self.microbatches, self.schedule, self.active_microbatches,
                                 self.timeout_s, self.address, self.handles, self.holding,
                                 self.runtime.training_modes()))
        threads: list[threading.Thread] = []
        results: list[Any] = [None] * self.microbatches
        failures: list[BaseException] = []
        try:
            threads = [self._start_driver(mb) for mb in range(self.microbatches)]
            self._collect(results, failures, len(threads))
        finally:
            for thread in threads:
                thread.join(self.timeout_s)
            timeline = self._end(start, time.time() - start)
            self.transport.close(self.address)
        if failures:  # several micro-batches may fail at once: report the earliest one
            raise min(failures, key=lambda e: _microbatch_of(e, self.microbatches))
        return results, timeline

    def _collect(self, results: list[Any], failures: list[BaseException], drivers: int) -> None:
        finished = 0
        while finished < drivers:
            message = self._wait()
            error: BaseException | None = None
            if isinstance(message, MicrobatchFinished):
                finished += 1
                results[message.microbatch] = message.result
                error = message.error
            elif isinstance(message, Failed):
                error = message.error
            elif failures:  # aborted, yet a driver does not report back: give up on it
                break
            elif message is None:
                error = PipelineError(f"step made no progress for {self.timeout_s} s (a hang?)",
                                      rank=self.rank)
            if error is not None and not isinstance(error, Cancelled):
                if not failures:
                    self._abort()
                failures.append(error)

    def _start_driver(self, microbatch: int) -> threading.Thread:
        args, kwargs = self.pieces[microbatch]
        driver = Driver(self, microbatch, args, kwargs)
        name = f"smpart-step{self.step}-mb{microbatch}"
        thread = compute_thread(driver.main, name)
        thread.start()
        return thread

    def _wait(self) -> Any | None:
        deadline = time.monotonic() + self.timeout_s + 1.0
        while time.monotonic() < deadline:
            message = self.transport.receive(self.address, POLL_S)
            if message is not None:
                return message
            try:
                self.transport.check()
            except Exception as err:  # a lost rank: fail the step at once
                return Failed(self.step, err)
        return None

    def _abort(self) -> None:
        self.aborted.set()
        self.broadcast(Abort(self.step), best_effort=True)

    def _end(self, start: float, duration: float) -> Timeline:
        self.broadcast(EndStep(self.step), best_effort=True)
        reports: dict[int, StageReport] = {}
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        while len(reports) < self.num_stages and time.monotonic() < deadline:
            message = self.transport.receive(self.address, POLL_S)
            if isinstance(message, StageReport) and message.step == self.step:
                reports[message.stage] = message
        spans = {stage: report.spans for stage, report in reports.items()}
        timeline = Timeline.from_spans(spans, start, duration, self.num_stages, self.schedule,
                                       self.microbatches)
        timeline.started = {stage: report.started for stage, report in reports.items()}
        timeline.bytes_sent = {pair: size for report in reports.values()
                               for pair, size in report.bytes_sent.items() if size}
        timeline.templates = [report.templates for report in reports.values() if report.templates]
        return timeline


def _microbatch_of(error: BaseException, last: int) -> int:
    microbatch = getattr(error, "microbatch", None)
    return last if microbatch is None else microbatch
