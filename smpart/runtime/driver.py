"""`Driver`: the thread that runs the user's step body for one micro-batch.

A driver is an endpoint without a stage: every module call it makes is a request to the stage
owning the module, answered on the driver's own address. The body's loss is computed here, on
the tensors the root module returned, and ``model.backward(loss)`` runs its (small) backward here
too; the `_Arrive` node behind those tensors turns their gradients into a message to the root's
stage, and the backward travels on from stage to stage as messages. The driver then waits until
no gradient message of its micro-batch is in flight, serving the ones addressed to it (inputs
created in the body that require grad).

Drivers make their first model call in micro-batch order (a turnstile), so micro-batches enter
the pipeline in order whatever the thread timing. Every driver starts with the step and first
waits for one of the schedule's in-flight slots (`StepRun.wait_for_slot`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from smpart.errors import PipelineError, SmpartError
from smpart.runtime import boundary
from smpart.runtime.baton import POLL_S, Cancelled
from smpart.runtime.calls import Frame, as_pipeline_error, running
from smpart.runtime.gradients import CallRecords, backpropagate, gradient_poster, held_posts
from smpart.runtime.messages import (
    BackwardRequest,
    ForwardRequest,
    ForwardResponse,
    ForwardsDone,
    GradResponse,
    MicrobatchFinished,
    Release,
)
from smpart.runtime.microbatches import detached
from smpart.runtime.server import coordinator_address, driver_address, new_call_id

if TYPE_CHECKING:
    from smpart.runtime.step_run import StepRun


class Driver:
    stage = None

    def __init__(self, run: StepRun, microbatch: int, args: tuple, kwargs: dict) -> None:
        self.run = run
        self.microbatch = microbatch
        self.args, self.kwargs = args, kwargs
        self.address = driver_address(run.step, microbatch)
        self.sent: CallRecords = {}
        self.backward_called = False
        self.forward_done = False
        self.passed_turn = False
        run.transport.open(self.address)

    # ================================================================ thread body
    def main(self) -> None:
        run, mb = self.run, self.microbatch
        finished = MicrobatchFinished(run.step, mb)
        slot = False
        try:
            run.wait_for_slot(mb)
            slot = True
            with running(Frame(self, run.step, mb)):
                result = run.fn(*self.args, **self.kwargs)
            self.pass_turn()
            self.finish_forward()
            self._drain()
            finished.result = detached(result)
        except Cancelled:
            finished.error = Cancelled()
        except BaseException as err:  # noqa: BLE001 - every failure must reach the coordinator
            finished.error = err if isinstance(err, SmpartError) else as_pipeline_error(
                err, None, None, mb, "step")
        finally:
            if slot:
                run.free_slot()  # first: the next micro-batch's start is on the critical path
            self._advance_turn()
            self.run.transport.close(self.address)
            self.run.broadcast(Release(run.step, mb))
            self.run.transport.send(coordinator_address(run.step), finished)

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
    def call(self, frame: Frame, stage: int, module: str, args: tuple, kwargs: dict) -> Any:
        """The body calls ``module`` (on ``stage``): request it and serve our inbox until answered."""
        run, mb = self.run, self.microbatch
        self.wait_turn()
        call_id = new_call_id()
        grad = torch.is_grad_enabled()
        kept, forwarded = boundary.depart_call(args, kwargs, grad,
                                               lambda: f"the arguments of module {module!r} (stage {stage})")
        if kept is not None:
            self.sent[call_id] = (module, kept)
        request = ForwardRequest(run.step, mb, call_id, self.address, module, args, kwargs, grad, forwarded)
        run.transport.send(stage, request)
        self.pass_turn()
        deadline = time.monotonic() + run.timeout_s
        what = f"module {module or '<root>'!r} on stage {stage}"
        message = None
        while not (isinstance(message, ForwardResponse) and message.call_id == call_id):
            message = self._poll(deadline, what)
        if message.error is not None:
            raise message.error
        route = boundary.route_back(stage, call_id, True, message.forwarded)
        return boundary.arrive(message.output, None, route if grad else None,
                               gradient_poster(run.transport.send, run.pending, run.step, mb))

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
        self.finish_forward()
        scale = 1.0 / self.run.microbatches if self.run.average_grads else 1.0
        grad = torch.ones_like(loss) if grad is None else grad
        held = held_posts()
        try:
            torch.autograd.backward(loss, grad * scale)
        finally:
            held.flush()

    def finish_forward(self) -> None:
        if not self.forward_done:
            self.forward_done = True
            self.run.broadcast(ForwardsDone(self.run.step, self.microbatch))

    def _drain(self) -> None:
        """Serve our inbox until no gradient message of this micro-batch is in flight."""
        deadline = time.monotonic() + self.run.timeout_s
        while self.run.pending.count(self.microbatch) > 0:
            self._poll(deadline, "the backward pass to finish")

    # ================================================================ inbox
    def _poll(self, deadline: float, waiting_for: str) -> Any:
        """The next message for this driver (None if none came or it was a gradient, served here)."""
        self._check(deadline, waiting_for)
        message = self.run.transport.receive(self.address, POLL_S)
        if isinstance(message, BackwardRequest | GradResponse):
            held = held_posts()
            try:
                backpropagate([(self.sent, message)])
            finally:
                self.run.pending.done(self.microbatch)
                held.flush()
            return None
        return message

    def _check(self, deadline: float, waiting_for: str) -> None:
        if self.run.aborted.is_set():
            raise Cancelled()
        if time.monotonic() > deadline:
            raise PipelineError(
                f"micro-batch {self.microbatch} waited more than {self.run.timeout_s} s for {waiting_for} "
                "(a hang, or work slower than the configured timeout_s)", microbatch=self.microbatch)
