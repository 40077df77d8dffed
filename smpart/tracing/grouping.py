"""From per-module records to tree nodes: merge modules that share parameters, place, order.

A partitioner must never put two modules that share an ``nn.Parameter`` on different stages (a
tied embedding and LM head would then need the same weight in two places). So modules are first
grouped with a union-find over parameter (and buffer) identity; each group becomes one
`ModuleNode`, placed under the lowest common ancestor of its members' parents and ordered at
its first call. A module object registered under several names is naturally a single member
with several names. Costs of a group add up; each parameter is counted once in the whole tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from smpart.tracing.recorder import INPUT_INDEX, CallStats
from smpart.tracing.tree import INPUT, DataEdge, ModuleNode


@dataclass
class ModuleInventory:
    """Every module object of a model once, in registration order, with all of its names."""

    modules: list[nn.Module]
    names: list[list[str]]

    @classmethod
    def of(cls, model: nn.Module) -> ModuleInventory:
        index: dict[int, int] = {}
        modules: list[nn.Module] = []
        names: list[list[str]] = []
        for name, module in model.named_modules(remove_duplicate=False):
            i = index.setdefault(id(module), len(modules))
            if i == len(modules):
                modules.append(module)
                names.append([])
            if name not in names[i]:
                names[i].append(name)
        return cls(modules, names)


def _union_find_groups(modules: Sequence[nn.Module]) -> list[int]:
    """``group[i]``: the representative module index of module ``i``'s shared-parameter group."""
    parent = list(range(len(modules)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, module in enumerate(modules):
        for tensor in itertools.chain(module._parameters.values(), module._buffers.values()):
            if tensor is None:
                continue
            j = owner.setdefault(id(tensor), i)
            a, b = find(i), find(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return [find(i) for i in range(len(modules))]


def _common_prefix(paths: list[str]) -> str:
    """Longest common dotted prefix: ``a.b.c``, ``a.b.d`` → ``a.b``; ``a``, ``b`` → ``""``."""
    split = [p.split(".") if p else [] for p in paths]
    common = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _parent_path(name: str) -> str:
    return name.rpartition(".")[0]


@dataclass
class _Group:
    members: list[int]
    parent: int | None = None  # representative of the parent group


def build_nodes(
    inventory: ModuleInventory, stats: list[CallStats], seconds: list[float] | None = None
) -> tuple[ModuleNode, list[str]]:
    """The root `ModuleNode` and, for every module index, the canonical name of its node.

    ``seconds[i]``, when given, is module ``i``'s measured self time (it becomes ``time_s``).
    """
    modules, names = inventory.modules, inventory.names
    rep = _union_find_groups(modules)
    groups: dict[int, _Group] = {}
    for i, r in enumerate(rep):
        groups.setdefault(r, _Group([])).members.append(i)

    def call_key(i: int) -> tuple:
        first = stats[i].first_call
        return (first is None, first if first is not None else 0, i)

    for group in groups.values():
        group.members.sort(key=call_key)
    groups = dict(sorted(groups.items()))
    root_rep = rep[0]
    path_index = {name: i for i, module_names in enumerate(names) for name in module_names}
    for r, group in groups.items():
        if r != root_rep:
            group.parent = _parent_group(r, group, names, path_index, rep, root_rep)
    _break_cycles(groups, root_rep)

    nodes = {r: _make_node(group, modules, names, stats, r == root_rep) for r, group in groups.items()}
    if seconds is not None:
        for r, group in groups.items():
            nodes[r].time_s = sum(seconds[i] for i in group.members)
    for r, group in groups.items():  # r, the smallest member index, is the registration order
        if group.parent is not None:
            nodes[group.parent].children.append(nodes[r])
    _order_children(nodes[root_rep])
    node_name = [nodes[rep[i]].name for i in range(len(modules))]
    return nodes[root_rep], node_name


def _order_children(root: ModuleNode) -> None:
    """Sort every node's children by first call, never-called ones last (in registration order).

    A container that is never called itself (an ``nn.ModuleList`` of layers) takes the first
    call of its descendants, so ``transformer.h`` sits where its layers ran; it keeps
    ``call_count == 0``. Children are appended in registration order, and the sort is stable.
    """
    for node in reversed(list(root.walk())):  # children before parents
        orders = [c.call_order for c in node.children if c.call_order is not None]
        if node.call_order is not None:
            orders.append(node.call_order)
        node.call_order = min(orders) if orders else None
        node.children.sort(key=lambda c: (c.call_order is None, c.call_order or 0))


def _parent_group(
    r: int, group: _Group, names: list[list[str]], path_index: dict[str, int], rep: list[int], root_rep: int
) -> int:
    """The group holding the lowest common ancestor of the parents of all the group's names."""
    member_names = [name for i in group.members for name in names[i]]
    path = _common_prefix([_parent_path(n) for n in member_names])
    while path and (path not in path_index or rep[path_index[path]] == r):
        path = _parent_path(path)
    return rep[path_index[path]] if path else root_rep


def _break_cycles(groups: dict[int, _Group], root_rep: int) -> None:
    """Re-attach to the root any group whose parent chain does not reach the root (only possible
    with exotic aliasing, where one module object sits under two unrelated parents)."""
    for r, group in groups.items():
        seen, current = {r}, group.parent
        while current is not None and current != root_rep:
            if current in seen:
                group.parent = root_rep
                break
            seen.add(current)
            current = groups[current].parent


def _make_node(
    group: _Group, modules: list[nn.Module], names: list[list[str]], stats: list[CallStats], is_root: bool
) -> ModuleNode:
    members = group.members
    node_names: list[str] = [""] if is_root else []
    for i in members:
        first = stats[i].called_as
        for name in ([first] if first else []) + names[i]:
            if name not in node_names:
                node_names.append(name)
    params = {id(p): p for i in members for p in modules[i]._parameters.values() if p is not None}
    buffers = {id(b): b for i in members for b in modules[i]._buffers.values() if b is not None}
    called = [stats[i].first_call for i in members if stats[i].first_call is not None]
    classes = list(dict.fromkeys(type(modules[i]).__name__ for i in members))
    kept = [stats[i].checkpoint_bytes for i in members if stats[i].checkpoint_bytes is not None]
    return ModuleNode(
        name=node_names[0],
        class_name="+".join(classes),
        names=node_names,
        call_order=min(called) if called else None,
        call_count=sum(stats[i].calls for i in members),
        param_count=sum(p.numel() for p in params.values()),
        param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers.values()),
        activation_bytes=sum(stats[i].activation_bytes for i in members),
        flops=float(sum(stats[i].flops for i in members)),
        op_bytes=sum(stats[i].op_bytes for i in members),
        saved_bytes=sum(stats[i].saved_bytes for i in members),
        time_s=None,
        checkpoint_bytes=sum(kept) if kept else None,
        call_inputs=next((stats[i].call_inputs for i in members if stats[i].call_inputs is not None), None),
    )


def build_edges(edges: dict[tuple[int, int], int], node_name: list[str]) -> list[DataEdge]:
    """Module-to-module byte counts turned into node-to-node `DataEdge` s (self-loops dropped)."""
    merged: dict[tuple[str, str], int] = {}
    for (src, dst), nbytes in edges.items():
        key = (INPUT if src == INPUT_INDEX else node_name[src], node_name[dst])
        if key[0] != key[1]:
            merged[key] = merged.get(key, 0) + nbytes
    return [DataEdge(src, dst, nbytes) for (src, dst), nbytes in merged.items()]
