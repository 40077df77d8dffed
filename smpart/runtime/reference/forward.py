"""The forward calls a stage serves and makes (`ForwardCalls`, part of `StageServer`).

Serving: a `Request` claims the stage's turn as the next forward call of its micro-batch, runs
the module inside the caller's `Ambient`, keeps its outputs for the backward, and answers (with
handles when the caller is a stage) before it gives the turn back. Making: a module of this stage
calling one of another stage sends a `Request`, gives the turn back while it waits, and takes it
again (a *resumed* call) before it computes here again.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from smpart.errors import PipelineError, SmpartError
from smpart.runtime.ambient import Ambient, capture
from smpart.runtime.program import templates
from smpart.runtime.reference import boundary, carried, handles
from smpart.runtime.reference.calls import Frame, as_pipeline_error, running
from smpart.runtime.reference.gradients import grad_mask, restore_requires_grad
from smpart.runtime.reference.scheduler import RESUME, Cancelled, Claim, TimedOut
from smpart.runtime.reference.stage_step import StageStep
from smpart.runtime.reference.workers import Waiter, debug, new_call_id
from smpart.runtime.schedule import FORWARD, Action
from smpart.runtime.wire.messages import STAGE, Fetch, Request, Response
from smpart.tensor_parallel import streams


class ForwardCalls:
    """The forward half of `StageServer` (see the module docstring); uses its transport, its
    step state (``run``) and its helpers."""

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
        self.send(callee, request)
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
