"""Reused subtrees: units whose call order does not bind their stages.

**Why.** The partitioner keeps a model's call-ordered units on non-decreasing stages, so that a
micro-batch flows one way through the pipeline. A module called several times (ALBERT's one
shared layer, a weight-tied recurrent block) breaks that picture by itself: its calls run its
units ``u1 … um``, then ``u1 … um`` again, so as soon as they span two stages the flow returns
from the later stage to the earlier one at every repeat, whatever order they are in. Keeping
them contiguous buys no one-way flow there, and it costs balance: ALBERT's layer is five heavy
pieces that a contiguous cut must keep in call order (1.21 × the lower bound at 4 stages, where
placing them freely gives 1.04).

**The rule.** A *loop unit* is a unit (a called module without called descendants) inside the
subtree of a node with ``call_count > 1`` that holds at least two units. Loop units may sit on
any stage. All other units, the *ordered units*, keep non-decreasing stages in call order. A
reused subtree with a single unit (a tied embedding, called first and last) is an ordinary
ordered unit, placed by its first call as before. Every other node rides with its first unit
below it, as in the leaf sequence (`smpart.partitioning.partitioner`).

**The search.** Fix the loop units' stages, and the best cut of the ordered units is the min-max
segmentation DP with the loop units' load preloaded on their stages (a stage holding a loop unit
may take no ordered unit). So only the loop units are searched:

1. Start from the stages the contiguous leaf-sequence cut gave them (so the answer is never
   worse than that cut), and from a packing onto the ordered units' own best cut. Alternate:
   pack the loop units onto the loads the ordered cut leaves (LPT, then moves and swaps;
   `smpart.partitioning.multiway`), recut the ordered units around them, until nothing improves.
2. With few loop units, branch and bound over their stages: heaviest unit first, the lightest
   stage tried first, a branch dropped once a stage reaches the best maximum found so far or
   the rest can no longer fit under it, units of equal cost on non-decreasing stages (swapping
   them changes nothing), each complete assignment scored by the DP. The search stops early
   when the best answer meets the lower bound max(total / stages, heaviest unit, heaviest pinned
   stage), and gives up at a fixed budget of search nodes and DP calls; the answer says whether
   it is proven optimal (``exact``).

**Stages of unequal speed** (``speeds``): a stage's time is its load ÷ its speed; the ordered cut
minimises the slowest time (`min_max_segments` with ``speeds``), the packing puts a unit where it
finishes first, and the branch and bound compares times: a branch stops once a stage's time
reaches the best found, or the rest no longer fits under it at every stage's speed; the lower
bound is max(total ÷ total speed, heaviest unit ÷ fastest speed, each pinned stage's time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from smpart.partitioning.multiway import lpt, rebalance
from smpart.partitioning.segment import Segmentation, min_max_segments
from smpart.tracing.tree import ModuleNode

#: Branch and bound runs when there are at most this many loop units.
EXACT_MAX_UNITS = 16
#: Search nodes and DP calls the branch and bound may spend before it settles for its best so far
#: (a few tenths of a second at most). The DP calls allowed shrink as the ordered units grow:
#: ``CUT_BUDGET * 100 / (100 + ordered units)``.
NODE_BUDGET = 20_000
CUT_BUDGET = 1_000
#: Rounds of "pack the loop units, recut the ordered ones" per starting point.
ALTERNATING_ROUNDS = 8


def loop_unit_names(root: ModuleNode, units: Sequence[ModuleNode]) -> set[str]:
    """Names of the units inside reused subtrees that hold at least two units."""
    unit_names = {u.name for u in units}
    loop: set[str] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node.call_count > 1:
            inside = {n.name for n in node.walk()} & unit_names
            if len(inside) >= 2:
                loop |= inside
            continue  # the topmost reused node decides for its whole subtree
        stack.extend(node.children)
    return loop


@dataclass(frozen=True)
class LoopPlacement:
    """Stages of the loop units and of the ordered units, the heaviest stage, and whether proven optimal."""

    loop_stage: tuple[int, ...]
    ordered_stage: tuple[int, ...]
    cost: float
    exact: bool


def place_loop_units(
    ordered: Sequence[float],
    loop: Sequence[float],
    num_stages: int,
    pin_load: Sequence[float | None],
    seed: Sequence[int],
    speeds: Sequence[float] | None = None,
) -> LoopPlacement:
    """Best stages for the loop units (any stage) and the ordered units (contiguous, in order).

    ``ordered`` and ``loop`` are the units' costs (ordered ones in call order); ``pin_load[s]``
    is the load pinned on stage ``s`` (None: nothing pinned there, so it needs a unit);
    ``seed`` is a feasible stage per loop unit to start from; ``speeds[s]`` divides stage ``s``'s
    load into its time (default: all 1).
    """
    cut = _OrderedCut(ordered, loop, num_stages, pin_load, speeds)
    best_cost, best = _alternate(cut, tuple(seed))
    pinned = [p / v for p, v in zip(pin_load, cut.speed, strict=True) if p is not None]
    lower = max(
        (sum(ordered) + sum(loop) + sum(p for p in pin_load if p is not None)) / sum(cut.speed),
        max([*ordered, *loop], default=0.0) / max(cut.speed),
        max(pinned, default=0.0),
    )
    exact = best_cost <= lower
    if not exact and len(loop) <= EXACT_MAX_UNITS:
        best_cost, best, exact = _branch_and_bound(cut, best_cost, best, lower)
    segmentation = cut.segmentation(best)
    return LoopPlacement(best, tuple(segmentation.stage_of_items()), segmentation.cost, exact)


class _OrderedCut:
    """The best contiguous cut of the ordered units around given loop-unit stages."""

    def __init__(
        self,
        ordered: Sequence[float],
        loop: Sequence[float],
        num_stages: int,
        pin_load: Sequence[float | None],
        speeds: Sequence[float] | None = None,
    ) -> None:
        self.ordered = list(ordered)
        self.loop = list(loop)
        self.num_stages = num_stages
        self.pin_load = list(pin_load)
        #: None keeps every call on the equal-stages path, number for number.
        self.speeds = None if speeds is None else [float(v) for v in speeds]
        self.speed = self.speeds or [1.0] * num_stages
        self.calls = 0
        self._memo: dict[tuple[float | None, ...], float] = {}

    def preload(self, loop_stage: Sequence[int]) -> tuple[float | None, ...]:
        """Load each stage starts with: its pins and loop units (None when it has neither)."""
        pre = list(self.pin_load)
        for size, s in zip(self.loop, loop_stage, strict=True):
            pre[s] = (pre[s] or 0.0) + size
        return tuple(pre)

    def cost(self, loop_stage: Sequence[int]) -> float:
        """Heaviest stage of the best cut (inf when some stage would stay empty)."""
        pre = self.preload(loop_stage)
        if pre not in self._memo:
            self.calls += 1
            if sum(p is None for p in pre) > len(self.ordered):
                self._memo[pre] = math.inf  # a stage with nothing on it that no ordered unit can fill
            else:
                self._memo[pre] = min_max_segments(self.ordered, self.num_stages, preload=pre,
                                                   speeds=self.speeds).cost
        return self._memo[pre]

    def segmentation(self, loop_stage: Sequence[int]) -> Segmentation:
        return min_max_segments(self.ordered, self.num_stages, preload=self.preload(loop_stage),
                                speeds=self.speeds)

    def base_loads(self, loop_stage: Sequence[int] | None) -> list[float] | None:
        """Per-stage load of pins plus ordered units in the best cut around ``loop_stage``.

        With ``loop_stage`` None, the ordered units are cut on their own (None if they cannot
        fill every unpinned stage).
        """
        if loop_stage is None:
            if sum(p is None for p in self.pin_load) > len(self.ordered):
                return None
            segmentation = min_max_segments(self.ordered, self.num_stages, preload=self.pin_load,
                                            speeds=self.speeds)
        else:
            segmentation = self.segmentation(loop_stage)
        return [
            (self.pin_load[s] or 0.0) + sum(self.ordered[i] for i in piece)
            for s, piece in enumerate(segmentation.pieces)
        ]


def _alternate(cut: _OrderedCut, seed: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
    """Step 1 of the search: pack the loop units, recut the ordered ones, repeat while it helps."""
    best = (cut.cost(seed), seed)
    starts = [seed]
    plain = cut.base_loads(None)
    if plain is not None:
        packed = lpt(cut.loop, plain, cut.speeds)
        starts.append(tuple(rebalance(cut.loop, plain, packed, speeds=cut.speeds)))
    for start in starts:
        current = (cut.cost(start), start)
        if math.isinf(current[0]):
            continue  # the packing left a stage empty that the ordered units cannot fill
        for _ in range(ALTERNATING_ROUNDS):
            base = cut.base_loads(current[1])
            packings = (rebalance(cut.loop, base, current[1], speeds=cut.speeds),
                        rebalance(cut.loop, base, lpt(cut.loop, base, cut.speeds), speeds=cut.speeds))
            step = min((cut.cost(p), tuple(p)) for p in packings)
            if not step[0] < current[0]:
                break
            current = step
        if current[0] < best[0]:
            best = current
    return best


class _Done(Exception):
    """Ends the branch and bound: optimum proven, or budget spent."""


def _branch_and_bound(
    cut: _OrderedCut, best_cost: float, best: tuple[int, ...], lower: float
) -> tuple[float, tuple[int, ...], bool]:
    """Step 2 of the search (see the module docstring); returns (cost, stages, proven optimal)."""
    sizes = cut.loop
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    remaining_after = [sum(sizes[i] for i in order[d:]) + sum(cut.ordered) for d in range(len(order) + 1)]
    loads = [p or 0.0 for p in cut.pin_load]
    speed = cut.speed
    stages = list(best)
    incumbent = [best_cost, best]
    nodes = 0
    cut_budget = cut.calls + CUT_BUDGET * 100 // (100 + len(cut.ordered))

    def visit(depth: int, floor: int) -> None:
        nonlocal nodes
        nodes += 1
        if nodes > NODE_BUDGET or cut.calls > cut_budget:
            raise _Done("budget")
        if depth == len(order):
            cost = cut.cost(stages)
            if cost < incumbent[0]:
                incumbent[:] = [cost, tuple(stages)]
                if cost <= lower:
                    raise _Done("optimal")
            return
        item = order[depth]
        size = sizes[item]
        for s in sorted(range(floor, len(loads)), key=lambda s: (loads[s] / speed[s], s)):
            if (loads[s] + size) / speed[s] >= incumbent[0]:
                continue
            old = loads[s]
            loads[s] = old + size
            room = sum(max(0.0, incumbent[0] * v - load) for load, v in zip(loads, speed, strict=True))
            if remaining_after[depth + 1] == 0 or remaining_after[depth + 1] < room:
                stages[item] = s
                same_size_next = depth + 1 < len(order) and sizes[order[depth + 1]] == size
                visit(depth + 1, s if same_size_next else 0)
            loads[s] = old

    try:
        visit(0, 0)
        proven = True
    except _Done as done:
        proven = str(done) == "optimal"
    return incumbent[0], incumbent[1], proven
