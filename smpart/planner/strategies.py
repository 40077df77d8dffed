"""The strategy space: parallel degrees, micro-batch counts and which devices form each stage.

``pp · tp · dp`` always equals the number of devices. Tensor parallelism stays inside a node
(it all-reduces every layer), so ``tp`` is a power of two that divides every node's device count.
Each node is cut into tensor-parallel groups; a stage takes ``dp`` consecutive groups of a node
ordering, so a stage spans as few nodes as it can and data-parallel replicas share fast links.

Device placement is pruned as Metis prunes it: identical devices are interchangeable, so only
the *order of device types* matters (nodes of one type keep their given order). Every ordering of
the distinct types is tried (a handful for real clusters; fastest-first and slowest-first only
beyond four types).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from smpart.planner.cluster import Cluster, Device
from smpart.planner.cost import StageDevices

#: Orderings of device types tried at most (beyond this: fastest-first and slowest-first only).
MAX_TYPE_ORDERS = 24


@dataclass(frozen=True)
class Strategy:
    pp: int
    tp: int
    dp: int
    microbatches: int
    microbatch_size: int
    stages: tuple[StageDevices, ...]


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tensor_degrees(cluster: Cluster, allowed: list[int] | None = None) -> list[int]:
    smallest = min(node.count for node in cluster.nodes)
    degrees = []
    tp = 1
    while tp <= smallest:
        if all(node.count % tp == 0 for node in cluster.nodes) and (allowed is None or tp in allowed):
            degrees.append(tp)
        tp *= 2
    return degrees


def placements(cluster: Cluster, tp: int, pp: int, dp: int) -> list[tuple[StageDevices, ...]]:
    """Distinct ways to lay ``pp`` stages of ``dp`` tensor-parallel groups over the cluster."""
    seen = set()
    out = []
    for order in _node_orders(cluster):
        groups = _tp_groups(cluster, order, tp)
        stages = tuple(StageDevices(tuple(groups[j * dp:(j + 1) * dp])) for j in range(pp))
        signature = tuple(tuple(d.rank for d in s.devices) for s in stages)
        if signature not in seen:
            seen.add(signature)
            out.append(stages)
    return out


def enumerate_strategies(cluster: Cluster, num_layers: int, global_batch: int, *,
                         tp_degrees: list[int] | None = None, max_microbatches: int | None = None,
                         ) -> Iterator[Strategy]:
    devices = cluster.num_devices
    for tp in tensor_degrees(cluster, tp_degrees):
        for pp in divisors(devices // tp):
            if pp > num_layers:
                continue
            dp = devices // tp // pp
            if global_batch % dp:
                continue
            layouts = placements(cluster, tp, pp, dp)
            for microbatches in divisors(global_batch // dp):
                if max_microbatches is not None and microbatches > max_microbatches:
                    continue
                size = global_batch // dp // microbatches
                for stages in layouts:
                    yield Strategy(pp, tp, dp, microbatches, size, stages)


def _node_orders(cluster: Cluster) -> list[list[int]]:
    by_type: dict[str, list[int]] = {}
    for index, node in enumerate(cluster.nodes):
        by_type.setdefault(node.device.name, []).append(index)
    names = list(by_type)
    if len(names) <= 4:  # 4! = 24 orders
        type_orders = list(itertools.permutations(names))[:MAX_TYPE_ORDERS]
    else:
        speed = {n: cluster.nodes[by_type[n][0]].device.tflops for n in names}
        fastest = sorted(names, key=lambda n: -speed[n])
        type_orders = [tuple(fastest), tuple(reversed(fastest))]
    return [[i for name in order for i in by_type[name]] for order in type_orders]


def _tp_groups(cluster: Cluster, order: list[int], tp: int) -> list[tuple[Device, ...]]:
    by_node: dict[int, list[Device]] = {}
    for device in cluster.devices():
        by_node.setdefault(device.node, []).append(device)
    groups = []
    for node in order:
        members = by_node[node]
        groups.extend(tuple(members[i:i + tp]) for i in range(0, len(members), tp))
    return groups
