"""`Driver`: the thread that runs the user's step body for one micro-batch.

A driver is an endpoint without a stage: every module call it makes is a `Request` to the stage
owning the module, answered on the driver's own address. The body's loss is computed here, on
the tensors the root module returned, and ``model.backward(loss)`` runs its (small) backward
here too; the `_Arrive` node behind those tensors turns their gradients into messages to the
stages, and the backward travels on from stage to stage as messages. The driver hands out the
micro-batch's backward credit (see `messages`) and waits for all of it to come home, serving the
gradient messages addressed to it (inputs created in the body that require grad) meanwhile.

Drivers make their first model call in micro-batch order (a turnstile), so micro-batches enter
the pipeline in order whatever the thread timing.
"""

from __future__ import annotations

import time
from fractions import Fraction
from typing import Any

import torch

from smpart.errors import PipelineError, SmpartError
from smpart.runtime.ambient import capture
from smpart.runtime.microbatches import detached
from smpart.runtime.reference import boundary, carried, handles
from smpart.runtime.reference.calls import Frame, as_pipeline_error, running
from smpart.runtime.reference.gradients import (
    CallRecords,
    Outbox,
    backpropagate,
    dispatch,
    grad_mask,
    restore_requires_grad,
)
from smpart.runtime.reference.scheduler import Cancelled
from smpart.runtime.reference.workers import POLL_S, new_call_id
from smpart.runtime.wire.messages import (
    STAGE,
    Batch,
    Credit,
    Fetch,
    ForwardDone,
    Gradients,
    MicrobatchFinished,
    Release,
    Request,
    Response,
    driver_endpoint,
)


