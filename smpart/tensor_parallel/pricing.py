"""What a tensor-parallel split divides, node by node: the planner's view of the swap-in.

The planner must price exactly what the runtime will run. A split of degree ``d`` divides by
``d`` only the modules the swap-in's rule splits (`plan_tensor_parallel`): a TransGAN attention
with one head stays whole on every rank of the group, and so does its time and its memory. So
the rule is run here, on the model, once per degree, and its outcome is written onto the traced
tree as plain numbers (`ModuleNode.tp_split`, one `SplitShare` per degree), which the planner
reads without torch:

- **params**: the share of a node's own parameter elements that are sharded (a row-parallel
  bias is replicated); **flops**: 1 for a split Linear / Conv1D and for an attention whose heads
  are split (its scores, softmax and weighted sum run on local heads), else 0.
- **collective bytes**, all-reduce equivalents per traced batch: a row-parallel layer and a
  vocabulary-split embedding all-reduce their output in the forward; a column-parallel layer fed
  the whole input all-reduces that input's gradient in the backward (one per projection, as the
  layers do it); an output all-gather (the LM head, a dimension-split embedding) moves half what
  an all-reduce of the same tensor does.

The runtime calls `plan_tensor_parallel(model, degree)` without a tree, so the decisions here
are made the same way; the tree only maps them onto nodes, and lends its recorded calls
(``example_inputs``) to the proof of an attention no adapter knows, as the runtime lends it the
partition's tree.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn

from smpart.tensor_parallel.decisions import (
    NONE,
    Decision,
    TensorParallelPlan,
    TensorParallelWarning,
    in_features,
    module_kind,
    out_features,
)
from smpart.tensor_parallel.layers import COLUMN, DIM, ROW, VOCAB, TensorParallelError
from smpart.tensor_parallel.plan import plan_tensor_parallel
from smpart.tracing.tree import ModuleTree, SplitShare

#: The degrees `record_split_shares` prices by default: tensor parallelism stays inside a node.
DEFAULT_DEGREES = (2, 4, 8)


def record_split_shares(tree: ModuleTree, model: nn.Module,
                        degrees: Iterable[int] = DEFAULT_DEGREES) -> ModuleTree:
    """Run the swap-in's rule on ``model`` for each degree and record its shares on ``tree``.

    Returns ``tree`` (changed in place): every node split at degree ``d`` gets
    ``tp_split[d]``, and ``tree.tp_degrees`` lists the degrees recorded. The rule's warnings are
    not repeated here; the runtime emits them when it splits the model.
    """
    degrees = sorted({int(d) for d in degrees if int(d) > 1})
    for degree in degrees:
        for node in tree.nodes():
            node.tp_split.pop(degree, None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TensorParallelWarning)
                plan = plan_tensor_parallel(model, degree, require_split=False, warn=False,
                                            example_inputs=tree)
        except TensorParallelError:  # the runtime could not split it either: the degree splits nothing
            continue
        for name, share in splittable_fraction(plan, tree, model).items():
            tree.node(name).tp_split[degree] = share
    tree.tp_degrees = tuple(sorted({*tree.tp_degrees, *degrees}))
    return tree


def splittable_fraction(plan: TensorParallelPlan, tree: ModuleTree | None = None,
                        model: nn.Module | None = None) -> dict[str, SplitShare]:
    """Per node of ``tree`` (or per planned module without one): what ``plan`` splits of it.

    A planner prices a node's own cost ``c`` as ``c·(1 − share) + c·share / degree``, plus the
    collectives. A node of several modules (a tied embedding and LM head: they share their
    parameters) averages their parameter shares and weighs their FLOPs shares by their matmuls'
    (an embedding lookup has none); the node's traced output bytes and calls are shared out by
    each module's output width and evenly.
    Collective bytes need the traced outputs and the layers' widths, so they are counted only
    when both ``tree`` and ``model`` are given.
    """
    per_module: dict[str, tuple[SplitShare, float]] = {}  # name -> (share, matmul weight)
    for name, decision in plan.decisions.items():
        params = decision.split_params / decision.params if decision.params else 0.0
        flops = 1.0 if decision.split and decision.style in (COLUMN, ROW) else 0.0
        matmul = decision.style in (COLUMN, ROW, NONE) and _is_matmul(model, name)
        weight = float(decision.params) if matmul else 0.0
        style = decision.style if decision.split else ""
        for alias in decision.names or (name,):
            per_module[alias] = (SplitShare(params, flops, style=style), weight)
    for name in plan.attention:  # its own scores, softmax and weighted sum run on local heads
        params = per_module[name][0].params if name in per_module else 0.0
        per_module[name] = (SplitShare(params, 1.0, style="heads"), 1.0)
    if tree is None:
        return {name: share for name, (share, _) in per_module.items()}
    out: dict[str, SplitShare] = {}
    for node in tree.nodes():
        entries = [per_module[n] for n in node.names if n in per_module]
        if not entries:
            continue
        forward = backward = 0.0
        counts = [0, 0]
        if model is not None:
            modules = {name: model.get_submodule(name) for name in node.names}
            widths = {name: _output_width(module) for name, module in modules.items()}
            calls = -(-node.call_count // len(node.names))  # each module's calls, rounded up
            for name, module in modules.items():
                decision = plan.decisions.get(name)
                if decision is not None and decision.split:
                    output_bytes = node.activation_bytes * widths[name] / (sum(widths.values()) or 1)
                    f, b = _collective_bytes(decision, module, output_bytes)
                    forward, backward = forward + f, backward + b
                    counts[0] += calls * (f > 0)
                    counts[1] += calls * (b > 0)
        out[node.name] = SplitShare(_weighted([s.params for s, _ in entries], [1.0] * len(entries)),
                                    _weighted([s.flops for s, _ in entries], [w for _, w in entries]),
                                    forward, backward,
                                    "+".join(sorted({s.style for s, _ in entries} - {""})), *counts)
    return out


def _is_matmul(model: nn.Module | None, name: str) -> bool:
    """Whether module ``name`` does a matmul (a Linear or Conv1D; unknown without the model: yes)."""
    return model is None or module_kind(model.get_submodule(name)) == "linear"


def _output_width(module: nn.Module) -> int:
    """Features per token a module returns: a merged node's outputs are shared out by these."""
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    return out_features(module) if module_kind(module) == "linear" else 1


