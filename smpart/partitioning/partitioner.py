"""The SageMaker tree partitioner, plus an exact leaf-sequence cut to keep it honest, plus reuse.

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
``num_stages`` non-empty pieces, with the load of pinned modules preloaded on their stages. The
root's own load (its own cost and its children that call nothing) is also tried alone on stage 0,
the units filling the later stages, and kept there when that is strictly faster: the tree walk
can leave a slow first device only that, and the leaf sequence must not do worse.

**Reused subtrees (beyond the paper).** A module called several times (ALBERT's shared layer)
runs its units again and again, so once they span two stages the flow loops back at every
repeat whatever their order: contiguity buys nothing there. Its units, the *loop units*, may go
to any stage; the other units, the *ordered units*, stay contiguous in call order. The
*reuse-aware* candidate searches the loop units' stages with the ordered units cut exactly
around them (`smpart.partitioning.reuse`). It is only tried when the model has a reused subtree
with two or more units; a plain sequential model keeps its contiguous stages.

The answers are scored, and the best one is kept: first a partition that leaves a stage empty
loses; then one whose ordered units step back to an earlier stage loses (a pipeline flows one
way; the walk's "no device: stay with the parent" rule can send a late module back to the
parent's stage; loop units are not counted, their back-edges are the model's own); then the
heavier heaviest stage loses (own costs summed per stage). Ties go to the earlier candidate in
the order tree walk, leaf sequence, reuse-aware. Stages are numbered in pipeline order: the
stage holding the earliest ordered call is stage 0.

**Pins** (``{node name: stage}``) fix a node and its subtree before anything else runs (a pin
deeper in a pinned subtree overrides it there). Pinned subtrees are taken out of the balancing:
the tree walk ignores them and the leaf sequence preloads their cost on their stage.

**Stages on devices of unequal speed and memory** (`Hardware`): a stage's *time* is its load ÷
its device's speed, the slowest stage's time is what every candidate minimises and the score
compares, and a stage's bytes (the tree's training memory of its nodes) must fit its device. The
leaf sequence is cut exactly under both (`min_max_segments` with ``speeds`` and ``capacity``). The
tree walk keeps its shape, with seats weighted by speed: at each node the segmentation and
D'Hondt become one exact choice (`smpart.partitioning.unequal`): runs of children on one device
each, or one child on a run of several devices, which the walk visits again with them; the
node's own load stays on its first device, and the choice counts what is on each device already
(its time, and its bytes against the capacity). A candidate that overflows a device loses to one
that does not (after the two flaws above); stages keep their device, so they are not renumbered.
The reuse-aware search weighs its stages by speed (`smpart.partitioning.reuse`), not by memory: the
score says when its answer overflows. Between candidates equally slow at their slowest stage
(within rounding), the one whose other stages are faster wins (their times compared from the
slowest down), so a stage forced to be the bottleneck does not leave the others unbalanced.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise

from smpart.errors import PartitionError
from smpart.partitioning.dhondt import dhondt
from smpart.partitioning.reuse import loop_unit_names, place_loop_units
from smpart.partitioning.segment import DoesNotFit, min_max_segments
from smpart.partitioning.unequal import Share, share_devices
from smpart.tracing.tree import ModuleNode, ModuleTree

#: A later candidate must beat an earlier one by more than this (relative) to be chosen, so that
#: rounding noise never flips the answer.
_TIE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Hardware:
    """What the stages run on: each stage's speed (its load ÷ speed is its time), the bytes its
    device may hold (inf: no limit), and every node's own bytes (the tree's training memory)."""

    speed: tuple[float, ...]
    capacity: tuple[float, ...]
    node_bytes: dict[str, float]

    @classmethod
    def alike(cls, num_stages: int) -> Hardware:
        return cls((1.0,) * num_stages, (math.inf,) * num_stages, {})

    @property
    def uniform(self) -> bool:
        """Equal speeds and no memory limit: the partitioner's original problem."""
        return len(set(self.speed)) <= 1 and all(math.isinf(c) for c in self.capacity)

    def bytes_of(self, name: str) -> float:
        return self.node_bytes.get(name, 0.0)


