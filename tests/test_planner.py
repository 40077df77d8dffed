"""The planner: clusters, layers ↔ partitions, the cost model's guarantees and the search."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from smpart.config import Config
from smpart.errors import ConfigError, PlanError
from smpart.planner import Cluster, CostOptions, Node, StageDevices, assign_layers, device_type, plan
from smpart.planner.cluster import GBPS, GBS, GIB, DeviceType
from smpart.planner.cost import CostModel
from smpart.planner.layers import layer_sequence
from smpart.tracing.tree import DataEdge, ModuleTree, SplitShare


def gpt_tree(n_layer: int = 8, hidden: int = 1024, seq: int = 1024, vocab: int = 50257,
             heads: int = 16) -> ModuleTree:
    """A GPT-shaped tree of plain numbers, costs for one sample (Megatron's formulas; a block
    saves 34·s·h + 5·a·s² bytes for backward, its MLP's output is all it returns besides)."""
    block_params = 12 * hidden * hidden
    blocks = [
        {"name": f"h.{i}", "class_name": "Block", "param_count": block_params,
         "param_bytes": 4 * block_params, "activation_bytes": 2 * seq * hidden,
         "saved_bytes": 34 * seq * hidden + 5 * heads * seq * seq,
         "flops": 24 * seq * hidden * hidden + 4 * seq * seq * hidden,
         "children": [{"name": f"h.{i}.mlp", "activation_bytes": 16 * seq * hidden}]}
        for i in range(n_layer)
    ]
    spec = {"name": "", "children": [
        {"name": "wte", "param_count": vocab * hidden, "param_bytes": 4 * vocab * hidden,
         "activation_bytes": 2 * seq * hidden, "flops": 2 * seq * hidden * vocab},
        {"name": "h", "class_name": "ModuleList", "call_count": 0, "children": blocks},
        {"name": "ln_f", "param_count": 2 * hidden, "param_bytes": 8 * hidden,
         "activation_bytes": 2 * seq * hidden, "flops": 5 * seq * hidden},
    ]}
    names = ["wte", *[f"h.{i}" for i in range(n_layer)], "ln_f"]
    edges = [DataEdge(a, b, 2 * seq * hidden) for a, b in zip(names, names[1:], strict=False)]
    return ModuleTree.from_spec(spec, edges=edges)


def uniform_tree(n_layer: int, flops: float = 1e12, params: int = 1_000_000) -> ModuleTree:
    spec = {"name": "", "children": [
        {"name": f"layer{i}", "flops": flops, "param_count": params, "param_bytes": 4 * params,
         "activation_bytes": 1 << 20} for i in range(n_layer)]}
    return ModuleTree.from_spec(spec)


# ---------------------------------------------------------------------------- cluster
CLUSTER_TOML = """
inter_node_gbps = 10
[device.Fast]
tflops = 200
memory_gib = 40
memory_gbs = 1000
[[node]]
device = "A100-80"
count = 1
intra_node_gbps = 600
[[node]]
device = "v100"
count = 2
[[node]]
device = "Fast"
count = 4
intra_node_gbps = 300
[[link]]
nodes = [0, 2]
gbps = 25
"""


def test_cluster_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER_TOML)
    cluster = Cluster.from_toml(path)
    assert [n.count for n in cluster.nodes] == [1, 2, 4] and cluster.num_devices == 7
    assert cluster.nodes[1].device == device_type("V100")
    assert cluster.nodes[2].device == DeviceType("Fast", 200.0, 40 * GIB, 1000 * GBS)
    assert cluster.bandwidth(0, 2) == cluster.bandwidth(2, 0) == 25 * GBPS
    assert cluster.bandwidth(0, 1) == 10 * GBPS and cluster.bandwidth(2, 2) == 300 * GBPS
    assert cluster.slowest_link([0, 1, 2]) == 10 * GBPS


