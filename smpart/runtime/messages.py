"""The messages stages, drivers and the step coordinator exchange; nothing else crosses.

Every message is a small dataclass carrying the step it belongs to, so a message left over from
an aborted step is recognised and dropped. Tensors travel inside `ForwardRequest` (arguments),
`ForwardResponse` (outputs) and the two gradient messages; the receiver always detaches them and
rebuilds its own autograd boundary (`smpart.runtime.boundary`), so no autograd graph ever spans
two stages. That is what lets a process-based transport replace the in-process one unchanged.

Addresses: a stage is addressed by its index (``int``); a driver (one micro-batch's step body)
by ``("driver", step, microbatch)``; a step's coordinator by ``("step", step)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Address = Any


@dataclass(slots=True)
class ForwardRequest:
    """Run ``module`` (a qualified name living on the receiving stage) on ``args``/``kwargs``."""

    step: int
    microbatch: int
    call_id: int
    reply_to: Address
    module: str
    args: Any
    kwargs: Any
    grad_enabled: bool
    #: Tensor index -> route, for arguments passed on unchanged (see `boundary.depart`).
    forwarded: dict = field(default_factory=dict)


@dataclass(slots=True)
class ForwardResponse:
    """The outputs of call ``call_id``, or the `PipelineError` it raised."""

    step: int
    microbatch: int
    call_id: int
    output: Any = None
    error: BaseException | None = None
    #: Tensor index -> route, for outputs that are tensors passed on unchanged.
    forwarded: dict = field(default_factory=dict)


@dataclass(slots=True)
class BackwardRequest:
    """Gradients of the outputs of call ``call_id`` (tensor index -> gradient), for its callee."""

    step: int
    microbatch: int
    call_id: int
    grads: dict[int, Any]


@dataclass(slots=True)
class GradResponse:
    """Gradients of the arguments call ``call_id`` sent (tensor index -> gradient), for its caller."""

    step: int
    microbatch: int
    call_id: int
    grads: dict[int, Any]


GradientMessage = BackwardRequest | GradResponse


@dataclass(slots=True)
class BeginStep:
    """A step starts: reset per-step state; ``policy`` is the schedule, ``pending`` the shared
    per-micro-batch counter of gradient messages in flight."""

    step: int
    microbatches: int
    policy: Any
    pending: Any
    timeout_s: float


@dataclass(slots=True)
class ForwardsDone:
    """Micro-batch ``microbatch`` has finished its forward pass (the schedule may care)."""

    step: int
    microbatch: int


@dataclass(slots=True)
class Drained:
    """The last gradient message of ``microbatch`` in flight was processed."""

    step: int
    microbatch: int


@dataclass(slots=True)
class Release:
    """Micro-batch ``microbatch`` is complete: drop what the stage kept for its backward."""

    step: int
    microbatch: int


@dataclass(slots=True)
class Abort:
    """The step failed: cancel its waiting work and drop its messages."""

    step: int


@dataclass(slots=True)
class EndStep:
    """The step is over: reply with a `StepReport` to ``reply_to``."""

    step: int
    reply_to: Address


@dataclass(slots=True)
class StepReport:
    """A stage's timeline spans for a step."""

    step: int
    stage: int
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)


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
class Shutdown:
    """Stop the receiving server."""
