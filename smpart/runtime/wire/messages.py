"""The messages drivers, stages and the step coordinator exchange; nothing else crosses.

Every message is plain, picklable data: step and micro-batch numbers, module names, tensors
(inside call arguments, outputs and gradients), exceptions made picklable
(`smpart.errors.PipelineError`). Nothing live travels: no locks, no counters shared by
reference, no schedule objects. That is what lets the process transport carry the same
messages the thread transport passes by reference.

An *address* is ``(place, endpoint)``: ``place`` is where a stage lives (a rank under
``torchrun``, an index on threads) and ``endpoint`` who receives there: `STAGE` (the stage's
server), ``("driver", step, microbatch)``, ``("step", step)`` (the step's coordinator) or
`MAIN` (the main thread of a rank that does not run the step body).

How the end of a backward pass is detected without a shared counter: *credit*. A micro-batch's
backward starts with credit 1 at its driver. Every gradient message carries a share of it; a
backward segment that consumed messages worth ``c`` gives each message it posts ``c / n``, or,
posting none, returns ``c`` to the driver (`Credit`). Credit is exact (fractions), so the
driver knows the backward is over when all of it has come back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

STAGE = "stage"
MAIN = "main"
Address = tuple[int, Any]


def driver_endpoint(step: int, microbatch: int) -> tuple:
    return ("driver", step, microbatch)


def coordinator_endpoint(step: int) -> tuple:
    return ("step", step)


@dataclass(slots=True)
class Request:
    """Run ``module`` of model ``model`` (both live on the receiving stage) on ``args``/``kwargs``."""

    step: int
    microbatch: int
    call_id: int
    reply_to: Address
    model: int
    module: str
    args: Any
    kwargs: Any
    #: The caller's thread-local state that changes what modules compute (grad mode, autocast).
    ambient: Any
    #: Tensor index -> route, for arguments passed on unchanged (see `boundary.depart`).
    forwarded: dict = field(default_factory=dict)
    #: Indices of the tensors that require grad on the sending side (a pickled tensor loses it).
    grad_mask: tuple[int, ...] = ()
    #: Carried state (caches) was packed for another process: unpack it, and answer with copies.
    carried: bool = False
    #: The arguments hold `handles.HandleRef`s to resolve.
    refs: bool = False
    #: The caller takes handles for the outputs (a stage); a driver asks for data.
    handles: bool = False


@dataclass(slots=True)
class Response:
    """The outputs of call ``call_id``, or the `PipelineError` it raised."""

    step: int
    microbatch: int
    call_id: int
    output: Any = None
    error: BaseException | None = None
    forwarded: dict = field(default_factory=dict)
    grad_mask: tuple[int, ...] = ()
    #: Snapshots of the carried objects of the call's arguments, as the callee left them.
    carried: list = field(default_factory=list)
    #: The output holds `handles.HandleRef`s to resolve.
    refs: bool = False


@dataclass(slots=True)
class Batch:
    """Messages for one endpoint sent as one, handled in their order: a driver's `ForwardDone`
    with the gradients of its loss."""

    messages: list

    @property
    def step(self) -> int:
        """The step of its messages (all of one step)."""
        return self.messages[0].step


@dataclass(slots=True)
class Fetch:
    """Send tensor ``index`` of the output of call ``of_call``, which the receiving stage holds, to
    ``reply_to`` as the `Response` to ``call_id`` (a handle is materialised; see `handles`)."""

    step: int
    microbatch: int
    call_id: Any
    reply_to: Address
    of_call: Any
    index: int


@dataclass(slots=True)
class Gradients:
    """Gradients for tensors one endpoint kept, from one backward segment: ``parts`` lists, per
    call, ``(call_id, to_outputs, {tensor index: gradient})``: the call's outputs, for the callee
    (``to_outputs``), or its arguments, for the caller.

    Everything one segment posts to one endpoint travels in one message and is back-propagated in
    one segment there. Sent apart, the two branches of a residual that cross stages would each run
    the shared graph behind them, and the messages would double at every layer."""

    step: int
    microbatch: int
    parts: list[tuple[Any, bool, dict[int, Any]]]
    credit: Fraction
    #: ``(sender stage, n)``: the sender's n-th gradient message of this micro-batch to this
    #: endpoint (-1: the driver). The same in every tensor-parallel column, unlike call ids.
    origin: tuple[int, int] = (-1, 0)
    #: From the driver, once the credit is home while this stage holds gradients back: no more
    #: messages are coming for this micro-batch, release them (`gradients.Holding`).
    flush: bool = False


@dataclass(slots=True)
class Grant:
    """The tensor-parallel leader of a stage gave its turn to the work named ``key`` (see
    `sequencing`); ``payload`` names the gradient messages a backward segment consumed."""

    step: int
    key: tuple
    payload: tuple = ()


@dataclass(slots=True)
class Credit:
    """Backward credit coming home to the driver of ``microbatch``; ``holding``: the stage at that
    address now holds gradients back (True) or no longer does (False). Riding with credit, the
    news is in before the driver can see all the credit home."""

    step: int
    microbatch: int
    amount: Fraction
    holding: tuple[Any, bool] | None = None


@dataclass(slots=True)
class BeginStep:
    """A step starts: reset per-step state and follow ``schedule`` for ``microbatches``."""

    step: int
    microbatches: int
    schedule: str
    active_microbatches: int | None
    timeout_s: float
    coordinator: Address
    #: Stages answer each other's calls with handles (`Config.output_handles`).
    handles: bool = False
    #: Stages hold gradients back until a part of the graph has them all (`Config.gradient_holding`).
    holding: bool = False
    #: Processes: model id -> the ``training`` flag of each of its modules (``modules()`` order) on
    #: the driver's rank, which the other ranks take (``model.eval()`` called there alone holds).
    modes: dict[int, bytes] | None = None


@dataclass(slots=True)
class ForwardDone:
    """Micro-batch ``microbatch`` has finished its forward pass everywhere."""

    step: int
    microbatch: int


@dataclass(slots=True)
class Release:
    """Micro-batch ``microbatch`` is complete (or failed): drop what was kept for it."""

    step: int
    microbatch: int


@dataclass(slots=True)
class Abort:
    """The step failed: cancel its work and drop its late messages."""

    step: int


@dataclass(slots=True)
class EndStep:
    """The step is over: reply with a `StageReport`."""

    step: int


@dataclass(slots=True)
class StageReport:
    """What a stage did during a step: timeline spans ``(microbatch, kind, start, end)`` in the
    stage's clock, and the order it started its actions."""

    step: int
    stage: int
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    #: ``(this stage, other stage) -> bytes`` of tensors this stage's place sent during the step.
    bytes_sent: dict[tuple[int, int], int] = field(default_factory=dict)
    #: What the calls this stage ran returned (`program.templates`), for the step programs; None
    #: when this stage's process is the coordinator's (its templates are there already).
    templates: dict | None = None


