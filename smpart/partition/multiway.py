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

The partitioner uses this for the units of reused subtrees (`smpart.partition.reuse`), whose
order does not constrain their stages; the exact branch-and-bound there takes over when there
are few of them.

Everything is deterministic: ties go to the lower bin index and the earlier item.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def lpt(sizes: Sequence[float], base: Sequence[float]) -> list[int]:
    """Bin of every item: largest item first, each into the currently lightest bin."""
    loads = list(base)
    bins = [0] * len(sizes)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(len(loads)), key=lambda b: (loads[b], b))
        bins[item] = target
        loads[target] += sizes[item]
    return bins


def rebalance(
    sizes: Sequence[float], base: Sequence[float], bins: Sequence[int], max_steps: int | None = None
) -> list[int]:
    """Improve ``bins`` by moves and swaps out of the heaviest bin (see the module docstring).

    ``max_steps`` bounds the number of moves and swaps (default: a few per item).
    """
    bins = list(bins)
    loads = list(base)
    members: list[list[tuple[float, int]]] = [[] for _ in base]  # sorted (size, item) per bin
    for item, b in enumerate(bins):
        loads[b] += sizes[item]
        members[b].append((sizes[item], item))
    for content in members:
        content.sort()
    limit = 4 * len(sizes) + 16 if max_steps is None else max_steps
    for _ in range(limit):
        heaviest = max(range(len(loads)), key=lambda b: (loads[b], -b))
        step = _best_step(heaviest, loads, members)
        if step is None:
            break
        item, to, other = step
        _shift(item, heaviest, to, sizes, bins, loads, members)
        if other is not None:
            _shift(other, to, heaviest, sizes, bins, loads, members)
    return bins


def _best_step(
    source: int, loads: list[float], members: list[list[tuple[float, int]]]
) -> tuple[int, int, int | None] | None:
    """The move or swap out of ``source`` that leaves the lightest pair maximum, or None.

    Returns (item leaving ``source``, bin it goes to, item coming back or None).
    """
    best: tuple[float, int, int, int | None] | None = None  # (pair max, item, to, other)
    for size, item in members[source]:
        for to in range(len(loads)):
            gap = loads[source] - loads[to]
            if to == source or gap <= 0:
                continue
            candidates: list[tuple[float, int | None]] = []
            if size < gap:
                candidates.append((size, None))
            # A swap gives away ``size - other``: the best one gives away about half the gap.
            content = members[to]
            at = bisect.bisect_left(content, (size - gap / 2, -1))
            for j in (at - 1, at):
                if 0 <= j < len(content):
                    other_size, other = content[j]
                    if 0 < size - other_size < gap:
                        candidates.append((size - other_size, other))
            for given, other in candidates:
                pair_max = max(loads[source] - given, loads[to] + given)
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
