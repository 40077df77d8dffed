"""Reused subtrees: loop units placed freely, against brute force and a hand-worked ALBERT."""

from __future__ import annotations

import itertools
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smpart.partitioning.api import partition
from smpart.partitioning.multiway import lpt, rebalance
from smpart.partitioning.result import Partition
from smpart.tracing.tree import ModuleNode, ModuleTree

# ---------------------------------------------------------------- an independent statement of the rule


def units_of(tree: ModuleTree) -> list[ModuleNode]:
    """Called modules without called descendants, in call order (the root counts as called)."""
    def called_below(node: ModuleNode) -> bool:
        return any(c.called or called_below(c) for c in node.children)

    found = [n for n in tree.nodes() if (n.called or n is tree.root) and not called_below(n)]
    return sorted(found, key=lambda n: n.call_order if n.call_order is not None else -1)


def anchored_costs(tree: ModuleTree, units: list[ModuleNode], costs: dict[str, float]) -> dict[str, float]:
    """Every node's cost added to the earliest unit in its subtree, else to its parent's unit."""
    rank = {u.name: i for i, u in enumerate(units)}
    total = {u.name: 0.0 for u in units}

    def visit(node: ModuleNode, parent_unit: str | None) -> None:
        below = [n.name for n in node.walk() if n.name in rank]
        unit = min(below, key=rank.__getitem__) if below else parent_unit
        total[unit] += costs[node.name]
        for child in node.children:
            visit(child, unit)

    visit(tree.root, None)
    return total


def loop_units_of(tree: ModuleTree, units: list[ModuleNode]) -> set[str]:
    names = {u.name for u in units}
    loop: set[str] = set()
    for node in tree.nodes():
        if node.call_count > 1:
            inside = {n.name for n in node.walk()} & names
            if len(inside) >= 2:
                loop |= inside
    return loop


def root_own_load(
    tree: ModuleTree, units: list[ModuleNode], costs: dict[str, float]
) -> tuple[set[str], float]:
    """The root and its children's subtrees holding no unit (empty when the root is a unit)."""
    names = {u.name for u in units}
    if tree.root.name in names:
        return set(), 0.0
    alone = {tree.root.name}
    for child in tree.root.children:
        subtree = {n.name for n in child.walk()}
        if not subtree & names:
            alone |= subtree
    return alone, sum(costs[name] for name in alone)


def brute_force(tree: ModuleTree, stages: int, costs: dict[str, float]) -> float:
    """Best heaviest stage over every assignment of units the rule allows: the root's own load
    rides with its first unit, or (when it is some work) sits alone on stage 0."""
    units = units_of(tree)
    cost = anchored_costs(tree, units, costs)
    loop = loop_units_of(tree, units)
    alone, alone_cost = root_own_load(tree, units, costs)
    seatings = [(cost, [0.0] * stages)]
    if alone_cost > 0 and stages > 1:
        rest = anchored_costs(tree, units, {n: 0.0 if n in alone else c for n, c in costs.items()})
        seatings.append((rest, [alone_cost] + [0.0] * (stages - 1)))
    best = float("inf")
    for unit_cost, preload in seatings:
        for assignment in itertools.product(range(stages), repeat=len(units)):
            used = set(assignment) | {s for s, p in enumerate(preload) if p > 0}
            if len(used) < stages:
                continue
            along = [s for u, s in zip(units, assignment, strict=True) if u.name not in loop]
            if any(b < a for a, b in pairwise(along)):
                continue
            loads = list(preload)
            for u, s in zip(units, assignment, strict=True):
                loads[s] += unit_cost[u.name]
            best = min(best, max(loads))
    return best


def stage_loads(part, costs: dict[str, float]) -> list[float]:
    loads = [0.0] * part.num_stages
    for name, s in part.node_stage.items():
        loads[s] += costs[name]
    return loads


# ---------------------------------------------------------------- random trees with a reused node


@st.composite
def reused_trees(draw, max_units: int = 6) -> ModuleTree:
    """prefix leaves, a node called 2-12 times holding 2+ leaves (one level nested), suffix leaves."""
    flops = st.integers(0, 30)
    prefix = draw(st.integers(0, 2))
    inner = draw(st.integers(2, max_units - prefix))
    suffix = draw(st.integers(0, max_units - prefix - inner))
    repeat = draw(st.integers(2, 12))
    nested = draw(st.integers(0, inner - 1))  # how many of the block's leaves sit in a sub-module
    block_leaves = [{"name": f"block.l{i}", "flops": draw(flops), "call_count": repeat} for i in range(inner)]
    children = block_leaves[: inner - nested]
    if nested:
        sub = {"name": "block.sub", "flops": draw(flops), "call_count": repeat, "children": []}
        for leaf in block_leaves[inner - nested :]:
            sub["children"].append({**leaf, "name": leaf["name"].replace("block.", "block.sub.")})
        children.insert(draw(st.integers(0, len(children))), sub)
    if draw(st.booleans()):  # a never-called module: follows its parent
        children.append({"name": "block.spare", "flops": 0, "param_bytes": 100, "call_count": 0})
    spec = {
        "name": "",
        "flops": draw(flops),
        "children": [
            *({"name": f"pre{i}", "flops": draw(flops)} for i in range(prefix)),
            {"name": "block", "flops": draw(flops), "call_count": repeat, "children": children},
            *({"name": f"post{i}", "flops": draw(flops)} for i in range(suffix)),
        ],
    }
    return ModuleTree.from_spec(spec)


