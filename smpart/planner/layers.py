"""From a `ModuleTree` to the planner's sequence of layers, and from layer stages back to a tree.

The planner cuts a model into *contiguous runs of layers*. A layer here is a subtree of the
module tree: starting at the root, any subtree holding more than ``max_share`` of the model's
cost, and any container that is never called itself (a ``ModuleList``), is opened up and its
children (in call order) take its place; everything else stays whole. A GPT thus becomes
``wte, wpe, drop, h.0 … h.95, ln_f``: the blocks stay whole (each is well under 1/8 of the
model), which is the granularity the cost model's per-layer tensor-parallel all-reduces assume.

Costs of a layer are its subtree's sums. A parent that was opened keeps its own cost (its own
parameters, the glue code between child calls) and lives with its first-called child, so that
cost is charged to that child's layer. A layer's activation memory is what its nodes keep for
backward (`ModuleTree.activation_memory_of`: the traced saved tensors, else the outputs); a cut
after layer ``l`` costs the activation bytes of the tree's `DataEdge`s crossing that point (or,
in a tree without edges, the layer's output).

`LayerSeq.partition` maps a stage per layer back to a `Partition` of every node: a layer's whole
subtree takes the layer's stage, an opened parent takes its first-called child's stage.

**Checkpointed layers.** The planner may checkpoint a stage's layers (`smpart.planner.search`), so
each layer also carries its costs when its root module is checkpointed: it keeps only the root's
inputs (``checkpoint_activation_bytes``) and runs its forward once more (``node_recompute``, per
node). A layer is ``checkpointable`` when that at least halves what it keeps (an embedding or a
LayerNorm saves little more than its input: checkpointing it would cost a forward for nothing)
and the tree knows its inputs (traced trees do; hand-built ones may not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from smpart.partitioning.result import Partition
from smpart.tracing.tree import (
    INPUT,
    SAVED,
    ModuleNode,
    ModuleTree,
    SplitShare,
    with_activation_checkpointing,
)

#: A subtree above this share of the model's cost is opened into its children.
DEFAULT_MAX_SHARE = 1 / 8
#: A layer is worth checkpointing when it then keeps at most this share of the bytes it saves.
CHECKPOINT_MAX_KEPT = 0.5


@dataclass
class LayerSeq:
    """Per-layer costs, in call order, for the batch the tree was traced with."""

    tree: ModuleTree
    #: Root node of each layer's subtree.
    roots: list[ModuleNode]
    #: Forward compute per layer, in the tree's unit (FLOPs, or measured fwd+bwd seconds).
    compute: np.ndarray
    param_count: np.ndarray
    param_bytes: np.ndarray
    buffer_bytes: np.ndarray
    #: Bytes of activations each layer keeps for its backward pass (autograd's saved tensors
    #: where the trace recorded them, else all its modules' outputs).
    activation_bytes: np.ndarray
    #: cut_bytes[l]: activation bytes sent forward when the model is cut after layer l (L-1 values).
    cut_bytes: np.ndarray
    #: Opened parent (canonical name) -> index of the layer whose stage it follows.
    parent_layer: dict[str, int] = field(default_factory=dict)
    #: Per node of the tree (any order): its layer, own compute and own forward op bytes, for
    #: costs that must be taken node by node before summing (the cost model's roofline).
    node_layer: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    node_compute: np.ndarray = field(default_factory=lambda: np.zeros(0))
    node_op_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: Per layer: whether checkpointing its root keeps fewer bytes than it saves, and the bytes
    #: the layer keeps when checkpointed (its activation bytes where it is not checkpointable).
    checkpointable: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    checkpoint_activation_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: Per node (as ``node_layer``): whether it runs again when its layer is checkpointed, and
    #: the compute of that extra forward in the tree's raw unit (forward FLOPs, or seconds).
    node_recomputed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    node_recompute: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: Per node (as ``node_layer``): the nodes themselves, for what a tensor-parallel split divides.
    nodes: list[ModuleNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.node_layer):  # no per-node costs given: one pseudo-node per layer, FLOPs only
            self.node_layer = np.arange(len(self.roots))
            self.node_compute = np.asarray(self.compute, dtype=float)
            self.node_op_bytes = np.zeros(len(self.roots))
        if not len(self.checkpointable):
            self.checkpointable = np.zeros(len(self.roots), dtype=bool)
            self.checkpoint_activation_bytes = np.asarray(self.activation_bytes, dtype=float)
        if not len(self.node_recompute):
            self.node_recomputed = np.zeros(len(self.node_layer), dtype=bool)
            self.node_recompute = np.zeros(len(self.node_layer))

    def __len__(self) -> int:
        return len(self.roots)

    def tensor_split(self, tp: int) -> TensorSplit | None:
        """What a ``tp``-way split leaves to each rank, from the tree's `SplitShare` records;
        None for a tree without them (the cost model then divides everything by ``tp``)."""
        if tp == 1 or not self.tree.tp_degrees or not self.nodes:
            return None
        shares = [n.tp_split.get(tp, SplitShare()) for n in self.nodes]
        flops = np.array([s.flops for s in shares])
        params = np.array([s.params for s in shares])
        node_params = np.array([n.param_count for n in self.nodes], dtype=float)
        node_activation = np.array([self.tree.activation_memory_of(n) for n in self.nodes], dtype=float)

        def per_layer(values: np.ndarray) -> np.ndarray:
            return np.bincount(self.node_layer, values, minlength=len(self))

        kept = 1 - flops + flops / tp
        param_total = per_layer(node_params)
        param_kept = per_layer(node_params * (1 - params + params / tp))
        return TensorSplit(
            node_scale=tp * (1 - flops) + flops,
            param_ratio=np.divide(param_kept, param_total, out=np.ones(len(self)), where=param_total > 0),
            activation_bytes=per_layer(node_activation * kept),
            forward_bytes=per_layer(np.array([s.forward_bytes for s in shares])),
            backward_bytes=per_layer(np.array([s.backward_bytes for s in shares])),
            forward_collectives=per_layer(np.array([s.forward_collectives for s in shares], dtype=float)),
            backward_collectives=per_layer(np.array([s.backward_collectives for s in shares], dtype=float)),
        )

    @property
    def names(self) -> list[str]:
        return [root.name for root in self.roots]

    def checkpoint_names(self, layers: list[int] | np.ndarray) -> list[str]:
        """Module names to checkpoint so that the checkpointable ones of ``layers`` are."""
        return [name for layer in layers if self.checkpointable[layer] for name in self.roots[layer].names]

    def partition(self, stage_of_layer: list[int], num_stages: int, memory_weight: float = 0.8,
                  meta: dict | None = None, checkpointed: list[str] | None = None) -> Partition:
        """The `Partition` of the whole tree that runs layer ``l`` on ``stage_of_layer[l]``, with
        modules ``checkpointed`` (names) costed as checkpointed."""
        tree = with_activation_checkpointing(self.tree, checkpointed) if checkpointed else self.tree
        node_stage: dict[str, int] = {}
        for root, stage in zip(self.roots, stage_of_layer, strict=True):
            for node in root.walk():
                node_stage[node.name] = stage
        for parent, layer in self.parent_layer.items():
            node_stage[parent] = stage_of_layer[layer]
        return Partition(tree, node_stage, num_stages, memory_weight, meta=meta)

    def pins(self, stage_of_layer: list[int]) -> dict[str, int]:
        """Module name -> stage for every layer root and opened parent (reproduces the partition)."""
        pins = {root.name: stage for root, stage in zip(self.roots, stage_of_layer, strict=True)}
        pins.update({parent: stage_of_layer[layer] for parent, layer in self.parent_layer.items()})
        pins.pop("", None)
        return pins


@dataclass(frozen=True)
class TensorSplit:
    """A ``tp``-way split of the layers, as the swap-in's rule makes it (`LayerSeq.tensor_split`)."""

    #: Per node: its own FLOPs and memory traffic on one rank, × tp (1 where split, tp where
    #: kept whole): a replica of tp devices runs a split node tp times faster, a whole one not.
    node_scale: np.ndarray
    #: Per layer: the share of its parameter elements each rank holds (1 / tp when all split).
    param_ratio: np.ndarray
    #: Per layer: activation bytes one rank keeps for the backward, per traced batch.
    activation_bytes: np.ndarray
    #: Per layer: all-reduce-equivalent bytes of its collectives, forward and backward, per traced batch.
    forward_bytes: np.ndarray
    backward_bytes: np.ndarray
    #: Per layer: collective calls per micro-batch, forward and backward.
    forward_collectives: np.ndarray
    backward_collectives: np.ndarray


