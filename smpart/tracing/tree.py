"""`ModuleTree`: the costed module tree every other room reads.

This file imports no torch on purpose: the partitioner and the planner work on a tree of plain
numbers, so their algorithms can be tested (and run) without a model. The tracer
(`smpart.tracing.tracer`) is what turns an ``nn.Module`` into one of these.

A node is a *group* of modules, not always one module: modules that share an ``nn.Parameter``
(a tied input embedding and LM head) are merged into one node placed under their lowest common
ancestor, so no partition can ever split them. A module called several times (an ALBERT layer)
is one node whose costs add up over its calls.

All costs on a node are its *own* ("self") costs, excluding its children: a parent's own
parameters and the code it runs between child calls are load that a partitioner must not ignore.
``total_*`` helpers sum a whole subtree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from smpart.errors import ConfigError

#: Bytes held per parameter byte during training: weights, gradients and Adam's two moments.
DEFAULT_PARAM_MEMORY_FACTOR = 4.0


@dataclass
class ModuleNode:
    """One node of the tree: a module, or modules that share parameters.

    ``name`` is the canonical qualified name ("" for the root); ``names`` lists every qualified
    module name that belongs to the node (more than one when modules were merged because they
    share a parameter, or when one module object is registered under several names).
    """

    name: str
    class_name: str = "Module"
    names: list[str] = field(default_factory=list)
    children: list[ModuleNode] = field(default_factory=list)
    #: Index of the node's first call in the traced forward (0-based), None if never called.
    call_order: int | None = None
    call_count: int = 0
    param_count: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    #: Bytes of the tensors the node's modules returned, summed over all calls: what flows
    #: between modules (data-flow edges, pipeline and tensor-parallel transfers).
    activation_bytes: int = 0
    #: Forward FLOPs of the node's own computation (children excluded), summed over calls.
    flops: float = 0.0
    #: Bytes its own forward operations wrote (every op's fresh output, views excluded), summed
    #: over calls: with ``flops``, the arithmetic intensity a roofline time estimate needs.
    op_bytes: int = 0
    #: Bytes autograd saves for backward in the node's own code (distinct storages, parameters
    #: excluded), summed over calls: what a micro-batch keeps alive until its backward.
    saved_bytes: int = 0
    #: Measured forward+backward seconds of the node's own computation, when measured.
    time_s: float | None = None

    def __post_init__(self) -> None:
        if not self.names:
            self.names = [self.name]

    @property
    def called(self) -> bool:
        return self.call_count > 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def walk(self) -> Iterator[ModuleNode]:
        """This node and all its descendants, parents before children, children in order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "class_name": self.class_name,
            "names": self.names,
            "call_order": self.call_order,
            "call_count": self.call_count,
            "param_count": self.param_count,
            "param_bytes": self.param_bytes,
            "buffer_bytes": self.buffer_bytes,
            "activation_bytes": self.activation_bytes,
            "flops": self.flops,
            "op_bytes": self.op_bytes,
            "saved_bytes": self.saved_bytes,
            "time_s": self.time_s,
        }
        out["children"] = [child.to_dict() for child in self.children]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModuleNode:
        fields = {k: v for k, v in data.items() if k != "children"}
        node = cls(**fields)
        node.children = [cls.from_dict(child) for child in data.get("children", [])]
        return node


@dataclass(frozen=True)
class DataEdge:
    """``nbytes`` of activations produced by node ``src`` are consumed by node ``dst``.

    ``src`` is ``INPUT`` for the model's own inputs. Summed over all calls.
    """

    src: str
    dst: str
    nbytes: int


#: Pseudo node name of the model's example inputs in `DataEdge.src`.
INPUT = "<input>"

#: `ModuleTree.activation_memory`: activations held for backward are the saved tensors...
SAVED = "saved"
#: ...or, for trees without them (built by hand, older JSON), the modules' outputs.
OUTPUTS = "outputs"


