"""`plan`: price every strategy of the space and rank the ones that fit.

For each strategy (pp, tp, dp, micro-batches, device placement) the cost model turns the layers
into per-stage time rows, per-boundary cut costs and per-stage memory rows, and `assign_layers`
finds the exact best contiguous stage boundaries under the memory caps. The data-parallel
all-reduce is added afterwards (it depends on the boundaries only through each stage's parameter
count, and AMP adds it the same way).

The layers get finer as stages multiply: with ``pp`` stages a layer may hold at most
``1 / (4·pp)`` of the model (`layer_sequence`'s ``max_share``), so 8 equal blocks on 6 fast and 2
half-speed stages can be cut inside a block instead of leaving the slow stages idle. Tensor-parallel
strategies keep whole blocks: the cost model counts Megatron's all-reduces per block.

**Tensor parallelism as the runtime splits it.** A tree from `smpart.trace` records what the
swap-in's rule splits at each degree (`ModuleNode.tp_split`): the cost model divides only that by
``tp`` (time, parameter state, activations), prices the collectives those modules run, and a
degree that splits nothing (or that the tree has no record of) is not proposed at all. A tree
without records (built by hand) is priced as if every layer split evenly.

Strategies are priced in order of a cheap lower bound — every layer at its fastest stage, the
bottleneck at least the average — and a strategy whose bound cannot enter the top ``top`` (nor
beat the best plan of its own pp=1 / tp=1 / dp=1 baseline) is skipped without solving.

**Activation checkpointing, stage by stage.** A strategy whose plain assignment does not fit in
memory is tried again with checkpointing, as Galvatron decides it: per stage, without when the
stage fits, with (paying one more forward of its checkpointed layers) when it does not. The
stage flags and the boundaries depend on each other, so a handful of flag vectors are solved
exactly and the fastest kept: every stage checkpointed (the least memory: if that does not fit,
nothing does); then, repeatedly, the stages that fit without it under the last boundaries found
stop checkpointing; and, for a few stages, the first ``m`` stages checkpointed (1F1B keeps the
most micro-batches in flight on the first stages). A plan that fits without checkpointing never
gets it (the same strategy with it is only slower), so plans of models that fit are unchanged.
The lower bound used for pruning stays a bound: checkpointing only adds time.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from smpart.errors import PlanError
from smpart.planner.assign import LayerAssignment, assign_layers, evaluate_assignment
from smpart.planner.cluster import GIB, Cluster
from smpart.planner.cost import CostModel, CostOptions, StageDevices, StrategyCosts
from smpart.planner.layers import DEFAULT_MAX_SHARE, layer_sequence
from smpart.planner.plan import Plan, Plans
from smpart.planner.strategies import Strategy, enumerate_strategies
from smpart.tracing.tree import ModuleTree


def plan(
    tree: ModuleTree,
    cluster: Cluster,
    global_batch: int,
    *,
    top: int = 10,
    memory_weight: float = 0.8,
    max_share: float = DEFAULT_MAX_SHARE,
    tp_degrees: list[int] | None = None,
    max_microbatches: int | None = None,
    virtual_stages: bool = False,
    options: CostOptions | None = None,
    **cost_options: object,
) -> Plans:
    """Rank the parallel strategies of ``tree`` on ``cluster`` for ``global_batch`` samples per step.

    ``cost_options`` are `CostOptions` fields (``trace_batch``, ``bytes_per_param``,
    ``efficiency``, ``pipeline``, ...). ``virtual_stages``: also price each 1F1B pipeline over two
    stages per rank (`Config.virtual_stages`). Raises `PlanError` when no strategy fits in memory, naming
    the stage that overflows least badly and by how much.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global_batch must be an int >= 1, got {global_batch!r}")
    if top < 1:
        raise PlanError(f"top must be >= 1, got {top}")
    options = _options(options, cost_options)
    started = time.perf_counter()
    models = _CostModels(tree, cluster, options, max_share)
    candidates = []
    for strategy in enumerate_strategies(cluster, len(tree), global_batch, tp_degrees=tp_degrees,
                                         max_microbatches=max_microbatches):
        model = models.get(strategy.pp, strategy.tp)
        if strategy.pp > len(model.layers) or not model.splits(strategy.tp):
            continue
        costs = model.strategy(list(strategy.stages), strategy.tp, strategy.microbatch_size,
                               strategy.microbatches)
        bound = _lower_bound(costs, strategy.microbatches) + model.fixed_overhead(strategy.pp,
                                                                                strategy.microbatches)
        candidates.append((bound, strategy, costs, model))
    if not candidates:
        raise PlanError(f"no strategy splits {cluster.num_devices} devices for a global batch of "
                        f"{global_batch}: it must be divisible by some data-parallel degree")
    candidates.sort(key=lambda item: item[0])

    ranking = _Ranking(top)
    infeasible: list[tuple[Strategy, StrategyCosts]] = []
    for bound, strategy, costs, model in candidates:
        if not ranking.worth_pricing(bound, strategy):
            continue
        assignment = _assign(costs, strategy)
        if assignment is None and model.can_checkpoint:
            worth = ranking.bound_check(strategy, model)
            assignment, costs = _with_checkpointing(strategy, costs, model, worth)
        if assignment is None:
            infeasible.append((strategy, costs))
            continue
        sync = _sync(model, strategy, assignment)
        pipeline = assignment.objective + model.fixed_overhead(strategy.pp, strategy.microbatches)
        plan_ = Plan(
            strategy.pp, strategy.tp, strategy.dp, strategy.microbatches, strategy.microbatch_size,
            strategy.stages, assignment.starts, pipeline + sync, pipeline, sync,
            assignment.stage_times, tuple(costs.stage_memory(assignment.starts)), model.layers,
            memory_weight, options.pipeline, costs.checkpointed if any(costs.checkpointed) else (),
            costs.replica_sizes,
        )
        ranking.add(plan_)
        if virtual_stages and options.pipeline == "interleaved":  # 1f1b: also over virtual stages
            interleaved = _interleaved(plan_, assignment.objective, model)
            if interleaved is not None:
                ranking.add(interleaved)
    if not ranking.plans:
        raise _nothing_fits(infeasible, cluster)
    return Plans(ranking.ranked(), cluster.num_devices, len(candidates), time.perf_counter() - started,
                 ranking.baselines)


