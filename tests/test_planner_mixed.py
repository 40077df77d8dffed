"""The planner's plans for mixed clusters carry what runs them, and run as planned.

A plan on devices of two types records, in ``plan.config``, each rank's device type (which
``init`` checks), the uneven layer split (pins) and each replica's batch share; `Plan.launch_order`
says which node to launch first; `price` reprices a plan on other devices (what a plan made for
identical devices costs on mixed ones). On 4 processes, a mixed plan's own config, fed by
`smpart.ReplicaBatchSampler`, trains like the unsplit model on the global batch.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import smpart
from smpart.devices import GIB, DeviceType, device_spec
from smpart.planner import Cluster, Node, plan, price
from smpart.planner.cluster import GBPS
from tests.launch import run_ranks, values
from tests.test_planner import uniform_tree
from tests.test_processes_3d import _example
from tests.test_runtime import train_step

FAST = DeviceType("fast", 200.0, 80 * GIB)
SLOW = DeviceType("slow", 100.0, 80 * GIB)


def two_and_two(slow_first: bool = False) -> Cluster:
    nodes = [Node(FAST, 2, 100 * GBPS), Node(SLOW, 2, 100 * GBPS)]
    return Cluster(nodes[::-1] if slow_first else nodes, 10 * GBPS)


def best_of(plans, pp: int, tp: int, dp: int):
    return next(p for p in plans if (p.pp, p.tp, p.dp) == (pp, tp, dp))


def test_a_pipeline_on_mixed_devices_gives_the_slow_stages_fewer_layers():
    plans = plan(uniform_tree(16), two_and_two(), 32, top=200)
    pipeline = best_of(plans, 4, 1, 1)
    kinds = [stage.devices[0].type for stage in pipeline.stages]
    counts = [b - a for a, b in zip(pipeline.starts, [*pipeline.starts[1:], 16], strict=True)]
    assert all(c_fast > c_slow for c_fast, k_fast in zip(counts, kinds, strict=True) if k_fast == FAST
               for c_slow, k_slow in zip(counts, kinds, strict=True) if k_slow == SLOW), (counts, kinds)
    config = pipeline.config
    assert config.device_types == [device_spec(k) for k in kinds]
    stage_of = {name: stage for name, stage in config.pin.items()}
    assert sorted(stage_of.values()) == sorted(j for j, c in enumerate(counts) for _ in range(c))
    assert config.data_parallel_shares is None  # one replica


def test_replicas_on_mixed_devices_take_batch_shares_by_speed():
    plans = plan(uniform_tree(16), two_and_two(), 48, top=500)
    replicas = next(p for p in plans if (p.pp, p.tp, p.dp) == (1, 1, 4) and p.microbatch_size % 3 == 0)
    kinds = [d.type for d in replicas.rank_devices]
    sizes = replicas.replica_sizes
    assert sum(sizes) == 4 * replicas.microbatch_size
    for size, kind in zip(sizes, kinds, strict=True):  # the fast replicas take twice the slow ones'
        assert size == (2 if kind == FAST else 1) * 4 * replicas.microbatch_size // 6
    assert replicas.config.data_parallel_shares == list(sizes)
    assert replicas.config.device_types == [device_spec(k) for k in kinds]
    smpart.Config.from_any(replicas.config.to_dict())  # a plain dict round trip (what init checks)


def test_the_launch_order_follows_the_plan_not_the_cluster_file():
    plans = plan(uniform_tree(16), two_and_two(slow_first=True), 32, top=200)
    for candidate in plans:
        first_type = candidate.rank_devices[0].type
        assert candidate.launch_order[0] == (1 if first_type == FAST else 0)
        assert candidate.to_dict()["launch_order"] == candidate.launch_order


def test_a_plan_repriced_on_its_own_cluster_costs_what_it_was_priced():
    plans = plan(uniform_tree(16), two_and_two(), 32, top=30)
    for candidate in plans:
        again = price(candidate, two_and_two())
        assert again.time_s == pytest.approx(candidate.time_s, rel=1e-9), candidate.summary()


def test_a_plan_for_identical_devices_is_slower_on_mixed_ones_than_the_mixed_plan():
    tree = uniform_tree(16)
    alike = Cluster([Node(FAST, 2, 100 * GBPS), Node(FAST, 2, 100 * GBPS)], 10 * GBPS)
    uniform = plan(tree, alike, 32).best
    mixed = plan(tree, two_and_two(), 32).best
    on_mixed = price(uniform, two_and_two())
    assert on_mixed.time_s > 1.3 * mixed.time_s
    assert mixed.mixed and not uniform.mixed and uniform.config.device_types is None


# ==================================================================== on 4 processes
def _run_mixed_plans(rank: int) -> list[tuple[str, float]]:
    """Every rank plans alike, declares the type its plan puts on it, and trains 2 steps."""
    example = _example("zoo_gpt2")
    args, kwargs, target = example.batch(12, seed=0)
    tree = smpart.trace(example.model, tuple(args), kwargs)
    plans = plan(tree, two_and_two(), global_batch=12, top=200)
    chosen = [best_of(plans, 2, 1, 2), next(p for p in plans if p.pp == 1 and p.data_parallel_shares)]
    report = []
    for chosen_plan in chosen:
        config = chosen_plan.config
        os.environ["SMPART_DEVICE_TYPE"] = config.device_types[rank]["name"]
        smpart.init(config, timeout_s=60)
        example = _example("zoo_gpt2")
        reference = copy.deepcopy(example.model)
        model = smpart.DistributedModel(example.model)
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step, indices in enumerate(smpart.ReplicaBatchSampler(24, 12)):
            args, _, target = example.batch(12, seed=step)
            mine = torch.tensor(indices) - 12 * step
            train_step(model, example, [a[mine] for a in args], {}, target[mine])
            example.loss(reference(*args), target).backward()
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.zero_grad()
        full = model.state_dict()
        worst = max((full[k] - v).abs().max().item() for k, v in reference.named_parameters())
        report.append((chosen_plan.summary(), worst))
        smpart.shutdown()
    return report


@pytest.mark.timeout(300)
def test_mixed_plans_run_as_planned_on_four_processes():
    for report in values(run_ranks(_run_mixed_plans, 4, timeout_s=290)):
        for summary, worst in report:
            assert worst <= 1e-6, (summary, worst)
        assert ":" in report[1][0], report  # the second plan's replicas take unequal shares
