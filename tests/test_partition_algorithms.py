"""The partitioner's building blocks against brute force and hand-worked answers."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smpart.partitioning.dhondt import dhondt
from smpart.partitioning.segment import min_max_segments

costs_st = st.lists(st.integers(0, 20).map(float), min_size=1, max_size=8)


def brute_force(costs: list[float], preload: list[float | None], speeds: list[float] | None = None,
                nbytes: list[float] | None = None, capacity: list[float | None] | None = None) -> float:
    """Try every placement of the k - 1 cuts (pieces may be empty only where preloaded): the least
    slowest ``(preload + sum) / speed`` with every piece's bytes within its capacity (inf if none fits)."""
    n, k = len(costs), len(preload)
    speeds, nbytes, capacity = speeds or [1.0] * k, nbytes or [0.0] * n, capacity or [None] * k
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        bounds = (0, *cuts, n)
        loads = []
        for s in range(k):
            lo, hi = bounds[s], bounds[s + 1]
            if hi == lo and preload[s] is None:
                break
            if capacity[s] is not None and sum(nbytes[lo:hi]) > capacity[s]:
                break
            loads.append(((preload[s] or 0.0) + sum(costs[lo:hi])) / speeds[s])
        else:
            best = min(best, max(loads))
    return best


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, k=st.integers(1, 5))
def test_segmentation_equals_brute_force(costs: list[float], k: int) -> None:
    if k > len(costs):
        with pytest.raises(ValueError):
            min_max_segments(costs, k)
        return
    result = min_max_segments(costs, k)
    assert result.cost == pytest.approx(brute_force(costs, [None] * k))
    assert [i for piece in result.pieces for i in piece] == list(range(len(costs)))
    assert all(len(piece) > 0 for piece in result.pieces)
    assert max(sum(costs[i] for i in piece) for piece in result.pieces) == pytest.approx(result.cost)


preload_st = st.lists(st.one_of(st.none(), st.integers(0, 30).map(float)), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, preload=preload_st)
def test_segmentation_with_preloads_equals_brute_force(costs: list[float], preload: list) -> None:
    if sum(p is None for p in preload) > len(costs):
        return
    result = min_max_segments(costs, len(preload), preload=preload)
    assert result.cost == pytest.approx(brute_force(costs, preload))
    for piece, pre in zip(result.pieces, preload, strict=True):
        assert pre is not None or len(piece) > 0


def test_segmentation_ties_fill_later_stages_first() -> None:
    # Four equal items in three pieces: the optimum (2) has the pair in any piece; the later
    # stages take as much as the optimum allows, so the pair lands last.
    assert min_max_segments([1, 1, 1, 1], 3).pieces == (range(0, 1), range(1, 2), range(2, 4))


def test_segmentation_handles_100k_items() -> None:
    costs = [float((i * 7919) % 101) for i in range(100_000)]
    result = min_max_segments(costs, 16)
    assert result.cost >= sum(costs) / 16
    assert result.cost <= sum(costs) / 16 + max(costs)


def test_dhondt_classic_example() -> None:
    # 100k/80k/30k/20k votes, 8 seats: quotients 100, 80, 50, 40, 33.3, 30, 26.7, 25 win.
    assert dhondt([100_000, 80_000, 30_000, 20_000], 8) == [4, 3, 1, 0]


def test_dhondt_hand_worked_cases() -> None:
    assert dhondt([3, 1], 3) == [3, 0]  # 3, 1.5, 1 (tie 1 vs 1 goes to the first) → all three
    assert dhondt([1, 1, 1], 2) == [1, 1, 0]  # ties go to the earlier segment
    assert dhondt([5, 4], 1) == [1, 0]
    assert dhondt([2, 3], 0) == [0, 0]
    assert dhondt([0, 0], 2) == [2, 0]


@given(weights=st.lists(st.floats(0, 100), min_size=1, max_size=6), seats=st.integers(0, 12))
def test_dhondt_respects_the_highest_averages_rule(weights: list[float], seats: int) -> None:
    alloc = dhondt(weights, seats)
    assert sum(alloc) == seats
    # Every winning quotient is at least every losing one: w_i / a_i >= w_j / (a_j + 1).
    for i, j in itertools.permutations(range(len(weights)), 2):
        if alloc[i]:
            assert weights[i] / alloc[i] >= weights[j] / (alloc[j] + 1) - 1e-9


def test_partition_package_imports_no_torch() -> None:
    """The partitioner runs on plain numbers: nothing in smpart/partitioning may import torch, and
    `Partition` is plain data: no view (smpart.viz) is imported from it."""
    root = Path(__file__).resolve().parents[1] / "smpart" / "partitioning"
    paths = sorted(root.glob("*.py"))
    assert len(paths) > 5, f"no partitioner sources under {root}"
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                assert module.split(".")[0] != "torch", f"{path.name} imports {module}"
                assert not module.startswith(("smpart.tracing.tracer", "smpart.runtime", "smpart.viz")), (
                    f"{path.name} imports {module}"
                )


def test_sides_of_the_bottleneck_are_balanced_too() -> None:
    # The optimum (100) is fixed by the first item; the rest still splits evenly.
    result = min_max_segments([100, 1, 1, 1, 1, 1, 1], 4)
    assert result.cost == 100
    assert result.pieces == (range(0, 1), range(1, 3), range(3, 5), range(5, 7))
