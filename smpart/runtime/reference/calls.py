"""Where a module call runs: here, or as a request to the stage that owns the module.

Placement installs a `StagedForward` as each placed module's ``forward`` (an instance attribute,
so ``module(...)``, its hooks and ``module.forward(...)`` all go through it). Every thread running
pipeline work carries a `Frame` (thread-local): which endpoint it works for (a stage's server or
a micro-batch's driver), for which step and micro-batch. A call to a module of the frame's own
stage runs inline, exactly as in the unsplit model; a call to a module of another stage becomes
``frame.endpoint.call(...)``, a `Request` whose answer comes back as fresh tensors, or as handles
to tensors the callee keeps (`handles`).

A stage frame holds its stage's turn (``frame.claim``) while it computes. Waiting for another
stage it gives the turn back; resumed, it runs as *glue* (the few lines between two remote calls
of an orchestrating module) until it next calls a module of its own stage, which takes the turn
again first (`StageServer.enter_compute`).

Outside a step (no frame) modules run inline in the calling thread, like an ordinary model.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from smpart.errors import PipelineError, SmpartError
from smpart.runtime.program import templates
from smpart.tensor_parallel import streams


class Endpoint(Protocol):
    """A thread that runs pipeline work and can call modules on other stages."""

    stage: int | None

    def call(self, frame: Frame, stage: int, model: int, module: str, args: tuple, kwargs: dict) -> Any: ...

    def fetch(self, frame: Frame, ref: Any) -> Any:
        """The data of a `handles.Handle` (``ref``: its reference), as it arrives here."""
        ...


@dataclass(slots=True)
class Frame:
    """What the current thread runs: ``endpoint`` works for ``microbatch`` of ``step``.

    ``run``, ``claim`` and ``since`` belong to stage frames: the stage's per-step state, the claim
    holding the stage's turn (None: not held) and when the current timeline span started.
    """

    endpoint: Endpoint
    step: int
    microbatch: int
    run: Any = None
    claim: Any = None
    since: float = 0.0
    #: A step program's glue (`program.glue`): every module call goes to the endpoint's
    #: ``glue_call``, which runs a split module here and a whole one on its rank.
    glue: bool = False
    #: The endpoint's stage (read at every module call).
    stage: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.stage = self.endpoint.stage


_local = threading.local()


def current_frame() -> Frame | None:
    return getattr(_local, "frame", None)


class running:  # noqa: N801 - used like a function: ``with running(frame):``
    """Run the block as ``frame`` (frames nest: the previous one is restored after)."""

    __slots__ = ("frame", "previous")

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.previous: Frame | None = None

    def __enter__(self) -> Frame:
        self.previous = current_frame()
        _local.frame = self.frame
        return self.frame

    def __exit__(self, *exc: object) -> None:
        _local.frame = self.previous


class WrappedForward:
    """A callable set as a module's ``forward`` over the one it replaces: the forward set on the
    instance before (by the user, or activation checkpointing), else the class's."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.instance_forward = module.__dict__.get("forward")

    def original(self, *args: Any, **kwargs: Any) -> Any:
        """The forward this one replaced."""
        if self.instance_forward is not None:
            return self.instance_forward(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __wrapped__(self) -> Any:
        """The original forward, so ``inspect.signature(module.forward)`` still works."""
        return self.instance_forward or type(self.module).forward.__get__(self.module)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__wrapped__)


