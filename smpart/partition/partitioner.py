"""The SageMaker tree partitioner, plus an exact leaf-sequence cut to keep it honest.

**The tree walk (the paper's algorithm).** Every node ``n`` carries a list of devices ``P(n)``
(the root gets all stages). Nodes are visited breadth-first; ``n`` itself lives on ``P(n)[0]``.
When ``n`` has several devices, its called children in call order become a sequence of items,
preceded by one *own-load* item holding ``n``'s own cost plus its uncalled children (uncalled
modules follow their parent), so the parent's load lands on ``P(n)[0]`` and is not ignored. The
sequence is cut into ``min(#items, #devices)`` contiguous pieces by the min-max segmentation DP,
and D'Hondt shares the devices among the pieces by weight, handing them out in order:

* a piece with no device stays with the parent (``P(n)[0]``);
* a piece with one device takes it, subtrees and all;
* a piece of one node with several devices gives them all to that node, which the walk revisits;
* a piece of several items with several devices is cut again the same way (a *virtual node*
  whose children are the piece's items).

**The leaf sequence (beyond the paper).** The tree walk is greedy: D'Hondt rounds device counts,
a heavy leaf can swallow devices it cannot use, and a parent's own load is only seen at its own
level. So the partitioner also cuts the *call-ordered leaf sequence* exactly: every called module
without called descendants is a unit; every other module rides with the first-called unit below
it (a parent's own cost and its uncalled children are charged to its first called leaf), or with
its parent's unit when it has none. The segmentation DP then splits the units into exactly
``num_stages`` non-empty pieces, with the load of pinned modules preloaded on their stages.

Both answers are scored, and the better one is kept: first a partition that leaves a stage empty
loses; then one whose call-ordered leaves step back to an earlier stage loses (a pipeline flows
one way; the walk's "no device: stay with the parent" rule can send a late module back to the
parent's stage); then the heavier heaviest stage loses (own costs summed per stage). The tree
walk wins exact ties. Stages are numbered in pipeline order: the stage holding the earliest call
is stage 0.

**Pins** (``{node name: stage}``) fix a node and its subtree before anything else runs (a pin
deeper in a pinned subtree overrides it there). Pinned subtrees are taken out of the balancing:
the tree walk ignores them and the leaf sequence preloads their cost on their stage.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise

from smpart.errors import PartitionError
from smpart.partition.dhondt import dhondt
from smpart.partition.segment import min_max_segments
from smpart.tracing.tree import ModuleNode, ModuleTree

#: The leaf sequence must beat the tree walk by more than this (relative) to be chosen, so that
#: rounding noise never flips the answer.
_TIE_TOLERANCE = 1e-9


@dataclass
class PartitionOutcome:
    """The chosen ``node_stage`` map and how it was reached (goes into ``Partition.meta``)."""

    node_stage: dict[str, int]
    method: str
    max_stage_cost: float
    candidates: dict[str, float] = field(default_factory=dict)


def partition_tree(
    tree: ModuleTree,
    costs: dict[str, float],
    num_stages: int,
    pinned: dict[str, int] | None = None,
) -> PartitionOutcome:
    """Assign every node of ``tree`` to one of ``num_stages`` stages (see the module docstring).

    ``costs`` are the nodes' own costs (`ModuleTree.node_costs`); ``pinned`` maps canonical node
    names to stages. Raises `PartitionError` when there are fewer call-ordered leaves than stages
    left to fill.
    """
    fixed = _spread_pins(tree.root, pinned or {})
    units = _leaf_units(tree.root, fixed)
    to_fill = num_stages - len(set((pinned or {}).values()))
    if len(units) < to_fill:
        raise PartitionError(
            f"the model has {len(units)} call-ordered leaf module(s) left to place but {to_fill} "
            f"stage(s) to fill, so some stage would hold nothing; use num_stages <= "
            f"{num_stages - to_fill + len(units)} (or pin fewer modules)"
        )
    candidates = {
        "tree": _tree_walk(tree, costs, num_stages, fixed, renumber=not pinned),
        "leaf-sequence": _leaf_sequence(tree, costs, num_stages, fixed, units),
    }
    scores = {name: _score(stages, costs, num_stages, units) for name, stages in candidates.items()}
    *tree_flaws, tree_cost = scores["tree"]
    *seq_flaws, seq_cost = scores["leaf-sequence"]
    best = "tree"
    if (*seq_flaws, seq_cost * (1 + _TIE_TOLERANCE)) < (*tree_flaws, tree_cost):
        best = "leaf-sequence"
    return PartitionOutcome(
        node_stage=candidates[best],
        method=best,
        max_stage_cost=scores[best][-1],
        candidates={name: score[-1] for name, score in scores.items()},
    )


# ---------------------------------------------------------------- pins


def _spread_pins(root: ModuleNode, pinned: dict[str, int]) -> dict[str, int]:
    """Stage of every node inside a pinned subtree; the deepest pin above a node wins."""
    fixed: dict[str, int] = {}
    stack: list[tuple[ModuleNode, int | None]] = [(root, None)]
    while stack:
        node, inherited = stack.pop()
        stage = pinned.get(node.name, inherited)
        if stage is not None:
            fixed[node.name] = stage
        stack.extend((child, stage) for child in node.children)
    return fixed


# ---------------------------------------------------------------- the tree walk


@dataclass(frozen=True)
class _Item:
    """One element of a sequence being cut: a child subtree, or the parent's own load (node None)."""

    node: ModuleNode | None
    cost: float