def price(plan: Plan, cluster: Cluster, options: CostOptions | None = None, **cost_options: object) -> Plan:
    """``plan`` as it would run on ``cluster``: the same degrees, micro-batches, stage boundaries,
    activation checkpointing and replica batch sizes, each of the plan's devices replaced by the
    device of ``cluster`` with the same number (`Device.rank`, counted node by node). What a plan
    made for other devices, say made believing them identical, costs on the devices it really
    runs on."""
    if cluster.num_devices != len(plan.rank_devices):
        raise PlanError(f"the plan runs on {len(plan.rank_devices)} devices, the cluster has "
                        f"{cluster.num_devices}")
    options = _options(options, cost_options)
    devices = list(cluster.devices())
    stages = tuple(StageDevices(tuple(tuple(devices[d.rank] for d in replica) for replica in stage.replicas))
                   for stage in plan.stages)
    model = CostModel(plan.layers, cluster, options)
    costs = model.strategy(list(stages), plan.tp, plan.microbatch_size, plan.microbatches,
                           replica_sizes=plan.replica_sizes or None)
    if plan.checkpointed:
        everywhere = model.strategy(list(stages), plan.tp, plan.microbatch_size, plan.microbatches,
                                    checkpointed=True, replica_sizes=plan.replica_sizes or None)
        costs = costs.mixed(everywhere, plan.checkpointed)
    assignment = evaluate_assignment(costs.layer_times, plan.starts, plan.microbatches, costs.cut_costs)
    pipeline = assignment.objective + model.fixed_overhead(plan.pp, plan.microbatches)
    sync = max(model.dp_sync_time(list(stages), plan.starts, plan.tp))
    return dataclasses.replace(plan, stages=stages, time_s=pipeline + sync, pipeline_s=pipeline,
                               dp_sync_s=sync, stage_times=assignment.stage_times,
                               stage_memory=tuple(costs.stage_memory(plan.starts)))


