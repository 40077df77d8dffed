"""`assign_layers` is exact: it matches brute force over every contiguous split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from smpart.errors import PlanError
from smpart.planner import assign_layers

#: `assign_layers` counts a stage as fitting its memory cap within this relative slack (float
#: round-off of its prefix sums; see its module docstring), so the reference does too.
FIT_SLACK = 1e-12


def brute_force(costs, k, microbatches, cuts=None, speeds=None, memory=None, caps=None):
    """Best objective and starts over all C(L-1, k-1) splits (None when nothing fits)."""
    num = len(costs)
    speeds = speeds or [1.0] * k
    best = None
    for inner in itertools.combinations(range(1, num), k - 1):
        starts = (0, *inner)
        bounds = [*starts, num]
        times = [sum(costs[bounds[i]:bounds[i + 1]]) / speeds[i] for i in range(k)]
        if memory is not None and any(sum(memory[bounds[i]:bounds[i + 1]]) > caps[i] * (1 + FIT_SLACK)
                                      for i in range(k)):
            continue
        cut = 0.0
        if cuts is not None:
            cut = sum(cuts[starts[j] - 1][j - 1] if np.ndim(cuts) == 2 else cuts[starts[j] - 1]
                      for j in range(1, k))
        value = (microbatches - 1) * max(times) + sum(times) + cut
        if best is None or value < best[0]:
            best = (value, starts)
    return best


@st.composite
def problems(draw):
    num = draw(st.integers(1, 9))
    k = draw(st.integers(1, min(num, 4)))
    costs = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 7.0]) | st.floats(0, 10),
                          min_size=num, max_size=num))
    microbatches = draw(st.integers(1, 12))
    cut_kind = draw(st.sampled_from(["none", "per_point", "per_boundary"]))
    cuts = None
    if cut_kind == "per_point" and num > 1:
        cuts = draw(st.lists(st.floats(0, 5), min_size=num - 1, max_size=num - 1))
    elif cut_kind == "per_boundary" and num > 1 and k > 1:
        cuts = [draw(st.lists(st.floats(0, 5), min_size=k - 1, max_size=k - 1)) for _ in range(num - 1)]
    speeds = draw(st.none() | st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=k, max_size=k))
    memory = caps = None
    if draw(st.booleans()):
        memory = draw(st.lists(st.floats(0, 4), min_size=num, max_size=num))
        caps = draw(st.lists(st.floats(0.5, 10), min_size=k, max_size=k))
    return costs, k, microbatches, cuts, speeds, memory, caps


@settings(max_examples=400, deadline=None)
@given(problems())
# A stage over its cap by one ulp fits within the slack (found by hypothesis in CI).
@example(([0.0] * 6 + [0.5, 0.5], 2, 2, None, None, [0.0] * 5 + [1.0, 2.220446049250313e-16, 0.0],
          [1.0, 1.0]))
@example(([0.0] * 7, 1, 1, None, None, [0.0] * 6 + [1.0000000000000002], [1.0]))
def test_matches_brute_force(problem):
    costs, k, microbatches, cuts, speeds, memory, caps = problem
    expected = brute_force(costs, k, microbatches, cuts, speeds, memory, caps)
    if expected is None:
        with pytest.raises(PlanError, match="fits in memory"):
            assign_layers(costs, k, microbatches, cuts, speeds, memory, caps)
        return
    got = assign_layers(costs, k, microbatches, cuts, speeds, memory, caps)
    assert got.objective == pytest.approx(expected[0], rel=1e-9, abs=1e-9)
    # the reported split is itself optimal, contiguous, non-empty and fits
    bounds = [*got.starts, len(costs)]
    assert got.starts[0] == 0 and all(bounds[i] < bounds[i + 1] for i in range(k))
    sp = speeds or [1.0] * k
    times = [sum(costs[bounds[i]:bounds[i + 1]]) / sp[i] for i in range(k)]
    assert got.stage_times == pytest.approx(times)
    if memory is not None:
        assert all(sum(memory[bounds[i]:bounds[i + 1]]) <= caps[i] * (1 + 1e-9) for i in range(k))


def test_uniform_layers_split_evenly():
    got = assign_layers([1.0] * 24, 4, 8)
    assert got.starts == (0, 6, 12, 18)
    assert got.objective == pytest.approx(7 * 6 + 24)


def test_faster_stage_gets_more_layers():
    got = assign_layers([1.0] * 30, 2, 16, stage_speeds=[2.0, 1.0])
    assert got.starts == (0, 20)


def test_expensive_cut_point_is_avoided():
    cuts = [0.0] * 9
    cuts[4] = 100.0  # cutting after layer 4 (the balanced cut) is very expensive
    got = assign_layers([1.0] * 10, 2, 4, cut_costs=cuts)
    assert got.starts != (0, 5)
    assert got.objective == pytest.approx(brute_force([1.0] * 10, 2, 4, cuts)[0])


def test_per_stage_cost_rows():
    rows = [[1.0, 1.0, 1.0, 1.0], [4.0, 4.0, 4.0, 0.5]]  # stage 1 is fast only on the last layer
    got = assign_layers(rows, 2, 4)
    assert got.starts == (0, 3)


def test_memory_cap_moves_the_boundary():
    free = assign_layers([1.0] * 8, 2, 4)
    capped = assign_layers([1.0] * 8, 2, 4, layer_memory=[1.0] * 8, stage_memory=[3.0, 10.0])
    assert free.starts == (0, 4) and capped.starts == (0, 3)


def test_infeasible_memory_raises():
    with pytest.raises(PlanError, match="layer 2 alone"):
        assign_layers([1.0] * 4, 2, 2, layer_memory=[1, 1, 9, 1], stage_memory=5.0)


@pytest.mark.parametrize("bad", [
    dict(layer_costs=[], num_stages=1, microbatches=1),
    dict(layer_costs=[1.0, -1.0], num_stages=1, microbatches=1),
    dict(layer_costs=[1.0], num_stages=2, microbatches=1),
    dict(layer_costs=[1.0, 2.0], num_stages=2, microbatches=0),
    dict(layer_costs=[1.0, 2.0], num_stages=2, microbatches=1, stage_speeds=[1.0, 0.0]),
    dict(layer_costs=[1.0, 2.0], num_stages=2, microbatches=1, cut_costs=[[1.0, 2.0, 3.0]] * 5),
])
def test_bad_input_is_a_plan_error(bad):
    with pytest.raises(PlanError):
        assign_layers(**bad)


def test_forty_layer_case_matches_brute_force():
    """A 40-layer case with speeds and per-boundary cuts (9,139 splits) agrees with brute force."""
    rng = np.random.default_rng(1)
    costs = rng.random(40) + 0.1
    speeds = rng.choice([1.0, 2.0], 4)
    cuts = rng.random((39, 3))
    got = assign_layers(costs, 4, 6, cut_costs=cuts, stage_speeds=speeds)
    expected = brute_force(list(costs), 4, 6, cuts.tolist(), list(speeds))
    assert got.objective == pytest.approx(expected[0], rel=1e-9)
