"""`Cluster`: the devices a plan may use, their speed and memory, and the links between them.

A cluster is a list of nodes; a node holds ``count`` devices of one `DeviceType` joined by an
intra-node link; nodes talk over the inter-node network (one figure, or one per node pair).
Nodes need not be alike: ``1 × A100 + 2 × V100 + 4 × V100`` is a valid cluster.

Bandwidths are stored in bytes per second; files and presets speak Gbit/s (``*_gbps``) and
GiB because that is how vendors and clouds quote them. A TOML file looks like
``examples/cluster.toml``::

    inter_node_gbps = 10
    [[node]]
    device = "V100"        # a preset, or a name defined under [device.NAME]
    count = 4
    intra_node_gbps = 170
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from smpart.devices import GBS, GIB, PRESETS, DeviceType, device_type
from smpart.errors import ConfigError

__all__ = ["GBPS", "GBS", "GIB", "PRESETS", "Cluster", "Device", "DeviceType", "Node", "device_type"]

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Node:
    """``count`` devices of one type, linked inside the node at ``intra_bandwidth`` bytes/s."""

    device: DeviceType
    count: int
    intra_bandwidth: float

    def __post_init__(self) -> None:
        if self.count < 1 or self.intra_bandwidth <= 0:
            raise ConfigError(f"a node needs count >= 1 and intra-node bandwidth > 0, got {self}")


@dataclass(frozen=True)
class Device:
    """One device of a cluster: its global rank, node index and type."""

    rank: int
    node: int
    type: DeviceType


@dataclass
class Cluster:
    """Nodes plus the inter-node network (``pair_bandwidth[(a, b)]`` overrides the default)."""

    nodes: list[Node]
    inter_bandwidth: float = 10 * GBPS
    pair_bandwidth: dict[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("a cluster needs at least one node")
        if self.inter_bandwidth <= 0:
            raise ConfigError("inter-node bandwidth must be > 0")
        self.pair_bandwidth = {tuple(sorted(k)): v for k, v in self.pair_bandwidth.items()}

    # ---------------------------------------------------------------- building
    @classmethod
    def homogeneous(cls, device: DeviceType | str, nodes: int, per_node: int,
                    intra_gbps: float = 600.0, inter_gbps: float = 100.0) -> Cluster:
        kind = device_type(device) if isinstance(device, str) else device
        return cls([Node(kind, per_node, intra_gbps * GBPS) for _ in range(nodes)], inter_gbps * GBPS)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a cluster file; errors name the file and the offending key (or line)."""
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"cluster file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from err
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "cluster") -> Cluster:
        return _ClusterReader(data, source).read()

    @classmethod
    def local(cls) -> Cluster:
        """This machine: its CUDA GPUs when torch sees any, else its CPU as one device."""
        import torch  # local: the planner itself needs no torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            props = torch.cuda.get_device_properties(0)
            preset = next((p for p in PRESETS.values() if p.name.split("-")[0] in props.name.upper()), None)
            if preset is None:  # an unknown GPU: a middling guess, and FLOPs alone price it
                kind = DeviceType(props.name, 100.0, props.total_memory)
            else:
                kind = DeviceType(props.name, preset.tflops, props.total_memory, preset.memory_bandwidth)
            return cls([Node(kind, torch.cuda.device_count(), 300 * GBPS)])
        cores = os.cpu_count() or 1
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        # ~50 GFLOP/s per core (AVX2 fp32 FMA at ~3 GHz, sustained); memcpy-speed "links"
        return cls([Node(DeviceType("cpu", 0.05 * cores, memory), 1, 80 * GBPS)])

    # ---------------------------------------------------------------- queries
    def devices(self) -> Iterator[Device]:
        rank = 0
        for index, node in enumerate(self.nodes):
            for _ in range(node.count):
                yield Device(rank, index, node.device)
                rank += 1

    @property
    def num_devices(self) -> int:
        return sum(node.count for node in self.nodes)

    def bandwidth(self, node_a: int, node_b: int) -> float:
        """Bytes/s between a device on ``node_a`` and one on ``node_b``."""
        if node_a == node_b:
            return self.nodes[node_a].intra_bandwidth
        return self.pair_bandwidth.get(tuple(sorted((node_a, node_b))), self.inter_bandwidth)

    def slowest_link(self, node_indices: list[int]) -> float:
        """The slowest link a ring over devices on these nodes must cross."""
        distinct = sorted(set(node_indices))
        if len(distinct) == 1:
            return self.bandwidth(distinct[0], distinct[0])
        return min(self.bandwidth(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:])

    def describe(self) -> str:
        parts = [f"{n.count}×{n.device.name}" for n in self.nodes]
        return f"{len(self.nodes)} node(s): " + ", ".join(parts)


