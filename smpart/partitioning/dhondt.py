"""D'Hondt allocation: share ``seats`` devices among segments in proportion to their weights.

The highest-averages method parliaments use: hand out seats one at a time, each to the segment
with the largest quotient ``weight / (seats_so_far + 1)``. A segment twice as heavy as another ends
up with about twice the devices, and a very light one may get none (the partitioner then leaves it
with the parent's device).

Ties go to the earlier segment, so the allocation is a pure function of its input; with the
segments in call order that also means earlier pipeline stages win ties.

Seats of unequal speed are not interchangeable, so on such devices the tree walk makes this
choice together with the segmentation's instead (`smpart.partitioning.unequal`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def dhondt(weights: Sequence[float], seats: int) -> list[int]:
    """Number of seats for each weight (same order); the counts add up to ``seats``.

    >>> dhondt([100_000, 80_000, 30_000, 20_000], 8)
    [4, 3, 1, 0]
    """
    if seats < 0:
        raise ValueError(f"seats must be >= 0, got {seats}")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    allocation = [0] * len(weights)
    if not weights:
        if seats:
            raise ValueError("cannot allocate seats to no segments")
        return allocation
    # heapq is a min-heap: store the negated quotient, then the index so that ties pick the first.
    heap = [(-float(w), i) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    for _ in range(seats):
        _, i = heapq.heappop(heap)
        allocation[i] += 1
        heapq.heappush(heap, (-float(weights[i]) / (allocation[i] + 1), i))
    return allocation
