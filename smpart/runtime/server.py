"""`ExecutionServer`: one per pipeline stage, serving the requests and gradients sent to it.

The server's threads (`LeaderFollowers`) take turns receiving the stage's messages and turn
each into work, run by the thread that received it:

- a `ForwardRequest` takes a compute-baton ticket (in arrival order); the thread waits for the
  baton, runs the module, keeps its outputs for the backward and answers;
- a `ForwardResponse` queues the waiting call's ticket on the glue baton; the call resumes when
  granted (see `enter_compute`);
- a gradient message (`BackwardRequest` for outputs this stage returned, `GradResponse` for
  arguments this stage sent) joins its micro-batch's backlog, and one backward segment runs for
  everything in that backlog (`smpart.runtime.gradients`);
- control messages (step begin/end, forward done, release, abort) update per-step state.

Work for an idle stage of the same process skips all that: the thread that posted a gradient
message runs the stage's backward segment itself (`ExecutionServer.deliver`), and a stage calling
a module of an idle stage runs the call itself (`ExecutionServer._call_elsewhere`), so a round
trip between idle stages passes no queue and wakes no thread. Either runs only when it changes
nothing about the order work runs in (`ExecutionServer._take_inline` gives the argument).

A call from this stage to a module on another stage gives the baton back while it waits, so the
stage keeps serving other micro-batches and nested placement (stage 1 calling a child pinned to
stage 0, itself called from stage 0) cannot deadlock. No thread ever blocks inside autograd:
backward segments only post messages.

Why several threads and not the classic re-entrant loop (the waiting call serving its inbox on
its own stack)? Frames on one stack can only resume last-in first-out: with a root module on
stage 0 orchestrating every stage, micro-batch 0's root would wait under micro-batch 1's, 2's...
and the pipeline would run one micro-batch at a time. One thread per waiting call lets any of
them resume, while the baton keeps the stage running one thing at a time. A waiting call does
receive for its stage while it holds the turn (`LeaderFollowers.serve`), but it only admits:
work it cannot run on its own stack goes to another thread, so nothing waits under it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from smpart.errors import PipelineError
from smpart.runtime import boundary
from smpart.runtime.baton import Baton, Cancelled, Ticket, TimedOut
from smpart.runtime.calls import Frame, StagedForward, as_pipeline_error, running
from smpart.runtime.gradients import CallRecords, backpropagate, gradient_poster, held_posts, module_of
from smpart.runtime.messages import (
    Abort,
    BackwardRequest,
    BeginStep,
    Drained,
    EndStep,
    Failed,
    ForwardRequest,
    ForwardResponse,
    ForwardsDone,
    GradientMessage,
    GradResponse,
    Release,
    Shutdown,
    StepReport,
)
from smpart.runtime.pool import LeaderFollowers, StopServing, Task
from smpart.runtime.schedule import BACKWARD, FORWARD, RESUME
from smpart.runtime.transport import Transport

POLL_S = 0.05
_call_ids = itertools.count()


def new_call_id() -> int:
    return next(_call_ids)


_UNCHANGED = contextlib.nullcontext()
_trampoline = threading.local()  # `ExecutionServer.deliver`: the work queued on this thread


def grad_mode(enabled: bool) -> contextlib.AbstractContextManager:
    """``torch.set_grad_enabled(enabled)``, or a no-op when it already is (the usual case)."""
    return _UNCHANGED if torch.is_grad_enabled() == enabled else torch.set_grad_enabled(enabled)


def driver_address(step: int, microbatch: int) -> tuple:
    return ("driver", step, microbatch)


def coordinator_address(step: int) -> tuple:
    return ("step", step)


class StageStep:
    """What one stage keeps during one step."""

    def __init__(self, begin: BeginStep) -> None:
        self.step = begin.step
        self.microbatches = begin.microbatches
        self.policy = begin.policy
        self.pending = begin.pending
        self.timeout_s = begin.timeout_s
        self.forwards_done: set[int] = set()
        self.aborted = False
        self.served: dict[int, CallRecords] = defaultdict(dict)  # outputs this stage returned
        self.sent: dict[int, CallRecords] = defaultdict(dict)  # arguments this stage sent
        self.waiting: dict[int, Ticket] = {}  # call_id -> ticket of the call waiting for it
        self.backlog: dict[int, list[GradientMessage]] = defaultdict(list)
        self.released: set[int] = set()  # micro-batches done (or failed): late messages are dropped
        self.spans: list[tuple[int, str, float, float]] = []
        self.lock = threading.Lock()

    def ready(self, kind: str) -> bool:
        return self.policy.ready(kind, len(self.forwards_done), self.microbatches)


class ExecutionServer:
    """The execution server of pipeline stage ``stage`` on ``device``."""

    def __init__(self, stage: int, device: torch.device, transport: Transport) -> None:
        self.stage = stage
        self.device = device
        self.transport = transport
        self.modules: dict[str, nn.Module] = {}
        self.baton = Baton()  # the stage's compute: module code and backward segments
        self.glue = Baton()  # calls resuming after a remote answer, in arrival order
        self.run: StageStep | None = None
        #: The servers of the same process, by stage (set by the runtime): an idle one may run a
        #: gradient message on the sending thread (`deliver`).
        self.peers: list[ExecutionServer] = []
        self._handlers: dict[type, Callable[[Any], Task | None]] = {
            BeginStep: self._on_begin,
            ForwardRequest: self._on_forward_request,
            ForwardResponse: self._on_forward_response,
            BackwardRequest: self._on_gradients,
            GradResponse: self._on_gradients,
            ForwardsDone: self._on_forwards_done,
            Release: self._on_release,
            Abort: self._on_abort,
            EndStep: self._on_end,
        }
        transport.open(stage)
        self.threads = LeaderFollowers(f"smpart-stage{stage}", lambda wait: transport.receive(stage, wait),
                                       self._admit_all, POLL_S)

    # ================================================================ lifecycle
    def stop(self, timeout_s: float) -> list[str]:
        """Stop the stage's threads; return the names of those still busy after ``timeout_s``."""
        self.transport.send(self.stage, Shutdown())
        stuck = self.threads.stop(timeout_s)
        self.transport.close(self.stage)
        return stuck

    # ================================================================ admitting messages
    def _admit_all(self, messages: list[Any]) -> list[Task]:
        """Admit messages that arrived together; tickets are granted once all are in. Only then
        does the transport stop counting them as unadmitted (`run_inline` relies on it)."""
        try:
            if len(messages) == 1:
                task = self._admit(messages[0])
                return [] if task is None else [task]
            with self.baton.deferred(), self.glue.deferred():
                tasks = [self._admit(message) for message in messages]
            return [task for task in tasks if task is not None]
        finally:
            self.transport.admitted(self.stage, len(messages))

    def _admit(self, message: Any) -> Task | None:
        """Turn a message into work (returned, run by the receiving thread) or handle it now."""
        if isinstance(message, Shutdown):
            raise StopServing()
        return self._handlers[type(message)](message)

    def _live(self, message: Any) -> StageStep | None:
        """The step ``message`` belongs to, if it is the current one and not aborted."""
        run = self.run
        return run if run is not None and run.step == message.step and not run.aborted else None

    def _on_begin(self, message: BeginStep) -> None:
        self.run = run = StageStep(message)
        self.baton.set_schedule(run.policy.rank, run.ready)
        self.glue.set_schedule(run.policy.rank, run.ready)

    def _on_forward_request(self, message: ForwardRequest) -> Task | None:
        run = self._live(message)
        if run is not None:
            ticket = self.baton.take(FORWARD, message.microbatch)
            return lambda: self._serve_call(run, message, ticket)
        return None

    def _on_forward_response(self, message: ForwardResponse) -> None:
        run = self._live(message)
        ticket = run and run.waiting.pop(message.call_id, None)
        if ticket is not None:
            ticket.payload = message
            self.glue.enqueue(ticket)

    def _on_gradients(self, message: GradientMessage) -> Task | None:
        run = self._live(message)
        if run is not None:
            with run.lock:
                run.backlog[message.microbatch].append(message)
            ticket = self.baton.take(BACKWARD, message.microbatch)
            return lambda: self._run_backward(run, message.microbatch, ticket)
        return None

    def _on_forwards_done(self, message: ForwardsDone) -> None:
        run = self._live(message)
        if run is not None:
            run.forwards_done.add(message.microbatch)
            self.baton.reconsider()

    def _on_release(self, message: Release) -> None:
        run = self._live(message)
        if run is not None:
            run.released.add(message.microbatch)
            run.served.pop(message.microbatch, None)
            run.sent.pop(message.microbatch, None)

    def _on_abort(self, message: Abort) -> None:
        run = self.run
        if run is None or run.step != message.step:
            return
        run.aborted = True
        self.baton.cancel_all()
        self.glue.cancel_all()
        for ticket in list(run.waiting.values()):
            ticket.cancel()
        run.waiting.clear()
        run.backlog.clear()
        run.served.clear()
        run.sent.clear()

    def _on_end(self, message: EndStep) -> None:
        run = self.run
        spans = list(run.spans) if run is not None and run.step == message.step else []
        if run is not None and run.step == message.step:
            self.run = None
        self.transport.send(message.reply_to, StepReport(message.step, self.stage, spans))

    # ================================================================ work
    def _serve_call(self, run: StageStep, request: ForwardRequest, ticket: Ticket) -> None:
        """Run a requested module call and answer it."""
        mb = request.microbatch
        try:
            self.baton.wait(ticket, run.timeout_s, lambda: self._describe_wait(request.module, mb),
                            self.threads.serve)
        except Cancelled:
            return
        except TimedOut as err:
            self._answer(run, request, error=PipelineError(str(err), stage=self.stage, module=request.module,
                                                           microbatch=mb))
            return
        response = self._compute(run, request, ticket)
        if response is not None and not run.aborted:
            self.transport.send(request.reply_to, response)

    def _compute(self, run: StageStep, request: ForwardRequest, ticket: Ticket) -> ForwardResponse | None:
        """Run a requested module call holding ``ticket`` (granted); its answer, None if cancelled."""
        mb = request.microbatch
        frame = Frame(self, run.step, mb, run=run, ticket=ticket, since=time.perf_counter())
        output = error = None
        forwarded: dict = {}
        try:
            route = boundary.route_back(request.reply_to, request.call_id, False, request.forwarded)
            post = gradient_poster(self.transport.send, run.pending, run.step, mb, self.deliver)
            args, kwargs = boundary.arrive_call(request.args, request.kwargs, self.device,
                                                route if request.grad_enabled else None, post)
            staged: StagedForward = self.modules[request.module].__dict__["forward"]
            with running(frame), grad_mode(request.grad_enabled):
                output = staged.run_here(frame, args, kwargs)
            what = lambda: f"the output of module {request.module!r} (stage {self.stage})"  # noqa: E731
            kept, forwarded = boundary.depart(output, request.grad_enabled, what)
            if kept is not None:
                run.served[mb][request.call_id] = (request.module, kept)
        except Cancelled:
            return None
        except Exception as err:
            error = as_pipeline_error(err, self.stage, request.module, mb)
        finally:
            self._step_out(frame)
        return ForwardResponse(run.step, mb, request.call_id, output, error, forwarded)

    def _answer(self, run: StageStep, request: ForwardRequest, output: Any = None,
                error: BaseException | None = None, forwarded: dict | None = None) -> None:
        if not run.aborted:
            response = ForwardResponse(run.step, request.microbatch, request.call_id, output, error,
                                       forwarded or {})
            self.transport.send(request.reply_to, response)

    def call(self, frame: Frame, stage: int, module: str, args: tuple, kwargs: dict) -> Any:
        """A module of this stage calls ``module`` on ``stage``: request, give the baton back, wait."""
        run: StageStep = frame.run
        mb = frame.microbatch
        call_id = new_call_id()
        grad = torch.is_grad_enabled()
        kept, forwarded = boundary.depart_call(args, kwargs, grad,
                                               lambda: f"the arguments of module {module!r} (stage {stage})")
        if kept is not None:
            run.sent[mb][call_id] = (module, kept)
        resume = self.glue.ticket(RESUME, mb)
        request = ForwardRequest(run.step, mb, call_id, self.stage, module, args, kwargs, grad, forwarded)
        self._step_out(frame)  # before sending: the callee then runs alone, not against our tail
        answer = self._call_elsewhere(stage, request)
        if answer is not None:  # answered on this thread: resume as if the answer had arrived
            resume.payload = answer
            self.glue.enqueue(resume)
        else:
            run.waiting[call_id] = resume
            self.transport.send(stage, request)
        try:
            self.glue.wait(resume, run.timeout_s, lambda: self._describe_wait(module, mb, stage),
                            self.threads.serve)
        except TimedOut as err:
            raise PipelineError(str(err), stage=stage, module=module, microbatch=mb) from None
        frame.glue = resume
        response: ForwardResponse = resume.payload
        if response.error is not None:
            raise response.error
        route = boundary.route_back(stage, call_id, True, response.forwarded)
        return boundary.arrive(response.output, self.device, route if grad else None,
                               gradient_poster(self.transport.send, run.pending, run.step, mb, self.deliver))

    def _run_backward(self, run: StageStep, mb: int, ticket: Ticket, inline: bool = False) -> None:
        """One backward segment for every gradient message of ``mb`` queued so far (``inline``: on
        another stage's thread, see `deliver`)."""
        try:
            self.baton.wait(ticket, run.timeout_s, lambda: self._describe_wait(None, mb),
                            self.threads.serve)
        except Cancelled:
            return
        except TimedOut as err:
            self.transport.send(coordinator_address(run.step), Failed(run.step, PipelineError(
                str(err), stage=self.stage, microbatch=mb)))
            return
        frame = Frame(self, run.step, mb, run=run, ticket=ticket, since=time.perf_counter())
        with run.lock:
            messages = run.backlog.pop(mb, [])
        # Hold our messages only if no other thread of this stage runs (we lead, see `pool`): else
        # one of them may admit our message to ourselves before we release the baton, so that the
        # schedule sees it when it picks the next work (micro-batch 0's next segment before 1's).
        held = held_posts() if inline or self.threads.leading() else None
        try:
            if messages and mb not in run.released:
                self._backpropagate(frame, messages)
        except Exception as err:
            records = {**run.served.get(mb, {}), **run.sent.get(mb, {})}
            failure = as_pipeline_error(err, self.stage, module_of(records, messages), mb, phase="backward")
            self.transport.send(coordinator_address(run.step), Failed(run.step, failure))
        finally:
            self._end_span(frame, BACKWARD)
            self.baton.release(ticket)
            for _ in messages:
                if run.pending.done(mb):
                    self.transport.send(driver_address(run.step, mb), Drained(run.step, mb))
            if held is not None:
                held.flush()

    # ================================================================ running gradients inline
    def deliver(self, address: Any, message: GradientMessage) -> None:
        """Deliver a gradient message posted by this stage, after the segment that posted it ended.

        When the stage it goes to is idle (`run_inline`), its backward segment runs right here on
        the sending thread: no queue, no thread wake-up, no hand-over of the GIL, which is most of
        a small hop's cost. The segment run here posts in turn, so a backward pass ping-ponging
        between two stages can run entirely on one thread, without either stage ever waiting.

        The trick is a trampoline: a segment run inline does not deliver its own posts (the stack
        would grow by a segment per hop); it queues them on this thread, and the outermost
        `deliver` works the queue off. Only the last queued message may run inline: any message
        before it is sent at once, so its stage never waits behind another stage's segment.
        """
        work: deque | None = getattr(_trampoline, "work", None)
        if work is not None:  # a `deliver` further down this stack works the queue off
            work.append((self, address, message))
            return
        _trampoline.work = work = deque([(self, address, message)])
        try:
            while work:
                sender, address, message = work.popleft()
                if work or not sender._run_elsewhere(address, message):
                    sender.transport.send(address, message)
        finally:
            _trampoline.work = None

    def _run_elsewhere(self, address: Any, message: GradientMessage) -> bool:
        """Run ``message`` for the stage at ``address`` on this thread, if both stages are idle.

        Leaving for another stage, the thread passes on its own stage's receiving (`step_aside`):
        this stage must stay served. That wakes a follower, so it is done only when this stage has
        nothing waiting; a busy stage keeps its thread and sends the message as usual.
        """
        target = self.peers[address] if type(address) is int and address < len(self.peers) else None
        if target is None or not target.idle():
            return False
        if target is not self:
            if not self.idle():
                return False
            self.threads.step_aside()
        return target.run_inline(message)

    def idle(self) -> bool:
        """Nothing runs on this stage, nothing waits to, no message sent to it awaits admission (a
        hint)."""
        return self.baton.idle() and self.transport.idle(self.stage)

    def run_inline(self, message: GradientMessage) -> bool:
        """Run ``message``'s backward segment on the calling thread if this stage is idle (see
        `_take_inline`)."""
        run = self._live(message)
        ticket = run and self._take_inline(BACKWARD, message.microbatch)
        if ticket is None:
            return False
        with run.lock:
            run.backlog[message.microbatch].append(message)
        self._run_backward(run, message.microbatch, ticket, inline=True)
        return True

    def _take_inline(self, kind: str, microbatch: int) -> Ticket | None:
        """The compute baton for work offered on another thread, if running it there now bypasses
        nothing: then the caller runs the work itself instead of sending the message.

        Why this keeps micro-batches in order (BatchNorm's running statistics depend on it): the
        transport counts a message from the moment it is sent until this stage has taken its
        ticket (`ThreadTransport.idle`, `_admit_all`), so at every instant each message for this
        stage is visible as unadmitted, or as a ticket in the baton, or both. We look at the count
        first and at the baton second (`Baton.try_take`: free, nobody waiting, nothing being
        admitted). A message sent before the look is therefore seen, in one place or the other,
        unless its work has already run to the end, and we decline; a message sent after it is a
        later arrival, which the baton would have queued behind us anyway. So the work runs exactly
        when it would have, had the message been sent and admitted at once, alone: with the same
        arrival order, no scheduling choice is made differently.
        """
        if not self.transport.idle(self.stage):
            return None
        return self.baton.try_take(kind, microbatch)

    def _call_elsewhere(self, stage: int, request: ForwardRequest) -> ForwardResponse | None:
        """Run a forward call for the stage ``stage`` of this process on this thread, if both stages
        are idle; its answer (None: send the request as usual).

        The forward half of a round trip then costs neither a queue, nor a thread wake-up, nor a
        hand-over of the GIL, each way. The calling thread was going to wait for the answer
        anyway; it runs the callee's module instead, as the callee's stage (its own frame, the
        callee's baton ticket, taken by `_take_inline`), then resumes like an answered call
        (the glue baton). As in `_run_elsewhere`, this stage's receiving is passed on first.
        """
        target = self.peers[stage] if stage < len(self.peers) else None
        if target is None or target is self or not self.idle():
            return None
        run = target._live(request)
        ticket = run and target._take_inline(FORWARD, request.microbatch)
        if ticket is None:
            return None
        self.threads.step_aside()
        answer = target._compute(run, request, ticket)
        if answer is None or run.aborted:
            raise Cancelled()
        return answer

    def _backpropagate(self, frame: Frame, messages: list[GradientMessage]) -> None:
        run, mb = frame.run, frame.microbatch
        served, sent = run.served[mb], run.sent[mb]  # outputs this stage returned, arguments it sent
        with running(frame):  # modules re-run in the backward (checkpointing) run as usual
            backpropagate([(served if isinstance(m, BackwardRequest) else sent, m) for m in messages])

    def enter_compute(self, frame: Frame) -> None:
        """A resumed call is about to run a module of this stage: take the compute baton first.

        Between its calls a resumed call runs as *glue*, holding only the glue baton (one resumed
        call at a time, in the order the answers arrived): the few lines that pass one stage's
        answer on to the next stage then never wait behind this stage's long-running work. Module
        code takes the compute baton, ahead of new work; the glue baton goes to the next call.
        """
        run: StageStep = frame.run
        ticket = self.baton.take(RESUME, frame.microbatch)
        try:
            self.baton.wait(ticket, run.timeout_s, lambda: self._describe_wait(None, frame.microbatch),
                            self.threads.serve)
        except TimedOut as err:
            raise PipelineError(str(err), stage=self.stage, microbatch=frame.microbatch) from None
        frame.ticket, frame.since = ticket, time.perf_counter()
        self.glue.release(frame.glue)
        frame.glue = None

    def _step_out(self, frame: Frame) -> None:
        """The call waits for another stage or ends: give back whatever it holds."""
        if frame.ticket is not None:
            self._end_span(frame, FORWARD)
            self.baton.release(frame.ticket)
            frame.ticket = None
        if frame.glue is not None:
            self.glue.release(frame.glue)
            frame.glue = None

    # ================================================================ helpers
    def _end_span(self, frame: Frame, kind: str) -> None:
        if frame.run is not None and frame.since:
            frame.run.spans.append((frame.microbatch, kind, frame.since, time.perf_counter()))
            frame.since = 0.0

    def _describe_wait(self, module: str | None, mb: int, on: int | None = None) -> str:
        what = f"module {module!r} on stage {on}" if on is not None else f"stage {self.stage}"
        return (f"micro-batch {mb} waited more than {self.run.timeout_s if self.run else '?'} s for {what} "
                f"(a hang, or a module slower than timeout_s)")
