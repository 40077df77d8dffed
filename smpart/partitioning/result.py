"""`Partition`: which pipeline stage every module of a model lives on.

The partitioner produces one, the runtime consumes it as is (it never recomputes a partition),
the planner and the views report on it. It is plain data: it keeps the `ModuleTree` it was cut
from so that per-stage figures need nothing else, survives a JSON round trip, and draws nothing
itself; the views take one (`smpart.show(part)`, `smpart.to_html(part, path)`, in `smpart.viz`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from smpart.devices import DeviceType, as_device_type
from smpart.errors import PartitionError
from smpart.tracing.tree import ModuleTree


@dataclass(frozen=True)
class StageLoad:
    """What one stage holds: own compute (tree unit), memory bytes, parameters, weighted cost."""

    compute: float
    memory: float
    param_count: int
    param_bytes: int
    cost: float


class Partition:
    """Stage of every node of a `ModuleTree`.

    ``node_stage`` maps each node's canonical name to its stage; every module name of the tree
    resolves through the node that holds it, so modules that share a parameter always report
    the same stage.
    """

    def __init__(
        self,
        tree: ModuleTree,
        node_stage: dict[str, int],
        num_stages: int,
        memory_weight: float,
        *,
        meta: dict[str, Any] | None = None,
    ) -> None:
        missing = [n.name for n in tree.nodes() if n.name not in node_stage]
        if missing:
            raise PartitionError(f"partition leaves {len(missing)} node(s) unplaced, e.g. {missing[:3]}")
        bad = {s for s in node_stage.values() if not 0 <= s < num_stages}
        if bad:
            raise PartitionError(f"stage(s) {sorted(bad)} outside 0..{num_stages - 1}")
        self.tree = tree
        self.node_stage = dict(node_stage)
        self.num_stages = num_stages
        self.memory_weight = memory_weight
        #: Free-form provenance: how it was made (partitioner, plan, pins), kept in JSON.
        self.meta = dict(meta or {})

    # ---------------------------------------------------------------- lookup
    def stage_of(self, module_name: str) -> int:
        """Stage of module ``module_name`` ("" is the root)."""
        try:
            node = self.tree.node(module_name)
        except KeyError:
            raise PartitionError(
                f"no module named {module_name!r} in this partition; "
                f"names look like {self.tree.module_names()[1:4]}"
            ) from None
        return self.node_stage[node.name]

    def module_stages(self) -> dict[str, int]:
        """Every module name of the model mapped to its stage."""
        return {name: self.node_stage[self.tree.node(name).name] for name in self.tree.module_names()}

    def modules_on(self, stage: int) -> list[str]:
        """Module names living on ``stage``, in tree order."""
        return [
            name
            for node in self.tree.nodes()
            if self.node_stage[node.name] == stage
            for name in node.names
        ]

    # ---------------------------------------------------------------- figures
    def stage_loads(self) -> list[StageLoad]:
        costs = self.tree.node_costs(self.memory_weight)
        sums = [[0.0, 0.0, 0, 0, 0.0] for _ in range(self.num_stages)]
        for node in self.tree.nodes():
            acc = sums[self.node_stage[node.name]]
            acc[0] += self.tree.compute_of(node)
            acc[1] += self.tree.memory_of(node)
            acc[2] += node.param_count
            acc[3] += node.param_bytes
            acc[4] += costs[node.name]
        return [StageLoad(c, m, int(pc), int(pb), w) for c, m, pc, pb, w in sums]

    @property
    def stage_compute(self) -> list[float]:
        return [s.compute for s in self.stage_loads()]

    @property
    def stage_memory(self) -> list[float]:
        return [s.memory for s in self.stage_loads()]

    @property
    def stage_params(self) -> list[int]:
        return [s.param_count for s in self.stage_loads()]

    # ---------------------------------------------------------------- devices
    @property
    def devices(self) -> list[DeviceType] | None:
        """The device type of each stage when it was cut for them (``partition(..., devices=...)``)."""
        specs = self.meta.get("devices")
        return None if not specs else [as_device_type(spec) for spec in specs]

    @property
    def stage_speeds(self) -> list[float]:
        """Each stage's speed relative to the fastest (all 1.0 without devices)."""
        devices = self.devices
        if devices is None:
            return [1.0] * self.num_stages
        fastest = max(d.tflops for d in devices)
        return [d.tflops / fastest for d in devices]

    @property
    def stage_times(self) -> list[float]:
        """Each stage's weighted cost ÷ its speed: what the partitioner balances (the cost itself
        without devices)."""
        return [s.cost / v for s, v in zip(self.stage_loads(), self.stage_speeds, strict=True)]

    @staticmethod
    def _imbalance(values: list[float]) -> float:
        mean = sum(values) / len(values)
        return max(values) / mean if mean > 0 else 1.0

    @property
    def imbalance(self) -> float:
        """Slowest stage's time over the perfectly balanced one (1.0 is perfect balance): the
        weighted costs' max over their mean, or on devices of unequal speed the slowest stage's
        time over total cost ÷ total speed."""
        speeds = self.stage_speeds
        ideal = sum(s.cost for s in self.stage_loads()) / sum(speeds)
        return max(self.stage_times) / ideal if ideal > 0 else 1.0

    @property
    def compute_imbalance(self) -> float:
        return self._imbalance(self.stage_compute)

    @property
    def memory_imbalance(self) -> float:
        return self._imbalance(self.stage_memory)

    def cut_bytes(self) -> int:
        """Activation bytes per step that cross a stage boundary (from the trace's data flow)."""
        return self.tree.cut_bytes(self.node_stage)

    # ---------------------------------------------------------------- json
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "smpart.partition/1",
            "num_stages": self.num_stages,
            "memory_weight": self.memory_weight,
            "node_stage": self.node_stage,
            "meta": self.meta,
            "tree": self.tree.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Partition:
        if data.get("format") != "smpart.partition/1":
            raise PartitionError("not an smpart partition file (expected format 'smpart.partition/1')")
        return cls(
            ModuleTree.from_dict(data["tree"]),
            {k: int(v) for k, v in data["node_stage"].items()},
            int(data["num_stages"]),
            float(data["memory_weight"]),
            meta=data.get("meta"),
        )

    def to_json(self, path: str | None = None) -> str:
        """The partition as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict())
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> Partition:
        """Read a partition from JSON text or from a file path."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path, encoding="utf-8") as fh:
                text = fh.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PartitionError(f"partition JSON is malformed: {err}") from err
        return cls.from_dict(data)

    def show(self, console: Any = None, max_depth: int | None = None) -> None:
        """Print the module tree coloured by stage and the per-stage table (`smpart.show`)."""
        _views().show(self, console, max_depth)

    def to_html(self, path: str | None = None, **views: Any) -> str:
        """The explorer page, written to ``path`` when given (`smpart.to_html`)."""
        return _views().to_html(self, path, **views)

    def _repr_html_(self) -> str:
        return self.to_html()._repr_html_()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Partition)
            and self.node_stage == other.node_stage
            and self.num_stages == other.num_stages
        )

    def __repr__(self) -> str:
        return (
            f"Partition(stages={self.num_stages}, memory_weight={self.memory_weight}, "
            f"imbalance={self.imbalance:.3f})"
        )


#: How a partition draws itself: `smpart.viz`'s views, a floor above, which the package wires in
#: (``smpart/__init__.py``) so that the data imports none of them; ``part.show()`` and
#: ``part.to_html()`` call them.
VIEWS: list[Any] = []


def _views() -> Any:
    if not VIEWS:
        raise PartitionError("a partition draws itself through smpart's views: import smpart first")
    return VIEWS[0]
