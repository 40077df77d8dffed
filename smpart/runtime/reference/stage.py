"""`StageServer`: one per pipeline stage, serving the requests and gradients sent to it.

A server has a *dispatcher*, which takes every message for the stage and turns it into state or
work, and a pool of *worker* threads that do the work. The dispatcher is the handler of the
stage's `Endpoint`: it runs on the server's own thread, or, on the transport's speed path, on the
thread that delivered the message; either way one message at a time, in arrival order.

- a `Request` becomes a job that claims the stage's turn (`scheduler`) as the next forward call
  of its micro-batch, runs the module, keeps its outputs for the backward and answers;
- a `Batch` is a `ForwardDone` with the gradients of the loss, taken in order;
- a `Response` wakes the call (or the fetch of a handle) that waits for it;
- a `Fetch` is answered at once with a tensor the stage holds (`handles`);
- `Gradients` join their micro-batch's backlog, and one backward segment runs for everything
  queued by the time it holds the turn (`gradients`);
- step control (begin, forward done, release, abort, end) updates the step's state.

A call that waits for another stage keeps its worker (its Python frames live on that thread's
stack) but gives the turn back, so the stage keeps serving other micro-batches and a module
calling back into this stage (nested placement) cannot deadlock. No thread ever blocks inside
autograd: backward segments only post messages.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from smpart.errors import PipelineError, SmpartError
from smpart.runtime.ambient import Ambient, capture, compute_thread
from smpart.runtime.program import templates
from smpart.runtime.reference import boundary, carried, handles
from smpart.runtime.reference.calls import Frame, as_pipeline_error, running
from smpart.runtime.reference.gradients import (
    CallRecords,
    Holding,
    Outbox,
    backpropagate,
    dispatch,
    grad_mask,
    module_of,
    restore_requires_grad,
)
from smpart.runtime.reference.scheduler import (
    NEW,
    RESUME,
    SEGMENT,
    Cancelled,
    Claim,
    StageScheduler,
    TimedOut,
)
from smpart.runtime.schedule import BACKWARD, FORWARD, Action, schedule_named
from smpart.runtime.wire.messages import (
    STAGE,
    Abort,
    Address,
    Armed,
    Batch,
    BeginStep,
    Credit,
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
    driver_endpoint,
)
from smpart.runtime.wire.transport import Transport
from smpart.tensor_parallel import streams

POLL_S = 0.05
log = logging.getLogger("smpart.runtime")
_call_counter = itertools.count()


def new_call_id(place: int) -> tuple[int, int]:
    """Call ids are unique per job: the caller's place and a per-process counter."""
    return (place, next(_call_counter))


def debugging() -> bool:
    """Whether ``SMPART_DEBUG`` is set (read when a stage server is made: at ``smpart.init``)."""
    return os.environ.get("SMPART_DEBUG", "") not in ("", "0")


def debug(what: str, *args: Any) -> None:
    log.warning("[rank %s %s] " + what, os.environ.get("RANK", "-"), threading.current_thread().name, *args)


class Waiter:
    """A call waiting for its `Response`."""

    __slots__ = ("event", "response", "cancelled")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.response: Response | None = None
        self.cancelled = False

    def deliver(self, response: Response | None) -> None:
        self.response = response
        self.event.set()

    def cancel(self) -> None:
        self.cancelled = True
        self.event.set()

    def wait(self, timeout_s: float, what: Callable[[], str], check: Callable[[], None]) -> Response:
        deadline = time.monotonic() + timeout_s
        while not self.event.wait(POLL_S):
            check()
            if time.monotonic() > deadline:
                raise TimedOut(what())
        if self.cancelled:
            raise Cancelled()
        assert self.response is not None
        return self.response


