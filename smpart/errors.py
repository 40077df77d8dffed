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

    ``stage``, ``module`` and ``microbatch`` say where; the original exception is ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        module: str | None = None,
        microbatch: int | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.module = module
        self.microbatch = microbatch


class PlanError(SmpartError):
    """The planner found no plan (nothing fits in memory) or got an invalid cluster."""
