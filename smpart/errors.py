"""Every error smpart raises on purpose derives from `SmpartError`.

Each message names what is wrong and what to do about it; the original exception, when there
is one, is chained (``raise ... from err``) so nothing is lost.
"""

from __future__ import annotations


class SmpartError(Exception):
    """Base class of all errors smpart raises deliberately."""


class ConfigError(SmpartError, ValueError):
    """A configuration value (``smpart.init``, ``Config``, a cluster file) is invalid."""


class TraceError(SmpartError):
    """The model could not be traced with the example inputs."""


class PartitionError(SmpartError):
    """The model cannot be cut as asked (bad stage count, pins, weights)."""


class PipelineError(SmpartError):
    """A step failed while running on the pipeline.

    ``stage``, ``module``, ``microbatch`` and ``rank`` say where; the original exception is
    ``__cause__`` in the process where it happened. Pickled (sent to another rank), it keeps its
    message and those fields and carries the original's traceback as text (``remote_traceback``),
    since the original exception itself may not pickle.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        module: str | None = None,
        microbatch: int | None = None,
        rank: int | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.module = module
        self.microbatch = microbatch
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple:
        trace = self.remote_traceback
        if trace is None and self.__cause__ is not None:
            import traceback

            trace = "".join(traceback.format_exception(self.__cause__))
        fields = {"stage": self.stage, "module": self.module, "microbatch": self.microbatch,
                  "rank": self.rank, "remote_traceback": trace}
        # the message alone: str() would carry the traceback in it too, twice once it is rebuilt
        return (_rebuild_pipeline_error, (type(self), super().__str__(), fields))

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback and self.__cause__ is None:
            return f"{text}\n\nOriginal traceback (on rank {self.rank}):\n{self.remote_traceback}"
        return text


def _rebuild_pipeline_error(cls: type, message: str, fields: dict) -> PipelineError:
    return cls(message, **fields)


class PeerLost(SmpartError):
    """A peer rank died or stopped answering (or, ``left``, shut smpart down while this rank still
    needs it); the step cannot complete without it."""

    def __init__(self, rank: int, detail: str = "", left: bool = False) -> None:
        if left:
            message = f"rank {rank} left the job"
        else:
            message = f"rank {rank} was lost (its process died or stopped answering)"
        if detail:
            message += f": {detail}"
        if left:
            message += ". Every rank must call the step function the same number of times"
        else:
            message += ". Its work cannot be recovered in this job: stop and restart it (from a checkpoint)"
        super().__init__(message)
        self.rank = rank
        self.detail = detail
        self.left = left

    def __reduce__(self) -> tuple:
        return (PeerLost, (self.rank, self.detail, self.left))


class CheckpointError(SmpartError):
    """A checkpoint cannot be written or read as asked (not a checkpoint, partial, another model)."""


class PlanError(SmpartError):
    """The planner found no plan (nothing fits in memory) or got an invalid cluster."""