class StageStep:
    """What one stage keeps during one step."""

    def __init__(self, begin: BeginStep, stage: int, num_stages: int, follower: bool = False) -> None:
        self.step = begin.step
        self.microbatches = begin.microbatches
        self.timeout_s = begin.timeout_s
        self.coordinator = begin.coordinator
        self.driver_place = begin.coordinator[0]
        actions = schedule_named(begin.schedule).actions(stage, num_stages, begin.microbatches,
                                                          begin.active_microbatches)
        self.scheduler = StageScheduler(actions, follower)
        self.requests: dict[int, int] = defaultdict(int)  # forward calls received per micro-batch
        self.resumes: dict[int, int] = defaultdict(int)  # resumed calls per micro-batch
        self.gradients_sent: dict[int, dict] = defaultdict(dict)  # per micro-batch: endpoint -> count
        self.served: dict[int, CallRecords] = defaultdict(dict)  # outputs this stage returned
        #: Outputs answered as handles, per micro-batch: (call id, tensor index) -> tensor.
        self.held: dict[int, dict[tuple[Any, int], torch.Tensor]] = defaultdict(dict)
        self.handles = begin.handles
        self.sent: dict[int, CallRecords] = defaultdict(dict)  # arguments this stage sent
        #: Each kept call's name across steps, (module, to_outputs, n-th such call of its
        #: micro-batch here), by (call id, to_outputs); the gradient messages each name got in this
        #: step (the most over its micro-batches), and what each micro-batch holds back (`gradients`).
        self.record_names: dict[tuple[Any, bool], tuple[str, bool, int]] = {}
        self.record_counts: dict[tuple[int, str, bool], int] = defaultdict(int)
        self.messages_per_record: dict[tuple[str, bool, int], int] = {}
        self.holdings: dict[int, Holding] = {}
        self.waiting: dict[Any, Waiter] = {}
        self.backlog: dict[int, list[Gradients]] = defaultdict(list)
        self.segment_queued: set[int] = set()
        self.released: set[int] = set()
        self.outbox = Outbox()
        self.bytes_before: dict[tuple[int, int], int] = {}
        self.spans: list[tuple[int, str, float, float]] = []
        self.aborted = False
        self.lock = threading.Lock()
        #: Notified when a gradient message joins the backlog or the step is aborted: what a
        #: tensor-parallel follower's segment waits on for the messages its leader's consumed.
        self.gradients_came = threading.Condition(self.lock)

    def home(self, microbatch: int) -> Address:
        return (self.driver_place, driver_endpoint(self.step, microbatch))

    def keep_record(self, records: dict[int, CallRecords], mb: int, call_id: Any, module: str,
                    kept: list, to_outputs: bool) -> None:
        """Keep a call's tensors for the gradients that will come back, under a name that the
        same call has in the next step too."""
        with self.lock:
            n = self.record_counts[(mb, module, to_outputs)]
            self.record_counts[(mb, module, to_outputs)] = n + 1
            self.record_names[(call_id, to_outputs)] = (module, to_outputs, n)
        records[mb][call_id] = (module, kept)

    def learn_messages(self, holding: Holding) -> None:
        """How many gradient messages each kept call of a released micro-batch got."""
        for key, count in holding.received.items():
            name = self.record_names.get(key)
            if name is not None:
                self.messages_per_record[name] = max(count, self.messages_per_record.get(name, 0))


def run_job(job: Callable[[], Any] | None) -> None:
    """Run ``job``, then the job it hands on, if any (returned: a backward segment hands on the
    segment its gradients started on a stage of this process, `Transport.lend`), and so on: a
    chain of segments runs on one thread in a loop, never nested. Jobs report their own failures,
    so anything escaping one is only warned of."""
    while callable(job):
        try:
            job = job()
        except BaseException:  # noqa: BLE001 - a last resort: the thread goes on with its next job
            warnings.warn(f"smpart: unexpected error in {threading.current_thread().name}:\n"
                          f"{traceback.format_exc()}", RuntimeWarning, stacklevel=1)
            return