class StagedForward(WrappedForward):
    """A module's ``forward`` that knows the module's stage. Dispatches on the caller's frame."""

    def __init__(self, module: nn.Module, model: int, name: str, stage: int) -> None:
        super().__init__(module)
        self.model = model
        self.name = name
        self.stage = stage
        #: The module's key in a program's tables (`program.glue`), made once.
        self.key = (model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        frame = getattr(_local, "frame", None)
        if frame is None:  # outside a step (threads: every stage is here; processes: only its own)
            if holds_meta(self.module, recurse=False):
                raise only_inside_a_step(f"module {self.name!r}")
            return self._forward(None, args, kwargs)
        if frame.glue:
            return frame.endpoint.glue_call(self, args, kwargs)
        if frame.stage != self.stage:
            streams.leave()  # a split region ends where the call leaves its stage (`streams`)
            return frame.endpoint.call(frame, self.stage, self.model, self.name, args, kwargs)
        if frame.claim is None:  # a resumed call, running as glue
            frame.endpoint.enter_compute(frame)
        if templates.recorder is not None:
            return self.run_here(frame, args, kwargs)
        # The common case, every call inside a module a program step runs whole: the forward, in
        # this frame (`_forward` and `original` inlined: this runs once per module call).
        try:
            if self.instance_forward is not None:
                return self.instance_forward(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)
        except Exception as err:
            mark_origin(err, frame.stage, self.name, frame.microbatch)
            raise

    def run_here(self, frame: Frame | None, args: tuple, kwargs: dict) -> Any:
        recorder = templates.recorder if frame is not None else None
        if recorder is not None and recorder.enter(self.model, self.name):
            try:
                output = self._forward(frame, args, kwargs)
            finally:
                recorder.leave()
            recorder.record(self.model, self.name, args, kwargs, output, frame.microbatch)  # type: ignore[union-attr]
            return output
        return self._forward(frame, args, kwargs)

    def _forward(self, frame: Frame | None, args: tuple, kwargs: dict) -> Any:
        try:  # `original`, inlined: every module a program step runs whole comes here
            if self.instance_forward is not None:
                return self.instance_forward(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)
        except Exception as err:
            if frame is not None:
                mark_origin(err, frame.stage, self.name, frame.microbatch)
            raise


def holds_meta(module: nn.Module, recurse: bool = True) -> bool:
    """Whether any of ``module``'s parameters or buffers (its own only, without ``recurse``) is on meta."""
    return any(t.is_meta for t in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)))


def only_inside_a_step(what: str) -> SmpartError:
    """The error for running ``what``, whose weights are on the meta device here, outside a step."""
    return SmpartError(
        f"{what} has weights on the meta device here (under torchrun a rank keeps only its own stage's "
        "weights once the model is placed; a model built on meta gets them at its first step), so it "
        "can run only inside a step: call it from an @smpart.step function, e.g. @smpart.step def "
        "predict(model, x): return model(x) (or model.generate(x))")


def install(module: nn.Module, model: int, name: str, stage: int) -> None:
    if isinstance(module.__dict__.get("forward"), StagedForward):
        raise PipelineError(f"module {name!r} is already placed by another DistributedModel; wrap each "
                            "model once, and do not share modules between two DistributedModels")
    module.forward = StagedForward(module, model, name, stage)  # type: ignore[method-assign]


def uninstall(module: nn.Module) -> None:
    staged = module.__dict__.get("forward")
    if isinstance(staged, StagedForward):
        if staged.instance_forward is not None:
            module.forward = staged.instance_forward  # type: ignore[method-assign]
        else:
            del module.forward


# ------------------------------------------------------------------ where errors happened
def mark_origin(err: BaseException, stage: int | None, module: str, microbatch: int) -> None:
    """Remember the innermost module an exception came from (the type is left alone, so user code
    that catches its own exceptions inside a forward keeps working)."""
    if not hasattr(err, "_smpart_origin"):
        with contextlib.suppress(AttributeError, TypeError):
            err._smpart_origin = (stage, module, microbatch)  # type: ignore[attr-defined]


def as_pipeline_error(err: BaseException, stage: int | None, module: str | None, microbatch: int,
                      phase: str = "forward", rank: int | None = None, hint: str = "") -> PipelineError:
    """``err`` as a `PipelineError` naming where it happened (already one: returned unchanged);
    ``hint`` (for an error the step body raised itself) ends the message."""
    if isinstance(err, PipelineError):
        return err
    stage, module, microbatch = getattr(err, "_smpart_origin", (stage, module, microbatch))
    where = "the step body" if stage is None else f"stage {stage}"
    if rank is not None:
        where += f" (rank {rank})"
    what = "" if module is None else f" in module {module or '<root>'!r}"
    if module is not None:
        hint = ""
    failure = PipelineError(
        f"{phase} of micro-batch {microbatch} failed on {where}{what}: {type(err).__name__}: {err}{hint}",
        stage=stage, module=module, microbatch=microbatch, rank=rank,
    )
    failure.__cause__ = err
    return failure