def layer_sequence(tree: ModuleTree, max_share: float = DEFAULT_MAX_SHARE) -> LayerSeq:
    """Split ``tree`` into call-ordered layers, opening subtrees above ``max_share`` of the cost."""
    weight = _subtree_weights(tree)
    total = weight[id(tree.root)] or 1.0
    roots: list[ModuleNode] = []
    opened: list[ModuleNode] = []
    _open(tree.root, weight, total * max_share, roots, opened)
    roots = _call_ordered(roots)
    index = {id(r): i for i, r in enumerate(roots)}

    compute = np.array([tree.total_compute(r) for r in roots], dtype=float)
    params = np.array([sum(n.param_count for n in r.walk()) for r in roots], dtype=float)
    param_bytes = np.array([sum(n.param_bytes for n in r.walk()) for r in roots], dtype=float)
    buffers = np.array([sum(n.buffer_bytes for n in r.walk()) for r in roots], dtype=float)
    activations = np.array([sum(tree.activation_memory_of(n) for n in r.walk()) for r in roots], dtype=float)
    parent_layer = {}
    for parent in opened:
        layer = index[id(_first_layer(parent, index))]
        parent_layer[parent.name] = layer
        compute[layer] += tree.compute_of(parent)
        params[layer] += parent.param_count
        param_bytes[layer] += parent.param_bytes
        buffers[layer] += parent.buffer_bytes
        activations[layer] += tree.activation_memory_of(parent)
    cuts = _cut_bytes(tree, roots, parent_layer)
    owners = _layer_of_nodes(roots, parent_layer)
    nodes = [n for n in tree.nodes() if n.name in owners]
    checkpointable, kept = _checkpointed_activations(tree, roots, activations)
    in_checkpointed = {id(n) for layer, root in enumerate(roots) if checkpointable[layer]
                       for n in root.walk()}
    return LayerSeq(
        tree, roots, compute, params, param_bytes, buffers, activations, cuts, parent_layer,
        node_layer=np.array([owners[n.name] for n in nodes], dtype=int),
        node_compute=np.array([tree.compute_of(n) for n in nodes], dtype=float),
        node_op_bytes=np.array([n.op_bytes for n in nodes], dtype=float),
        checkpointable=checkpointable,
        checkpoint_activation_bytes=kept,
        node_recomputed=np.array([id(n) in in_checkpointed for n in nodes], dtype=bool),
        node_recompute=np.array([_forward_compute(tree, n) if id(n) in in_checkpointed else 0.0
                                 for n in nodes], dtype=float),
        nodes=nodes,
    )