def _interleaved(plan: Plan, objective: float, model: CostModel) -> Plan | None:
    """``plan`` over virtual stages (`Config.virtual_stages` = 2: each rank runs two stages of half
    its work, interleaved as torch's ``Interleaved1F1B``): the pipeline's fill and drain, the sum of
    the stage times, shrink by half, at the price of twice the cuts a micro-batch crosses and twice
    the per-stage overhead through the pipeline; the steady state is unchanged. Priced on the same
    boundaries (the runtime cuts ``2 pp`` balanced stages of its own), on identical devices only,
    with the memory of the plan it derives from."""
    if plan.pp < 2 or len(plan.layers) < 2 * plan.pp or plan.mixed or plan.checkpointed:
        return None
    times = plan.stage_times
    fill = sum(times)
    cuts = max(0.0, objective - (plan.microbatches - 1) * max(times) - fill)
    pipeline = ((plan.microbatches - 1) * max(times) + fill / 2 + 2 * cuts
                + model.fixed_overhead(2 * plan.pp, plan.microbatches))
    return dataclasses.replace(plan, time_s=pipeline + plan.dp_sync_s, pipeline_s=pipeline, virtual_stages=2)


def _assign(costs: StrategyCosts, strategy: Strategy) -> LayerAssignment | None:
    """The best boundaries of ``strategy`` under its memory caps, None when nothing fits."""
    try:
        return assign_layers(costs.layer_times, strategy.pp, strategy.microbatches, cut_costs=costs.cut_costs,
                             layer_memory=costs.layer_memory, stage_memory=1.0)
    except PlanError:
        return None


def _sync(model: CostModel, strategy: Strategy, assignment: LayerAssignment) -> float:
    return max(model.dp_sync_time(list(strategy.stages), assignment.starts, strategy.tp))


#: Up to this many stages, every "first m stages checkpoint" vector is solved too.
PREFIX_STAGES = 8


def _with_checkpointing(strategy: Strategy, plain: StrategyCosts, model: CostModel,
                        worth: Callable[[StrategyCosts], bool],
                        ) -> tuple[LayerAssignment | None, StrategyCosts]:
    """The fastest assignment of ``strategy`` with checkpointing on some stages (module docstring),
    and its costs; (None, every stage checkpointed) when even that does not fit or could not rank.

    Every stage checkpointed keeps the least memory (a layer is only checkpointed when that keeps
    fewer bytes): when it does not fit, nothing does. Other flag vectors are solved only when
    ``worth`` says their lower bound could still enter the ranking.
    """
    everywhere = model.strategy(list(strategy.stages), strategy.tp, strategy.microbatch_size,
                                strategy.microbatches, checkpointed=True)
    k = strategy.pp
    solved: dict[tuple[bool, ...], tuple[LayerAssignment | None, StrategyCosts]] = {}

    def solve(flags: tuple[bool, ...], always: bool = False) -> LayerAssignment | None:
        if flags not in solved:
            costs = everywhere if all(flags) else plain.mixed(everywhere, flags)
            solved[flags] = (_assign(costs, strategy) if always or worth(costs) else None, costs)
        return solved[flags][0]

    flags = (True,) * k
    if solve(flags, always=True) is None:
        return None, everywhere
    while True:  # stages that fit without checkpointing under the last boundaries stop using it
        relaxed = tuple(f and not fits for f, fits in zip(flags, _fits(plain, solved[flags][0]), strict=True))
        if relaxed == flags or solve(relaxed) is None:
            break
        flags = relaxed
    if k <= PREFIX_STAGES:
        for m in range(1, k):
            solve((True,) * m + (False,) * (k - m))
    feasible = [(assignment.objective + _sync(model, strategy, assignment), i, assignment, costs)
                for i, (assignment, costs) in enumerate(solved.values()) if assignment is not None]
    _, _, assignment, costs = min(feasible, key=lambda item: item[:2])
    return assignment, costs


def _fits(costs: StrategyCosts, assignment: LayerAssignment) -> list[bool]:
    """Per stage: whether its layers fit under ``costs`` (the test `assign_layers` applies)."""
    bounds = [*assignment.starts, costs.layer_memory.shape[1]]
    return [costs.layer_memory[j, bounds[j]:bounds[j + 1]].sum() <= 1.0 + 1e-12
            for j in range(len(assignment.starts))]