def _tree_walk(
    tree: ModuleTree,
    costs: dict[str, float],
    num_stages: int,
    fixed: dict[str, int],
    *,
    renumber: bool,
) -> dict[str, int]:
    """The paper's breadth-first walk (Algorithm 1 with segmentation and D'Hondt)."""
    subtree = _free_subtree_costs(tree.root, costs, fixed)
    first_call = _first_calls(tree.root)
    stage = dict(fixed)
    queue: deque[tuple[ModuleNode, list[int]]] = deque([(tree.root, list(range(num_stages)))])
    while queue:
        node, devices = queue.popleft()
        if node.name in fixed:
            continue
        if len(devices) == 1:
            _place_subtree(node, devices[0], fixed, stage)
            continue
        stage[node.name] = devices[0]
        free = [c for c in node.children if c.name not in fixed]
        # A container (ModuleList, ModuleDict) is never called itself: it counts as called when
        # something inside it is, at the time of its first call.
        called = sorted((c for c in free if first_call[c.name] < math.inf), key=lambda c: first_call[c.name])
        uncalled = [c for c in free if first_call[c.name] == math.inf]
        for child in uncalled:
            _place_subtree(child, devices[0], fixed, stage)
        own_load = costs[node.name] + sum(subtree[c.name] for c in uncalled)
        items = [_Item(None, own_load)] + [_Item(c, subtree[c.name]) for c in called]
        _cut_items(items, devices, queue, fixed, stage)
    return _renumber_by_first_call(tree, stage) if renumber else stage


def _cut_items(
    items: list[_Item],
    devices: list[int],
    queue: deque[tuple[ModuleNode, list[int]]],
    fixed: dict[str, int],
    stage: dict[str, int],
) -> None:
    """Segment ``items`` over ``devices``, give devices by D'Hondt, and act on each piece."""
    pieces = min_max_segments([it.cost for it in items], min(len(items), len(devices))).pieces
    seats = dhondt([sum(items[i].cost for i in piece) for piece in pieces], len(devices))
    next_device = 0
    for piece, count in zip(pieces, seats, strict=True):
        members = [items[i] for i in piece]
        given = devices[next_device : next_device + count]
        next_device += count
        if count <= 1:
            target = given[0] if given else devices[0]
            for item in members:
                if item.node is not None:
                    _place_subtree(item.node, target, fixed, stage)
        elif len(members) == 1:
            if members[0].node is not None:
                queue.append((members[0].node, given))
            # A lone own-load item cannot be split: the spare devices stay idle (and the leaf
            # sequence will win the comparison).
        else:
            _cut_items(members, given, queue, fixed, stage)


def _first_calls(root: ModuleNode) -> dict[str, float]:
    """Earliest call anywhere in each subtree (inf when nothing in it was called)."""
    first: dict[str, float] = {}
    for node in _post_order(root):
        own = node.call_order if node.call_order is not None and node.called else math.inf
        first[node.name] = min([own] + [first[c.name] for c in node.children])
    return first


def _place_subtree(node: ModuleNode, device: int, fixed: dict[str, int], stage: dict[str, int]) -> None:
    for n in node.walk():
        if n.name not in fixed:
            stage[n.name] = device


def _free_subtree_costs(root: ModuleNode, costs: dict[str, float], fixed: dict[str, int]) -> dict[str, float]:
    """Cost of every subtree, pinned nodes excluded (their load is not the walk's to balance)."""
    total: dict[str, float] = {}
    for node in _post_order(root):
        own = 0.0 if node.name in fixed else costs[node.name]
        total[node.name] = own + sum(total[c.name] for c in node.children)
    return total