@dataclass
class PartitionOutcome:
    """The chosen ``node_stage`` map and how it was reached (goes into ``Partition.meta``)."""

    node_stage: dict[str, int]
    method: str
    max_stage_cost: float
    candidates: dict[str, float] = field(default_factory=dict)
    #: Extra facts for ``Partition.meta`` (how many loop units; whether their search was exact).
    notes: dict[str, object] = field(default_factory=dict)


def partition_tree(
    tree: ModuleTree,
    costs: dict[str, float],
    num_stages: int,
    pinned: dict[str, int] | None = None,
    hardware: Hardware | None = None,
) -> PartitionOutcome:
    """Assign every node of ``tree`` to one of ``num_stages`` stages (see the module docstring).

    ``costs`` are the nodes' own costs (`ModuleTree.node_costs`); ``pinned`` maps canonical node
    names to stages; ``hardware`` says what each stage runs on (default: alike devices, no memory
    limit). Raises `PartitionError` when there are fewer call-ordered leaves than stages left to
    fill.
    """
    hw = hardware or Hardware.alike(num_stages)
    fixed = _spread_pins(tree.root, pinned or {})
    units = _leaf_units(tree.root, fixed)
    to_fill = num_stages - len(set((pinned or {}).values()))
    if len(units) < to_fill:
        raise PartitionError(
            f"the model has {len(units)} call-ordered leaf module(s) left to place but {to_fill} "
            f"stage(s) to fill, so some stage would hold nothing; use num_stages <= "
            f"{num_stages - to_fill + len(units)} (or pin fewer modules)"
        )
    loop = loop_unit_names(tree.root, units)
    ordered = [u for u in units if u.name not in loop]
    renumber = not pinned and hw.uniform  # on unequal devices a stage keeps its device
    candidates = {
        "tree": _tree_walk(tree, costs, num_stages, fixed, hw, renumber=renumber),
        "leaf-sequence": _leaf_sequence(tree, costs, num_stages, fixed, units, hw),
    }
    notes: dict[str, object] = {}
    if loop:
        candidates["reuse-aware"], exact = _reuse_aware(
            tree, costs, num_stages, fixed, units, loop, candidates["leaf-sequence"], hw, renumber=renumber
        )
        notes = {"loop_units": len(loop), "loop_search": "exact" if exact else "heuristic"}
    scores = {name: _score(stages, costs, num_stages, ordered, hw) for name, stages in candidates.items()}
    best = "tree"
    for name, (*flaws, cost, rest) in scores.items():
        *best_flaws, best_cost, best_rest = scores[best]
        tied = tuple(flaws) == tuple(best_flaws) and cost <= best_cost * (1 + _TIE_TOLERANCE)
        if (*flaws, cost * (1 + _TIE_TOLERANCE)) < (*best_flaws, best_cost) or (tied and rest < best_rest):
            best = name
    if scores[best][2]:
        notes["over_memory"] = True  # every candidate overflows some device (the caller says which)
    return PartitionOutcome(
        node_stage=candidates[best],
        method=best,
        max_stage_cost=scores[best][-2],
        candidates={name: score[-2] for name, score in scores.items()},
        notes=notes,
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
    bytes: float = 0.0


def _tree_walk(
    tree: ModuleTree,
    costs: dict[str, float],
    num_stages: int,
    fixed: dict[str, int],
    hw: Hardware,
    *,
    renumber: bool,
) -> dict[str, int]:
    """The paper's breadth-first walk (Algorithm 1 with segmentation and D'Hondt)."""
    subtree = _free_subtree_costs(tree.root, costs, fixed)
    on_device = None if hw.uniform else _OnDevices(tree, hw, fixed, costs)
    subtree_bytes = {} if on_device is None else _free_subtree_costs(
        tree.root, {n.name: hw.bytes_of(n.name) for n in tree.nodes()}, fixed)
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
        if on_device is None:
            items = [_Item(None, own_load)] + [_Item(c, subtree[c.name]) for c in called]
            _cut_items(items, devices, queue, fixed, stage)
            continue
        own_bytes = hw.bytes_of(node.name) + sum(subtree_bytes[c.name] for c in uncalled)
        items = [_Item(None, own_load, own_bytes)]
        items += [_Item(c, subtree[c.name], subtree_bytes[c.name]) for c in called]
        on_device.cut(items, devices, queue, stage)
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


class _OnDevices:
    """The tree walk's cuts on stages of unequal speed and memory (`smpart.partitioning.unequal`), and
    the load and bytes each stage holds so far (pins included)."""

    def __init__(self, tree: ModuleTree, hw: Hardware, fixed: dict[str, int],
                 costs: dict[str, float]) -> None:
        self.hw, self.fixed = hw, fixed
        self.load = [0.0] * len(hw.speed)
        self.bytes = [0.0] * len(hw.speed)
        for name, s in fixed.items():
            self.add(s, costs[name], hw.bytes_of(name))
        units = {u.name for u in _leaf_units(tree.root, fixed)}
        self.units_below: dict[str, int] = {}
        for node in _post_order(tree.root):
            own = int(node.name in units)
            self.units_below[node.name] = own + sum(self.units_below[c.name] for c in node.children)

    def add(self, device: int, load: float, nbytes: float) -> None:
        self.load[device] += load
        self.bytes[device] += nbytes

    def cut(self, items: list[_Item], devices: list[int], queue: deque[tuple[ModuleNode, list[int]]],
            stage: dict[str, int]) -> None:
        """Place ``items`` (the node's own load first, then its called children) on ``devices``."""
        own, children = items[0], items[1:]
        self.add(devices[0], own.cost, own.bytes)  # the node and its uncalled children sit there already
        if not children:
            return  # a lone own load cannot be split: the spare devices stay idle (the leaf sequence wins)
        args = ([c.cost for c in children], [c.bytes for c in children],
                [self.units_below[c.node.name] for c in children], [self.hw.speed[d] for d in devices],
                [self.load[d] for d in devices])
        room = [self.hw.capacity[d] - self.bytes[d] for d in devices]
        shares = share_devices(*args, room) or share_devices(*args, [math.inf] * len(devices))
        if shares is None:  # too few children to fill the devices: one each, the rest stay idle
            shares = [Share(range(i, i + 1), range(i, i + 1)) for i in range(len(children))]
        for share in shares:
            given = [devices[p] for p in share.devices]
            if share.split is None:
                for i in share.items:
                    self._place(children[i], given[0], stage)
                continue
            for i in share.items:  # the lighter children at the ends of the heaviest one's run
                if i != share.split:
                    self._place(children[i], given[0] if i < share.split else given[-1], stage)
            queue.append((children[share.split].node, given))

    def _place(self, item: _Item, device: int, stage: dict[str, int]) -> None:
        _place_subtree(item.node, device, self.fixed, stage)
        self.add(device, item.cost, item.bytes)


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
    hw: Hardware,
) -> dict[str, int]:
    """Exact min-max cut of the call-ordered units, every other free node riding with its anchor
    (on unequal devices: of the slowest stage's time, within each device's memory when it can),
    the root's own load seated as `_root_seatings` says."""
    answers = []
    for anchor, pinned in _root_seatings(tree.root, fixed, units, costs, num_stages):
        unit_stage = _cut_units(units, anchor, costs, num_stages, pinned, hw)
        answers.append(_spread_units(anchor, unit_stage, pinned))
    return answers[_fastest(answers, costs, hw)]