def _weighted(values: list[float], weights: list[float]) -> float:
    total = sum(weights)
    if total == 0:
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total


def _collective_bytes(decision: Decision, module: nn.Module, output_bytes: float) -> tuple[float, float]:
    """(forward, backward) all-reduce-equivalent bytes of one split module's collectives.

    An all-gather (or its backward, a split) of a tensor moves half what an all-reduce of it does.
    """
    if decision.style == VOCAB:
        return output_bytes, 0.0
    if decision.style == DIM:
        return output_bytes / 2, 0.0
    input_bytes = output_bytes * in_features(module) / max(out_features(module), 1)
    if decision.style == ROW:  # partial sums reduced; a whole input is split (its gradient gathered)
        return output_bytes, 0.0 if decision.input_is_parallel else input_bytes / 2
    # column: every rank needs the whole input, so its gradient is all-reduced
    return (output_bytes / 2 if decision.gather_output else 0.0), input_bytes


def split_totals(plan: TensorParallelPlan, tree: ModuleTree) -> SplitShare:
    """The whole model's split share of parameters and of FLOPs, weighted by the tree's costs."""
    shares = splittable_fraction(plan, tree)
    params = sum(n.param_count for n in tree.nodes())
    flops = sum(n.flops for n in tree.nodes())
    split_p = sum(n.param_count * shares[n.name].params for n in tree.nodes() if n.name in shares)
    split_f = sum(n.flops * shares[n.name].flops for n in tree.nodes() if n.name in shares)
    return SplitShare(split_p / params if params else 0.0, split_f / flops if flops else 0.0)


__all__ = ["DEFAULT_DEGREES", "SplitShare", "record_split_shares", "split_totals", "splittable_fraction"]
