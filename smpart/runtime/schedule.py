"""Pipeline schedules as data: which ready work a stage runs next, and what may run at all.

A stage runs one piece of work at a time (see `smpart.runtime.baton`). When it is free it asks
its schedule two questions about every waiting piece of work (a forward call to start or resume,
a batch of gradients to propagate): may it run now (`ready`), and in which order (`rank`, lowest
first). The schedule also says how many micro-batches may be in flight at once (`in_flight`).

- ``simple`` (GPipe): every micro-batch's forward first, then the backwards. Gradient work is held
  until all micro-batches have finished their forward pass, so all of them are in flight.
- ``interleaved`` (1F1B-like): gradient work runs as soon as it is ready; when both kinds are
  ready the stage alternates (one forward, one backward, backward first), older micro-batches
  first. At most ``active_microbatches`` are in flight, which bounds the activations kept alive;
  the default, stages + 1, is the 1F1B bound plus one, so that when a micro-batch completes the
  next one's forward is already waiting at the first stage instead of arriving just too late.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

FORWARD = "forward"
BACKWARD = "backward"
#: A forward call resuming after another stage answered it. Usually a few lines of glue that pass
#: the answer on to the next stage (a root module orchestrating every stage), so both schedules
#: run it first: delaying it behind a long backward would starve the stages downstream.
RESUME = "resume"


class Schedule(ABC):
    """A policy consulted by every stage; holds no per-step state itself."""

    name: str

    @abstractmethod
    def in_flight(self, microbatches: int, num_stages: int, active_microbatches: int | None) -> int:
        """How many micro-batches may run at once."""

    @abstractmethod
    def rank(self, kind: str, microbatch: int, last: str | None) -> tuple[int, int]:
        """Sort key of a piece of work among the ready ones (lowest runs first); ``last`` is the
        kind of work the stage ran last."""

    @abstractmethod
    def ready(self, kind: str, forwards_done: int, microbatches: int) -> bool:
        """Whether work of ``kind`` may run, given how many forward passes have finished."""


@dataclass(frozen=True)
class Simple(Schedule):
    """All forwards, then all backwards."""

    name: str = "simple"

    def in_flight(self, microbatches: int, num_stages: int, active_microbatches: int | None) -> int:
        return microbatches  # the backwards wait for every forward: a smaller cap would deadlock

    def rank(self, kind: str, microbatch: int, last: str | None) -> tuple[int, int]:
        return ({RESUME: 0, FORWARD: 1, BACKWARD: 2}[kind], microbatch)

    def ready(self, kind: str, forwards_done: int, microbatches: int) -> bool:
        return kind != BACKWARD or forwards_done >= microbatches


@dataclass(frozen=True)
class Interleaved(Schedule):
    """Forward and backward work alternate (backward first); a bounded number in flight."""

    name: str = "interleaved"

    def in_flight(self, microbatches: int, num_stages: int, active_microbatches: int | None) -> int:
        return min(microbatches, active_microbatches or num_stages + 1)

    def rank(self, kind: str, microbatch: int, last: str | None) -> tuple[int, int]:
        if kind == RESUME:
            return (0, microbatch)
        if last == BACKWARD:
            return ({FORWARD: 1, BACKWARD: 2}[kind], microbatch)
        return ({BACKWARD: 1, FORWARD: 2}[kind], microbatch)

    def ready(self, kind: str, forwards_done: int, microbatches: int) -> bool:
        return True


SCHEDULES: dict[str, Schedule] = {"simple": Simple(), "interleaved": Interleaved()}


def schedule_named(name: str) -> Schedule:
    return SCHEDULES[name]
