"""Exact pipeline layer assignment: which contiguous run of layers each stage gets.

The objective is AMP's pipeline time for ``B`` micro-batches::

    (B - 1) · max_i t_i  +  Σ_i t_i  +  Σ cut costs,     t_i = (layers of stage i) / speed_i

subject to every stage holding at least one layer and at most its memory cap. AMP solves it with
a DP over (layer, stage, current max) in O(k·L⁴). smpart splits the max away instead:

* **Fix the bottleneck.** For a bound ``T``, let ``f(T)`` be the least ``Σ t_i + Σ cuts`` with every
  ``t_i ≤ T``. Then the optimum is ``min_T (B - 1)·T + f(T)`` over the finitely many values the
  max can take (segment times), and any solution met on the way is a real, achievable plan.
* **Each f(T) is one vectorised pass per stage.** With prefix sums ``P``, stage ``j`` ending at ``l``
  costs ``dp[j][l] = P[l]/s_j + min_{s ∈ W(l)} (dp[j-1][s] − P[s]/s_j + cut[s][j])``: the
  transition separates into a term of ``l`` and a term of ``s``, and the window ``W(l)`` of
  legal starts (time ≤ T, memory ≤ cap) moves right monotonically with ``l``. A monotone deque
  would make that O(k·L) in Python; a sparse-table range minimum (O(k·L log L)) does the same
  with a dozen numpy operations per stage, which is far faster for L <= 10⁴.
* **Few bounds are ever tried.** ``f`` is a non-increasing step function. A bound's solution has
  a realised max ``r ≤ T`` and ``f`` is constant on ``[r, T]``, so that whole interval is done.
  Candidate bounds are bisected in sorted order; a range ``[a, b]`` is dropped when
  ``(B - 1)·a + f(b) ≥ best`` (nothing inside can win) or when ``f`` is equal at both ends. The
  range is also capped above: no ``T`` with ``(B - 1)·T + f(∞) ≥ best`` can win.

``layer_costs`` and ``layer_memory`` may also be given per stage (a ``k × L`` array) for stages
whose per-layer cost is not a plain speed ratio (tensor-parallel all-reduces, memory that depends
on how many micro-batches a stage keeps in flight); the algorithm is unchanged. Exact means exact
up to float round-off (comparisons carry a 1e-12 relative slack).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from smpart.errors import PlanError

#: Relative slack when comparing a stage's time or memory with its bound (float round-off).
_REL_EPS = 1e-12
#: Bottleneck weight used with a single micro-batch, only to break ties towards balance.
_TIE_WEIGHT = 1e-9
#: Candidate bounds materialised at once; wider windows are processed in chunks.
_CHUNK = 1 << 21


@dataclass(frozen=True)
class LayerAssignment:
    """An optimal assignment: stage ``i`` runs layers ``starts[i] .. starts[i+1] - 1``."""

    starts: tuple[int, ...]
    stage_times: tuple[float, ...]
    objective: float

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_of_layer(self, num_layers: int) -> list[int]:
        bounds = [*self.starts, num_layers]
        return [i for i in range(len(self.starts)) for _ in range(bounds[i], bounds[i + 1])]


@dataclass
class _Problem:
    prefix: np.ndarray  # (k, L+1): row j holds prefix sums of layer times on stage j
    cuts: np.ndarray  # (L+1, k): cost of a stage j >= 1 starting at prefix index s
    mem_prefix: np.ndarray | None  # (k, L+1) prefix sums of layer memory on stage j
    mem_caps: np.ndarray | None  # (k,)
    microbatches: int

    @property
    def num_layers(self) -> int:
        return self.prefix.shape[1] - 1

    @property
    def num_stages(self) -> int:
        return self.prefix.shape[0]


@dataclass(frozen=True)
class _Solution:
    starts: tuple[int, ...]
    total: float  # Σ t_i + Σ cuts
    bottleneck: float  # max t_i

    def objective(self, microbatches: int) -> float:
        return (microbatches - 1) * self.bottleneck + self.total


def assign_layers(
    layer_costs: Sequence[float],
    num_stages: int,
    microbatches: int,
    cut_costs: Sequence[float] | Sequence[Sequence[float]] | None = None,
    stage_speeds: Sequence[float] | None = None,
    layer_memory: Sequence[float] | None = None,
    stage_memory: Sequence[float] | float | None = None,
) -> LayerAssignment:
    """The exact minimum of ``(B−1)·max t_i + Σ t_i + Σ cuts`` over contiguous assignments.

    ``cut_costs[l]`` (or ``cut_costs[l][j]`` for boundary ``j``, between stages ``j`` and ``j+1``)
    is the cost of cutting after layer ``l``; ``stage_speeds[i]`` divides stage ``i``'s layer
    cost; ``layer_memory`` summed over a stage must not exceed ``stage_memory[i]`` (one figure
    for all stages, or one per stage). Raises `PlanError` when no assignment fits.
    """
    problem = _problem(layer_costs, num_stages, microbatches, cut_costs, stage_speeds,
                       layer_memory, stage_memory)
    best = _solve(problem)
    return _assignment(problem, best)


def evaluate_assignment(
    layer_costs: Sequence[Sequence[float]],
    starts: Sequence[int],
    microbatches: int,
    cut_costs: Sequence[float] | Sequence[Sequence[float]] | None = None,
) -> LayerAssignment:
    """The objective of given boundaries (``starts``, one per stage) under ``layer_costs`` (a
    ``k × L`` array): what a split chosen for other devices costs on these."""
    problem = _problem(layer_costs, len(starts), microbatches, cut_costs, None, None, None)
    return _assignment(problem, _evaluate(problem, tuple(starts)))


# ---------------------------------------------------------------------------- validation
def _problem(layer_costs, num_stages, microbatches, cut_costs, stage_speeds, layer_memory,
             stage_memory) -> _Problem:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int | np.integer) or num_stages < 1:
        raise PlanError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int | np.integer) or microbatches < 1:
        raise PlanError(f"microbatches must be an int >= 1, got {microbatches!r}")
    costs = _per_stage("layer_costs", layer_costs, num_stages)
    num_layers = costs.shape[1]
    if num_stages > num_layers:
        raise PlanError(f"{num_stages} stages need at least {num_stages} layers, got {num_layers}")
    speeds = np.ones(num_stages) if stage_speeds is None else np.asarray(stage_speeds, dtype=float)
    if speeds.shape != (num_stages,) or np.any(~np.isfinite(speeds)) or np.any(speeds <= 0):
        raise PlanError(f"stage_speeds must be {num_stages} positive numbers, got {stage_speeds!r}")
    times = costs / speeds[:, None]
    mem_prefix = mem_caps = None
    if layer_memory is not None or stage_memory is not None:
        if layer_memory is None or stage_memory is None:
            raise PlanError("give both layer_memory and stage_memory, or neither")
        memory = _per_stage("layer_memory", layer_memory, num_stages)
        if memory.shape[1] != num_layers:
            raise PlanError(f"layer_memory must have {num_layers} entries per stage, got {memory.shape[1]}")
        try:
            mem_caps = np.broadcast_to(np.asarray(stage_memory, dtype=float), (num_stages,)).copy()
        except ValueError:
            raise PlanError(f"stage_memory must be one number or {num_stages}: {stage_memory!r}") from None
        mem_prefix = _prefix(memory)
    return _Problem(_prefix(times), _cut_matrix(cut_costs, num_layers, num_stages), mem_prefix, mem_caps,
                    int(microbatches))


def _per_stage(name: str, values, num_stages: int) -> np.ndarray:
    """A (k, L) array: one row for all stages (1-D input) or one row per stage (2-D input)."""
    array = np.asarray(values, dtype=float)
    if array.ndim == 1:
        array = np.broadcast_to(array, (num_stages, len(array)))
    if array.ndim != 2 or array.shape[0] != num_stages or array.shape[1] == 0:
        raise PlanError(f"{name} must be a non-empty list of L numbers, or {num_stages} such lists "
                        f"(one per stage); got shape {np.shape(values)}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise PlanError(f"{name} must be finite and >= 0")
    return array


def _prefix(rows: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros((rows.shape[0], 1)), np.cumsum(rows, axis=1)], axis=1)


def _cut_matrix(cut_costs, num_layers: int, num_stages: int) -> np.ndarray:
    """(L+1, k): entry [s, j] is the cost paid when stage j >= 1 starts at layer s."""
    cuts = np.zeros((num_layers + 1, num_stages))
    if cut_costs is None or num_stages == 1:
        return cuts
    given = np.asarray(cut_costs, dtype=float)
    if given.ndim == 1:
        given = np.repeat(given[:, None], num_stages - 1, axis=1)
    if given.ndim != 2 or given.shape != (num_layers - 1, num_stages - 1):
        raise PlanError(
            f"cut_costs must have {num_layers - 1} rows (one per cut point) and "
            f"{num_stages - 1} columns (one per boundary), got shape {np.shape(cut_costs)}"
        )
    if not np.all(np.isfinite(given)):
        raise PlanError("cut_costs must be finite")
    # A stage j >= 1 starting at layer s cuts after layer s-1 at boundary j-1.
    cuts[1:num_layers, 1:] = given
    return cuts


# ---------------------------------------------------------------------------- f(T)
def _range_min_table(values: np.ndarray) -> np.ndarray:
    """Sparse table: row p holds min(values[i : i + 2**p]) (inf past the end)."""
    n = len(values)
    rows = [values]
    width = 1
    while width * 2 <= n:
        prev = rows[-1]
        row = np.full(n, np.inf)
        row[: n - width] = np.minimum(prev[: n - width], prev[width:])
        rows.append(row)
        width *= 2
    return np.stack(rows)


def _range_min(table: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(values[lo:hi+1]) for each pair; inf where the range is empty."""
    length = hi - lo + 1
    ok = length > 0
    out = np.full(len(lo), np.inf)
    if not ok.any():
        return out
    lo, hi, length = lo[ok], hi[ok], length[ok]
    level = np.floor(np.log2(length)).astype(np.int64)
    out[ok] = np.minimum(table[level, lo], table[level, hi - (1 << level) + 1])
    return out


