"""What crosses between ranks for a program step under ``torchrun``.

A program step's path carries only `Transfers`: a rank's tensors for one destination at one point
of the glue (most often one activation, or one gradient), keyed by ``(kind, micro-batch, k)``;
from a program's second run on (a model's fourth step), where its last run's routes agreed, not
even those: the tensors travel unframed (`smpart.runtime.program.routes`).
Around the step, once each: the first stage's rank says which program runs (`BeginProgram`, with
what the other ranks lack: the recorded templates and the program, the first time), each rank
answers with what the driver gathers into the `StepOutput` (`ProgramReport`), and the usual
`StepResult` ends the step everywhere. `ProgramAbort` tells every rank of the step to give up
the program (an error, or a divergence: then the step runs again on the reference runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The endpoint of a rank's program inbox.
PROGRAM = "program"


@dataclass(slots=True)
class Transfers:
    """Tensors for one rank from pipeline rank ``src``: ``[(key, tensor or None, requires grad), ...]``."""

    step: int
    items: list
    src: int = -1


@dataclass(slots=True)
class BeginProgram:
    """Run step ``step`` as the program of ``key`` (``discover``: in the discovery order, recording
    it). ``inputs``: each micro-batch's inputs as the first rank sees them (a template: the other
    ranks hold placeholders for its tensors); ``inputs``, ``templates``, ``program``: sent when
    new (None: what the rank received last, for ``key`` where ``inputs`` and ``program``)."""

    step: int
    key: Any
    discover: bool
    inputs: list
    templates: dict | None = None
    program: Any = None
    grad_scale: float = 1.0
    #: The caller's grad mode and autocast (the step's ambient), and where to send the reports.
    ambient: Any = None
    reply_to: Any = None
    #: Every module's train/eval flag on the first stage's rank (`ProcessRuntime.training_modes`).
    modes: Any = None
    #: The tensors travel unframed, as the last run of this program noted (`routes`).
    direct: bool = False


@dataclass(slots=True)
class ProgramReport:
    """A rank's part of a program step: the result tensors it holds, its spans and what it sent;
    in a discovery step, what its glue did; its error, if it failed."""

    step: int
    rank: int
    pipeline_rank: int
    report: Any
    bytes_sent: dict = field(default_factory=dict)
    messages: dict = field(default_factory=dict)
    mutable_buffers: set | None = None
    #: What crossed each of this rank's pairs, in digests (`routes.Notes.digests`); None: not noted.
    routes: dict | None = None


@dataclass(slots=True)
class ProgramAbort:
    """Give up step ``step``'s program: ``why``; ``diverged``: it runs again on the reference runtime."""

    step: int
    why: str
    diverged: bool