class Driver:
    stage = None

    def __init__(self, run: Any, microbatch: int, args: tuple, kwargs: dict) -> None:
        self.run = run
        self.microbatch = microbatch
        self.args, self.kwargs = args, kwargs
        self.address = (run.place, driver_endpoint(run.step, microbatch))
        self.sent: CallRecords = {}
        self.outbox = Outbox()
        self.gradients_sent: dict = {}  # endpoint -> gradient messages sent (their origins)
        self.credit_home = Fraction(0)
        self.holding: set[Any] = set()  # stages that hold gradients of this micro-batch back
        self.backward_called = False
        self.forward_done = False
        self.passed_turn = False
        run.transport.open(self.address)

    # ================================================================ thread body
    def main(self) -> None:
        run, mb = self.run, self.microbatch
        finished = MicrobatchFinished(run.step, mb)
        try:
            with running(Frame(self, run.step, mb)), run.ambient.applied():
                result = run.fn(*self.args, **self.kwargs)
            self.pass_turn()
            self.finish_forward()
            if self.backward_called:
                self._await_backward()
            finished.result = detached(result)
        except Cancelled:
            finished.error = Cancelled()
        except BaseException as err:  # noqa: BLE001 - every failure must reach the coordinator
            finished.error = err if isinstance(err, SmpartError) else as_pipeline_error(
                err, None, None, mb, "step", rank=run.rank, hint=_split_hint(err, run.microbatches))
        finally:
            self._advance_turn()
            run.transport.close(self.address)
            run.broadcast(Release(run.step, mb), best_effort=True)
            run.report(finished)

    # ================================================================ turnstile
    def wait_turn(self) -> None:
        """Block until every earlier micro-batch has made its first model call."""
        if self.passed_turn:
            return
        run = self.run
        deadline = time.monotonic() + run.timeout_s
        with run.turn:
            while run.next_turn < self.microbatch:
                self._check(deadline, "the earlier micro-batches to start")
                run.turn.wait(POLL_S)

    def pass_turn(self) -> None:
        """Let the next micro-batch make its first call (after waiting for our own turn)."""
        if not self.passed_turn:
            self.wait_turn()
            self._advance_turn()

    def _advance_turn(self) -> None:
        if self.passed_turn:
            return
        self.passed_turn = True
        with self.run.turn:
            self.run.next_turn = max(self.run.next_turn, self.microbatch + 1)
            self.run.turn.notify_all()

    # ================================================================ calls
    def call(self, frame: Frame, stage: int, model: int, module: str, args: tuple, kwargs: dict) -> Any:
        """The body calls ``module`` (on ``stage``): request it and wait for the answer."""
        run, mb = self.run, self.microbatch
        self.wait_turn()
        call_id = new_call_id(run.place)
        ambient = capture()
        what = lambda: f"the arguments of module {module!r} (stage {stage})"  # noqa: E731
        (args, kwargs), refs = handles.departing((args, kwargs))
        kept, forwarded = boundary.depart_call(args, kwargs, ambient.grad_enabled, what)
        if kept is not None:
            self.sent[call_id] = (module, kept)
        callee = (run.place_of_stage(stage), STAGE)
        remote = not run.transport.local(callee[0])
        (sent_args, sent_kwargs), originals = (carried.pack_call((args, kwargs)) if remote
                                               else ((args, kwargs), []))
        request = Request(run.step, mb, call_id, self.address, model, module, sent_args, sent_kwargs,
                          ambient, forwarded, grad_mask(kept, forwarded), bool(originals), refs)
        run.send(callee, request)
        self.pass_turn()
        message = self._response(call_id, f"module {module or '<root>'!r} on stage {stage}")
        route = boundary.route_back(callee, call_id, True, message.forwarded)
        output = message.output
        if remote:
            output = carried.unpack_answer(output, message.carried, originals, None)
        restore_requires_grad(output, message.grad_mask)
        route = route if ambient.grad_enabled else None
        output = boundary.arrive(output, run.device, route, self.outbox.post)
        if message.refs:  # outputs held by other stages: the body computes with data
            output = handles.resolve(output, None, lambda ref: self.fetch(frame, ref), None)
        return output

    def fetch(self, frame: Frame, ref: handles.HandleRef) -> torch.Tensor:
        """Materialise a handle: ask the stage holding it for the data (unless it came with it)."""
        run = self.run
        if ref.data is not None:
            return handles.arrive_fetched(ref.data, ref, run.device, self.outbox.post)
        fetch_id = new_call_id(run.place)
        run.send(ref.owner, Fetch(run.step, ref.microbatch, fetch_id, self.address, ref.call_id, ref.index))
        message = self._response(fetch_id, f"a tensor held at {ref.owner}")
        return handles.arrive_fetched(message.output, ref, run.device, self.outbox.post)

    def _response(self, call_id: Any, what: str) -> Response:
        """Serve the inbox until the answer to ``call_id`` comes; raise the error it brings."""
        deadline = time.monotonic() + self.run.timeout_s
        message = None
        while not (isinstance(message, Response) and message.call_id == call_id):
            message = self._next(deadline, what)
        if message.error is not None:
            raise message.error
        return message

    # ================================================================ backward
    def backward(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """``model.backward(loss)``: backward of the loss here; the rest flows as messages."""
        if self.backward_called:
            raise SmpartError("model.backward() was called twice for the same micro-batch; call it once per "
                              "step body (combine losses first: model.backward(loss_a + loss_b))")
        if not isinstance(loss, torch.Tensor):
            raise SmpartError(f"model.backward() needs a tensor loss, got {type(loss).__name__}")
        if not loss.requires_grad:
            raise SmpartError("model.backward(loss): the loss does not require grad; was it computed from "
                              "the model's output, outside torch.no_grad()?")
        if grad is None and loss.numel() != 1:
            raise SmpartError(f"model.backward(loss) needs a scalar loss (got shape {tuple(loss.shape)}), "
                              "or pass the gradient: model.backward(loss, grad)")
        self.backward_called = True
        scale = 1.0 / self.run.microbatches if self.run.average_grads else 1.0
        grad = torch.ones_like(loss) if grad is None else grad
        torch.autograd.backward(loss, grad * scale)
        self._dispatch(Fraction(1), forward_over=not self.forward_done)
        self.forward_done = True

    def finish_forward(self) -> None:
        if not self.forward_done:
            self.forward_done = True
            self.run.broadcast(ForwardDone(self.run.step, self.microbatch))

    def _dispatch(self, credit: Fraction, forward_over: bool = False) -> None:
        """Send the gradients posted by a backward here. ``forward_over``: the loss's backward, and
        the stages are still to hear that this micro-batch's forward is over: the `ForwardDone`
        rides with the gradients to each stage that gets some (one message, not two; it was
        always followed by them at once), and goes alone to the others, after them."""
        run = self.run
        posts = self.outbox.take()
        notice = ForwardDone(run.step, self.microbatch)
        unannounced = dict.fromkeys(run.stage_addresses()) if forward_over else {}

        def send(address: Any, message: Any) -> None:
            if address in unannounced:
                del unannounced[address]
                message = Batch([notice, message])
            run.send(address, message)

        if posts:
            dispatch(send, posts, credit, run.step, self.microbatch, self.address, counts=self.gradients_sent)
        else:
            self.credit_home += credit
        for address in unannounced:
            run.send(address, notice)

    def _await_backward(self) -> None:
        """Serve our inbox until every share of the backward credit has come home and no stage
        holds gradients back: those still holding then are flushed (a message they expected
        did not come; see `gradients`), and the credit goes round once more."""
        deadline = time.monotonic() + self.run.timeout_s
        flushed: set[Any] = set()
        while True:
            while self.credit_home < 1:
                self._next(deadline, "the backward pass to finish")
            if not self.holding:
                return
            if self.holding & flushed:  # a flushed stage holds nothing back: a bug, not a wait
                raise SmpartError(f"stages {sorted(self.holding & flushed)} still hold gradients of "
                                  f"micro-batch {self.microbatch} after a flush")
            # What a flushed stage sends may make another hold: at most one round per stage.
            flushed |= self.holding
            self.credit_home = Fraction(0)
            share, run = Fraction(1, len(self.holding)), self.run
            for address in sorted(self.holding):
                run.send(address, Gradients(run.step, self.microbatch, [], share, (-2, 0), flush=True))

    # ================================================================ inbox
    def _next(self, deadline: float, waiting_for: str) -> Any:
        """The next message for this driver; credit and gradients are handled here (None returned)."""
        message = self.run.transport.receive(self.address, POLL_S)
        if message is None:
            self._check(deadline, waiting_for)
            return None
        if isinstance(message, Credit):
            self.credit_home += message.amount
            if message.holding is not None:
                address, holds = message.holding
                (self.holding.add if holds else self.holding.discard)(address)
            return None
        if isinstance(message, Gradients):
            try:
                backpropagate({}, self.sent, [message])
            except Exception as err:
                mb, rank = self.microbatch, self.run.rank
                raise as_pipeline_error(err, None, None, mb, "backward", rank=rank) from err
            self._dispatch(message.credit)
            return None
        return message

    def _check(self, deadline: float, waiting_for: str) -> None:
        if self.run.aborted.is_set():
            raise Cancelled()
        self.run.transport.check()
        if time.monotonic() > deadline:
            raise PipelineError(f"micro-batch {self.microbatch} waited more than {self.run.timeout_s} s for "
                                f"{waiting_for} (a hang, or work slower than the configured timeout_s)",
                                microbatch=self.microbatch, rank=self.run.rank)


def _split_hint(err: BaseException, microbatches: int) -> str:
    """For a shape-like error in the step body: that its tensor arguments were split (a tensor
    meant whole, such as class weights, arrives cut into micro-batches unless named)."""
    if microbatches < 2 or not isinstance(err, RuntimeError | ValueError | IndexError):
        return ""
    if isinstance(err, torch.OutOfMemoryError):  # a RuntimeError too, and nothing to do with splitting
        return ""
    return (f" (every tensor argument of the step is split into {microbatches} micro-batches along "
            "dim 0; pass the ones meant whole with @smpart.step(non_split_inputs=['name']))")