def _min_start(prefix: np.ndarray, ends: np.ndarray, budget: float) -> np.ndarray:
    """Smallest start s with prefix[end] - prefix[s] <= budget, for each end."""
    slack = abs(budget) * _REL_EPS + 1e-300
    return np.searchsorted(prefix, prefix[ends] - budget - slack, side="left")


def _window_starts(problem: _Problem, j: int, ends: np.ndarray, bound: float) -> np.ndarray:
    """First legal start of stage j for each end: its time <= bound, its memory <= its cap."""
    lo = np.full(len(ends), j)
    if np.isfinite(bound):
        lo = np.maximum(lo, _min_start(problem.prefix[j], ends, bound))
    if problem.mem_prefix is not None:
        lo = np.maximum(lo, _min_start(problem.mem_prefix[j], ends, problem.mem_caps[j]))
    return lo


def _bounded_sum(problem: _Problem, bound: float) -> _Solution | None:
    """Least Σ t_i + Σ cuts with every stage time <= bound (None: infeasible)."""
    num_layers, num_stages = problem.num_layers, problem.num_stages
    rows = np.full((num_stages + 1, num_layers + 1), np.inf)
    rows[0, 0] = 0.0
    for j in range(num_stages):
        prefix = problem.prefix[j]
        if j == num_stages - 1:
            ends = np.array([num_layers])
        else:  # the j stages before hold >= j layers, the k-1-j after >= k-1-j
            ends = np.arange(j + 1, num_layers - (num_stages - 1 - j) + 1)
        lo = _window_starts(problem, j, ends, bound)
        values = rows[j] - prefix + problem.cuts[:, j]
        rows[j + 1, ends] = _range_min(_range_min_table(values), lo, ends - 1) + prefix[ends]
        if not np.isfinite(rows[j + 1]).any():
            return None
    if not np.isfinite(rows[num_stages, num_layers]):
        return None
    return _backtrack(problem, rows, bound)


