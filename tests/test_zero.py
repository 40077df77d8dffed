"""The split of parameters between data-parallel replicas for sharded optimizer state."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from smpart.runtime.processes.zero import owners


def test_by_hand():
    # largest first, each to the least loaded replica: 8 -> 0, 5 -> 1, 4 -> 1, 3 -> 0
    assert owners([3, 8, 4, 5], 2) == [0, 0, 1, 1]


@given(st.lists(st.integers(1, 10_000), max_size=40), st.integers(1, 8))
def test_every_parameter_has_one_owner_and_loads_stay_within_one_parameter(sizes, dp):
    owner = owners(sizes, dp)
    assert len(owner) == len(sizes) and all(0 <= o < dp for o in owner)
    load = [sum(s for s, o in zip(sizes, owner, strict=True) if o == r) for r in range(dp)]
    assert max(load) - min(load) <= max(sizes, default=0)
    assert owners(sizes, dp) == owner  # the same on every replica
