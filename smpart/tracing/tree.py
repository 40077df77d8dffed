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

**Activation checkpointing** changes two costs, and `with_activation_checkpointing` rewrites a
tree for it: a checkpointed module keeps only its inputs for the backward (its ``saved_bytes``
become its ``checkpoint_bytes``; its descendants keep nothing), and every node of its subtree
runs its forward once more in the backward (``recomputed``: `ModuleTree.compute_of` adds one). A
model traced with checkpointing already installed gets the same marks from the tracer, and its
saved bytes are those checkpoint really keeps.

**Tensor parallelism** divides only what it can split. ``ModuleNode.tp_split`` records, per
degree, the `SplitShare` of the node's own parameters and FLOPs that the swap-in's rule divides by
the degree, and the bytes its collectives move (`smpart.tensor_parallel.record_split_shares` fills
it from the model, by the same rule the runtime applies); the planner prices tensor parallelism
from it. A tree without it (built by hand, an older JSON) is priced as if everything split.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from smpart.errors import ConfigError

#: Bytes held per parameter byte during training: weights, gradients and Adam's two moments.
DEFAULT_PARAM_MEMORY_FACTOR = 4.0
#: Share of a node's training compute that is its forward (backward = 2 × forward): what one more
#: forward adds when the node is recomputed, unless the tracer measured the model's own share.
DEFAULT_FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class SplitShare:
    """What a tensor-parallel split of one degree does to a node's own costs.

    ``params`` and ``flops``: the shares of the node's own parameters and FLOPs divided by the
    degree (the rest is replicated on every rank of the group: norms, a row-parallel bias, an
    attention kept whole). ``forward_bytes`` / ``backward_bytes``: bytes its collectives reduce or
    gather per traced batch, summed over calls (a row-parallel output, a column-parallel input's
    gradient); ``forward_collectives`` / ``backward_collectives``: how many collective calls move
    them. ``style``: how its modules are split (``"column"``, ``"row"``, ``"vocab"``, ``"dim"``,
    ``"heads"`` for an attention computing on local heads; ``+``-joined for a node of several
    modules), empty when kept whole.
    """

    params: float = 0.0
    flops: float = 0.0
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    style: str = ""
    #: Collective calls (all-reduces, all-gathers) per forward and per backward of one batch, over
    #: all its calls: each pays a latency whatever its size.
    forward_collectives: int = 0
    backward_collectives: int = 0

    @property
    def split(self) -> bool:
        return bool(self.style)


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
    #: What checkpointing the node would keep for the backward instead of ``saved_bytes``: the
    #: distinct storages its modules were called with (arguments and keyword arguments,
    #: parameters excluded), summed over calls, plus any model output it returned (the loss keeps
    #: those anyway). None when unknown (a tree built by hand or an older JSON).
    checkpoint_bytes: int | None = None
    #: The node is a checkpointed module: it keeps only its inputs (``saved_bytes`` counts those).
    checkpointed: bool = False
    #: The node's forward runs again in the backward (it is, or is inside, a checkpointed module).
    recomputed: bool = False
    #: Tensor-parallel degree -> what a split of that degree divides (see `SplitShare`); a degree
    #: recorded on the tree but absent here splits nothing of this node.
    tp_split: dict[int, SplitShare] = field(default_factory=dict)
    #: The arguments of the first call of the node's first-called module, described: tensors' shapes
    #: and dtypes, plain values (`smpart.tracing.call_inputs`); None when unknown.
    call_inputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.names:
            self.names = [self.name]
        self.tp_split = {int(d): s if isinstance(s, SplitShare) else SplitShare(**s)
                         for d, s in self.tp_split.items()}

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
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpointed": self.checkpointed,
            "recomputed": self.recomputed,
        }
        if self.tp_split:
            out["tp_split"] = {str(d): dataclasses.asdict(s) for d, s in self.tp_split.items()}
        if self.call_inputs is not None:
            out["call_inputs"] = self.call_inputs
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
    #: Share of training compute that is forward (`DEFAULT_FORWARD_SHARE`, or measured by the
    #: tracer): the price of recomputing a node, as a fraction of its compute.
    forward_share: float = DEFAULT_FORWARD_SHARE
    #: Tensor-parallel degrees whose splits the nodes' ``tp_split`` records (empty: unknown).
    tp_degrees: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.tp_degrees = tuple(sorted(int(d) for d in self.tp_degrees))
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
        """The node's own compute in the tree's unit (measured seconds, else FLOPs), including the
        forward it runs again in the backward when it is ``recomputed``.

        In FLOPs, a node's compute is its forward FLOPs standing for a whole training step
        (forward and backward) of ``1 / forward_share`` times as many; one more forward thus adds
        ``forward_share`` of it, in either unit.
        """
        return self.base_compute_of(node) + self.recompute_of(node)

    def base_compute_of(self, node: ModuleNode) -> float:
        """The node's own compute without any recomputation (forward FLOPs, or measured seconds)."""
        if self.compute_unit == "time":
            return node.time_s or 0.0
        return node.flops

    def recompute_of(self, node: ModuleNode) -> float:
        """What recomputing the node adds to `compute_of` (0 when it is not recomputed)."""
        return self.base_compute_of(node) * self.forward_share if node.recomputed else 0.0

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
            "forward_share": self.forward_share,
            "tp_degrees": list(self.tp_degrees),
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
            forward_share=data.get("forward_share", DEFAULT_FORWARD_SHARE),
            tp_degrees=tuple(data.get("tp_degrees", ())),
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