@settings(max_examples=60, deadline=None)
@given(tree=reused_trees(), stages=st.integers(1, 4), w=st.sampled_from([0.0, 0.5]))
def test_reuse_aware_equals_brute_force_over_the_rule(tree: ModuleTree, stages: int, w: float) -> None:
    if len(units_of(tree)) < stages:
        return
    costs = tree.node_costs(w)
    best = brute_force(tree, stages, costs)
    part = partition(tree, stages, memory_weight=w)
    assert part.meta["loop_search"] == "exact"
    assert part.meta["candidates"]["reuse-aware"] == pytest.approx(best, abs=1e-12)
    assert max(stage_loads(part, costs)) <= best + 1e-12  # the winner is never worse
    assert all(part.modules_on(s) for s in range(stages))


@settings(max_examples=40, deadline=None)
@given(tree=reused_trees(max_units=7), stages=st.integers(2, 4))
def test_ordered_units_keep_pipeline_order_and_stage_zero_starts(tree: ModuleTree, stages: int) -> None:
    units = units_of(tree)
    if len(units) < stages:
        return
    part = partition(tree, stages, memory_weight=0.3)
    loop = loop_units_of(tree, units)
    along = [part.stage_of(u.name) for u in units if u.name not in loop]
    if part.meta["method"] != "tree":
        assert along == sorted(along)
    if part.meta["method"] == "reuse-aware" and along:
        # Stage 0 is where the pipeline starts: it holds the first ordered unit, or else a call
        # that runs before it (the root's own code, or a loop unit called earlier).
        first_ordered = min(u.call_order for u in units if u.name not in loop)
        first_on_zero = min(n.call_order for n in tree.nodes()
                            if n.call_order is not None and part.stage_of(n.name) == 0)
        assert along[0] == 0 or first_on_zero < first_ordered
    assert part == partition(tree, stages, memory_weight=0.3)  # deterministic
    assert part.meta["candidates"]["reuse-aware"] <= part.meta["candidates"]["leaf-sequence"] + 1e-12


# ---------------------------------------------------------------- ALBERT by hand


def albert_like(repeat: int = 12) -> ModuleTree:
    """ALBERT's shape with its compute (GFLOPs × 10, rounded) in one shared layer called 12 times."""
    called = {"call_count": repeat}
    layer = {
        "name": "layer",
        **called,
        "children": [
            {"name": "layer.ln_1", **called},
            {"name": "layer.attn", "flops": 97, **called, "children": [
                {"name": "layer.attn.c_attn", "flops": 217, **called},
                {"name": "layer.attn.c_proj", "flops": 72, **called},
            ]},
            {"name": "layer.ln_2", **called},
            {"name": "layer.mlp", **called, "children": [
                {"name": "layer.mlp.c_fc", "flops": 290, **called},
                {"name": "layer.mlp.c_proj", "flops": 290, **called},
            ]},
        ],
    }
    spec = {
        "name": "",
        "children": [
            {"name": "word_embeddings", "param_bytes": 1000},
            {"name": "embedding_projection", "flops": 1},
            layer,
            {"name": "head", "flops": 236},
        ],
    }
    return ModuleTree.from_spec(spec)


def test_albert_four_stages_by_hand() -> None:
    # Items (attn's own code rides with c_attn): 314, 72, 290, 290 free; 1 (embeddings) and 236
    # (head) in order. No stage can beat 314, and {314} {290} {290} {72 + 236 + 1} reaches it
    # (so does {314} {290 + 1} {290} {72 + 236}); a contiguous cut must put c_proj's 72 beside
    # c_attn's 314 or beside a 290, or the head beside a 290: 362 at best.
    part = partition(albert_like(), 4, memory_weight=0.0)
    assert part.meta["method"] == "reuse-aware"
    assert part.meta["loop_units"] == 6 and part.meta["loop_search"] == "exact"
    assert part.meta["candidates"]["leaf-sequence"] * 1203 == pytest.approx(362)
    assert sorted(part.stage_compute) in ([290, 290, 309, 314], [290, 291, 308, 314])
    assert part.stage_of("layer.attn") == part.stage_of("layer.attn.c_attn")
    assert part.stage_of("layer.mlp.c_fc") != part.stage_of("layer.mlp.c_proj")
    assert part.stage_of("word_embeddings") == part.stage_of("embedding_projection") == 0
    back = Partition.from_json(part.to_json())
    assert back == part and back.meta == part.meta