@dataclass
class ModuleTree:
    """The costed tree of a model, as `smpart.trace` returns it."""

    root: ModuleNode
    edges: list[DataEdge] = field(default_factory=list)
    param_memory_factor: float = DEFAULT_PARAM_MEMORY_FACTOR
    #: "time" when every called node carries a measured ``time_s``, else "flops".
    compute_unit: str = "flops"
    #: Bytes of the example inputs (the batch the trace ran on).
    input_bytes: int = 0
    #: Which bytes `activation_memory_of` counts: ``"saved"`` (``saved_bytes``) or ``"outputs"``
    #: (``activation_bytes``). None: "saved" when any node has saved bytes, else "outputs".
    activation_memory: str | None = None

    def __post_init__(self) -> None:
        self._index: dict[str, ModuleNode] = {}
        self.reindex()
        if self.activation_memory is None:
            self.activation_memory = SAVED if any(n.saved_bytes for n in self.nodes()) else OUTPUTS
        if self.activation_memory not in (SAVED, OUTPUTS):
            raise ConfigError(f"activation_memory must be {SAVED!r} or {OUTPUTS!r}, "
                              f"got {self.activation_memory!r}")

    # ---------------------------------------------------------------- lookup
    def reindex(self) -> None:
        """Rebuild the name index; call after editing the node structure by hand."""
        self._index = {}
        for node in self.root.walk():
            for name in node.names:
                self._index[name] = node

    def nodes(self) -> Iterator[ModuleNode]:
        """Every node, parents first, children in call order."""
        return self.root.walk()

    def node(self, module_name: str) -> ModuleNode:
        """The node holding module ``module_name`` (KeyError if there is none)."""
        return self._index[module_name]

    def __contains__(self, module_name: str) -> bool:
        return module_name in self._index

    def module_names(self) -> list[str]:
        return list(self._index)

    def __len__(self) -> int:
        return sum(1 for _ in self.nodes())

    # ---------------------------------------------------------------- costs
    def compute_of(self, node: ModuleNode) -> float:
        """The node's own compute in the tree's unit (measured seconds, else FLOPs)."""
        if self.compute_unit == "time":
            return node.time_s or 0.0
        return node.flops

    def activation_memory_of(self, node: ModuleNode) -> int:
        """Bytes of activations the node's own code keeps alive from forward to backward.

        The saved tensors when the trace recorded them, and *instead of* the outputs, not in
        addition: an output that some backward needs is itself a saved tensor (counted once,
        by its storage), and one that none needs is freed as soon as its readers ran. Trees
        without saved bytes (built by hand, older JSON) fall back to the outputs.
        """
        return node.saved_bytes if self.activation_memory == SAVED else node.activation_bytes

    def memory_of(self, node: ModuleNode) -> float:
        """The node's own training memory in bytes: parameter state, buffers and activations
        kept for backward (`activation_memory_of`), for one batch of the traced size."""
        return (
            node.param_bytes * self.param_memory_factor
            + node.buffer_bytes
            + self.activation_memory_of(node)
        )

    def total_compute(self, node: ModuleNode | None = None) -> float:
        return sum(self.compute_of(n) for n in (node or self.root).walk())

    def total_memory(self, node: ModuleNode | None = None) -> float:
        return sum(self.memory_of(n) for n in (node or self.root).walk())

    def node_costs(self, memory_weight: float) -> dict[str, float]:
        """Each node's own cost ``(1 - w)·compute + w·memory``, both normalised by the root's total.

        Keys are canonical node names. The values of all nodes add up to 1 (or 0 for a tree
        with neither compute nor memory).
        """
        total_c = self.total_compute() or 1.0
        total_m = self.total_memory() or 1.0
        w = memory_weight
        return {
            n.name: (1 - w) * self.compute_of(n) / total_c + w * self.memory_of(n) / total_m
            for n in self.nodes()
        }

    # ---------------------------------------------------------------- data flow
    def cut_bytes(self, stage_of_node: dict[str, int]) -> int:
        """Activation bytes that cross stages, given each canonical node name's stage."""
        total = 0
        for edge in self.edges:
            if edge.src == INPUT:
                continue
            if stage_of_node.get(edge.src) != stage_of_node.get(edge.dst):
                total += edge.nbytes
        return total

    # ---------------------------------------------------------------- json
    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root.to_dict(),
            "edges": [[e.src, e.dst, e.nbytes] for e in self.edges],
            "param_memory_factor": self.param_memory_factor,
            "compute_unit": self.compute_unit,
            "input_bytes": self.input_bytes,
            "activation_memory": self.activation_memory,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModuleTree:
        return cls(
            root=ModuleNode.from_dict(data["root"]),
            edges=[DataEdge(*e) for e in data.get("edges", [])],
            param_memory_factor=data.get("param_memory_factor", DEFAULT_PARAM_MEMORY_FACTOR),
            compute_unit=data.get("compute_unit", "flops"),
            input_bytes=data.get("input_bytes", 0),
            activation_memory=data.get("activation_memory"),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> ModuleTree:
        return cls.from_dict(json.loads(text))

    # ---------------------------------------------------------------- building by hand
    @classmethod
    def from_spec(cls, spec: dict[str, Any], **kwargs: Any) -> ModuleTree:
        """Build a tree of plain numbers, for tests and benchmarks.

        ``spec`` is nested dicts: ``{"name": "", "flops": 1, "param_bytes": 4,
        "children": [{"name": "a", "flops": 10}, ...]}``; every `ModuleNode` field may be given.
        Nodes without ``call_order`` get one in pre-order; ``call_count`` defaults to 1.
        """
        counter = iter(range(1 << 62))

        def build(s: dict[str, Any]) -> ModuleNode:
            fields = {k: v for k, v in s.items() if k != "children"}
            fields.setdefault("call_count", 1)
            if fields["call_count"] > 0:
                fields.setdefault("call_order", next(counter))
            node = ModuleNode(**fields)
            node.children = [build(c) for c in s.get("children", [])]
            return node

        return cls(root=build(spec), **kwargs)
