"""One rank's step under a program: its list of actions, run in order by one loop on one thread.

Each micro-batch's step body runs in a greenlet (a coroutine on the rank's thread). An ``F``
action switches into micro-batch ``m``'s greenlet, which runs the body (`glue`) until the end of
that action: where the program cut the forward (a tensor coming back from a rank this one sent
to: the rank does other work meanwhile), or the end of the body. The loss's backward runs inside
the body, at ``model.backward(loss)``, on the rank holding the loss; every other backward action
runs in the loop: receive the gradients of a round of roots, run autograd, send the gradients of
the leaves that are final. Sends are one-way and posted as soon as their tensor exists; a
receive is the only wait.

A greenlet that stops mid-body carries torch's thread-local state with it (grad mode, autocast,
the glue's torch-function mode, smpart's frame): `Suspension` puts the loop's back while the loop
runs, and the greenlet's back when it resumes.

The same loop runs on threads (one thread per stage, `ThreadWire`) and under ``torchrun`` (the
rank's main thread, `ProcessWire`); only the wire differs.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from greenlet import getcurrent, greenlet

from smpart.errors import PipelineError, SmpartError
from smpart.runtime import ambient as ambient_state
from smpart.runtime.program.actions import Action, Program
from smpart.runtime.program.glue import (
    Backward,
    BodyDone,
    GlueMode,
    MicrobatchRun,
    release_placeholders,
    send_final_leaves,
)
from smpart.runtime.program.messages import ProgramAbort, Transfers
from smpart.runtime.program.templates import (
    Diverged,
    OutputTemplate,
    call_key,
    spec_from_state,
    spec_state,
)
from smpart.runtime.reference import calls
from smpart.runtime.reference.calls import current_frame, running
from smpart.runtime.reference.scheduler import Cancelled
from smpart.tensor_parallel import streams

POLL_S = 0.05


# ==================================================================== wires
class Aborted(SmpartError):
    """Another rank gave up this step (its error, or a divergence); nothing more to wait for."""

    def __init__(self, why: str, diverged: bool = False) -> None:
        super().__init__(why)
        self.diverged = diverged


class ThreadWire:
    """Transfers between the stages of one process: mailboxes keyed by (kind, micro-batch, k)."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.boxes = [dict() for _ in range(size)]
        self.lock = threading.Lock()
        #: One condition per receiving stage, on the one lock: a send wakes only its receiver.
        self.arrived = [threading.Condition(self.lock) for _ in range(size)]
        self.timeout_s = timeout_s
        self.abort: Aborted | None = None
        self.sent_bytes: dict[tuple[int, int], int] = {}
        self.messages: dict[tuple[int, int], int] = {}
        #: Set when every stage runs on one thread (`one_thread.OneThread`): a receive switches.
        self.one_thread: Any = None

    def at(self, me: int) -> _ThreadEnd:
        return _ThreadEnd(self, me)

    def fail(self, why: Aborted) -> None:
        with self.lock:
            if self.abort is None:
                self.abort = why
            for arrived in self.arrived:
                arrived.notify_all()
        if self.one_thread is not None:
            self.one_thread.wake_all()


class _ThreadEnd:
    def __init__(self, wire: ThreadWire, me: int) -> None:
        self.wire = wire
        self.me = me

    def send(self, to: int, items: list[tuple]) -> None:
        wire = self.wire
        size = sum(t.numel() * t.element_size() for _, t, _ in items if t is not None)
        with wire.lock:
            box = wire.boxes[to]
            for key, tensor, needs in items:
                box[key] = (tensor, needs)
            pair = (self.me, to)
            wire.sent_bytes[pair] = wire.sent_bytes.get(pair, 0) + size
            wire.messages[pair] = wire.messages.get(pair, 0) + 1
            wire.arrived[to].notify()
        if wire.one_thread is not None:
            wire.one_thread.arrived(to, [key for key, _, _ in items])

    def receive(self, key: tuple, src: int) -> tuple[torch.Tensor | None, bool]:
        wire = self.wire
        if wire.one_thread is not None:
            return wire.one_thread.receive(self.me, key, src)
        deadline = time.monotonic() + wire.timeout_s
        with wire.lock:
            box = wire.boxes[self.me]
            while key not in box:
                if wire.abort is not None:
                    raise wire.abort
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(
                        f"rank {self.me} waited more than {wire.timeout_s} s for "
                        f"{describe_key(key)} from rank {src} (a hang?)",
                        stage=self.me,
                        microbatch=key[1],
                    )
                wire.arrived[self.me].wait(min(left, POLL_S * 4))
            return box.pop(key)

    def fail(self, why: Aborted) -> None:
        self.wire.fail(why)