def test_albert_two_stages_by_hand() -> None:
    # Half of 1203 is 601.5; no subset of {1, 314, 72, 290, 290, 236} sums to 601 or 602, and
    # 314 + 290 = 604 leaves 599 for the other stage (embeddings and head together, in order).
    part = partition(albert_like(), 2, memory_weight=0.0)
    assert part.meta["method"] == "reuse-aware"
    assert sorted(part.stage_compute) == [599, 604]
    assert part.stage_of("embedding_projection") == part.stage_of("head") == 0


def test_pins_hold_with_a_reused_layer() -> None:
    part = partition(albert_like(), 4, memory_weight=0.0, pin={"layer.mlp.c_fc": 2, "head": 3})
    assert part.stage_of("layer.mlp.c_fc") == 2 and part.stage_of("head") == 3
    assert all(part.modules_on(s) for s in range(4))
    assert part == partition(albert_like(), 4, memory_weight=0.0, pin={"layer.mlp.c_fc": 2, "head": 3})


def test_many_loop_units_fall_back_to_the_heuristic() -> None:
    called = {"call_count": 3}
    leaves = [{"name": f"block.l{i}", "flops": 10 + (7 * i) % 13, **called} for i in range(40)]
    spec = {"name": "", "children": [
        {"name": "embed", "flops": 5},
        {"name": "block", **called, "children": leaves},
        {"name": "head", "flops": 30},
    ]}
    part = partition(ModuleTree.from_spec(spec), 6, memory_weight=0.0)
    assert part.meta["loop_units"] == 40
    assert part.meta["candidates"]["reuse-aware"] <= part.meta["candidates"]["leaf-sequence"]
    assert all(part.modules_on(s) for s in range(6))


# ---------------------------------------------------------------- models without loops stay contiguous


@st.composite
def plain_trees(draw) -> ModuleTree:
    """Nested modules, each called once (a tied pair may be called twice: one unit)."""
    counter = itertools.count()

    def node(prefix: str, depth: int) -> dict:
        name = f"{prefix}m{next(counter)}"
        kids = draw(st.integers(0, 3)) if depth < 3 else 0
        return {"name": name, "flops": draw(st.integers(0, 20)),
                "children": [node(f"{name}.", depth + 1) for _ in range(kids)]}

    spec = {"name": "", "children": [node("", 1) for _ in range(draw(st.integers(1, 5)))]}
    tree = ModuleTree.from_spec(spec)
    if draw(st.booleans()):  # a module called twice but holding one unit: a tied embedding
        leaf = next(n for n in tree.nodes() if n.is_leaf and n.name)
        leaf.call_count = 2
    return tree


@settings(max_examples=60, deadline=None)
@given(tree=plain_trees(), stages=st.integers(2, 5))
def test_models_without_loops_keep_contiguous_stages(tree: ModuleTree, stages: int) -> None:
    units = units_of(tree)
    if len(units) < stages:
        return
    part = partition(tree, stages, memory_weight=0.5)
    assert "reuse-aware" not in part.meta["candidates"] and "loop_units" not in part.meta
    along = [part.stage_of(u.name) for u in units]
    assert along == sorted(along)


def test_tied_embedding_called_twice_partitions_as_if_called_once() -> None:
    blocks = [{"name": f"h.{i}", "flops": 40 + i} for i in range(8)]
    spec = {"name": "", "children": [{"name": "wte", "names": ["wte", "lm_head"], "flops": 100}, *blocks]}
    once = partition(ModuleTree.from_spec(spec), 4, memory_weight=0.0)
    spec["children"][0]["call_count"] = 2
    twice = partition(ModuleTree.from_spec(spec), 4, memory_weight=0.0)
    assert twice.node_stage == once.node_stage
    assert twice.meta["method"] == once.meta["method"]


# ---------------------------------------------------------------- multiway packing


def test_lpt_then_local_search_by_hand() -> None:
    # LPT: 5 | 5, then 4 → bin 0 (tie), 3 → bin 1, 3 → bin 1: loads 9 and 11. Swapping a 5 for
    # the 4 moves 1 across: 10 and 10, the optimum.
    sizes = [5, 5, 4, 3, 3]
    packed = lpt(sizes, [0, 0])
    assert packed == [0, 1, 0, 1, 1]
    balanced = rebalance(sizes, [0, 0], packed)
    assert sorted(sum(s for s, b in zip(sizes, balanced, strict=True) if b == k) for k in (0, 1)) == [10, 10]


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40).map(float), min_size=1, max_size=12),
    base=st.lists(st.integers(0, 60).map(float), min_size=1, max_size=5),
)
def test_local_search_never_worsens_and_leaves_no_improving_move(sizes: list, base: list) -> None:
    def loads(bins: list[int]) -> list[float]:
        out = list(base)
        for size, b in zip(sizes, bins, strict=True):
            out[b] += size
        return out

    start = lpt(sizes, base)
    final = rebalance(sizes, base, start)
    assert max(loads(final)) <= max(loads(start))
    after = loads(final)
    top = max(range(len(base)), key=lambda b: (after[b], -b))
    for size, b in zip(sizes, final, strict=True):
        if b == top:
            assert all(after[top] - after[o] <= size for o in range(len(base)) if o != top)
