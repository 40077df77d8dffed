"""`smpart.partition` on trees of plain numbers: invariants, pins, bad input, JSON, show()."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from smpart.errors import PartitionError, SmpartError
from smpart.partitioning.api import partition
from smpart.partitioning.result import Partition
from smpart.partitioning.segment import min_max_segments
from smpart.tracing.tree import ModuleNode, ModuleTree
from smpart.viz import show


def random_tree(seed: int, size: int) -> ModuleTree:
    """A random tree: random fan-out, costs, some never-called modules, one shared-parameter node."""
    rng = random.Random(seed)
    root: dict = {"name": "", "flops": rng.randint(0, 5), "children": []}
    nodes = [root]
    for i in range(size):
        parent = rng.choice(nodes)
        prefix = f"{parent['name']}." if parent["name"] else ""
        child = {
            "name": f"{prefix}m{i}",
            "flops": rng.randint(0, 50),
            "param_bytes": rng.randint(0, 100),
            "call_count": 0 if rng.random() < 0.1 else 1,
            "children": [],
        }
        parent["children"].append(child)
        nodes.append(child)
    tree = ModuleTree.from_spec(root)
    # Merge a second name into one leaf, as the tracer does for modules sharing a parameter.
    leaf = next(n for n in tree.nodes() if n.is_leaf and n.name)
    leaf.names.append("tied_head")
    tree.reindex()
    return tree


def called_units(tree: ModuleTree) -> int:
    """Called nodes without called descendants (the call-ordered leaves)."""
    def has_called_below(node: ModuleNode) -> bool:
        return any(c.called or has_called_below(c) for c in node.children)

    return sum(1 for n in tree.nodes() if (n.called or n is tree.root) and not has_called_below(n))


def gpt_like(layers: int = 8) -> ModuleTree:
    blocks = [
        {
            "name": f"h.{i}",
            "flops": 1,
            "children": [
                {"name": f"h.{i}.attn", "flops": 40, "param_bytes": 400},
                {"name": f"h.{i}.mlp", "flops": 80, "param_bytes": 800},
            ],
        }
        for i in range(layers)
    ]
    spec = {
        "name": "",
        "children": [
            {"name": "wte", "names": ["wte", "lm_head"], "flops": 100, "param_bytes": 5000},
            {"name": "h", "children": blocks},
            {"name": "ln_f", "flops": 1, "param_bytes": 8},
        ],
    }
    return ModuleTree.from_spec(spec)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), size=st.integers(1, 40), stages=st.integers(1, 6), w=st.floats(0, 1))
def test_every_module_on_one_stage_and_no_stage_empty(seed: int, size: int, stages: int, w: float) -> None:
    tree = random_tree(seed, size)
    if called_units(tree) < stages:
        with pytest.raises(PartitionError, match="stage"):
            partition(tree, stages, memory_weight=w)
        return
    part = partition(tree, stages, memory_weight=w)
    placed = [name for s in range(stages) for name in part.modules_on(s)]
    assert sorted(placed) == sorted(tree.module_names())  # each module exactly once
    assert all(part.modules_on(s) for s in range(stages))
    assert part.stage_of("tied_head") == part.stage_of(tree.node("tied_head").name)
    assert part == partition(tree, stages, memory_weight=w)  # deterministic


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), size=st.integers(4, 30), stages=st.integers(2, 4))
def test_never_worse_than_an_exact_cut_of_the_leaf_sequence(seed: int, size: int, stages: int) -> None:
    """Independent reference: cut the call-ordered leaves (each with its whole subtree cost)."""
    tree = random_tree(seed, size)
    if called_units(tree) < stages:
        return
    part = partition(tree, stages, memory_weight=0.5)
    costs = tree.node_costs(0.5)
    loads = [0.0] * stages
    for name, s in part.node_stage.items():
        loads[s] += costs[name]
    assert max(loads) == pytest.approx(part.meta["max_stage_cost"])
    assert max(loads) >= 1 / stages - 1e-9
    # Cutting only between the root's called children is one feasible answer (never-called
    # children follow the root, so they count with the root's own cost).
    subtree = {c.name: sum(costs[n.name] for n in c.walk()) for c in tree.root.children}
    called = [subtree[c.name] for c in tree.root.children if any(n.called for n in c.walk())]
    stays = costs[""] + sum(subtree.values()) - sum(called)
    if len(called) >= stages:
        assert max(loads) <= min_max_segments(called, stages).cost + stays + 1e-9


def test_stages_follow_call_order_on_a_gpt_like_model() -> None:
    tree = gpt_like(8)
    part = partition(tree, 4, memory_weight=0.0)
    order = [part.stage_of(f"h.{i}.mlp") for i in range(8)]
    assert order == sorted(order) and order[0] in (0, 1) and order[-1] == 3
    assert part.stage_of("wte") == part.stage_of("lm_head") == 0
    assert part.stage_of("ln_f") == 3


def test_paper_walk_alone_balances_equal_layers() -> None:
    # The layers sit in a container that is never called itself (an nn.ModuleList).
    layers = [{"name": f"h.{i}", "flops": 10} for i in range(8)]
    spec = {"name": "", "children": [{"name": "h", "call_count": 0, "children": layers}]}
    part = partition(ModuleTree.from_spec(spec), 4, memory_weight=0.0)
    assert part.meta["method"] == "tree"
    assert part.stage_compute == [20, 20, 20, 20]
    assert [part.stage_of(f"h.{i}") for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert part.stage_of("h") == 0


def test_parent_own_cost_is_counted() -> None:
    # The root itself is as heavy as all its children: it needs a stage of its own.
    spec = {"name": "", "flops": 30, "children": [{"name": f"l{i}", "flops": 10} for i in range(3)]}
    part = partition(ModuleTree.from_spec(spec), 2, memory_weight=0.0)
    assert sorted(part.stage_compute) == [30, 30]


def test_uncalled_modules_follow_their_parent() -> None:
    spec = {
        "name": "",
        "children": [
            {"name": "a", "flops": 10},
            {"name": "moe", "children": [
                {"name": "moe.e0", "flops": 10},
                {"name": "moe.e1", "flops": 0, "call_count": 0, "param_bytes": 10},
            ]},
            {"name": "b", "flops": 10},
        ],
    }
    part = partition(ModuleTree.from_spec(spec), 3, memory_weight=0.0)
    assert part.stage_of("moe.e1") == part.stage_of("moe")
    assert [part.stage_of(n) for n in ("a", "moe.e0", "b")] == [0, 1, 2]


def test_pins_are_respected_and_balanced_around() -> None:
    tree = gpt_like(8)
    part = partition(tree, 4, memory_weight=0.0, pin={"h.7": 1, "ln_f": 0})
    assert part.stage_of("h.7") == part.stage_of("h.7.mlp") == 1
    assert part.stage_of("ln_f") == 0
    assert part.meta["pins"] == {"h.7": 1, "ln_f": 0}
    assert all(part.modules_on(s) for s in range(4))


def test_pinning_one_name_of_a_shared_node_pins_all_of_it() -> None:
    part = partition(gpt_like(8), 4, memory_weight=0.0, pin={"lm_head": 3})
    assert part.stage_of("wte") == part.stage_of("lm_head") == 3


def test_deeper_pin_overrides_its_pinned_parent() -> None:
    part = partition(gpt_like(8), 4, memory_weight=0.0, pin={"h": 2, "h.0.mlp": 0})
    assert part.stage_of("h.3.attn") == 2
    assert part.stage_of("h.0.mlp") == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_stages": 0}, "at least 1"),
        ({"num_stages": 2.5}, "must be an int"),
        ({"num_stages": 2, "memory_weight": 1.5}, r"\[0, 1\]"),
        ({"num_stages": 2, "memory_weight": -0.1}, r"\[0, 1\]"),
        ({"num_stages": 2, "pin": {"h.3.mpl": 1}}, "did you mean 'h.3.mlp'"),
        ({"num_stages": 2, "pin": {"h.3": 2}}, r"stages are 0\.\.1"),
        ({"num_stages": 2, "pin": {"wte": 0, "lm_head": 1}}, "share parameters"),
        ({"num_stages": 40}, "num_stages <= 18"),
    ],
)
def test_bad_input_raises_a_clear_error(kwargs: dict, match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        partition(gpt_like(8), **kwargs)


def test_single_module_model_cannot_fill_two_stages() -> None:
    tree = ModuleTree.from_spec({"name": "", "class_name": "Linear", "flops": 10})
    assert partition(tree, 1).stage_of("") == 0
    with pytest.raises(SmpartError, match="num_stages <= 1"):
        partition(tree, 2)


def test_json_round_trip(tmp_path) -> None:
    part = partition(gpt_like(4), 3, memory_weight=0.3, pin={"ln_f": 2})
    path = tmp_path / "p.json"
    part.to_json(str(path))
    back = Partition.from_json(str(path))
    assert back == part
    assert back.meta == part.meta
    assert back.module_stages() == part.module_stages()


def test_hundred_thousand_node_tree() -> None:
    blocks = [
        {"name": f"b{i}", "children": [{"name": f"b{i}.l{j}", "flops": 1 + (i * j) % 7} for j in range(9)]}
        for i in range(10_000)
    ]
    tree = ModuleTree.from_spec({"name": "", "children": blocks})
    part = partition(tree, 8, memory_weight=0.0)
    assert part.compute_imbalance < 1.01


def test_show_renders_stages_and_modules() -> None:
    part = partition(gpt_like(8), 4, memory_weight=0.5)
    console = Console(record=True, width=140)
    show(part, console=console)
    text = console.export_text()
    for needle in ("stage 0", "stage 3", "mlp", "wte, lm_head", "imbalance"):
        assert needle in text


def test_show_collapses_large_trees() -> None:
    blocks = [{"name": f"h.{i}", "children": [{"name": f"h.{i}.mlp", "flops": 5}]} for i in range(1000)]
    part = partition(ModuleTree.from_spec({"name": "", "children": blocks}), 4, memory_weight=0.0)
    console = Console(record=True, width=140)
    show(part, console=console, max_depth=2)
    lines = console.export_text().splitlines()
    assert len(lines) < 150
    assert "h.999" in "\n".join(lines)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), size=st.integers(3, 30), stages=st.integers(2, 4), data=st.data())
def test_random_pins_are_respected(seed: int, size: int, stages: int, data) -> None:
    tree = random_tree(seed, size)
    name = data.draw(st.sampled_from(tree.module_names()[1:]))
    stage = data.draw(st.integers(0, stages - 1))
    try:
        part = partition(tree, stages, memory_weight=0.5, pin={name: stage})
    except PartitionError as err:
        assert "stage(s) to fill" in str(err)  # too few leaves left outside the pinned subtree
        return
    assert all(part.stage_of(n) == stage for node in tree.node(name).walk() for n in node.names)
    assert all(part.modules_on(s) for s in range(stages))