# ---------------------------------------------------------------- the leaf sequence


def _leaf_units(root: ModuleNode, fixed: dict[str, int]) -> list[ModuleNode]:
    """Called, unpinned nodes with no called unpinned descendant, in call order.

    The root counts as called (it is the model's entry point) so a tree always has a unit unless
    everything is pinned.
    """
    has_unit_below: dict[str, bool] = {}
    units: list[ModuleNode] = []
    for node in _post_order(root):
        if node.name in fixed:
            has_unit_below[node.name] = False
            continue
        below = any(has_unit_below[c.name] for c in node.children)
        is_unit = not below and (node.called or node is root)
        if is_unit:
            units.append(node)
        has_unit_below[node.name] = below or is_unit
    return sorted(units, key=_call_key)


def _leaf_sequence(
    tree: ModuleTree,
    costs: dict[str, float],
    num_stages: int,
    fixed: dict[str, int],
    units: list[ModuleNode],
) -> dict[str, int]:
    """Exact min-max cut of the call-ordered units, every other free node riding with its anchor."""
    anchor = _anchors(tree.root, fixed, units)
    position = {u.name: i for i, u in enumerate(units)}
    unit_cost = [0.0] * len(units)
    for name, unit in anchor.items():
        unit_cost[position[unit]] += costs[name]
    preload: list[float | None] = [None] * num_stages
    for name, s in fixed.items():
        preload[s] = (preload[s] or 0.0) + costs[name]
    segmentation = min_max_segments(unit_cost, num_stages, preload=preload)
    unit_stage = segmentation.stage_of_items()
    stage = dict(fixed)
    for name, unit in anchor.items():
        stage[name] = unit_stage[position[unit]]
    return stage


def _anchors(root: ModuleNode, fixed: dict[str, int], units: list[ModuleNode]) -> dict[str, str]:
    """Unit every free node rides with: its earliest unit below, else its parent's anchor."""
    order = {u.name: i for i, u in enumerate(units)}
    earliest: dict[str, int | None] = {}
    for node in _post_order(root):
        if node.name in fixed:
            earliest[node.name] = None
            continue
        below = [earliest[c.name] for c in node.children if earliest[c.name] is not None]
        own = order.get(node.name)
        earliest[node.name] = min(below + ([own] if own is not None else []), default=None)
    anchor: dict[str, str] = {}
    stack: list[tuple[ModuleNode, int | None]] = [(root, None)]
    while stack:
        node, parent_unit = stack.pop()
        if node.name in fixed:
            continue
        unit = earliest[node.name] if earliest[node.name] is not None else parent_unit
        if unit is None:  # only an unpinned, unit-less root gets here; units are never empty then
            unit = 0
        anchor[node.name] = units[unit].name
        stack.extend((child, unit) for child in node.children)
    return anchor


# ---------------------------------------------------------------- scoring and order


def _score(
    stage: dict[str, int], costs: dict[str, float], num_stages: int, units: list[ModuleNode]
) -> tuple[bool, bool, float]:
    """(leaves a stage empty, leaves out of pipeline order, heaviest stage's cost): lower is better."""
    loads = [0.0] * num_stages
    used = [False] * num_stages
    for name, s in stage.items():
        loads[s] += costs[name]
        used[s] = True
    along = [stage[u.name] for u in units]
    steps_back = any(later < earlier for earlier, later in pairwise(along))
    return (not all(used), steps_back, max(loads))


def _renumber_by_first_call(tree: ModuleTree, stage: dict[str, int]) -> dict[str, int]:
    """Renumber stages so that the stage holding the earliest call is 0, the next one 1, ..."""
    first = {s: math.inf for s in set(stage.values())}
    for node in tree.nodes():
        if node.call_order is not None:
            s = stage[node.name]
            first[s] = min(first[s], node.call_order)
    ordered = sorted(first, key=lambda s: (first[s], s))
    slots = sorted(first)  # stages in use keep their set of numbers, only the order changes
    mapping = dict(zip(ordered, slots, strict=True))
    return {name: mapping[s] for name, s in stage.items()}


def _call_key(node: ModuleNode) -> tuple[float, str]:
    return (node.call_order if node.call_order is not None else math.inf, node.name)


def _post_order(root: ModuleNode) -> Iterator[ModuleNode]:
    """Children before parents, without recursion (trees can be deep)."""
    return reversed(list(root.walk()))