def _options(options: CostOptions | None, overrides: dict[str, object]) -> CostOptions:
    known = {f.name for f in fields(CostOptions)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise PlanError(f"unknown plan option(s) {unknown}; cost options are {sorted(known)}")
    base = options or CostOptions()
    return CostOptions(**{**{f.name: getattr(base, f.name) for f in fields(CostOptions)}, **overrides})


class _CostModels:
    """One `CostModel` per layer granularity: ``max_share`` for tensor-parallel strategies, finer
    (at most ``1 / (4·pp)`` of the model per layer) for pipelines of many stages."""

    def __init__(self, tree: ModuleTree, cluster: Cluster, options: CostOptions, max_share: float) -> None:
        self.tree, self.cluster, self.options, self.max_share = tree, cluster, options, max_share
        self.by_share: dict[float, CostModel] = {}

    def get(self, pp: int, tp: int) -> CostModel:
        share = self.max_share if tp > 1 else min(self.max_share, 1 / (4 * pp))
        if share not in self.by_share:
            self.by_share[share] = CostModel(layer_sequence(self.tree, share), self.cluster, self.options)
        return self.by_share[share]


def _lower_bound(costs: StrategyCosts, microbatches: int) -> float:
    fastest = costs.layer_times.min(axis=0)
    bottleneck = max(fastest.max(), fastest.sum() / costs.layer_times.shape[0])
    return (microbatches - 1) * bottleneck + fastest.sum()


@dataclass
class _Ranking:
    """The ``top`` fastest plans so far, plus the best plan of each baseline family."""

    top: int

    def __post_init__(self) -> None:
        self.heap: list[tuple[float, int, Plan]] = []  # max-heap by time (negated)
        self.baselines: dict[str, Plan] = {}
        self.count = 0

    @staticmethod
    def families(pp: int, tp: int, dp: int) -> list[str]:
        return [name for name, ok in (("pp=1", pp == 1), ("tp=1", tp == 1), ("dp=1", dp == 1)) if ok]

    def worth_pricing(self, bound: float, strategy: Strategy) -> bool:
        if len(self.heap) < self.top or bound < -self.heap[0][0]:
            return True
        return any(family not in self.baselines or bound < self.baselines[family].time_s
                   for family in self.families(strategy.pp, strategy.tp, strategy.dp))

    def bound_check(self, strategy: Strategy, model: CostModel) -> Callable[[StrategyCosts], bool]:
        """Whether costs of ``strategy`` could still enter the ranking, by their lower bound."""
        overhead = model.fixed_overhead(strategy.pp, strategy.microbatches)

        def worth(costs: StrategyCosts) -> bool:
            return self.worth_pricing(_lower_bound(costs, strategy.microbatches) + overhead, strategy)

        return worth

    def add(self, plan: Plan) -> None:
        for family in self.families(plan.pp, plan.tp, plan.dp):
            if family not in self.baselines or plan.time_s < self.baselines[family].time_s:
                self.baselines[family] = plan
        self.count += 1
        item = (-plan.time_s, -self.count, plan)
        if len(self.heap) < self.top:
            heapq.heappush(self.heap, item)
        elif plan.time_s < -self.heap[0][0]:
            heapq.heapreplace(self.heap, item)

    @property
    def plans(self) -> list[Plan]:
        return [item[2] for item in self.heap]

    def ranked(self) -> list[Plan]:
        return [item[2] for item in sorted(self.heap, key=lambda item: (-item[0], -item[1]))]


def _nothing_fits(infeasible: list[tuple[Strategy, StrategyCosts]], cluster: Cluster) -> PlanError:
    """Say which stage of the least-overflowing strategy would overflow, and by how much."""
    worst_best = None
    for strategy, costs in infeasible:
        assignment = assign_layers(costs.layer_times, strategy.pp, strategy.microbatches,
                                   cut_costs=costs.cut_costs)
        memory = costs.stage_memory(assignment.starts)
        ratios = [used / budget for used, budget in memory]
        stage = int(np.argmax(ratios))
        if worst_best is None or ratios[stage] < worst_best[0]:
            worst_best = (ratios[stage], strategy, stage, memory[stage], costs)
    ratio, strategy, stage, (used, budget), costs = worst_best
    where = strategy.stages[stage].describe()
    checkpointing = " even with activation checkpointing on every stage," if any(costs.checkpointed) else ""
    return PlanError(
        f"no plan fits in memory on {cluster.describe()}. The closest, pp={strategy.pp} tp={strategy.tp} "
        f"dp={strategy.dp} with {strategy.microbatches} micro-batches of {strategy.microbatch_size},"
        f"{checkpointing} still overflows stage {stage} ({where}): it needs {used / GIB:.3g} GiB per device, "
        f"{(used - budget) / GIB:.3g} GiB over its usable {budget / GIB:.3g} GiB ({ratio:.0%}). "
        "Add devices, use devices with more memory, or lower bytes_per_param / the batch size."
    )