@dataclass(slots=True)
class MicrobatchFinished:
    """A driver is done: the body's return value, or the error that stopped it."""

    step: int
    microbatch: int
    result: Any = None
    error: BaseException | None = None


@dataclass(slots=True)
class Failed:
    """A stage failed outside any forward call (in a backward segment)."""

    step: int
    error: BaseException


@dataclass(slots=True)
class Armed:
    """Local only: this rank's main thread entered ``step`` (see `StageServer.arm`)."""

    step: int


@dataclass(slots=True)
class Shutdown:
    """Stop the receiving endpoint."""


@dataclass(slots=True)
class PlaceModel:
    """Processes: the driver traced and partitioned model ``model``; place it and acknowledge."""

    model: int
    partition: Any
    reply_to: Address


@dataclass(slots=True)
class Placed:
    """A rank placed model ``model`` (``error``: it could not)."""

    model: int
    rank: int
    error: BaseException | None = None


@dataclass(slots=True)
class StepResult:
    """Processes: what the step returned on the driver's rank, for every other rank's call."""

    step: int
    results: Any = None
    timeline: Any = None
    error: BaseException | None = None


@dataclass(slots=True)
class Leaving:
    """Processes: rank ``rank`` shuts smpart down after taking part in ``steps`` steps (sent to its
    peers before its transport closes). A peer still finishing one of those steps goes on; one in
    a later step would wait for it in vain, and fails instead (`RoutedTransport.check`)."""

    rank: int
    steps: int


@dataclass(slots=True)
class StateRequest:
    """Processes: rank ``rank`` asks for this rank's part of a state dict (request ``request``):
    ``kind`` "model" (the entries of ``DistributedModel`` #``target`` held here) or "optimizer"
    (the state of ``DistributedOptimizer`` #``target`` for the parameters held here). Answered by
    the main thread where the rank's parameters hold still: inside the step function before the
    step begins, inside its own ``state_dict()``, and at ``smpart.shutdown()``."""

    rank: int
    request: int
    kind: str
    target: int


@dataclass(slots=True)
class StateReply:
    """This rank's part (``part``) for ``StateRequest`` ``request`` (``error``: it could not give it)."""

    rank: int
    request: int
    part: dict[Any, Any] | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class StateDone:
    """Processes, to the driver's rank: rank ``rank``, which asked it for state since the last step,
    is done asking and waits for step ``step`` (the driver's rank may begin it)."""

    rank: int
    step: int