def _cut_units(
    units: list[ModuleNode],
    anchor: dict[str, str],
    costs: dict[str, float],
    num_stages: int,
    fixed: dict[str, int],
    hw: Hardware,
) -> dict[str, int]:
    """Stage of every unit: the exact cut of their costs (each with its riders) after the load
    ``fixed`` puts on each stage."""
    unit_cost = _unit_costs(anchor, costs)
    costs_in_order = [unit_cost[u.name] for u in units]
    preload = _pin_loads(fixed, costs, num_stages)
    if hw.uniform:
        segmentation = min_max_segments(costs_in_order, num_stages, preload=preload)
    else:
        unit_bytes = _unit_costs(anchor, {name: hw.bytes_of(name) for name in anchor})
        pinned_bytes = [0.0] * num_stages
        for name, s in fixed.items():
            pinned_bytes[s] += hw.bytes_of(name)
        room = [c - b for c, b in zip(hw.capacity, pinned_bytes, strict=True)]
        try:
            segmentation = min_max_segments(
                costs_in_order, num_stages, preload=preload, speeds=hw.speed,
                memory=[unit_bytes.get(u.name, 0.0) for u in units], capacity=room)
        except DoesNotFit:  # nothing fits: the fastest cut, which the caller reports as overflowing
            segmentation = min_max_segments(costs_in_order, num_stages, preload=preload, speeds=hw.speed)
    return dict(zip((u.name for u in units), segmentation.stage_of_items(), strict=True))