class _ClusterReader:
    """Turns a parsed TOML/dict into a Cluster, naming the key of the first bad value."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data, self.source = data, source

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {message}")

    def number(self, table: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
        if key not in table:
            if default is None:
                raise self.fail(f"{where}.{key}" if where else key, "missing (required)")
            return default
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.fail(f"{where}.{key}" if where else key, f"must be a number > 0, got {value!r}")
        return float(value)

    def read(self) -> Cluster:
        known = {"node", "device", "inter_node_gbps", "link"}
        for key in self.data:
            if key not in known:
                raise self.fail(key, f"unknown key; a cluster file has {sorted(known)}")
        kinds = self.device_types()
        raw_nodes = self.data.get("node")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise self.fail("node", "add at least one [[node]] table (device, count, intra_node_gbps)")
        nodes = [self.node(i, raw, kinds) for i, raw in enumerate(raw_nodes)]
        inter = self.number(self.data, "inter_node_gbps", "", 10.0) * GBPS
        return Cluster(nodes, inter, self.links(len(nodes)))

    def device_types(self) -> dict[str, DeviceType]:
        kinds = {}
        for name, table in self.data.get("device", {}).items():
            where = f"device.{name}"
            if not isinstance(table, dict):
                raise self.fail(where, "must be a table with tflops and memory_gib (and memory_gbs)")
            for key in table:
                if key not in {"tflops", "memory_gib", "memory_gbs"}:
                    raise self.fail(f"{where}.{key}", "unknown key; a device has tflops, memory_gib and "
                                                      "memory_gbs")
            bandwidth = self.number(table, "memory_gbs", where) * GBS if "memory_gbs" in table else None
            kinds[name.upper()] = DeviceType(
                name, self.number(table, "tflops", where), int(self.number(table, "memory_gib", where) * GIB),
                bandwidth,
            )
        return kinds

    def node(self, index: int, raw: Any, kinds: dict[str, DeviceType]) -> Node:
        where = f"node[{index}]"
        if not isinstance(raw, dict):
            raise self.fail(where, "must be a table")
        for key in raw:
            if key not in {"device", "count", "intra_node_gbps"}:
                raise self.fail(f"{where}.{key}", "unknown key; a node has device, count, intra_node_gbps")
        name = raw.get("device")
        if not isinstance(name, str):
            raise self.fail(f"{where}.device", f"must name a device type, got {name!r}")
        try:
            kind = kinds.get(name.upper()) or device_type(name)
        except ConfigError as err:
            raise self.fail(f"{where}.device", str(err)) from None
        count = raw.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise self.fail(f"{where}.count", f"must be an integer >= 1, got {count!r}")
        return Node(kind, count, self.number(raw, "intra_node_gbps", where, 300.0) * GBPS)

    def links(self, num_nodes: int) -> dict[tuple[int, int], float]:
        links = {}
        for i, raw in enumerate(self.data.get("link", [])):
            where = f"link[{i}]"
            pair = raw.get("nodes") if isinstance(raw, dict) else None
            valid = isinstance(pair, list) and len(pair) == 2 and pair[0] != pair[1]
            if not valid or not all(isinstance(n, int) and 0 <= n < num_nodes for n in pair):
                raise self.fail(f"{where}.nodes", f"must be two different node indices in 0..{num_nodes - 1}")
            links[(pair[0], pair[1])] = self.number(raw, "gbps", where) * GBPS
        return links
