"""Min-max contiguous segmentation: cut a sequence of costs into k pieces, the heaviest as light as possible.

This is the dynamic programme of the SageMaker partitioner. With ``F[s][i]`` the best achievable
maximum when the first ``i`` items go to stages ``0..s``::

    F[s][i] = min over j of  max(F[s-1][j],  preload[s] + (P[i] - P[j]))      (P = prefix sums)

The trick that makes it fast: ``F[s-1][j]`` never decreases with ``j`` while the last piece's sum
``P[i] - P[j]`` never increases, so the best ``j`` sits where the two curves cross. That crossing is
the first ``j`` with ``F[s-1][j] + P[j] >= P[i] + preload[s]``: the left side is sorted, so one
``numpy.searchsorted`` finds it for every ``i`` at once. The whole programme costs
O(k · n log n) in a handful of vectorised passes, so 100,000 items cut in milliseconds.

``preload`` lets some stages start with a fixed load (modules pinned there by the user). A stage
that already holds something may receive no items; every other stage gets at least one. (Only
stages without a preload must be non-empty; that is what keeps ``F[s]`` monotone in ``i``, which
the crossing argument needs.)

Many cuts usually share the optimal maximum, and the DP alone does not care how the stages away
from the bottleneck look (one heavy item can leave a neighbour nearly idle). So once the optimum
is known, the heaviest piece is kept and the items on each side of it are cut again on their own,
recursively: every stage ends up as light as the stages around it allow, and the maximum never
rises. Every cut is deterministic: the cuts are placed from the last stage backwards, each
stage taking as many items as its optimum allows, and the first heaviest piece is the one kept.

**Stages of unequal speed and memory** (``speeds``, ``memory``, ``capacity``): a piece's time is
its load ÷ its stage's speed, the slowest piece's time is minimised, and the items' bytes on each
stage must fit its capacity. The crossing trick needs ``F[s-1][j]`` non-decreasing in ``j``, which
speeds break (items ``[1, 4, 1]`` on a fast stage then a slow one: two items cost 4, three cost
2.5). So this case is solved another way, exactly too: whether a maximum time ``T`` is reachable
is a sweep over the stages of the set of item counts each can end at (a stage starting after
item ``j`` reaches as far as its time and bytes allow: two `numpy.searchsorted` on prefix sums,
and every count between is reachable too), and ``T`` is bisected over the bit patterns of
non-negative float64s, whose order is that of their values: at most 63 sweeps find the least
reachable ``T`` exactly. The cut, the ties and the rebalanced sides follow the rules above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segmentation:
    """``pieces[s]`` is the range of item indices stage ``s`` takes; ``cost`` is the heaviest stage."""

    pieces: tuple[range, ...]
    cost: float

    def stage_of_items(self) -> list[int]:
        """Stage of every item, in item order."""
        return [s for s, piece in enumerate(self.pieces) for _ in piece]


class DoesNotFit(ValueError):
    """No cut keeps every stage's items within its ``capacity``."""


def min_max_segments(
    costs: Sequence[float],
    k: int,
    *,
    preload: Sequence[float | None] | None = None,
    speeds: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
    capacity: Sequence[float | None] | None = None,
) -> Segmentation:
    """Split ``costs`` into ``k`` contiguous pieces minimising the largest ``(preload + sum) / speed``.

    ``preload[s]`` is None for a stage that starts empty (it must get at least one item) or a
    number for a stage that already holds that much (it may get none). ``speeds[s]`` divides
    stage ``s``'s load (default 1); ``memory[i]`` is item ``i``'s bytes and ``capacity[s]`` the
    bytes stage ``s`` may take (None: no limit). ``cost`` is the slowest piece's time. Raises
    ValueError when there are fewer items than stages that must be filled, or for negative
    costs, and `DoesNotFit` when no cut fits the capacities.
    """
    if k < 1:
        raise ValueError(f"need at least one piece, got k={k}")
    values = np.asarray(costs, dtype=np.float64)
    if values.size and values.min() < 0:
        raise ValueError("costs must be non-negative")
    pre = list(preload) if preload is not None else [None] * k
    if len(pre) != k:
        raise ValueError(f"preload has {len(pre)} entries for {k} pieces")
    required = [p is None for p in pre]
    offset = np.array([0.0 if p is None else float(p) for p in pre])
    n = values.size
    if sum(required) > n:
        raise ValueError(f"cannot fill {sum(required)} pieces with {n} items")

    speed = np.ones(k) if speeds is None else np.asarray(speeds, dtype=np.float64)
    if speed.shape != (k,) or not np.all(np.isfinite(speed)) or np.any(speed <= 0):
        raise ValueError(f"speeds must be {k} positive numbers, got {speeds!r}")
    caps = np.full(k, np.inf) if capacity is None else np.array(
        [np.inf if c is None else float(c) for c in capacity], dtype=np.float64)
    if caps.shape != (k,):
        raise ValueError(f"capacity has {caps.size} entries for {k} pieces")
    if np.all(speed == speed[0]) and not np.isfinite(caps).any():
        pieces, best = _balanced(values, offset, required)
        return Segmentation(tuple(pieces), best / speed[0])
    bytes_ = np.zeros(n) if memory is None else np.asarray(memory, dtype=np.float64)
    if bytes_.shape != (n,) or (n and bytes_.min() < 0):
        raise ValueError(f"memory must be {n} non-negative numbers")
    stages = _Stages(offset, np.array(required), speed, caps)
    pieces, best = _balanced_unequal(values, bytes_, stages)
    return Segmentation(tuple(pieces), best)


