"""Multiway number partitioning onto bins that already hold a load: LPT, then local search.

Put every item into one of ``k`` bins, each starting with a given base load, so that the fullest
bin is as light as possible. The problem is NP-hard; two classic steps get close quickly and
scale to many items:

* **LPT** (longest processing time first, Graham 1969): items from largest to smallest, each
  into the bin that is lightest at that moment. Without base loads it is within 4/3 of optimal.
* **Local search**: while the heaviest bin can give something away, move one of its items to a
  lighter bin, or swap one of its items for a smaller one there. A move of size ``d`` from a bin
  of load ``A`` to one of load ``B`` is taken only when ``B + d < A``: the pair's maximum drops
  and so does the sum of squared loads, so the search cannot cycle and ends in a state where no
  single move or swap helps the heaviest bin.

The partitioner uses this for the units of reused subtrees (`smpart.partitioning.reuse`), whose
order does not constrain their stages; the exact branch-and-bound there takes over when there
are few of them.

**Bins of unequal speed** (``speeds``; a bin's *time* is its load ÷ its speed, uniform machines
in scheduling's terms): LPT puts each item where it would finish first, and the local search
empties the slowest bin by the same moves and swaps, taken only when the pair's larger time drops
below the slowest bin's. A swap is aimed at the exchange that would equalise the pair's times.
With equal speeds both are the steps above, number for number.

Everything is deterministic: ties go to the lower bin index and the earlier item.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def lpt(sizes: Sequence[float], base: Sequence[float], speeds: Sequence[float] | None = None) -> list[int]:
    """Bin of every item: largest item first, each into the bin where it would finish first (with
    equal speeds: the currently lightest)."""
    loads = list(base)
    speed = _speeds(speeds, len(loads))
    bins = [0] * len(sizes)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        finish = loads if speeds is None else [(load + sizes[item]) / v
                                               for load, v in zip(loads, speed, strict=True)]
        target = min(range(len(loads)), key=lambda b: (finish[b], b))
        bins[item] = target
        loads[target] += sizes[item]
    return bins


def rebalance(
    sizes: Sequence[float], base: Sequence[float], bins: Sequence[int], max_steps: int | None = None,
    speeds: Sequence[float] | None = None,
) -> list[int]:
    """Improve ``bins`` by moves and swaps out of the slowest bin (see the module docstring).

    ``max_steps`` bounds the number of moves and swaps (default: a few per item).
    """
    bins = list(bins)
    loads = list(base)
    speed = _speeds(speeds, len(loads))
    members: list[list[tuple[float, int]]] = [[] for _ in base]  # sorted (size, item) per bin
    for item, b in enumerate(bins):
        loads[b] += sizes[item]
        members[b].append((sizes[item], item))
    for content in members:
        content.sort()
    limit = 4 * len(sizes) + 16 if max_steps is None else max_steps
    for _ in range(limit):
        heaviest = max(range(len(loads)), key=lambda b: (loads[b] / speed[b], -b))
        step = _best_step(heaviest, loads, members, speed)
        if step is None:
            break
        item, to, other = step
        _shift(item, heaviest, to, sizes, bins, loads, members)
        if other is not None:
            _shift(other, to, heaviest, sizes, bins, loads, members)
    return bins


def _speeds(speeds: Sequence[float] | None, bins: int) -> list[float]:
    return [1.0] * bins if speeds is None else [float(v) for v in speeds]


def _best_step(
    source: int, loads: list[float], members: list[list[tuple[float, int]]], speed: list[float]
) -> tuple[int, int, int | None] | None:
    """The move or swap out of ``source`` that leaves the lightest pair maximum time, or None.

    Returns (item leaving ``source``, bin it goes to, item coming back or None).
    """
    best: tuple[float, int, int, int | None] | None = None  # (pair max, item, to, other)
    slowest = loads[source] / speed[source]
    for size, item in members[source]:
        for to in range(len(loads)):
            # the load ``to`` can take before it is as slow as ``source`` (equal speeds: the gap)
            gap = slowest * speed[to] - loads[to]
            if to == source or gap <= 0:
                continue
            candidates: list[tuple[float, int | None]] = []
            if size < gap:
                candidates.append((size, None))
            # A swap gives away ``size - other``: the best one evens the pair's times (equal
            # speeds: about half the gap).
            even = (loads[source] * speed[to] - loads[to] * speed[source]) / (speed[source] + speed[to])
            content = members[to]
            at = bisect.bisect_left(content, (size - even, -1))
            for j in (at - 1, at):
                if 0 <= j < len(content):
                    other_size, other = content[j]
                    if 0 < size - other_size < gap:
                        candidates.append((size - other_size, other))
            for given, other in candidates:
                pair_max = max((loads[source] - given) / speed[source], (loads[to] + given) / speed[to])
                if best is None or pair_max < best[0]:
                    best = (pair_max, item, to, other)
    return None if best is None else best[1:]


def _shift(
    item: int,
    source: int,
    target: int,
    sizes: Sequence[float],
    bins: list[int],
    loads: list[float],
    members: list[list[tuple[float, int]]],
) -> None:
    bins[item] = target
    loads[source] -= sizes[item]
    loads[target] += sizes[item]
    members[source].remove((sizes[item], item))
    bisect.insort(members[target], (sizes[item], item))