class WorkerPool:
    """Threads that run jobs; a new one starts whenever every thread is busy (a waiting call keeps
    its thread), and idle ones are reused, so a steady state starts none."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
            else:
                thread = compute_thread(self._loop, f"{self._name}-{len(self.threads)}")
                self.threads.append(thread)
                thread.start()
            self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            run_job(job)
            with self._lock:
                self._idle += 1

    def stop(self, timeout_s: float) -> list[str]:
        for _ in self.threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]


class StageServer:
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
        self.transport.start(lambda: self._serve_call(run, message, claim), self.workers.submit)

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
        self.transport.start(lambda: self._run_segment(run, mb), self.workers.submit)

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

    # ================================================================ forward calls
    def _serve_call(self, run: StageStep, request: Request, claim: Claim) -> None:
        """Run a requested module call and answer it."""
        mb = request.microbatch
        try:
            run.scheduler.acquire(claim, run.timeout_s, lambda: self._describe_wait(run, request.module, mb),
                                  self.transport.check)
        except Cancelled:
            return
        except (TimedOut, SmpartError) as err:
            self._answer(run, request, error=err if isinstance(err, PipelineError) else PipelineError(
                str(err), stage=self.stage, module=request.module, microbatch=mb, rank=self.rank))
            return
        self._announce(run, claim)
        if self.debug:
            debug("stage %d runs %s: module %r (call %s)", self.stage, claim.action, request.module,
                  request.call_id)
        frame = Frame(self, run.step, mb, run=run, claim=claim, since=time.time())
        try:
            self._run_call(run, request, frame)
        finally:
            streams.leave()  # a split region left open (its row partner on another stage) ends here
            self._step_out(frame)

    def _run_call(self, run: StageStep, request: Request, frame: Frame) -> None:
        """The body of `_serve_call`, the turn held: run the module, then answer. The answer is sent
        before the turn is given back, as the next action would otherwise start first and take the
        CPU (and the GIL) from the send that another stage waits for."""
        mb = request.microbatch
        output, error, forwarded, mask, snapshots, refs = None, None, {}, (), [], False
        ambient: Ambient = request.ambient
        try:
            route = boundary.route_back(request.reply_to, request.call_id, False, request.forwarded)
            received_args, received_kwargs = request.args, request.kwargs
            if request.carried:
                received = carried.unpack_call((received_args, received_kwargs), self.device)
                received_args, received_kwargs = received
            restore_requires_grad((received_args, received_kwargs) if received_kwargs else received_args,
                                  request.grad_mask)
            args, kwargs = boundary.arrive_call(received_args, received_kwargs, self.device,
                                                route if ambient.grad_enabled else None, run.outbox.post)
            if request.refs:
                args, kwargs = self._resolve(run, mb, (args, kwargs))
            staged = self.modules[(request.model, request.module)].__dict__["forward"]
            with running(frame), ambient.applied():
                output = staged.run_here(frame, args, kwargs)
                output, refs = handles.departing(output, not request.handles, request.reply_to)
            what = lambda: f"the output of module {request.module!r} (stage {self.stage})"  # noqa: E731
            kept, forwarded = boundary.depart(output, ambient.grad_enabled, what)
            mask = grad_mask(kept, forwarded)
            if kept is not None:
                run.keep_record(run.served, mb, request.call_id, request.module, kept, True)
            if request.handles:  # the output stays here; the caller gets references
                output = handles.hold(output, self.address, run.step, mb, request.call_id, run.held[mb], mask,
                                      forwarded)
                forwarded, mask, refs = {}, (), True
            if request.carried:
                output, snapshots = carried.pack_answer((args, kwargs), output)
        except Cancelled:
            return
        except Exception as err:
            output, forwarded, mask, refs = None, {}, (), False
            error = as_pipeline_error(err, self.stage, request.module, mb, rank=self.rank)
        self._answer(run, request, output, error, forwarded, mask, snapshots, refs)

    def _answer(self, run: StageStep, request: Request, output: Any = None,
                error: BaseException | None = None, forwarded: dict | None = None,
                mask: tuple[int, ...] = (), snapshots: list | None = None, refs: bool = False) -> None:
        """Answer a call."""
        if not run.aborted:
            self.send(request.reply_to, Response(run.step, request.microbatch, request.call_id, output, error,
                                                 forwarded or {}, mask, snapshots or [], refs))

    def _resolve(self, run: StageStep, mb: int, value: Any) -> Any:
        """``value`` with its handle references resolved: the tensors this stage holds, `Handle`s for
        the others' (see `handles`)."""
        return handles.resolve(value, lambda ref: self._held(run, ref),
                               lambda ref: handles.Handle(ref, self.device, run.outbox.post), self.address)

    def _request_fetch(self, run: StageStep, ref: handles.HandleRef, fetch_id: Any) -> Waiter:
        waiter = Waiter()
        run.waiting[fetch_id] = waiter
        self.send(ref.owner, Fetch(run.step, ref.microbatch, fetch_id, self.address, ref.call_id, ref.index))
        return waiter

    def _held(self, run: StageStep, ref: handles.HandleRef) -> torch.Tensor:
        tensor = run.held.get(ref.microbatch, {}).get(ref.key) if ref.step == run.step else None
        if tensor is None:
            raise PipelineError(handles.describe_missing(ref, self.stage), stage=self.stage,
                                microbatch=ref.microbatch, rank=self.rank)
        return tensor

    def fetch(self, frame: Frame, ref: handles.HandleRef) -> torch.Tensor:
        """Materialise a handle: ask its owner for the data and wait (holding the turn if this frame
        does: the owner's dispatcher answers without needing any stage's turn)."""
        run: StageStep = frame.run
        if ref.owner == self.address:
            return self._held(run, ref)
        if ref.data is not None:  # small: it came with its reference
            return handles.arrive_fetched(ref.data, ref, self.device, run.outbox.post)
        return self._fetched(run, ref)

    def _fetched(self, run: StageStep, ref: handles.HandleRef) -> torch.Tensor:
        waiter = self._request_fetch(run, ref, new_call_id(self.place))
        what = lambda: (f"micro-batch {ref.microbatch} waited more than {run.timeout_s} s for a tensor held "  # noqa: E731
                        f"at {ref.owner} (a hang)")
        try:
            response = waiter.wait(run.timeout_s, what, lambda: self._check(run))
        except TimedOut as err:
            raise PipelineError(str(err), stage=self.stage, microbatch=ref.microbatch,
                                rank=self.rank) from None
        if response.error is not None:
            raise response.error
        return handles.arrive_fetched(response.output, ref, self.device, run.outbox.post)

    def call(self, frame: Frame, stage: int, model: int, module: str, args: tuple, kwargs: dict) -> Any:
        """A module of this stage calls ``module`` on ``stage``: request it, give the turn back, wait."""
        recorder = templates.recording()
        if recorder is not None:
            recorder.crossing()
        run: StageStep = frame.run
        mb = frame.microbatch
        call_id = new_call_id(self.place)
        ambient = capture()
        what = lambda: f"the arguments of module {module!r} (stage {stage})"  # noqa: E731
        callee = (self.place_of_stage(stage), STAGE)
        (args, kwargs), refs = handles.departing((args, kwargs), to=callee)
        kept, forwarded = boundary.depart_call(args, kwargs, ambient.grad_enabled, what)
        if kept is not None:
            run.keep_record(run.sent, mb, call_id, module, kept, False)
        remote = not self.transport.local(callee[0])
        (sent_args, sent_kwargs), originals = (carried.pack_call((args, kwargs)) if remote
                                               else ((args, kwargs), []))
        request = Request(run.step, mb, call_id, self.address, model, module, sent_args, sent_kwargs, ambient,
                          forwarded, grad_mask(kept, forwarded), bool(originals), refs, run.handles)
        waiter = Waiter()
        run.waiting[call_id] = waiter
        self._step_out(frame)
        job = self.transport.lend(lambda: self.send(callee, request))
        run_job(job)  # the callee's stage is in this process and took it at once: run it here
        try:
            response = waiter.wait(run.timeout_s, lambda: self._describe_wait(run, module, mb, stage),
                                   lambda: self._check(run))
        except TimedOut as err:
            raise PipelineError(str(err), stage=stage, module=module, microbatch=mb, rank=self.rank) from None
        if response.error is not None:
            raise response.error
        route = boundary.route_back(callee, call_id, True, response.forwarded)
        output = response.output
        if remote:
            output = carried.unpack_answer(output, response.carried, originals, self.device)
        restore_requires_grad(output, response.grad_mask)
        route = route if ambient.grad_enabled else None
        output = boundary.arrive(output, self.device, route, run.outbox.post)
        return self._resolve(run, mb, output) if response.refs else output

    def enter_compute(self, frame: Frame) -> None:
        """A resumed call is about to run a module of this stage: take the turn first."""
        run: StageStep = frame.run
        mb = frame.microbatch
        claim = Claim(Action(FORWARD, mb), RESUME, run.resumes[mb])
        run.resumes[mb] += 1
        try:
            what = lambda: self._describe_wait(run, None, mb)  # noqa: E731
            run.scheduler.acquire(claim, run.timeout_s, what, self.transport.check)
        except TimedOut as err:
            raise PipelineError(str(err), stage=self.stage, microbatch=mb, rank=self.rank) from None
        self._announce(run, claim)
        if self.debug:
            debug("stage %d resumes %s (micro-batch %d's call goes on)", self.stage, claim.action, mb)
        frame.claim, frame.since = claim, time.time()

    def _step_out(self, frame: Frame) -> None:
        """The frame waits for another stage or ends: close its span, give the turn back."""
        if frame.claim is not None:
            frame.run.spans.append((frame.microbatch, "forward", frame.since, time.time()))
            frame.run.scheduler.release(frame.claim)
            frame.claim = None

    # ================================================================ backward segments
    def _run_segment(self, run: StageStep, mb: int) -> Callable[[], Any] | None:
        """One backward segment for every gradient message of ``mb`` queued by the time it runs.
        Returns the job its gradients started on a stage of this process, to run next on this
        thread (`run_job`): the thread was done, and another would have to wake up for it."""
        claim = Claim(Action(BACKWARD, mb), SEGMENT)
        try:
            run.scheduler.acquire(claim, run.timeout_s, lambda: self._describe_wait(run, None, mb),
                                  self.transport.check)
        except Cancelled:
            return
        except (TimedOut, SmpartError) as err:
            failure = PipelineError(str(err), stage=self.stage, microbatch=mb, rank=self.rank)
            self.send(run.coordinator, Failed(run.step, failure))
            return
        start = time.time()
        try:
            messages = self._take_backlog(run, mb, claim)
        except (Cancelled, TimedOut, SmpartError) as err:
            run.scheduler.release(claim)
            if not isinstance(err, Cancelled):
                failure = PipelineError(str(err), stage=self.stage, microbatch=mb, rank=self.rank)
                self.send(run.coordinator, Failed(run.step, failure))
            return
        self._announce(run, claim, tuple(m.origin for m in messages))
        if self.debug:
            flush = " (flush)" if any(m.flush for m in messages) else ""
            debug("stage %d runs %s: a backward segment for %d gradient message(s)%s", self.stage,
                  claim.action, len(messages), flush)
        credit = sum((m.credit for m in messages), Fraction(0))
        served, sent = run.served.get(mb, {}), run.sent.get(mb, {})
        holding = self._holding(run, mb)
        failed = False
        try:
            if mb not in run.released:
                with running(Frame(self, run.step, mb, run=run, claim=claim)):
                    call_by_call = self.tp_follower or bool(self.tp_followers)
                    backpropagate(served, sent, messages, call_by_call, holding)
        except Exception as err:
            failed = True
            failure = as_pipeline_error(err, self.stage, module_of(served, sent, messages), mb, "backward",
                                        rank=self.rank)
            self.send(run.coordinator, Failed(run.step, failure))
        finally:
            posts = run.outbox.take()
            run.spans.append((mb, "backward", start, time.time()))
        job = None
        try:  # the gradients go before the turn does (see `_run_call`)
            if not failed and not run.aborted:
                if bool(holding.pending) != holding.reported:  # tell the driver, with credit
                    holding.reported = not holding.reported
                    news, credit = credit / 2, credit - credit / 2
                    self.send(run.home(mb), Credit(run.step, mb, news, (self.address, holding.reported)))
                home, sent = run.home(mb), run.gradients_sent[mb]
                job = self.transport.lend(lambda: dispatch(self.send, posts, credit, run.step, mb, home,
                                                           self.stage, sent))
        finally:
            run.scheduler.release(claim)
        return job

    def _holding(self, run: StageStep, mb: int) -> Holding:
        holding = run.holdings.get(mb)
        if holding is None:
            names, expected = run.record_names, self.messages_per_record
            holding = run.holdings[mb] = Holding(lambda call_id, to_outputs: expected.get(
                names.get((call_id, to_outputs)), 0))
        return holding

    def _take_backlog(self, run: StageStep, mb: int, claim: Claim) -> list[Gradients]:
        """The gradient messages this segment consumes, in the order of their origins (so that
        every tensor-parallel rank back-propagates the same tensors in the same order): all that
        are queued, or on a follower those its leader's segment consumed (waiting for them)."""
        if not self.tp_follower:
            with run.lock:
                messages = run.backlog.pop(mb, [])
                run.segment_queued.discard(mb)
            return sorted(messages, key=lambda m: m.origin)
        wanted = set(claim.payload)
        deadline = time.monotonic() + run.timeout_s
        with run.gradients_came:  # woken by each message; every POLL_S it checks for lost peers
            while not wanted <= {m.origin for m in run.backlog.get(mb, [])}:
                self._check(run)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimedOut(self._describe_wait(run, None, mb))
                run.gradients_came.wait(min(POLL_S, left))
            queued = run.backlog[mb]
            taken = [m for m in queued if m.origin in wanted]
            rest = [m for m in queued if m.origin not in wanted]
            run.backlog[mb] = rest
            if not rest:
                run.segment_queued.discard(mb)
        if rest:  # gradients that a later segment of the leader consumed
            self.workers.submit(lambda: self._run_segment(run, mb))
        return sorted(taken, key=lambda m: m.origin)

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