def describe_key(key: tuple) -> str:
    kind, mb, k = key
    return f"{'activation' if kind == 'F' else 'gradient'} {k} of micro-batch {mb}"


# ==================================================================== the loop
class Suspension:
    """Thread-local torch state a greenlet takes with it when it stops mid-body."""

    __slots__ = ("ambient", "frame", "modes", "region")

    def __init__(self) -> None:
        self.ambient = ambient_state.capture()
        self.frame = current_frame()
        self.modes: list = []
        self.region: streams.Suspended | None = None

    def leave(self, base: ambient_state.Ambient) -> None:
        """Take the body's state off the thread (the loop's goes back on), a tensor-parallel split
        region too: what the loop runs meanwhile draws from the shared random stream."""
        stack = torch._C._len_torch_function_stack()
        self.modes = [torch._C._pop_torch_function_stack() for _ in range(stack)]
        self.region = streams.suspend() if streams.live is not None else None
        _set_ambient(base)
        _set_frame(None)

    def resume(self) -> None:
        _set_ambient(self.ambient)
        _set_frame(self.frame)
        if self.region is not None:
            streams.resume(self.region)
        for mode in reversed(self.modes):
            torch._C._push_on_torch_function_stack(mode)


def _set_ambient(state: ambient_state.Ambient) -> None:
    if torch.is_inference_mode_enabled() != state.inference_mode:
        raise Diverged("inference mode changes inside the step body across a suspension of its micro-batch")
    torch._C._set_grad_enabled(state.grad_enabled)
    wanted = dict(state.autocast)
    for kind in ambient_state.AUTOCAST_DEVICE_TYPES:
        dtype = wanted.get(kind)
        torch.set_autocast_enabled(kind, dtype is not None)
        if dtype is not None:
            torch.set_autocast_dtype(kind, dtype)
    torch.set_autocast_cache_enabled(state.autocast_cache)


def _set_frame(frame: Any) -> None:
    calls._local.frame = frame