def _balanced(values: np.ndarray, offset: np.ndarray, required: list[bool]) -> tuple[list[range], float]:
    """An optimal cut whose non-bottleneck sides are themselves cut optimally, recursively."""
    prefix = np.concatenate(([0.0], np.cumsum(values)))
    tables = _forward(prefix, offset, required)
    best = float(tables[-1][values.size])
    pieces = list(_cut_backwards(prefix, offset, required, tables, best))
    loads = [offset[s] + prefix[p.stop] - prefix[p.start] for s, p in enumerate(pieces)]
    heaviest = int(np.argmax(loads))
    for first, last in ((0, heaviest), (heaviest + 1, len(pieces))):
        if last - first < 2:
            continue  # zero or one stage on this side: nothing to rebalance
        start, stop = pieces[first].start, pieces[last - 1].stop
        side, _ = _balanced(values[start:stop], offset[first:last], required[first:last])
        pieces[first:last] = [range(start + p.start, start + p.stop) for p in side]
    return pieces, best


def _forward(prefix: np.ndarray, offset: np.ndarray, required: list[bool]) -> list[np.ndarray]:
    """``tables[s][i]``: best maximum for the first ``i`` items on stages ``0..s`` (inf if infeasible)."""
    n = prefix.size - 1
    ends = np.arange(n + 1)
    first = np.full(n + 1, np.inf)
    lo = int(required[0])
    first[lo:] = offset[0] + prefix[lo:]
    tables = [first]
    for s in range(1, len(required)):
        prev = tables[-1]
        lo_prev = sum(required[:s])  # smallest j for which prev[j] is finite
        hi = ends - int(required[s])  # the last piece may not be empty when required
        row = np.full(n + 1, np.inf)
        valid = hi >= lo_prev
        if valid.any():
            key = prev[lo_prev:] + prefix[lo_prev:]
            cross = lo_prev + np.searchsorted(key, prefix + offset[s], side="left")
            cross = np.minimum(cross, hi)
            before = np.maximum(cross - 1, lo_prev)
            at_cross = np.maximum(prev[cross], offset[s] + prefix - prefix[cross])
            at_before = np.maximum(prev[before], offset[s] + prefix - prefix[before])
            row[valid] = np.minimum(at_cross, at_before)[valid]
        tables.append(row)
    return tables


def _cut_backwards(
    prefix: np.ndarray,
    offset: np.ndarray,
    required: list[bool],
    tables: list[np.ndarray],
    best: float,
) -> tuple[range, ...]:
    """Place the cuts from the last stage back, each stage taking as many items as ``best`` allows."""
    end = prefix.size - 1
    pieces: list[range] = []
    for s in range(len(required) - 1, 0, -1):
        lo = sum(required[:s])
        hi = end - int(required[s])
        # Smallest start j whose piece still fits under ``best``; the sums use the same arithmetic
        # as the forward pass, so the comparison is exact.
        j = int(np.searchsorted(prefix, prefix[end] + offset[s] - best, side="left"))
        j = min(max(j, lo), hi)
        while j > lo and offset[s] + prefix[end] - prefix[j - 1] <= best:
            j -= 1
        while j < hi and (offset[s] + prefix[end] - prefix[j] > best or tables[s - 1][j] > best):
            j += 1
        pieces.append(range(j, end))
        end = j
    pieces.append(range(0, end))
    return tuple(reversed(pieces))


# ---------------------------------------------------------------- stages of unequal speed and memory


