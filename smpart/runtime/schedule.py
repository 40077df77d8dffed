"""Pipeline schedules as data: the order in which each stage starts its work.

A schedule is a list of *actions* per stage: ``F3`` is "the forward work of micro-batch 3 on
this stage", ``B3`` its backward work. The list is computed before the step runs, can be printed
(`Schedule.describe`) and tested, and the runtime follows it: a stage starts an action only
when every action before it in its list has started, or can no longer happen (see
`smpart.runtime.reference.scheduler`). A timeline of a real run therefore starts its spans in list order.

An action may span several pieces of work: a stage whose module is called several times for one
micro-batch, or a backward that reaches the stage in several gradient messages, runs every piece
of the action as it comes once the action has started. An action whose work never comes (a
mixture-of-experts layer that no token of this micro-batch was routed to) is passed over once
the micro-batch's forward (or backward) is known to be over everywhere.

- ``gpipe`` (SMP's ``simple``): every micro-batch's forward, then every backward, in order
  (``active_microbatches`` does not apply: every micro-batch is in flight by construction).
- ``1f1b`` (SMP's ``interleaved``): stage ``s`` of ``p`` starts ``p - s`` forwards, then
  alternates one forward and one backward, then finishes the backwards. At most ``p - s + 1``
  micro-batches keep activations on stage ``s`` at once (one stage alone: 1).

Why ``p - s`` and not ``p - 1 - s`` as in torch's ``Schedule1F1B``: there the last stage computes
the loss, so the gradient that starts its backward is ready when its forward ends. Here the loss
is computed by the step body, on the first stage's rank: a position after the last stage, whose
gradient comes back a round trip later. Counting that position as a stage, the last stage runs
the next micro-batch's forward during the round trip instead of waiting for it, and every stage
before it keeps one forward more in hand, as 1F1B needs to stay fed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from smpart.errors import ConfigError

FORWARD = "F"
BACKWARD = "B"


class Action(NamedTuple):
    """One micro-batch's forward (``"F"``) or backward (``"B"``) work on one stage."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def gpipe_actions(stage: int, num_stages: int, microbatches: int,
                  active_microbatches: int | None = None) -> list[Action]:
    """All forwards, then all backwards."""
    return ([Action(FORWARD, i) for i in range(microbatches)]
            + [Action(BACKWARD, i) for i in range(microbatches)])


def one_f_one_b_actions(stage: int, num_stages: int, microbatches: int,
                        active_microbatches: int | None = None) -> list[Action]:
    """Warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
    The loss counts as one more stage (see the module docstring). ``active_microbatches`` caps the
    warm-up (fewer micro-batches in flight, a longer bubble)."""
    warmup = min(microbatches, num_stages - stage if num_stages > 1 else 0)
    if active_microbatches is not None:
        warmup = min(warmup, active_microbatches - 1)
    actions = [Action(FORWARD, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    actions += [Action(BACKWARD, i) for i in range(microbatches - warmup, microbatches)]
    return actions


@dataclass(frozen=True)
class Schedule:
    """A named rule giving every stage its list of actions."""

    name: str

    def actions(self, stage: int, num_stages: int, microbatches: int,
                active_microbatches: int | None = None) -> list[Action]:
        return _BUILDERS[self.name](stage, num_stages, microbatches, active_microbatches)

    def table(self, num_stages: int, microbatches: int,
              active_microbatches: int | None = None) -> list[list[Action]]:
        return [self.actions(s, num_stages, microbatches, active_microbatches) for s in range(num_stages)]

    def describe(self, num_stages: int, microbatches: int, active_microbatches: int | None = None) -> str:
        """One line per stage, e.g. ``stage 0: F0 F1 B0 F2 B1 F3 B2 B3``."""
        table = self.table(num_stages, microbatches, active_microbatches)
        return "\n".join(f"stage {s}: " + " ".join(map(str, actions)) for s, actions in enumerate(table))


_BUILDERS = {"gpipe": gpipe_actions, "1f1b": one_f_one_b_actions}
ALIASES = {"simple": "gpipe", "interleaved": "1f1b"}


def schedule_named(name: str) -> Schedule:
    """``gpipe``, ``1f1b``, or SMP's aliases ``simple`` and ``interleaved``."""
    canonical = ALIASES.get(name, name)
    if canonical not in _BUILDERS:
        raise ConfigError(f"unknown pipeline schedule {name!r}; use one of "
                          f"{sorted([*_BUILDERS, *ALIASES])}")
    return Schedule(canonical)