@pytest.mark.parametrize("text, key", [
    ("[[node]]\ndevice = 'T4'\ncount = 0\n", "node[0].count"),
    ("[[node]]\ndevice = 'Q9000'\n", "node[0].device"),
    ("[[node]]\ndevice = 'T4'\nintra_node_gbps = -3\n", "node[0].intra_node_gbps"),
    ("[[node]]\ndevice = 'T4'\ncolour = 'red'\n", "node[0].colour"),
    ("inter_node_gbps = 'fast'\n[[node]]\ndevice = 'T4'\n", "inter_node_gbps"),
    ("[device.X]\ntflops = 1\n[[node]]\ndevice = 'X'\n", "device.X.memory_gib"),
    ("[device.X]\ntflops=1\nmemory_gib=1\nmemory_gbs=0\n[[node]]\ndevice = 'X'\n", "device.X.memory_gbs"),
    ("[device.X]\ntflops = 1\nmemory_gib = 1\nspeed = 2\n[[node]]\ndevice = 'X'\n", "device.X.speed"),
    ("[[node]]\ndevice = 'T4'\n[[link]]\nnodes = [0, 5]\ngbps = 1\n", "link[0].nodes"),
    ("nodes = 3\n", "nodes"),
    ("", "node"),
    ("[[node]\ndevice = 'T4'\n", "line 1"),
])
def test_bad_cluster_file_names_the_key(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        Cluster.from_toml(path)


def test_example_cluster_file_loads():
    cluster = Cluster.from_toml(Path(__file__).resolve().parents[1] / "examples" / "cluster.toml")
    assert cluster.num_devices == 16 and {n.device.name for n in cluster.nodes} == {"V100", "T4"}


def test_local_cluster_describes_this_machine():
    cluster = Cluster.local()
    assert cluster.num_devices >= 1 and cluster.nodes[0].device.memory_bytes > 0


# ---------------------------------------------------------------------------- layers
def test_layers_are_blocks_and_map_back_to_a_full_partition():
    tree = gpt_tree(n_layer=8)
    layers = layer_sequence(tree)
    assert layers.names == ["wte", *[f"h.{i}" for i in range(8)], "ln_f"]
    assert layers.cut_bytes.tolist() == [2 * 1024 * 1024] * 9
    stages = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    part = layers.partition(stages, 3)
    assert {n.name for n in tree.nodes()} == set(part.node_stage)
    assert part.stage_of("h.1.mlp") == 0 and part.stage_of("h.5.mlp") == 1
    assert part.stage_of("h") == 0  # an opened container follows its first-called child
    assert part.stage_of("") == 0
    # pins name every layer and opened parent, so a runtime honouring them gets this partition
    pins = layers.pins(stages)
    assert pins["h.6"] == 2 and pins["h"] == 0 and Config(pipeline_parallel_degree=3, pin=pins)


def test_parent_cost_is_charged_to_its_first_child_layer():
    spec = {"name": "", "children": [
        {"name": "a", "param_count": 10, "param_bytes": 40, "flops": 5.0, "children": [
            {"name": "a.x", "flops": 1.0}, {"name": "a.y", "flops": 1.0}]},
        {"name": "b", "flops": 1.0}]}
    tree = ModuleTree.from_spec(spec)
    layers = layer_sequence(tree, max_share=0.1)
    assert layers.names == ["a.x", "a.y", "b"]
    assert layers.compute.tolist() == [6.0, 1.0, 1.0] and layers.param_count.tolist() == [10, 0, 0]


# ---------------------------------------------------------------------------- search
def homogeneous(nodes: int, per_node: int, kind: str = "A100-80") -> Cluster:
    return Cluster.homogeneous(kind, nodes, per_node, intra_gbps=2400, inter_gbps=200)


def test_every_plan_uses_every_device_and_fits():
    tree = gpt_tree(n_layer=12)
    cluster = Cluster([Node(device_type("V100"), 4, 170 * GBPS) for _ in range(3)]
                      + [Node(device_type("T4"), 4, 50 * GBPS)], 10 * GBPS)
    plans = plan(tree, cluster, 32, top=50, bytes_per_param=16.0)
    assert len(plans) > 10
    for p in plans:
        assert p.pp * p.tp * p.dp == cluster.num_devices
        ranks = sorted(d.rank for s in p.stages for d in s.devices)
        assert ranks == list(range(cluster.num_devices))
        assert p.microbatches * p.microbatch_size * p.dp == 32
        assert all(used <= budget * (1 + 1e-9) for used, budget in p.stage_memory)
        assert p.config.pipeline_parallel_degree == p.pp and p.config.data_parallel_degree == p.dp
    times = [p.time_s for p in plans]
    assert times == sorted(times)


@pytest.mark.parametrize("saved", [0, 3 << 20])
def test_predicted_memory_matches_an_independent_count(saved):
    tree = uniform_tree(8, params=10_000_000)
    for node in tree.root.children:
        node.saved_bytes = saved
    tree.activation_memory = "saved" if saved else "outputs"
    kept = saved or 1 << 20  # what autograd saves when known, else the outputs
    cluster = homogeneous(1, 4)
    best = plan(tree, cluster, 8, tp_degrees=[1], bytes_per_param=16.0, pipeline="simple").best
    per_stage_layers = [len(best.partition.modules_on(j)) - (1 if j == 0 else 0) for j in range(best.pp)]
    for j, count in enumerate(per_stage_layers):
        activation = count * kept * best.microbatch_size * best.microbatches  # all in flight
        assert best.stage_memory[j][0] == pytest.approx(count * 10_000_000 * 16 + activation)


def test_homogeneous_equal_layers_split_uniformly():
    plans = plan(uniform_tree(16), homogeneous(1, 4), 64, tp_degrees=[1], top=50)
    four = [p for p in plans if p.pp == 4]
    assert four and all(p.starts == (0, 4, 8, 12) for p in four)


def test_faster_gpus_get_more_layers():
    cluster = Cluster([Node(device_type("H100"), 1, 300 * GBPS), Node(device_type("T4"), 1, 300 * GBPS)],
                      100 * GBPS)
    plans = plan(uniform_tree(20), cluster, 16, top=50)
    two = next(p for p in plans if p.pp == 2)
    counts = {s.devices[0].type.name: n for s, n in zip(two.stages, _counts(two), strict=True)}
    assert counts["H100"] > 3 * counts["T4"]


def test_many_stages_cut_inside_blocks_so_slow_devices_share_the_work():
    """8 equal blocks on 6 fast and 2 half-speed devices: whole blocks force a 2-block bottleneck
    (a slow stage with one block, or a fast one with two); halves of blocks allow 1.5."""
    blocks = [{"name": f"h{i}", "children": [{"name": f"h{i}.attn", "flops": 1e12},
                                             {"name": f"h{i}.mlp", "flops": 1e12}]} for i in range(8)]
    half = DeviceType("Half", device_type("A100-80").tflops / 2, 80 * GIB)
    cluster = Cluster([Node(device_type("A100-80"), 6, 600 * GBPS), Node(half, 2, 600 * GBPS)], 100 * GBPS)
    plans = plan(ModuleTree.from_spec({"name": "", "children": blocks}), cluster, 8, tp_degrees=[1], top=1000)
    eight = next(p for p in plans if p.pp == 8)
    block_on_fast = 2e12 * (1 + CostOptions().backward_factor) / (312e12 * 0.4) * eight.microbatch_size
    assert max(eight.stage_times) == pytest.approx(1.5 * block_on_fast)
    assert all(t > 0.4 * block_on_fast for t in eight.stage_times)  # no stage left idle


def _counts(p):
    bounds = [*p.starts, len(p.layers)]
    return [bounds[j + 1] - bounds[j] for j in range(p.pp)]


def test_plan_partition_is_consistent_with_its_layers():
    tree = gpt_tree(n_layer=8)
    best = plan(tree, homogeneous(1, 4), 32).best
    part = best.partition
    assert part.num_stages == best.pp
    for name, stage in best.config.pin.items():
        assert part.stage_of(name) == stage


def test_plan_partition_carries_each_stages_devices_and_capacity():
    """The explorer draws a plan's stages against their devices: one replica of a stage is a
    tensor-parallel group, holding the stage split tp ways, so its capacity is tp × a device's budget."""
    cluster = Cluster([Node(device_type("A100-40"), 2, 600 * GBPS), Node(device_type("T4"), 2, 50 * GBPS)],
                      10 * GBPS)
    plans = plan(gpt_tree(n_layer=8, hidden=512, seq=256), cluster, 8, top=1000)
    for p in (next(p for p in plans if p.tp == 2 and p.pp == 2), next(p for p in plans if p.pp == 4)):
        meta = p.partition.meta
        expected = [0.9 * p.tp * min(d.type.memory_bytes for d in s.devices) for s in p.stages]
        assert meta["device_memory"] == pytest.approx(expected)
        assert len(meta["device_names"]) == p.pp
        for name, stage in zip(meta["device_names"], p.stages, strict=True):
            assert stage.devices[0].type.name in name and (f"tp={p.tp}" in name) == (p.tp > 1)


def test_best_plan_beats_the_search_space_exhaustively():
    """Every strategy priced by hand (cost model + brute force) is no faster than the best plan."""
    tree = gpt_tree(n_layer=6, hidden=512, seq=256)
    cluster = Cluster([Node(device_type("V100"), 2, 170 * GBPS), Node(device_type("T4"), 2, 50 * GBPS)],
                      10 * GBPS)
    plans = plan(tree, cluster, 8, top=1000)
    from smpart.planner.strategies import enumerate_strategies

    model = CostModel(layer_sequence(tree), cluster, CostOptions())
    fastest = float("inf")
    for s in enumerate_strategies(cluster, len(model.layers), 8):
        costs = model.strategy(list(s.stages), s.tp, s.microbatch_size, s.microbatches)
        try:
            a = assign_layers(costs.layer_times, s.pp, s.microbatches, costs.cut_costs,
                              layer_memory=costs.layer_memory, stage_memory=1.0)
        except PlanError:
            continue
        fastest = min(fastest, a.objective + max(model.dp_sync_time(list(s.stages), a.starts, s.tp)))
    assert plans.best.time_s == pytest.approx(fastest)


def test_model_too_big_names_stage_and_overflow():
    tree = uniform_tree(4, params=2_000_000_000)  # 8e9 params × 16 B = 128 GB on 4 × 16 GiB
    with pytest.raises(PlanError, match=r"overflows stage \d .*GiB over its usable"):
        plan(tree, homogeneous(1, 4, "V100"), 4)


def test_saved_activations_overflow_a_plan_that_fit_by_outputs():
    """A layer returns 2 MiB per sample but autograd keeps 20 GiB of it for backward (a block's
    attention scores and MLP hidden states are saved, never returned). Priced by its outputs the
    model fits on 4 × 80 GiB; priced by what training keeps alive, no plan does."""
    spec = {"name": "", "children": [
        {"name": f"layer{i}", "flops": 1e12, "param_count": 10**9, "param_bytes": 4 * 10**9,
         "activation_bytes": 2 << 20, "saved_bytes": 20 * GIB} for i in range(4)]}
    by_outputs = ModuleTree.from_spec(spec, activation_memory="outputs")
    by_saved = ModuleTree.from_spec(spec)
    assert by_saved.activation_memory == "saved"
    options = {"tp_degrees": [1], "bytes_per_param": 16.0}
    assert plan(by_outputs, homogeneous(1, 4), 4, **options).best
    # every strategy: some device holds >= 4 layer-samples in flight (pp = 4: stage 0 holds four
    # micro-batches; pp = 1: four layers), 80 GiB before any parameter
    with pytest.raises(PlanError, match=r"overflows stage \d .*GiB over its usable"):
        plan(by_saved, homogeneous(1, 4), 4, **options)


def test_memory_bound_layers_are_priced_by_memory_bandwidth():
    """A roofline: a layer takes the longer of its FLOPs at the device's speed and its memory
    traffic (twice the bytes its ops write, forward and backward) at the device's bandwidth."""
    tree = ModuleTree.from_spec({"name": "", "children": [
        {"name": "dense", "flops": 1e12, "op_bytes": 10**6},  # 10⁶ FLOPs per byte: compute-bound
        {"name": "narrow", "flops": 1e9, "op_bytes": 10**9}]})  # 1 FLOP per byte: memory-bound
    layers = layer_sequence(tree)
    assert layers.names == ["dense", "narrow"]
    fwd_bwd = 1 + CostOptions().backward_factor
    for kind, bandwidth in ((device_type("V100"), 900e9), (DeviceType("NoBandwidth", 125.0, 16 * GIB), None)):
        cluster = Cluster([Node(kind, 1, 300 * GBPS)])
        stage = StageDevices(((next(cluster.devices()),),))
        times = CostModel(layers, cluster).strategy([stage], 1, 1, 1).layer_times[0]
        assert times[0] == pytest.approx(1e12 * fwd_bwd / (125e12 * 0.4))
        expected = 2 * 1e9 * fwd_bwd / (bandwidth * 0.7) if bandwidth else 1e9 * fwd_bwd / (125e12 * 0.4)
        assert times[1] == pytest.approx(expected)


def test_roofline_is_taken_per_module_whatever_the_layer_granularity():
    """A memory-bound attention beside a compute-bound MLP costs the sum of their own rooflines,
    whether the block is one layer or two."""
    tree = ModuleTree.from_spec({"name": "", "children": [
        {"name": "block", "children": [{"name": "block.attn", "flops": 1e9, "op_bytes": 10**9},
                                       {"name": "block.mlp", "flops": 1e12, "op_bytes": 10**6}]},
        {"name": "head", "flops": 1e12}]})
    cluster = Cluster([Node(device_type("V100"), 1, 300 * GBPS)])
    stage = StageDevices(((next(cluster.devices()),),))
    fwd_bwd = 1 + CostOptions().backward_factor
    attn, mlp = 2 * 1e9 * fwd_bwd / (900e9 * 0.7), 1e12 * fwd_bwd / (125e12 * 0.4)
    for share, names in ((0.9, ["block", "head"]), (0.1, ["block.attn", "block.mlp", "head"])):
        layers = layer_sequence(tree, max_share=share)
        assert layers.names == names
        times = CostModel(layers, cluster).strategy([stage], 1, 1, 1).layer_times[0]
        assert times[:-1].sum() == pytest.approx(attn + mlp)


def test_mixed_stage_splits_its_batch_by_speed():
    cluster = Cluster([Node(device_type("H100"), 1, 300 * GBPS), Node(device_type("T4"), 1, 300 * GBPS)])
    model = CostModel(layer_sequence(uniform_tree(4)), cluster)
    devices = list(cluster.devices())
    mixed = StageDevices(((devices[0],), (devices[1],)))
    alone = StageDevices(((devices[0],),))
    # 2 × 16 samples shared 989 : 65 in whole samples: 30.03 and 1.97 -> 30 and 2
    costs = model.strategy([mixed], 1, 16, 1)
    assert costs.replica_sizes == (30, 2)
    t_mixed = costs.layer_times.sum()
    t_alone = model.strategy([alone], 1, 16, 1).layer_times.sum()  # the H100 alone, 16 samples
    assert t_mixed / t_alone == pytest.approx(max(30 / 989, 2 / 65) / (16 / 989))
    # with one sample each, neither can give the other any: the T4 sets the pace
    assert model.strategy([mixed], 1, 1, 1).replica_sizes == (1, 1)


def test_a_replicas_share_is_the_same_on_every_stage():
    """A replica's micro-batch flows through all its stages: one size per replica, set by its
    slowest stage (the runtime runs exactly this: Config.data_parallel_shares)."""
    cluster = Cluster([Node(device_type("H100"), 2, 300 * GBPS), Node(device_type("V100"), 1, 300 * GBPS),
                       Node(device_type("H100"), 1, 300 * GBPS)])
    model = CostModel(layer_sequence(uniform_tree(4)), cluster)
    d = list(cluster.devices())
    # replica 0: H100 then H100; replica 1: H100 then V100 -> shares 989 : 125 of 2 x 9 samples
    stages = [StageDevices(((d[0],), (d[1],))), StageDevices(((d[3],), (d[2],)))]
    assert model.replica_sizes(stages, 9) == (16, 2)


def test_show_and_json(capsys):
    plans = plan(gpt_tree(n_layer=8), homogeneous(2, 4), 64)
    plans.show(top=3)
    out = capsys.readouterr().out
    assert "Why the best plan wins" in out and "all stages fit" in out
    data = json.loads(plans.to_json(top=3))
    assert data["plans"][0]["config"]["pipeline_parallel_degree"] == plans.best.pp
    assert Config.from_any(data["plans"][0]["config"]) == plans.best.config


def test_bad_plan_arguments():
    with pytest.raises(PlanError, match="global_batch"):
        plan(gpt_tree(), homogeneous(1, 2), 0)
    with pytest.raises(PlanError, match="unknown plan option"):
        plan(gpt_tree(), homogeneous(1, 2), 8, colour="red")


def test_cli_plan_json(tmp_path, capsys):
    from smpart.cli import main

    path = tmp_path / "c.toml"
    path.write_text("[[node]]\ndevice = 'A100-40'\ncount = 4\n")
    assert main(["plan", "examples.models:gpt2", "--cluster", str(path), "--global-batch", "16",
                 "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 3 and data["num_devices"] == 4
    path.write_text("[[node]]\ndevice = 'A100-40'\ncount = 'four'\n")
    assert main(["plan", "examples.models:gpt2", "--cluster", str(path), "--global-batch", "16"]) == 2
    assert "node[0].count" in capsys.readouterr().err


def test_fixed_overheads_shift_the_time_exactly_and_keep_the_split():
    """A per-micro-batch overhead o costs (B − 1 + pp)·o; a message latency α costs 2α per boundary.
    Neither moves the boundaries (both are the same for every split)."""
    tree, cluster = uniform_tree(16), homogeneous(1, 4)
    base = {(p.pp, p.dp, p.microbatches): p for p in plan(tree, cluster, 64, tp_degrees=[1], top=500)}
    o, alpha = 2e-3, 5e-4
    shifted = plan(tree, cluster, 64, tp_degrees=[1], top=500,
                   microbatch_overhead_s=o, message_latency_s=alpha)
    assert len(shifted) == len(base)
    for p in shifted:
        ref = base[(p.pp, p.dp, p.microbatches)]
        assert p.starts == ref.starts
        extra = (p.microbatches - 1 + p.pp) * o + 2 * alpha * (p.pp - 1)
        assert p.time_s == pytest.approx(ref.time_s + extra, rel=1e-9, abs=1e-12)


def test_microbatch_overhead_makes_fewer_microbatches_win():
    """Without overhead, more micro-batches always shrink the bubble; with a large fixed cost per
    micro-batch the best plan uses fewer of them."""
    def best_pipelined(**options):
        plans = plan(uniform_tree(16), homogeneous(1, 4), 64, tp_degrees=[1], top=500, **options)
        return min((p for p in plans if p.pp == 4), key=lambda p: p.time_s)

    free, costly = best_pipelined(), best_pipelined(microbatch_overhead_s=10.0)
    assert free.microbatches > 1
    assert costly.microbatches < free.microbatches


# ---------------------------------------------------------------------------- activation checkpointing
def checkpointable_tree(saved: int, inputs: int | None, n_layer: int = 4, params: int = 2_500_000_000,
                        flops: float = 1e12) -> ModuleTree:
    """Equal layers that save ``saved`` bytes per sample for backward, ``inputs`` if checkpointed."""
    layer = {"flops": flops, "param_count": params, "param_bytes": 4 * params, "activation_bytes": 2 << 20,
             "saved_bytes": saved}
    if inputs is not None:
        layer["checkpoint_bytes"] = inputs
    layers = [{"name": f"layer{i}", **layer} for i in range(n_layer)]
    return ModuleTree.from_spec({"name": "", "children": layers})


def test_a_model_that_fits_only_with_checkpointing_gets_it_on_the_stages_that_need_it():
    """Each A100 holds one layer's state (40 GB of 77 usable) and 3 micro-batches of its 10 GiB of
    saved activations. 1F1B (the loss counting as a stage) keeps 5 micro-batches in flight on stage
    0, 4 on stage 1, 3 on stage 2, capped at the 4 there are: only stages 0 and 1 overflow, and only
    they checkpoint (1 GiB of inputs per micro-batch)."""
    options = {"tp_degrees": [1], "bytes_per_param": 16.0}
    with pytest.raises(PlanError, match="overflows"):
        plan(checkpointable_tree(10 * GIB, None), homogeneous(1, 4), 4, **options)
    plans = plan(checkpointable_tree(10 * GIB, GIB), homogeneous(1, 4), 4, **options)
    best = plans.best
    assert (best.pp, best.microbatches) == (4, 4)
    assert best.checkpointed == (True, True, False, False) and best.checkpointed_stages == [0, 1]
    assert best.activation_checkpointing == ["layer0", "layer1"]
    assert best.config.activation_checkpointing == ["layer0", "layer1"]
    assert all(used <= budget for used, budget in best.stage_memory)
    state = 2_500_000_000 * 16
    assert best.stage_memory[0][0] == pytest.approx(state + 4 * GIB)  # 4 micro-batches of inputs
    assert best.stage_memory[1][0] == pytest.approx(state + 4 * GIB)
    assert best.stage_memory[2][0] == pytest.approx(state + 3 * 10 * GIB)
    # a checkpointed stage pays one more forward: 4 F instead of 3 F
    assert best.stage_times[0] == pytest.approx(best.stage_times[2] * 4 / 3)
    assert "checkpointing stage(s) 0-1" in best.summary()
    assert any("only with activation checkpointing" in reason for reason in plans.reasons())
    assert [s["activation_checkpointing"] for s in best.to_dict()["stages"]] == [True, True, False, False]
    partition = best.partition  # costed as checkpointed
    assert partition.tree.node("layer1").recomputed and not partition.tree.node("layer2").recomputed


def test_checkpointing_is_never_chosen_when_the_plain_plan_fits():
    tree = checkpointable_tree(GIB, GIB // 8, params=10**8)
    for p in plan(tree, homogeneous(1, 4), 8, top=50):
        assert p.checkpointed == () and p.config.activation_checkpointing == []


def test_a_layer_whose_inputs_outweigh_its_saved_tensors_is_not_checkpointed():
    tree = ModuleTree.from_spec({"name": "", "children": [
        {"name": "emb", "flops": 1e9, "saved_bytes": 100, "checkpoint_bytes": 400},
        {"name": "block", "flops": 1e12, "saved_bytes": 10**6, "checkpoint_bytes": 10**4, "op_bytes": 10**5},
        {"name": "norm", "flops": 1e6, "saved_bytes": 100, "checkpoint_bytes": 60},  # saves too little
        {"name": "never", "call_count": 0, "checkpoint_bytes": 0}]})
    layers = layer_sequence(tree, max_share=1.0)
    assert layers.names == ["emb", "block", "norm", "never"]
    assert layers.checkpointable.tolist() == [False, True, False, False]
    assert layers.checkpoint_activation_bytes.tolist() == [100, 10**4, 100, 0]
    assert layers.checkpoint_names([0, 1, 2, 3]) == ["block"]
    model = CostModel(layers, homogeneous(1, 1))
    stage = StageDevices(((next(model.cluster.devices()),),))
    plain = model.strategy([stage], 1, 1, 1).layer_times[0]
    checkpointed = model.strategy([stage], 1, 1, 1, checkpointed=True).layer_times[0]
    assert checkpointed[0] == plain[0] and checkpointed[2] == plain[2] and checkpointed[3] == plain[3]
    assert checkpointed[1] == pytest.approx(plain[1] * 4 / 3)  # compute-bound: one more forward of 3


def test_even_checkpointing_everything_may_not_fit():
    with pytest.raises(PlanError, match="even with activation checkpointing on every stage"):
        plan(checkpointable_tree(80 * GIB, 40 * GIB), homogeneous(1, 4), 4, tp_degrees=[1])


def test_a_traced_model_is_planned_with_its_blocks_checkpointed():
    """End to end: a traced GPT on devices too small for its saved activations; the plan's config
    names modules that `checkpointed_names` resolves on the model itself."""
    from examples.models import gpt2
    from smpart.runtime.placement.activation_checkpointing import checkpointed_names
    from smpart.tracing.tracer import trace

    example = gpt2(n_layer=12, n_embd=64, seq_len=64, batch_size=8)  # blocks stay whole layers
    tree = trace(example.model, example.args)
    per_sample = sum(tree.activation_memory_of(n) for n in tree.nodes()) / 8
    params = sum(p.numel() for p in example.model.parameters())
    # room for 60% of the training state (so two stages) and a third of one sample's saved tensors
    tiny = DeviceType("Tiny", 1.0, int((params * 16 * 0.6 + per_sample / 3) / 0.9), 1e11)
    cluster = Cluster([Node(tiny, 2, 100 * GBPS)])
    best = plan(tree, cluster, 2, trace_batch=8, tp_degrees=[1]).best
    assert best.checkpointed_stages
    names = best.config.activation_checkpointing
    # whole blocks; not the tied embedding + LM head: checkpointed, it would keep the logits anyway
    assert names and all(re.fullmatch(r"transformer\.h\.\d+", name) for name in names)
    assert checkpointed_names(example.model, names, registry=None) == names


# ---------------------------------------------------------------------------- tensor parallelism
def _split_tree() -> ModuleTree:
    """Two equal layers; at tp = 2 the swap-in splits all of ``split`` (its output all-reduced
    forward, its input's gradient backward) and nothing of ``whole``."""
    split = SplitShare(params=1.0, flops=1.0, forward_bytes=1e6, backward_bytes=3e6, style="column",
                       forward_collectives=1, backward_collectives=2)
    leaf = {"flops": 1e12, "param_count": 10**6, "param_bytes": 4 * 10**6, "saved_bytes": 8 * 10**6,
            "activation_bytes": 10**6}
    tree = ModuleTree.from_spec({"name": "", "children": [
        {"name": "split", **leaf, "tp_split": {2: split}}, {"name": "whole", **leaf}]})
    tree.tp_degrees = (2,)
    return tree


def test_tensor_parallelism_divides_only_what_the_swap_in_splits():
    """Hand-worked: on a tp = 2 group the split layer runs at twice a device's speed, holds half
    its state and activations and pays its collectives (bytes and a latency per call); the whole
    layer costs what it does on one device."""
    layers = layer_sequence(_split_tree())
    cluster = Cluster([Node(DeviceType("D", 100.0, 80 * GIB), 2, 100 * GBPS)])
    devices = tuple(cluster.devices())
    model = CostModel(layers, cluster, CostOptions(bytes_per_param=16.0, collective_latency_s=1e-3))
    costs = model.strategy([StageDevices((devices,))], 2, 1, 1)
    one_device = 1e12 * 3 / (100e12 * 0.4)
    allreduce = 2 * (2 - 1) / 2 * (1e6 + 3e6) / (100 * GBPS) + 3 * 1e-3  # bytes, and 3 calls' latency
    assert costs.layer_times[0] == pytest.approx([one_device / 2 + allreduce, one_device])
    (row, _), = costs.replica_memory[0]
    assert row == pytest.approx([16e6 / 2 + 8e6 / 2, 16e6 + 8e6])
    stages = [StageDevices(((devices[0],), (devices[1],)))]  # and data parallelism syncs what each holds
    assert model.dp_sync_time(stages, (0,), 2)[0] == pytest.approx(
        2 * 1 / 2 * (1e6 / 2 + 1e6) * 2 / (100 * GBPS))


def test_tensor_split_records_survive_json():
    tree = _split_tree()
    again = ModuleTree.from_json(tree.to_json())
    assert again.tp_degrees == (2,) and again.node("split").tp_split == tree.node("split").tp_split
    assert again.node("whole").tp_split == {}


def test_a_degree_that_splits_nothing_or_was_not_recorded_is_never_proposed():
    tree = _split_tree()
    cluster = Cluster([Node(DeviceType("D", 100.0, 80 * GIB), 4, 100 * GBPS)])
    assert {p.tp for p in plan(tree, cluster, 8, top=1000)} == {1, 2}  # 4 was not recorded
    for node in tree.nodes():
        node.tp_split = {}
    assert {p.tp for p in plan(tree, cluster, 8, top=1000)} == {1}
    tree.tp_degrees = ()  # no records at all (a tree built by hand): priced as if all split
    assert {p.tp for p in plan(tree, cluster, 8, top=1000)} == {1, 2, 4}


def test_transgan_one_head_attention_is_priced_whole_so_tensor_parallelism_loses():
    """The AMP paper's TransGAN setting: its narrow blocks have one attention head, which the
    swap-in keeps whole. Priced as if everything split, tp = 2 would win; priced as the runtime
    splits, the narrow blocks cost as much on a tp group as on one device and no tp plan wins."""
    import warnings

    import torch

    import smpart
    from examples.models import transgan

    ex = transgan(wide=1024, narrow=16, bottom_width=9, wide_heads=16, narrow_heads=1, batch_size=1,
                  device="meta", dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = smpart.trace(ex.model, ex.args, ex.kwargs)
    assert tree.tp_degrees == (2, 4, 8)
    assert tree.node("narrow_blocks.0.attn.c_attn").tp_split[2].flops == 0.0
    assert tree.node("wide_blocks.0.attn.c_attn").tp_split[2].flops == 1.0
    mlp = tree.node("wide_blocks.0.mlp.c_fc").tp_split[2], tree.node("wide_blocks.0.mlp.c_proj").tp_split[2]
    # a column layer all-reduces its input's gradient in the backward, its row partner its output
    assert [(s.forward_collectives, s.backward_collectives) for s in mlp] == [(0, 1), (1, 0)]
    cluster = Cluster([Node(device_type("V100"), 4, 170 * GBPS) for _ in range(4)], 10 * GBPS)
    unknown = ModuleTree.from_dict({**tree.to_dict(), "tp_degrees": []})
    assert plan(unknown, cluster, 64).best.tp > 1
    assert plan(tree, cluster, 64).best.tp == 1

    model = CostModel(layer_sequence(tree), cluster)
    narrow = model.layers.names.index("narrow_blocks.0")
    wide = model.layers.names.index("wide_blocks.0")
    device = next(cluster.devices()).type
    speed, bandwidth = device.flops * 0.4, device.memory_bandwidth * 0.7
    one = model.sample_times(speed, bandwidth)
    group = model.sample_times(2 * speed, 2 * bandwidth, tp=2)  # a tp = 2 group: twice the devices
    assert group[narrow] == pytest.approx(one[narrow], rel=0.05)
    assert group[wide] < 0.6 * one[wide]


def test_the_planners_activations_in_flight_are_those_of_the_runtimes_1f1b_lists():
    """The cost model prices 1F1B's memory by its own formula (the planner imports no runtime):
    it must equal, for every stage, the most micro-batches whose forward has started and whose
    backward has not, walking the runtime's action list."""
    from smpart.planner.cost import _interleaved_in_flight
    from smpart.runtime.schedule import FORWARD, one_f_one_b_actions

    for stages in range(1, 9):
        for stage in range(stages):
            for microbatches in range(1, 13):
                live = most = 0
                for action in one_f_one_b_actions(stage, stages, microbatches):
                    live += 1 if action.kind == FORWARD else -1
                    most = max(most, live)
                priced = min(_interleaved_in_flight(stage, stages), microbatches)
                assert priced == most, (stage, stages, microbatches)


# ---------------------------------------------------------------------------- virtual stages
def test_virtual_stages_halve_the_fill_and_drain_of_a_1f1b_pipeline():
    """Two stages per rank (``Config.virtual_stages=2``, torch's Interleaved1F1B): on even stages of
    time t, a 1F1B pipeline of pp ranks takes (B − 1 + pp)·t + c, c the time on the cuts;
    interleaved, (B − 1 + pp/2)·t + 2c, a micro-batch crossing twice the cuts. Only asked for; and
    the plan's config lets the runtime cut its 2·pp stages itself."""
    tree, cluster = uniform_tree(16), homogeneous(1, 4)
    assert all(p.virtual_stages == 1 for p in plan(tree, cluster, 64, tp_degrees=[1], top=500))
    plans = list(plan(tree, cluster, 64, tp_degrees=[1], top=500, virtual_stages=True))
    plain = {(p.pp, p.dp, p.microbatches): p for p in plans if p.virtual_stages == 1}
    virtual = [p for p in plans if p.virtual_stages == 2]
    assert {(p.pp, p.dp, p.microbatches) for p in virtual} == {k for k in plain if k[0] > 1}
    for p in virtual:
        ref = plain[(p.pp, p.dp, p.microbatches)]
        t = max(ref.stage_times)
        cuts = ref.pipeline_s - (p.microbatches - 1 + p.pp) * t
        assert 0 <= cuts < 1e-3 * t
        assert p.pipeline_s == pytest.approx((p.microbatches - 1 + p.pp / 2) * t + 2 * cuts, rel=1e-9)
        assert p.time_s == pytest.approx(p.pipeline_s + ref.dp_sync_s, rel=1e-9)
        config = p.config
        assert config.virtual_stages == 2 and not config.pin
        assert "x2 virtual" in p.summary()