@dataclass(frozen=True)
class _Stages:
    """Per stage: preloaded load, whether it must take an item, speed, and bytes it may take."""

    offset: np.ndarray
    required: np.ndarray
    speed: np.ndarray
    capacity: np.ndarray

    def __len__(self) -> int:
        return self.offset.size

    def part(self, first: int, last: int) -> _Stages:
        return _Stages(self.offset[first:last], self.required[first:last], self.speed[first:last],
                       self.capacity[first:last])


def _balanced_unequal(values: np.ndarray, bytes_: np.ndarray, stages: _Stages) -> tuple[list[range], float]:
    """`_balanced` for stages of unequal speed and memory (see the module docstring)."""
    sweep = _Sweep(values, bytes_, stages)
    if sweep.reachable(np.inf) is None:
        raise DoesNotFit("no cut keeps every stage's items within its capacity")
    limit = sweep.least_time()
    pieces = sweep.cut_backwards(limit)
    times = [sweep.time(s, p.start, p.stop) for s, p in enumerate(pieces)]
    best = max(times)
    heaviest = int(np.argmax(times))
    for first, last in ((0, heaviest), (heaviest + 1, len(pieces))):
        if last - first < 2:
            continue
        start, stop = pieces[first].start, pieces[last - 1].stop
        side, _ = _balanced_unequal(values[start:stop], bytes_[start:stop], stages.part(first, last))
        pieces[first:last] = [range(start + p.start, start + p.stop) for p in side]
    return pieces, best


class _Sweep:
    """Which item counts stages ``0..s`` can end at when no stage may take longer than ``T``."""

    def __init__(self, values: np.ndarray, bytes_: np.ndarray, stages: _Stages) -> None:
        self.prefix = np.concatenate(([0.0], np.cumsum(values)))
        self.bytes = np.concatenate(([0.0], np.cumsum(bytes_)))
        self.stages = stages
        self.n = values.size

    def time(self, s: int, start: int, stop: int) -> float:
        st = self.stages
        return float((st.offset[s] + (self.prefix[stop] - self.prefix[start])) / st.speed[s])

    def reach(self, s: int, starts: np.ndarray, limit: float) -> np.ndarray:
        """The last item count stage ``s`` can end at from each start, within ``limit`` seconds
        and its capacity (below the start when even an empty piece is too much)."""
        st = self.stages
        load = limit * st.speed[s] - st.offset[s]  # the items' load the stage has room for
        by_time = np.searchsorted(self.prefix, self.prefix[starts] + load, side="right") - 1
        by_bytes = np.searchsorted(self.bytes, self.bytes[starts] + st.capacity[s], side="right") - 1
        return np.minimum(by_time, by_bytes)

    def reachable(self, limit: float) -> list[np.ndarray] | None:
        """``ends[s][i]``: stages ``0..s`` can take the first ``i`` items; None if not all of them."""
        ends: list[np.ndarray] = []
        current = np.zeros(self.n + 1, dtype=bool)
        current[0] = True
        for s in range(len(self.stages)):
            starts = np.flatnonzero(current)
            last = self.reach(s, starts, limit)
            first = starts + int(self.stages.required[s])
            ok = last >= first
            marks = (np.bincount(first[ok], minlength=self.n + 2)
                     - np.bincount(last[ok] + 1, minlength=self.n + 2))
            current = np.cumsum(marks)[: self.n + 1] > 0
            ends.append(current)
        return ends if current[self.n] else None

    def least_time(self) -> float:
        """The least ``T`` for which every item fits: bisect the bits of non-negative floats."""
        low, high = -1, int(np.float64(np.inf).view(np.int64))  # low infeasible (below 0.0), high feasible
        while high - low > 1:
            middle = (low + high) // 2
            if self.reachable(float(np.int64(middle).view(np.float64))) is None:
                low = middle
            else:
                high = middle
        return float(np.int64(high).view(np.float64))

    def cut_backwards(self, limit: float) -> list[range]:
        """Cuts from the last stage back, each stage taking as many items as ``limit`` allows."""
        ends = self.reachable(limit)
        assert ends is not None
        end = self.n
        pieces: list[range] = []
        for s in range(len(self.stages) - 1, 0, -1):
            starts = np.flatnonzero(ends[s - 1][: end - int(self.stages.required[s]) + 1])
            start = int(starts[np.argmax(self.reach(s, starts, limit) >= end)])
            pieces.append(range(start, end))
            end = start
        pieces.append(range(0, end))
        return pieces[::-1]