def _checkpointed_activations(tree: ModuleTree, roots: list[ModuleNode],
                              activations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: whether checkpointing its root is worth it, and the bytes it keeps if so.

    What an opened parent charged to the layer (``activations`` minus the root's subtree) stays.
    """
    checkpointable = np.zeros(len(roots), dtype=bool)
    kept = np.asarray(activations, dtype=float).copy()
    if tree.activation_memory != SAVED:
        return checkpointable, kept
    for layer, root in enumerate(roots):
        if root.checkpoint_bytes is None or root.recomputed or not root.called:
            continue
        own = sum(tree.activation_memory_of(n) for n in root.walk())
        if root.checkpoint_bytes <= CHECKPOINT_MAX_KEPT * own and own > 0:
            checkpointable[layer] = True
            kept[layer] += root.checkpoint_bytes - own
    return checkpointable, kept


def _forward_compute(tree: ModuleTree, node: ModuleNode) -> float:
    """One more forward of ``node``: its forward FLOPs, or the forward share of its measured time."""
    if tree.compute_unit == "time":
        return (node.time_s or 0.0) * tree.forward_share
    return node.flops


# ---------------------------------------------------------------------------- helpers
def _subtree_weights(tree: ModuleTree) -> dict[int, float]:
    """Share-of-model weight of each subtree: normalised compute plus normalised memory."""
    total_c = tree.total_compute() or 1.0
    total_m = tree.total_memory() or 1.0
    weight: dict[int, float] = {}

    def visit(node: ModuleNode) -> float:
        own = tree.compute_of(node) / total_c + tree.memory_of(node) / total_m
        weight[id(node)] = own + sum(visit(child) for child in node.children)
        return weight[id(node)]

    visit(tree.root)
    return weight


def _open(node: ModuleNode, weight: dict[int, float], limit: float, roots: list[ModuleNode],
          opened: list[ModuleNode], is_root: bool = True) -> None:
    """Open the root (a one-layer model cannot be pipelined), every never-called container and
    every subtree above ``limit``."""
    if node.children and (is_root or node.call_count == 0 or weight[id(node)] > limit):
        opened.append(node)
        for child in node.children:
            _open(child, weight, limit, roots, opened, is_root=False)
    else:
        roots.append(node)


def _first_call(node: ModuleNode) -> float:
    orders = [n.call_order for n in node.walk() if n.call_order is not None]
    return min(orders) if orders else np.inf


def _call_ordered(roots: list[ModuleNode]) -> list[ModuleNode]:
    """Layers sorted by first call; a never-called subtree stays right after its tree-order neighbour."""
    keyed = []
    last = -np.inf
    for position, root in enumerate(roots):
        first = _first_call(root)
        if np.isfinite(first):
            last = first
        keyed.append(((first if np.isfinite(first) else last), position, root))
    return [root for _, _, root in sorted(keyed, key=lambda item: (item[0], item[1]))]


def _first_layer(parent: ModuleNode, index: dict[int, int]) -> ModuleNode:
    """The layer root below ``parent`` that is called first (an opened parent follows it)."""
    below = [n for n in parent.walk() if id(n) in index]
    return min(below, key=lambda n: index[id(n)])


def _layer_of_nodes(roots: list[ModuleNode], parent_layer: dict[str, int]) -> dict[str, int]:
    layer_of: dict[str, int] = dict(parent_layer)
    for i, root in enumerate(roots):
        for node in root.walk():
            layer_of[node.name] = i
    return layer_of


def _cut_bytes(tree: ModuleTree, roots: list[ModuleNode], parent_layer: dict[str, int]) -> np.ndarray:
    """Bytes crossing each cut point, from the data edges (difference array over layer spans)."""
    num = len(roots)
    layer_of = _layer_of_nodes(roots, parent_layer)
    crossing = np.zeros(num + 1)
    used = False
    for edge in tree.edges:
        dst = layer_of.get(edge.dst)
        src = 0 if edge.src == INPUT else layer_of.get(edge.src)
        if src is None or dst is None or src == dst:
            continue
        lo, hi = min(src, dst), max(src, dst)
        crossing[lo] += edge.nbytes
        crossing[hi] -= edge.nbytes
        used = True
    if not used:  # no data-flow edges: each layer hands its output to the next
        return np.array([root.activation_bytes for root in roots[:-1]], dtype=float)
    return np.cumsum(crossing)[: num - 1]
