"""Terminal views with rich: a module tree coloured by stage and a per-stage table.

Every node line reads ``name Class [stage] compute% memory% params calls``: the name relative to
its parent (as ``print(model)`` shows it), the shares those of the node's whole *subtree*. Two
things keep a 1,000-module model readable:

* in a run of same-class siblings (the 48 blocks of a transformer) only the first is expanded,
  and a stretch of them on one stage shows its first and last member around a one-line summary,
  so every cut between stages stays visible;
* ``max_depth`` stops expanding below a depth and says how many modules are folded away.

Under tensor parallelism (a partition whose ``meta`` records it, see `smpart.viz.split`) a split
node's line ends in a ``tp×2 column`` tag, and the stage table and summary count the split
modules (a node of tied modules counts once, as it shows as one line).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from smpart.errors import ConfigError
from smpart.partitioning.result import Partition
from smpart.tracing.tree import ModuleNode, ModuleTree
from smpart.viz.split import TensorSplit, tensor_split

STAGE_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
#: Runs of at least this many same-class siblings on one stage are collapsed.
COLLAPSE_RUN = 4
#: The tensor-parallel tag of a split module: a colour no stage uses.
SPLIT_STYLE = "bold dark_orange"


def stage_colour(stage: int | None) -> str:
    return "white" if stage is None else STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def show(item: Partition | ModuleTree, console: Console | None = None, max_depth: int | None = None) -> None:
    """Print a `Partition` (the stage-coloured tree, the per-stage table) or a costed `ModuleTree`.

    ``console`` is a ``rich.console.Console`` (a fresh one by default); ``max_depth`` stops
    expanding the tree below that depth.
    """
    if isinstance(item, Partition):
        show_partition(item, console, max_depth)
    elif isinstance(item, ModuleTree):
        show_tree(item, console, max_depth)
    else:
        raise ConfigError(f"show() prints a Partition or a ModuleTree, got {type(item).__name__}")


def show_partition(part: Partition, console: Console | None = None, max_depth: int | None = None) -> None:
    """Print the stage-coloured tree and the per-stage table of ``part``."""
    (console or Console()).print(
        Group(partition_tree_view(part, max_depth), stage_table(part), stage_summary(part))
    )


def show_tree(tree: ModuleTree, console: Console | None = None, max_depth: int | None = None) -> None:
    """Print a costed `ModuleTree` (no stages yet), as ``smpart trace`` does."""
    console = console or Console()
    console.print(_TreeView(tree, None, max_depth, None).build())
    console.print(
        f"{len(tree)} nodes · {_count(sum(n.param_count for n in tree.nodes()))} parameters · "
        f"{_amount(tree.total_compute())} {tree.compute_unit} · {_bytes(tree.total_memory())} training memory"
    )


def partition_tree_view(part: Partition, max_depth: int | None = None) -> Tree:
    return _TreeView(part.tree, part, max_depth, tensor_split(part)).build()


def stage_table(part: Partition) -> Table:
    """One row per stage: modules, compute share, memory, parameters, weighted cost; under tensor
    parallelism also how many of its modules are split (``tp×2 split``). A partition cut for
    devices (``partition(..., devices=...)``, or a plan's) names each stage's device and shows the
    memory against it; cut for devices of unequal speed, also each stage's time (cost ÷ speed)."""
    loads = part.stage_loads()
    total_compute = sum(s.compute for s in loads) or 1.0
    split = tensor_split(part)
    devices = _device_labels(part)
    capacity = part.meta.get("device_memory")
    timed = part.devices is not None and len(set(part.stage_speeds)) > 1
    table = Table(title=f"{part.num_stages} stages, memory_weight={part.memory_weight:g}")
    columns = ["stage", "modules", "compute", "memory", "params", "cost"]
    if split is not None:
        columns.insert(2, f"tp×{split.degree} split")
    if timed:
        columns.append("time")
    if devices is not None:
        columns.append("device")
    for column in columns:
        table.add_column(column, justify="left" if column in ("stage", "device") else "right")
    times = part.stage_times
    for stage, load in enumerate(loads):
        memory = _bytes(load.memory) + (f" / {_bytes(capacity[stage])}" if capacity else "")
        over = bool(capacity) and load.memory > capacity[stage]
        cells: list[str | Text] = [
            Text(f"stage {stage}", style=stage_colour(stage)),
            str(len(part.modules_on(stage))),
            f"{100 * load.compute / total_compute:.1f}%",
            Text(memory, style="bold red" if over else ""),
            _count(load.param_count),
            f"{load.cost:.3f}",
        ]
        if split is not None:
            cells.insert(2, str(sum(1 for name in split.styles if part.node_stage[name] == stage)))
        if timed:
            cells.append(f"{times[stage]:.3f}")
        if devices is not None:
            cells.append(devices[stage])
        table.add_row(*cells)
    return table


def _device_labels(part: Partition) -> list[str] | None:
    """Each stage's device in words: its type (speed and memory), or a plan's description."""
    kinds = part.devices
    if kinds is not None:
        return [kind.describe() for kind in kinds]
    names = part.meta.get("device_names")
    return [str(n) for n in names] if names and len(names) == part.num_stages else None


def stage_summary(part: Partition) -> Text:
    """One line: how uneven the stages are and how much activation crosses the cuts; under tensor
    parallelism a second: how many modules are split, by style."""
    timed = part.devices is not None and len(set(part.stage_speeds)) > 1
    first = (f"time on each stage's device {part.imbalance:.3f} (slowest ÷ perfectly balanced)" if timed
             else f"cost {part.imbalance:.3f}")
    text = Text(
        f"imbalance (max/mean): {first} · compute {part.compute_imbalance:.3f} · "
        f"memory {part.memory_imbalance:.3f} · {_bytes(part.cut_bytes())} of activations cross stages"
    )
    split = tensor_split(part)
    if split is not None:
        text.append("\n" + split.summary(), style=SPLIT_STYLE)
    return text


@dataclass
class _TreeView:
    tree: ModuleTree
    part: Partition | None
    max_depth: int | None
    split: TensorSplit | None

    def __post_init__(self) -> None:
        # Subtree totals, children before parents.
        self._compute: dict[str, float] = {}
        self._memory: dict[str, float] = {}
        #: Earliest call in each subtree: containers (ModuleList) are never called themselves.
        self._first_call: dict[str, float] = {}
        for node in reversed(list(self.tree.nodes())):
            kids = node.children
            own = node.call_order if node.called and node.call_order is not None else math.inf
            self._first_call[node.name] = min([own] + [self._first_call[c.name] for c in kids])
            self._compute[node.name] = self.tree.compute_of(node) + sum(self._compute[c.name] for c in kids)
            self._memory[node.name] = self.tree.memory_of(node) + sum(self._memory[c.name] for c in kids)
        #: (lowest, highest) stage anywhere in each subtree: shows cuts inside folded blocks.
        self._span: dict[str, tuple[int, int]] = {}
        if self.part is not None:
            for node in reversed(list(self.tree.nodes())):
                stages = [self.part.node_stage[node.name]]
                for child in node.children:
                    stages.extend(self._span[child.name])
                self._span[node.name] = (min(stages), max(stages))
        #: Split nodes strictly below each node: a folded line says how many it hides.
        self._split_below: dict[str, int] = {}
        if self.split is not None:
            for node in reversed(list(self.tree.nodes())):
                self._split_below[node.name] = sum(
                    self._split_below[c.name] + (c.name in self.split.styles) for c in node.children)

    def build(self) -> Tree:
        root = Tree(self._label(self.tree.root, ""), guide_style="dim")
        stack = [(self.tree.root, root, 0)]
        while stack:
            node, branch, depth = stack.pop()
            if self.max_depth is not None and depth >= self.max_depth and node.children:
                hidden = sum(1 for _ in node.walk()) - 1
                branch.add(Text(f"… {hidden} modules below", style="dim"))
                continue
            pending = []
            in_call_order = sorted(node.children, key=lambda c: self._first_call[c.name])
            for entry, expand in self._entries(in_call_order):
                if isinstance(entry, Text):
                    branch.add(entry)
                    continue
                folded = not expand or (self.max_depth is not None and depth + 1 >= self.max_depth)
                child_branch = branch.add(self._label(entry, node.name, folded=folded))
                if expand:
                    pending.append((entry, child_branch, depth + 1))
            stack.extend(reversed(pending))
        return root

    def _entries(self, children: list[ModuleNode]) -> Iterator[tuple[ModuleNode | Text, bool]]:
        """``(child, expand it?)`` in call order; long runs of look-alike siblings are folded.

        In a run (same class, with sub-modules: the blocks of a ModuleList) only the first is
        expanded; the others get one line each, and a stretch of them on one stage shows only
        its first and last around a summary line, so every cut between stages stays visible.
        """
        i = 0
        while i < len(children):
            j = i
            while j + 1 < len(children) and _alike(children[i], children[j + 1]):
                j += 1
            run = children[i : j + 1]
            i = j + 1
            if len(run) < COLLAPSE_RUN:
                yield from ((child, True) for child in run)
                continue
            yield run[0], True
            for same_stage in self._by_stage(run[1:]):
                if len(same_stage) < COLLAPSE_RUN:
                    yield from ((child, False) for child in same_stage)
                    continue
                yield same_stage[0], False
                yield self._summary(same_stage[1:-1]), False
                yield same_stage[-1], False

    def _by_stage(self, nodes: list[ModuleNode]) -> Iterator[list[ModuleNode]]:
        group: list[ModuleNode] = []
        for node in nodes:
            if group and self._span.get(node.name) != self._span.get(group[0].name):
                yield group
                group = []
            group.append(node)
        if group:
            yield group

    def _summary(self, nodes: list[ModuleNode]) -> Text:
        stage = self._stage(nodes[0])
        where = "" if stage is None else f" on stage {stage}"
        return Text(f"… {len(nodes)} more {nodes[0].class_name}{where}", style=f"dim {stage_colour(stage)}")

    def _stage(self, node: ModuleNode) -> int | None:
        return None if self.part is None else self.part.node_stage[node.name]

    def _label(self, node: ModuleNode, parent_name: str, *, folded: bool = False) -> Text:
        stage = self._stage(node)
        colour = stage_colour(stage)
        label = Text(_short_names(node, parent_name), style=f"bold {colour}")
        label.append(f" {node.class_name}", style="dim")
        if stage is not None:
            low, high = self._span[node.name]
            inside = f", parts on {low}–{high}" if low != high else ""
            label.append(f"  [stage {stage}{inside}]", style=colour)
        compute = self._compute[node.name] / (self._compute[self.tree.root.name] or 1.0)
        memory = self._memory[node.name] / (self._memory[self.tree.root.name] or 1.0)
        label.append(f"  {100 * compute:.1f}% compute  {100 * memory:.1f}% memory")
        if node.param_count:
            label.append(f"  {_count(node.param_count)} params", style="dim")
        style = self.split.styles.get(node.name) if self.split is not None else None
        if style:
            label.append(f"  tp×{self.split.degree} {style}", style=SPLIT_STYLE)
        hidden = self._split_below.get(node.name, 0) if folded and node.children else 0
        if hidden:
            label.append(f"  tp×{self.split.degree}: {hidden} split inside", style=f"dim {SPLIT_STYLE}")
        if self._first_call[node.name] == math.inf:
            label.append("  never called", style="italic")
        elif node.call_count > 1:
            label.append(f"  ×{node.call_count} calls", style="italic")
        return label


def _alike(a: ModuleNode, b: ModuleNode) -> bool:
    return a.class_name == b.class_name and bool(a.children) and bool(b.children)


def _short_names(node: ModuleNode, parent_name: str) -> str:
    """Names relative to the parent (``mlp`` under ``h.0``), full where a name lives elsewhere."""
    if not node.name:
        return "(model)"
    prefix = f"{parent_name}." if parent_name else ""
    return ", ".join(n[len(prefix) :] if prefix and n.startswith(prefix) else n for n in node.names)


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:g}"


def _amount(x: float) -> str:
    return _count(x) if x >= 1000 else f"{x:.3g}"


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
