"""One level of the tree walk on devices of unequal speed: segmentation and D'Hondt in one step.

On alike devices the walk cuts a node's children into pieces by the min-max DP and D'Hondt then
hands each piece seats in proportion to its weight: a heavy piece takes several (the walk visits
it again with them), a light one may take none and stays on the parent's device. On devices of
unequal speed a seat is worth its device's speed, and the devices are handed out in pipeline
order, so which device a piece gets depends on every piece before it: counts alone no longer say
enough. So both choices are made together, exactly, by a dynamic programme over (children
placed, devices used), a piece being a contiguous run of children with either

* **one device**: its time ``(preload + their load) / speed``, its bytes within the device's room;
* **several devices** (2 up to the leaf units its heaviest child holds: more would idle): the
  heaviest child takes them all and the walk visits it again with them; the lighter children
  around it (D'Hondt's seatless pieces) sit on the run's first device (those before it) or last
  device (those after), next to the heaviest child's first and last parts, so the pipeline never
  steps back. Its time is D'Hondt's view, the heaviest child divided over the run:
  ``(preload + load) / (the run's speeds summed)``, or the time of the children fixed on the
  first or last device if longer; its bytes must fit the run's rooms summed.

The slowest piece's time is minimised. A device that already holds load (the node's own, on its
first device) may take no child; every other device must take one or be in a run. Ties go to the
later devices taking more children, as in the segmentation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Share:
    """Children ``items`` (indices) on ``devices`` (positions in the device list); with several
    devices, ``split`` is the child that takes them all (the others sit at the run's ends)."""

    items: range
    devices: range
    split: int | None = None


def share_devices(
    costs: Sequence[float],
    nbytes: Sequence[float],
    splittable: Sequence[int],
    speeds: Sequence[float],
    preload: Sequence[float],
    room: Sequence[float],
) -> list[Share] | None:
    """The best shares of the children over the devices (see the module docstring); None when no
    sharing fills every device that holds nothing yet, or none fits the rooms."""
    n, m = len(costs), len(speeds)
    cost = np.asarray(costs, dtype=float)
    load = np.concatenate(([0.0], np.cumsum(cost)))
    held = np.concatenate(([0.0], np.cumsum(np.asarray(nbytes, dtype=float))))
    speed_sum = np.concatenate(([0.0], np.cumsum(np.asarray(speeds, dtype=float))))
    pre_sum = np.concatenate(([0.0], np.cumsum(np.asarray(preload, dtype=float))))
    rooms = np.asarray(room, dtype=float)
    room_sum = np.concatenate(([0.0], np.cumsum(np.where(np.isinf(rooms), 0.0, rooms))))
    unlimited = np.concatenate(([0], np.cumsum(np.isinf(rooms))))  # a run with one has room for all
    reach = np.asarray(splittable, dtype=int)
    heaviest = _heaviest_from(cost)
    widest = int(reach.max(initial=1))
    best = np.full((n + 1, m + 1), np.inf)
    best[0, 0] = 0.0
    back: dict[tuple[int, int], tuple[int, int, int | None]] = {}
    for d in range(1, m + 1):
        for i in range(n + 1):
            # children j..i-1 on device d-1 (none only where the device holds something already)
            last = i if preload[d - 1] > 0 else i - 1
            if last >= 0:
                starts = np.arange(last + 1)
                alone = (preload[d - 1] + load[i] - load[starts]) / speeds[d - 1]
                times = np.maximum(best[starts, d - 1], alone)
                times[held[i] - held[starts] > room[d - 1]] = np.inf
                j = int(np.argmin(times))
                if times[j] < best[i, d]:
                    best[i, d], back[i, d] = times[j], (j, d - 1, None)
            if i == 0:
                continue
            # children j..i-1 on devices e..d-1, the heaviest one taking the run
            starts = np.arange(i)
            split = heaviest[i][starts]
            lead = load[split] - load[starts]  # the lighter children before the heaviest one
            trail = load[i] - load[split + 1]  # and after it
            for e in range(max(0, d - widest), d - 1):
                spread = (pre_sum[d] - pre_sum[e] + load[i] - load[starts]) / (speed_sum[d] - speed_sum[e])
                ends = np.maximum((preload[e] + lead) / speeds[e], (preload[d - 1] + trail) / speeds[d - 1])
                times = np.maximum(best[starts, e], np.maximum(spread, ends))
                if unlimited[d] == unlimited[e]:
                    times[held[i] - held[starts] > room_sum[d] - room_sum[e]] = np.inf
                times[reach[split] < d - e] = np.inf
                j = int(np.argmin(times))
                if times[j] < best[i, d]:
                    best[i, d], back[i, d] = times[j], (j, e, int(split[j]))
    if not np.isfinite(best[n, m]):
        return None
    shares: list[Share] = []
    i, d = n, m
    while d > 0:
        j, e, split = back[i, d]
        shares.append(Share(range(j, i), range(e, d), split))
        i, d = j, e
    return shares[::-1]


def _heaviest_from(cost: np.ndarray) -> list[np.ndarray]:
    """``out[i][j]``: the index of the heaviest of children ``j..i-1`` (the first on ties)."""
    out = [np.zeros(0, dtype=int)]
    for i in range(1, cost.size + 1):
        best = np.empty(i, dtype=int)
        top = i - 1
        for j in range(i - 1, -1, -1):
            if cost[j] >= cost[top]:
                top = j
            best[j] = top
        out.append(best)
    return out