@dataclass
class RankReport:
    """What one rank's step under a program produced."""

    rank: int
    #: (micro-batch, leaf index) -> the value of a tensor the body returned, held by this rank.
    provided: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    #: Per micro-batch: the result's pytree spec and its plain leaves (the same on every rank).
    specs: dict[int, Any] = field(default_factory=dict)
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    #: Discovery: per micro-batch, the glue's events and what the rank did, in order.
    events: dict[int, list] = field(default_factory=dict)
    forward: dict[int, list] = field(default_factory=dict)
    backward: dict[int, list] = field(default_factory=dict)
    error: BaseException | None = None

    def __getstate__(self) -> dict:
        # The specs travel as plain tuples (`templates.spec_state` says why).
        state = dict(self.__dict__)
        state["specs"] = {mb: _spec_as(spec_state, entry) for mb, entry in self.specs.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        state["specs"] = {mb: _spec_as(spec_from_state, entry) for mb, entry in state["specs"].items()}
        self.__dict__.update(state)


def _spec_as(convert: Callable[[Any], Any], entry: tuple | None) -> tuple | None:
    """A micro-batch's (spec, constants, tensors) with its spec converted."""
    return None if entry is None else (convert(entry[0]), *entry[1:])


class RankRun:
    """Runs one rank's actions for one step (``program`` None: the discovery order, GPipe's)."""

    def __init__(
        self,
        context: Any,
        step: int,
        program: Program | None,
        fn: Callable,
        inputs: Callable[[int, MicrobatchRun], tuple[tuple, dict]],
        wire: Any,
        ambient: ambient_state.Ambient,
        grad_scale: float,
        microbatches: int,
        before_backward: Callable[[], None] | None = None,
    ) -> None:
        self.context = context
        #: Called once, before this rank's first backward of the step (`steps.drive`).
        self.before_backward = before_backward
        self.me = context.me
        self.size = context.size
        self.everyone = (1 << context.size) - 1
        self.stage = context.stage
        self.device = context.device
        self.owners = context.owners
        self.whole = context.whole
        self.recomputed = context.recomputed or {}
        self.templates = context.templates
        self.varies = context.varies
        self.meta_cache = context.meta_cache
        self.kept_placeholders = context.kept_placeholders if context.kept_placeholders is not None else {}
        self.process_rank = context.process_rank
        self.step = step
        self.program = program
        self.fn = fn
        self.inputs = inputs
        self.wire = wire
        self.ambient = ambient
        self.grad_scale = grad_scale
        self.microbatches = microbatches
        #: One rank (pp 1): nothing is held elsewhere, the glue needs no mode and calls no checks:
        #: a step is the micro-batch loop and, with data parallelism, the buckets (DDP's shape).
        self.checks_outputs = context.size > 1
        self.suspend_at = program.suspend_at[self.me] if program is not None else frozenset()
        self.expected = program.events[self.me] if program is not None else None
        self.stop = program.stops[self.me] if program is not None and program.stops else None
        self.mode = GlueMode()
        self.runs: dict[int, MicrobatchRun] = {}
        self.bodies: dict[int, greenlet] = {}
        self.backwards: dict[int, Backward] = {}
        self.rounds_done: dict[int, int] = {}
        self.report = RankReport(self.me)
        self.loop: Any = None
        self.base = ambient_state.capture()
        self.current: Action | None = None
        self.current_index = -1
        self.span_start = 0.0  # where the span of the forward running now began

    # ================================================================ the actions
    def actions(self) -> tuple[list[Action], list[str]]:
        """This rank's actions and their names."""
        if self.program is not None:
            return self.program.actions[self.me], self.program.labels[self.me]
        actions = discovery_actions(self.microbatches)
        return actions, [str(a) for a in actions]

    def run(self) -> RankReport:
        self.loop = getcurrent()
        try:
            for i, (action, label) in enumerate(zip(*self.actions(), strict=True)):
                self.current, self.current_index = action, i
                self._do(action, label)
        except BaseException as err:
            self._kill_bodies()
            if isinstance(err, PipelineError) and self.program is not None and err.args:
                err.args = (
                    f"{err.args[0]}\n{self.program.marked(self.me, self.current_index)}",
                    *err.args[1:],
                )
            self.report.error = err
            raise
        finally:
            release_placeholders(self.kept_placeholders)
            self._let_go()
        return self.report

    def _do(self, action: Action, label: str) -> None:
        kind = action.kind
        if kind == "F":
            self.span_start = time.time()
            self.report.started.append(label)
            self._resume(action.microbatch)
            self.report.spans.append((action.microbatch, "forward", self.span_start, time.time()))
        elif kind == "B":
            if action.inline:  # the loss's backward: it ran inside the body, at model.backward
                return
            if action.microbatch not in self.runs:  # nothing of it is left on this rank
                return
            start = time.time()
            self.report.started.append(label)
            self._backward_rounds(action.microbatch, action.rounds)
            self.report.spans.append((action.microbatch, "backward", start, time.time()))

    def _resume(self, mb: int) -> None:
        body = self.bodies.get(mb)
        if body is None:
            body = self.bodies[mb] = greenlet(lambda: self._body(mb), parent=self.loop)
            body.switch()
        else:
            body.switch()

    def _body(self, mb: int) -> None:
        run = self.runs[mb] = MicrobatchRun(self, mb, self.step, self.expected, self.stop)
        args, kwargs = self.inputs(mb, run)
        mode = self.mode if self.size > 1 else contextlib.nullcontext()
        self.mode.run = run
        try:
            with running(run.frame), self.ambient.applied(), mode:
                result = self.fn(*args, **kwargs)
                if streams.live is not None:  # a split region left open (its row partner on another rank)
                    streams.leave()
                run.finish(result)
        except BodyDone:  # the rest of the body has nothing for this rank
            if streams.live is not None:
                streams.leave()
            run.flush_sends()
        if run.leaves:  # gradients no root of this rank can reach (none, without a backward) go now
            sent = send_final_leaves(run, max((root.pos for root in run.roots), default=-1), self.wire)
            if sent:
                run.structure.append(("end_sent", tuple(sent)))
        if run.expected is not None and not run.stopped and run.cursor != len(run.expected):
            raise Diverged(f"micro-batch {mb} on rank {self.me} ended before doing all the program recorded")
        self.report.specs[mb] = run.result_spec
        for i, value in run.provided.items():
            self.report.provided[(mb, i)] = value
        if self.program is None:
            self.report.events[mb] = run.events
            self.report.forward[mb] = run.structure
        if not run.roots and not run.leaves:
            self._drop(mb)

    def before_receive(self, run: MicrobatchRun, k: int) -> None:
        """The body is about to wait for transfer ``k``: where the program cut the forward there,
        the micro-batch stops here and the loop goes on with its next action."""
        if k in self.suspend_at and run.microbatch in self.bodies:
            suspension = Suspension()
            suspension.leave(self.base)
            self.loop.switch()
            suspension.resume()
            self.mode.run = run

    def check_output(self, staged: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """A whole module this rank ran must return what the other ranks' placeholders say."""
        key = call_key(staged.model, staged.name, args, kwargs)
        template = self.templates.get(key)
        if type(template) is not OutputTemplate or not template.matches(output):  # None, UNPREDICTABLE
            raise Diverged(
                f"module {staged.name!r} returned {_outline(output)}, not what the recorded step "
                "returned for such arguments (an output shape that depends on the data?)"
            )

    # ================================================================ backward
    def loss_round(self, run: MicrobatchRun, loss: torch.Tensor, grad: torch.Tensor) -> None:
        """The loss's backward, on the rank holding the loss, at ``model.backward(loss)``: its span
        is its own, the forward's ends where it starts (and goes on after it, for the body's tail)."""
        if self.before_backward is not None:
            ask, self.before_backward = self.before_backward, None
            ask()
        start = time.time()
        self.report.spans.append((run.microbatch, "forward", self.span_start, start))
        name = (
            f"B{run.microbatch}"
            if self.program is None
            else self.program.loss_labels[self.me][run.microbatch]
        )
        self.report.started.append(name)
        self._backward(run, [loss], [grad], retain=bool(run.roots))
        below = max((root.pos for root in run.roots), default=-1)
        sent = send_final_leaves(run, below, self.wire)
        run.structure.append(("loss_sent", tuple(sent)))
        self.span_start = time.time()
        self.report.spans.append((run.microbatch, "backward", start, self.span_start))

    def _backward_rounds(self, mb: int, rounds: tuple[int, int] | None) -> None:
        """Run rounds ``rounds`` (first, end; None: all that are left) of micro-batch ``mb``."""
        run = self.runs.get(mb)
        if run is None:
            return
        back = self.backwards.get(mb)
        if back is None:
            back = self.backwards[mb] = Backward(run)
            sent = send_final_leaves(run, back.remaining_pos(0), self.wire)  # none of the roots reaches them
            if self.program is None:
                self.report.backward.setdefault(mb, []).append(((), tuple(sent)))
        first = self.rounds_done.get(mb, 0)
        end = len(back.rounds) if rounds is None else min(rounds[1], len(back.rounds))
        for i in range(first, end):
            received = self._run_round(run, back.rounds[i], i + 1 < len(back.rounds))
            sent = send_final_leaves(run, back.remaining_pos(i + 1), self.wire)
            if self.program is None:
                self.report.backward.setdefault(mb, []).append((received, tuple(sent)))
        self.rounds_done[mb] = end
        if end >= len(back.rounds):
            send_final_leaves(run, -1, self.wire)
            self._drop(mb)

    def _run_round(self, run: MicrobatchRun, roots: list, more: bool) -> tuple:
        tensors: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        received = []
        for root in roots:
            grad, _ = self.wire.receive(("B", run.microbatch, root.k), root.to)
            received.append((root.k, root.to))
            if grad is None:
                continue
            key = id(root.tensor)
            tensors[key] = root.tensor
            grad = grad.to(root.tensor.device) if grad.device != root.tensor.device else grad
            grads[key] = grads[key] + grad if key in grads else grad
        if tensors:
            self._backward(run, list(tensors.values()), [grads[k] for k in tensors], retain=more)
        return tuple(received)

    def _backward(self, run: MicrobatchRun, tensors: list, grads: list, retain: bool) -> None:
        """One autograd pass of a micro-batch; an error in it names the stage and micro-batch."""
        try:
            with running(run.inline):
                torch.autograd.backward(tensors, grads, retain_graph=retain)
        except Exception as err:
            raise PipelineError(
                f"backward of micro-batch {run.microbatch} failed on stage {self.stage}: "
                f"{type(err).__name__}: {err}",
                stage=self.stage,
                microbatch=run.microbatch,
                rank=self.process_rank,
            ) from err

    def _drop(self, mb: int) -> None:
        run = self.runs.pop(mb, None)
        if run is not None:
            run.let_go()
        self.backwards.pop(mb, None)

    def _let_go(self) -> None:
        """Break the step's reference cycles (a micro-batch's run and its frames, the tensors it
        marked, its greenlet's closure), so that its tensors are freed when the step ends, as
        an unsplit step's are, not at the garbage collector's next pass."""
        for run in self.runs.values():
            run.let_go()
        self.runs.clear()
        self.backwards.clear()
        self.bodies.clear()
        self.mode.run = None
        self.loop = None

    def _kill_bodies(self) -> None:
        for body in self.bodies.values():
            if not body.dead:
                with contextlib.suppress(BaseException):
                    body.throw(Cancelled())
        self.bodies.clear()
        with contextlib.suppress(Exception):
            while torch._C._len_torch_function_stack():
                mode = torch._C._pop_torch_function_stack()
                if mode is not self.mode:
                    torch._C._push_on_torch_function_stack(mode)
                    break
        _set_frame(None)


def _outline(value: Any) -> str:
    shapes = [tuple(t.shape) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return f"tensors of shapes {shapes[:4]}{' ...' if len(shapes) > 4 else ''}"


def discovery_actions(microbatches: int) -> list[Action]:
    """The order of a step that records a program: every micro-batch's whole body (the loss's
    backward inside it), then the rest of every backward. Deadlock-free whatever the model: every
    rank meets the glue's transfers in the same order."""
    return [Action("F", mb) for mb in range(microbatches)] + [Action("B", mb) for mb in range(microbatches)]


class ProcessWire:
    """Transfers between ranks under ``torchrun``: one message per destination and event, on the
    process transport, into the receiver's program inbox. ``me``: this rank's pipeline rank;
    ``notes`` (a `routes.Notes`, or None) notes what crossed, for the next run to go direct."""

    def __init__(
        self,
        transport: Any,
        rank: int,
        place_of: Callable[[int], int],
        step: int,
        timeout_s: float,
        inbox: Any,
        endpoint: Any,
        me: int = -1,
        notes: Any = None,
    ) -> None:
        self.transport = transport
        self.rank = rank
        self.place_of = place_of
        self.step = step
        self.timeout_s = timeout_s
        self.inbox = inbox
        self.endpoint = endpoint
        self.me = me
        self.notes = notes
        self.got: dict[tuple, tuple] = {}
        self.messages: dict[int, int] = {}
        self.sent_bytes: dict[int, int] = {}

    def send(self, to: int, items: list[tuple]) -> None:
        place = self.place_of(to)
        if self.notes is not None:
            self.notes.sent(to, items)
        self.transport.send(self.rank, (place, self.endpoint), Transfers(self.step, items, self.me))
        self.messages[to] = self.messages.get(to, 0) + 1
        size = sum(t.numel() * t.element_size() for _, t, _ in items if t is not None)
        self.sent_bytes[to] = self.sent_bytes.get(to, 0) + size

    def receive(self, key: tuple, src: int) -> tuple[torch.Tensor | None, bool]:
        deadline = time.monotonic() + self.timeout_s
        while key not in self.got:
            message = self.inbox(POLL_S)
            if message is None:
                self.transport.check()
                if time.monotonic() > deadline:
                    raise PipelineError(
                        f"rank {self.rank} waited more than {self.timeout_s} s for "
                        f"{describe_key(key)} from pipeline rank {src} (a hang?)",
                        microbatch=key[1],
                        rank=self.rank,
                    )
                continue
            if isinstance(message, Transfers):
                if message.step != self.step:
                    continue
                if self.notes is not None:
                    self.notes.arrived(message.src, message.items)
                for item_key, tensor, needs in message.items:
                    self.got[item_key] = (tensor, needs)
            elif isinstance(message, ProgramAbort) and message.step == self.step:
                raise Aborted(message.why, message.diverged)
        return self.got.pop(key)

    def fail(self, why: Aborted) -> None:
        pass

    def settle(self, error: BaseException | None) -> None:
        """After this rank's part of the step: nothing left in flight (framed sends complete on
        the transport's thread)."""


def drain(inbox: Callable[[float], Any]) -> None:
    """Drop what is left in a program inbox (a step that was given up)."""
    with contextlib.suppress(queue.Empty):
        while inbox(0.0) is not None:
            pass