def _root_seatings(
    root: ModuleNode, fixed: dict[str, int], units: list[ModuleNode], costs: dict[str, float], num_stages: int
) -> list[tuple[dict[str, str], dict[str, int]]]:
    """The ways to seat the root's own load (the root and its children that call nothing), each as
    (every free node's anchor unit, the nodes fixed on a stage): riding with the first unit, and,
    where it is some work, alone on stage 0 with the units on the later stages (a first device
    much slower than the rest is best left with the model's own code only, as the tree walk may
    leave it). A stage with no work is no stage, so a root costing nothing is never alone."""
    anchor = _anchors(root, fixed, units)
    seatings = [(anchor, fixed)]
    if root.name in fixed or any(u is root for u in units) or num_stages < 2:
        return seatings
    unit_names = {u.name for u in units}
    alone = {root.name}
    for child in root.children:
        subtree = [n.name for n in child.walk()]
        if not unit_names.intersection(subtree):
            alone.update(name for name in subtree if name not in fixed)
    if sum(costs[name] for name in alone) > 0:
        rest = {name: unit for name, unit in anchor.items() if name not in alone}
        seatings.append((rest, {**fixed, **dict.fromkeys(alone, 0)}))
    return seatings


def _fastest(answers: list[dict[str, int]], costs: dict[str, float], hw: Hardware) -> int:
    """Which answer's slowest stage is fastest; the earlier one unless a later one is strictly so."""
    def slowest(stage: dict[str, int]) -> float:
        loads = [0.0] * len(hw.speed)
        for name, s in stage.items():
            loads[s] += costs[name]
        return max(load / v for load, v in zip(loads, hw.speed, strict=True))

    best = 0
    for i, answer in enumerate(answers):
        if slowest(answer) < slowest(answers[best]) * (1 - _TIE_TOLERANCE):
            best = i
    return best


# ---------------------------------------------------------------- reuse-aware


def _reuse_aware(
    tree: ModuleTree,
    costs: dict[str, float],
    num_stages: int,
    fixed: dict[str, int],
    units: list[ModuleNode],
    loop: set[str],
    contiguous: dict[str, int],
    hw: Hardware,
    *,
    renumber: bool,
) -> tuple[dict[str, int], bool]:
    """Loop units on any stage, ordered units cut contiguously around them (`smpart.partitioning.reuse`).

    ``contiguous`` (the leaf-sequence answer) seeds the search. Returns the stages and whether
    the search proved them optimal under the rule.
    """
    ordered = [u.name for u in units if u.name not in loop]
    looped = [u.name for u in units if u.name in loop]
    answers: list[dict[str, int]] = []
    exact: list[bool] = []
    for anchor, pinned in _root_seatings(tree.root, fixed, units, costs, num_stages):
        unit_cost = _unit_costs(anchor, costs)
        placement = place_loop_units(
            [unit_cost[name] for name in ordered],
            [unit_cost[name] for name in looped],
            num_stages,
            _pin_loads(pinned, costs, num_stages),
            seed=[contiguous[name] for name in looped],
            speeds=None if hw.uniform else hw.speed,
        )
        unit_stage = dict(zip(looped, placement.loop_stage, strict=True))
        unit_stage.update(zip(ordered, placement.ordered_stage, strict=True))
        answers.append(_spread_units(anchor, unit_stage, pinned))
        exact.append(placement.exact)
    best = _fastest(answers, costs, hw)
    stage = answers[best]
    if renumber:
        stage = _renumber_by_first_call(tree, stage, leading=set(ordered))
    return stage, exact[best]