# ---------------------------------------------------------------------------- checkpointing
def with_activation_checkpointing(tree: ModuleTree, names: list[str] | tuple[str, ...]) -> ModuleTree:
    """A copy of ``tree`` whose modules ``names`` are checkpointed.

    Each named node (a module name, or any of the names of a merged node) keeps only its inputs:
    its ``saved_bytes`` become its ``checkpoint_bytes`` and its descendants' become 0; every node of
    its subtree is marked ``recomputed`` (one more forward, see `ModuleTree.compute_of`). A name
    inside a subtree already checkpointed changes nothing (the outer module recomputes it).

    Inputs are counted per node, so a tensor handed to several checkpointed modules (a mask given
    to every block) is counted by each; a trace of the model with checkpointing installed counts
    it once. Only a tree that counts saved tensors (``activation_memory == "saved"``, any traced
    trainable model) sees its memory change. Raises `ConfigError` for an unknown name or a node
    whose input bytes are unknown.
    """
    out = ModuleTree.from_dict(tree.to_dict())
    targets = []
    for name in names:
        if name not in out:
            raise ConfigError(f"activation checkpointing: the tree has no module {name!r}")
        node = out.node(name)
        if node.checkpoint_bytes is None:
            raise ConfigError(f"activation checkpointing: module {name!r} has no checkpoint_bytes, so what "
                              "it would keep is unknown; trace the model again (smpart.trace) to get them")
        targets.append(node)
    depth = {id(n): d for n, d in _depths(out.root)}
    for node in sorted(targets, key=lambda n: depth[id(n)]):  # outermost first
        if node.recomputed:
            continue
        for inner in node.walk():
            inner.saved_bytes = 0
            inner.checkpointed = False
        node.saved_bytes = node.checkpoint_bytes or 0
        mark_recomputed(node)
    return out


def mark_recomputed(node: ModuleNode) -> None:
    """Mark ``node`` checkpointed and every node of its subtree recomputed."""
    node.checkpointed = True
    for inner in node.walk():
        inner.recomputed = True


def _depths(root: ModuleNode) -> Iterator[tuple[ModuleNode, int]]:
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        yield node, depth
        stack.extend((child, depth + 1) for child in node.children)