def _backtrack(problem: _Problem, rows: np.ndarray, bound: float) -> _Solution:
    starts = []
    end = problem.num_layers
    for j in range(problem.num_stages - 1, -1, -1):
        lo = int(_window_starts(problem, j, np.array([end]), bound)[0])
        prefix = problem.prefix[j]
        window = rows[j, lo:end] - prefix[lo:end] + problem.cuts[lo:end, j]
        end = lo + int(np.argmin(window))
        starts.append(end)
    starts.reverse()
    return _evaluate(problem, tuple(starts))


def _stage_times(problem: _Problem, starts: tuple[int, ...]) -> list[float]:
    bounds = [*starts, problem.num_layers]
    return [float(problem.prefix[i, bounds[i + 1]] - problem.prefix[i, bounds[i]])
            for i in range(len(starts))]


def _evaluate(problem: _Problem, starts: tuple[int, ...]) -> _Solution:
    times = _stage_times(problem, starts)
    cut_total = sum(problem.cuts[starts[i], i] for i in range(1, len(starts)))
    return _Solution(starts, float(sum(times) + cut_total), max(times))


# ---------------------------------------------------------------------------- min over T
def _solve(problem: _Problem) -> _Solution:
    free = _bounded_sum(problem, np.inf)
    if free is None:
        raise _infeasible(problem)
    search = _BoundSearch(problem, free)
    search.run()
    return search.best