def _unit_costs(anchor: dict[str, str], costs: dict[str, float]) -> dict[str, float]:
    """Each unit's cost: its own plus that of every node riding with it."""
    total: dict[str, float] = {}
    for name, unit in anchor.items():
        total[unit] = total.get(unit, 0.0) + costs[name]
    return total


def _pin_loads(fixed: dict[str, int], costs: dict[str, float], num_stages: int) -> list[float | None]:
    """Load pinned on each stage, None where nothing is pinned (that stage needs a unit)."""
    preload: list[float | None] = [None] * num_stages
    for name, s in fixed.items():
        preload[s] = (preload[s] or 0.0) + costs[name]
    return preload


def _spread_units(
    anchor: dict[str, str], unit_stage: dict[str, int], fixed: dict[str, int]
) -> dict[str, int]:
    """Stage of every node: fixed ones where they are, the rest with their unit."""
    stage = dict(fixed)
    for name, unit in anchor.items():
        stage[name] = unit_stage[unit]
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
    stage: dict[str, int], costs: dict[str, float], num_stages: int, ordered: list[ModuleNode], hw: Hardware
) -> tuple[bool, bool, bool, float, tuple[float, ...]]:
    """(leaves a stage empty, ordered units out of pipeline order, overflows a device's memory,
    slowest stage's time, the other stages' times from the slowest down): lower is better. The
    last breaks ties on unequal devices only (on alike ones the earlier candidate keeps them)."""
    loads = [0.0] * num_stages
    nbytes = [0.0] * num_stages
    used = [False] * num_stages
    for name, s in stage.items():
        loads[s] += costs[name]
        nbytes[s] += hw.bytes_of(name)
        used[s] = True
    along = [stage[u.name] for u in ordered]
    steps_back = any(later < earlier for earlier, later in pairwise(along))
    over = any(b > c for b, c in zip(nbytes, hw.capacity, strict=True))
    times = sorted((load / v for load, v in zip(loads, hw.speed, strict=True)), reverse=True)
    return (not all(used), steps_back, over, times[0], () if hw.uniform else tuple(times[1:]))


def _renumber_by_first_call(
    tree: ModuleTree, stage: dict[str, int], leading: set[str] | None = None
) -> dict[str, int]:
    """Renumber stages so that the stage holding the earliest call is 0, the next one 1, ...

    With ``leading`` (the ordered units), a stage holding any of them is placed by its earliest
    one, so their order survives; a stage holding none is placed by its earliest call.
    """
    first = {s: math.inf for s in set(stage.values())}
    lead = dict(first)
    for node in tree.nodes():
        if node.call_order is not None:
            s = stage[node.name]
            first[s] = min(first[s], node.call_order)
            if leading is not None and node.name in leading:
                lead[s] = min(lead[s], node.call_order)
    key = {s: lead[s] if lead[s] < math.inf else first[s] for s in first}
    ordered = sorted(key, key=lambda s: (key[s], s))
    slots = sorted(first)  # stages in use keep their set of numbers, only the order changes
    mapping = dict(zip(ordered, slots, strict=True))
    return {name: mapping[s] for name, s in stage.items()}


def _call_key(node: ModuleNode) -> tuple[float, str]:
    return (node.call_order if node.call_order is not None else math.inf, node.name)


def _post_order(root: ModuleNode) -> Iterator[ModuleNode]:
    """Children before parents, without recursion (trees can be deep)."""
    return reversed(list(root.walk()))
