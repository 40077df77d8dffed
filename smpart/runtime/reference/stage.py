"""`StageServer`: one per pipeline stage; its job is to turn the messages sent to it into work.

A server has a *dispatcher*, which takes every message for the stage and turns it into state or
work, and a pool of *worker* threads that do the work (`workers`): forward calls (`forward`) and
backward segments (`segments`), with the step's state in a `StageStep` (`stage_step`). The
dispatcher is the handler of the stage's `Endpoint`, on the server's own thread: one message at
a time, in arrival order.

- a `Request` becomes a forward call's job;
- a `Batch` is a `ForwardDone` with the gradients of the loss, taken in order;
- a `Response` wakes the call (or the fetch of a handle) that waits for it;
- a `Fetch` is answered at once with a tensor the stage holds (`handles`);
- `Gradients` join their micro-batch's backlog, and a backward segment's job takes them;
- step control (begin, forward done, release, abort, end) updates the step's state.

A call that waits for another stage keeps its worker (its Python frames live on that thread's
stack) but gives the turn back (`scheduler`), so the stage keeps serving other micro-batches and
a module calling back into this stage (nested placement) cannot deadlock. No thread ever blocks
inside autograd: backward segments only post messages.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from smpart.errors import PipelineError, SmpartError
from smpart.runtime.ambient import compute_thread
from smpart.runtime.program import templates
from smpart.runtime.reference.forward import ForwardCalls
from smpart.runtime.reference.scheduler import NEW, Cancelled, Claim
from smpart.runtime.reference.segments import BackwardSegments
from smpart.runtime.reference.stage_step import StageStep
from smpart.runtime.reference.workers import POLL_S, WorkerPool, debug, debugging
from smpart.runtime.schedule import FORWARD, Action
from smpart.runtime.wire.messages import (
    STAGE,
    Abort,
    Address,
    Armed,
    Batch,
    BeginStep,
    EndStep,
    Failed,
    Fetch,
    ForwardDone,
    Gradients,
    Grant,
    Release,
    Request,
    Response,
    Shutdown,
    StageReport,
)
from smpart.runtime.wire.transport import Transport


class StageServer(ForwardCalls, BackwardSegments):
    """The execution server of pipeline stage ``stage``, living at ``place`` on ``device``."""

    def __init__(self, stage: int, num_stages: int, place: int, device: torch.device,
                 transport: Transport, place_of_stage: Callable[[int], int], rank: int | None = None,
                 tp_followers: list[int] | None = None, tp_follower: bool = False) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.place = place
        self.device = device
        self.transport = transport
        self.place_of_stage = place_of_stage
        self.rank = rank
        self.address: Address = (place, STAGE)
        self.debug = debugging()
        #: Tensor parallelism (see `scheduler`): the places of this stage's other tensor-parallel
        #: ranks if this one leads them, or whether this one follows its leader's grants.
        self.tp_followers = list(tp_followers or [])
        self.tp_follower = tp_follower
        self.modules: dict[tuple[int, str], nn.Module] = {}
        #: Gradient messages each kept call got in the last step with a backward (`gradients`).
        self.messages_per_record: dict[tuple[str, bool, int], int] = {}
        self.run: StageStep | None = None
        self.workers = WorkerPool(f"smpart-stage{stage}")
        #: Messages of steps that have not begun here yet (per-pair FIFO does not order messages
        #: from different ranks), replayed when they begin.
        self._early: dict[int, list[Any]] = defaultdict(list)
        #: The last step this rank's main thread has entered: a stage of a rank that does not run the
        #: step body must not begin a step while its main thread still runs the optimizer of the
        #: previous one (`arm`). Threads and the driver's rank: no limit.
        self.armed = math.inf if rank is None else -1
        #: The last step that began here (its `BeginStep` handled).
        self.begun = -1
        #: When the dispatcher last received a message (a rank waiting for a step to end uses it to
        #: tell a long step from a hung one).
        self.last_activity = time.monotonic()
        #: Called by the dispatcher once every micro-batch of a step is released here (the
        #: stage's gradients are final): data parallelism starts averaging them then.
        self.on_gradients_final: Callable[[int], None] | None = None
        #: Called by the dispatcher as a step begins here, before any of its work (processes: the
        #: driver's modules' training modes).
        self.on_begin: Callable[[BeginStep], None] | None = None
        self._stopping = False
        self._handlers: dict[type, Callable[[Any], None]] = {
            BeginStep: self._on_begin, Request: self._on_request, Response: self._on_response,
            Gradients: self._on_gradients, ForwardDone: self._on_forward_done, Release: self._on_release,
            Abort: self._on_abort, EndStep: self._on_end, Grant: self._on_grant, Fetch: self._on_fetch,
        }
        self.endpoint = transport.serve(self.address, self._dispatch)
        self.thread = compute_thread(self._dispatch_loop, f"smpart-stage{stage}")
        self.thread.start()

    # ================================================================ lifecycle
    def stop(self, timeout_s: float) -> list[str]:
        """Stop the dispatcher and every worker; the names of threads still busy after ``timeout_s``."""
        self.transport.send(self.place, self.address, Shutdown())
        self.thread.join(timeout_s)
        stuck = self.workers.stop(timeout_s)
        self.transport.unserve(self.address)
        return stuck + ([self.thread.name] if self.thread.is_alive() else [])

    def send(self, address: Address, message: Any) -> None:
        self.transport.send(self.place, address, message)

    def arm(self, step: int) -> None:
        """This rank's main thread entered ``step``: the stage may begin it (wakes the dispatcher)."""
        self.armed = step
        self.transport.send(self.place, self.address, Armed(step))

    # ================================================================ the dispatcher
    def _dispatch_loop(self) -> None:
        while not self._stopping:
            if self.endpoint.serve_one(POLL_S):
                continue
            try:
                self.transport.check()
            except SmpartError as err:  # the transport failed (a lost rank): fail the running step
                self.endpoint.deliver(_TransportFailed(err))

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, _TransportFailed):
            self._fail_running(message.error)
            return
        self.last_activity = time.monotonic()
        if isinstance(message, Shutdown):
            self._stopping = True
            self._abort_running()
        elif isinstance(message, Armed):
            self._begin_ready_steps()
        else:
            self._admit(message)

    def _admit(self, message: Any) -> None:
        """Handle ``message`` now, or keep it until its step begins here (a `Batch` whole)."""
        step = message.step
        current = self.run.step if self.run is not None else self.begun
        if step > current and not (isinstance(message, BeginStep) and step <= self.armed):
            self._early[step].append(message)
            return
        if isinstance(message, Batch):
            for each in message.messages:
                self._admit(each)
            return
        if self.debug:
            debug("stage %d receives %s", self.stage, _describe(message))
        try:
            self._handlers[type(message)](message)
        except Exception:  # a bug in a handler must not silence the stage
            warnings.warn(f"smpart: stage {self.stage} failed to handle {type(message).__name__}:\n"
                          f"{traceback.format_exc()}", RuntimeWarning, stacklevel=1)
        if isinstance(message, BeginStep):
            for early in self._early.pop(step, []):
                self._admit(early)

    def _begin_ready_steps(self) -> None:
        for step in sorted(self._early):
            begin = next((m for m in self._early[step] if isinstance(m, BeginStep)), None)
            if begin is None or step > self.armed:
                return
            self._early[step].remove(begin)
            self._admit(begin)

    def _live(self, message: Any) -> StageStep | None:
        run = self.run
        return run if run is not None and run.step == message.step and not run.aborted else None

    def _on_begin(self, message: BeginStep) -> None:
        self._abort_running()
        if self.on_begin is not None:
            self.on_begin(message)
        self.begun = message.step
        self.run = StageStep(message, self.stage, self.num_stages, self.tp_follower)
        self.run.bytes_before = dict(self.transport.bytes_sent)

    def _on_request(self, message: Request) -> None:
        run = self._live(message)
        if run is None:
            return
        mb = message.microbatch
        claim = Claim(Action(FORWARD, mb), NEW, run.requests[mb])
        run.requests[mb] += 1
        self.workers.submit(lambda: self._serve_call(run, message, claim))

    def _on_response(self, message: Response) -> None:
        run = self._live(message)
        if run is None:
            return
        waiter = run.waiting.pop(message.call_id, None)
        if waiter is not None:
            waiter.deliver(message)

    def _on_fetch(self, message: Fetch) -> None:
        """Send a held tensor to the endpoint materialising its handle (no turn: it exists)."""
        run = self._live(message)
        if run is None:
            return
        tensor = run.held.get(message.microbatch, {}).get((message.of_call, message.index))
        error = None
        if tensor is None:
            error = PipelineError(f"stage {self.stage} no longer holds output {message.index} of call "
                                  f"{message.of_call}: a tensor was used after its micro-batch was released",
                                  stage=self.stage, microbatch=message.microbatch, rank=self.rank)
        if not run.aborted:
            answer = Response(run.step, message.microbatch, message.call_id, tensor, error)
            self.send(message.reply_to, answer)

    def _on_gradients(self, message: Gradients) -> None:
        run = self._live(message)
        if run is None or message.microbatch in run.released:
            return
        mb = message.microbatch
        with run.lock:
            run.backlog[mb].append(message)
            run.gradients_came.notify_all()
            if mb in run.segment_queued:
                return
            run.segment_queued.add(mb)
        self.workers.submit(lambda: self._run_segment(run, mb))

    def _on_grant(self, message: Grant) -> None:
        run = self._live(message)
        if run is not None:
            run.scheduler.follow(message.key, message.payload)

    def _announce(self, run: StageStep, claim: Claim, payload: tuple = ()) -> None:
        """A tensor-parallel leader holds the turn for ``claim``: its followers grant the same."""
        for place in self.tp_followers:
            self.send((place, STAGE), Grant(run.step, claim.key, payload))

    def _on_forward_done(self, message: ForwardDone) -> None:
        run = self._live(message)
        if run is not None:
            run.scheduler.forward_over(message.microbatch)

    def _on_release(self, message: Release) -> None:
        run = self._live(message)
        if run is not None:
            mb = message.microbatch
            run.released.add(mb)
            holding = run.holdings.pop(mb, None)
            if holding is not None:
                run.learn_messages(holding)
            run.served.pop(mb, None)
            run.sent.pop(mb, None)
            run.held.pop(mb, None)
            run.scheduler.microbatch_over(mb)
            if len(run.released) == run.microbatches and self.on_gradients_final is not None:
                self.on_gradients_final(run.step)

    def _on_abort(self, message: Abort) -> None:
        run = self.run
        if run is not None and run.step == message.step:
            self._abort(run)

    def _on_end(self, message: EndStep) -> None:
        run = self.run
        if run is None or run.step != message.step:
            return
        if not run.aborted and run.messages_per_record:
            self.messages_per_record = run.messages_per_record
        self._abort(run)  # nothing of this step may still run or wait
        self.run = None
        started = [str(a) for a in run.scheduler.started_order]
        recorder = templates.recording()
        recorded = recorder.recorded() if recorder is not None and not self.transport.local(
            run.driver_place) else None
        report = StageReport(message.step, self.stage, list(run.spans), started,
                             self._bytes_since(run.bytes_before), recorded)
        self.send(run.coordinator, report)

    def _abort(self, run: StageStep) -> None:
        with run.lock:
            run.aborted = True
            run.gradients_came.notify_all()
        run.scheduler.abort()
        for waiter in list(run.waiting.values()):
            waiter.cancel()
        run.waiting.clear()
        run.backlog.clear()
        run.served.clear()
        run.sent.clear()
        run.held.clear()

    def _abort_running(self) -> None:
        if self.run is not None:
            self._abort(self.run)

    def _fail_running(self, err: SmpartError) -> None:
        run = self.run
        if run is not None and not run.aborted:
            self.send(run.coordinator, Failed(run.step, err))
            self._abort(run)

    # ================================================================ helpers
    def _bytes_since(self, before: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
        """Tensor bytes this stage's place sent to each other stage since ``before``."""
        stage_of = {self.place_of_stage(s): s for s in range(self.num_stages)}
        sent: dict[tuple[int, int], int] = {}
        for (src, dst), total in list(self.transport.bytes_sent.items()):
            size = total - before.get((src, dst), 0)
            if src == self.place and size > 0 and dst in stage_of:
                key = (self.stage, stage_of[dst])
                sent[key] = sent.get(key, 0) + size
        return sent

    def _check(self, run: StageStep) -> None:
        if run.aborted:
            raise Cancelled()
        self.transport.check()

    def _describe_wait(self, run: StageStep, module: str | None, mb: int, on: int | None = None) -> str:
        what = f"module {module!r} on stage {on}" if on is not None else f"its turn on stage {self.stage}"
        return (f"micro-batch {mb} waited more than {run.timeout_s} s for {what} "
                f"(a hang, or a module slower than timeout_s)")


class _TransportFailed:
    """Delivered by the server's own thread when the transport failed (a lost rank)."""

    def __init__(self, error: SmpartError) -> None:
        self.error = error


def _describe(message: Any) -> str:
    name = type(message).__name__
    mb = getattr(message, "microbatch", None)
    module = getattr(message, "module", None)
    where = f", module={module!r}" if module else ""
    return f"{name}(step={getattr(message, 'step', '-')}, mb={mb}{where})"