class _BoundSearch:
    """Bisection over candidate bottleneck bounds, pruned as the module docstring explains."""

    def __init__(self, problem: _Problem, free: _Solution) -> None:
        self.problem = problem
        self.floor = free.total  # f(∞): no f(T) is smaller
        # With one micro-batch every split of equal Σ ties; a tiny weight on the bottleneck
        # breaks ties towards the balanced split (changing the objective by <= 1e-9 relative).
        self.weight = max(problem.microbatches - 1, _TIE_WEIGHT)
        self.best = free
        self.best_value = self.value(free)
        self.least_total = np.inf  # least f(T) over the bounds evaluated so far

    def consider(self, solution: _Solution | None) -> None:
        if solution is not None:
            self.least_total = min(self.least_total, solution.total)
            value = self.value(solution)
            if value < self.best_value:
                self.best, self.best_value = solution, value

    def value(self, solution: _Solution) -> float:
        return self.weight * solution.bottleneck + solution.total

    def ceiling(self) -> float:
        """No bound at or above this can beat the best found: (B-1)·T + f(∞) >= best."""
        return min((self.best_value - self.floor) / self.weight, self.best.bottleneck)

    def run(self) -> None:
        rows = np.unique(self.problem.prefix, axis=0)
        times = np.diff(rows, axis=1)
        # every layer runs somewhere, and the slowest stage is no faster than the average
        low = max(times.min(axis=0).max(), times.min(axis=0).sum() / self.problem.num_stages)
        while low < self.ceiling():
            high = _chunk_top(rows, low, self.ceiling())
            self._search(_candidates(rows, low, high))
            low = np.nextafter(high, np.inf)

    def _search(self, bounds: np.ndarray) -> None:
        """Search the sorted candidate ``bounds`` of one chunk."""
        # Every bound evaluated so far lies below this chunk and f does not increase, so the
        # least f met so far is an upper bound of f on the whole chunk.
        stack = [(0, len(bounds) - 1, self.floor, self.least_total)]
        while stack:
            lo, hi, f_low, f_high = stack.pop()  # f_low <= f(T) <= f_high on bounds[lo..hi]
            if lo > hi or f_high <= f_low * (1 + _REL_EPS):
                continue  # f is constant here: its best point was already evaluated below
            if self.weight * bounds[lo] + f_low >= self.best_value:
                continue
            mid = (lo + hi) // 2
            solution = _bounded_sum(self.problem, bounds[mid])
            self.consider(solution)
            f_mid = np.inf if solution is None else solution.total
            left_hi = mid - 1
            if solution is not None:  # f is constant on [realised max, bounds[mid]]
                left_hi = int(np.searchsorted(bounds, solution.bottleneck * (1 - _REL_EPS), "left")) - 1
                # the slack may let the realised max exceed the bound (costs near 1e-300):
                # never search mid again, or the loop would not end
                left_hi = min(left_hi, mid - 1)
            stack.append((mid + 1, hi, f_low, f_mid))
            stack.append((lo, left_hi, f_mid, f_high))


def _segment_ranges(prefix: np.ndarray, low: float, high: float):
    """For each start a: the ends b with prefix[b] - prefix[a] in [low, high]."""
    first = np.searchsorted(prefix, prefix + low * (1 - _REL_EPS), side="left")
    stop = np.searchsorted(prefix, prefix + high * (1 + _REL_EPS), side="right")
    return first, np.maximum(stop, first)


def _count(rows: np.ndarray, low: float, high: float) -> int:
    total = 0
    for prefix in rows:
        first, stop = _segment_ranges(prefix, low, high)
        total += int((stop - first).sum())
    return total


def _chunk_top(rows: np.ndarray, low: float, high: float) -> float:
    """A value in [low, high] so that [low, value] holds at most _CHUNK candidates (or high)."""
    while _count(rows, low, high) > _CHUNK and high > low * (1 + 1e-9):
        high = (low + high) / 2
    return high


def _candidates(rows: np.ndarray, low: float, high: float) -> np.ndarray:
    """Sorted distinct segment times (of any stage's row) in [low, high]."""
    parts = []
    for prefix in rows:
        first, stop = _segment_ranges(prefix, low, high)
        counts = stop - first
        total = int(counts.sum())
        if total == 0:
            continue
        starts = np.repeat(np.arange(len(prefix)), counts)
        offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        ends = np.repeat(first, counts) + offsets
        parts.append(prefix[ends] - prefix[starts])
    if not parts:
        return np.empty(0)
    values = np.unique(np.concatenate(parts))
    return values[(values >= low * (1 - _REL_EPS)) & (values <= high * (1 + _REL_EPS))]


# ---------------------------------------------------------------------------- results
def _assignment(problem: _Problem, solution: _Solution) -> LayerAssignment:
    times = tuple(_stage_times(problem, solution.starts))
    return LayerAssignment(solution.starts, times, solution.objective(problem.microbatches))


def _infeasible(problem: _Problem) -> PlanError:
    memory = np.diff(problem.mem_prefix, axis=1)
    caps = problem.mem_caps
    biggest = int(np.argmax(memory.min(axis=0) - caps.max()))
    if np.all(memory[:, biggest] > caps):
        detail = f"layer {biggest} alone needs more than any stage holds"
    else:
        detail = (f"the layers need at least {memory.min(axis=0).sum():.4g} in all; "
                  f"the stages hold {caps.sum():.4g}")
    return PlanError(f"no assignment of {problem.num_layers} layers to {problem.num_stages} stages fits "
                     f"in memory: {detail}. Use more stages or devices with more memory.")
