"""The elementwise check: does a module's forward feed its column-parallel children into their
row-parallel partner through elementwise operations only (read with ``torch.fx``)?

An MLP split Megatron-style is exact only then: every rank applies the activation, dropout or
product to its own slice of the hidden features, and nothing needs the whole of them.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.mul, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.mul, torch.sub, torch.div, torch.neg, torch.tanh, torch.sigmoid, torch.relu, torch.exp,
    torch.erf, torch.sqrt, torch.pow, torch.abs, torch.clamp, torch.square,
    F.relu, F.gelu, F.silu, F.mish, F.tanh, F.sigmoid, F.dropout, F.leaky_relu, F.elu, F.selu, F.celu,
    F.softplus, F.hardswish, F.hardsigmoid, F.relu6, F.hardtanh, F.logsigmoid,
}
_ELEMENTWISE_METHODS = {
    "add", "mul", "sub", "div", "neg", "pow", "tanh", "sigmoid", "relu", "exp", "sqrt", "abs", "clamp",
    "square", "float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "clone",
    "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__",
}
#: Methods whose extra tensor arguments only lend a dtype or device.
_UNARY_METHODS = {"float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "clone"}
_ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh,
                        nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus,
                        nn.Softsign, nn.Tanhshrink, nn.Dropout, nn.Identity)


def _elementwise_module(module: nn.Module) -> bool:
    if any(True for _ in module.parameters()):
        return False
    if isinstance(module, _ELEMENTWISE_MODULES):
        return True
    return type(module).__module__ == "transformers.activations" and "GLU" not in type(module).__name__


class _ChildrenAsLeaves(torch.fx.Tracer):
    """Traces one module's own forward; every child is a leaf (``call_module``)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return m is not self.root


def elementwise_between(parent: nn.Module, columns: list[str], row: str) -> tuple[bool | None, str]:
    """Whether ``parent``'s forward feeds the direct children ``columns`` into ``row`` through
    elementwise operations only, and uses their outputs nowhere else.

    ``(True, "")``: checked; ``(False, why)``: it does not; ``(None, why)``: ``torch.fx`` could not
    read the forward (Python control flow on inputs, say), so nothing is known.
    """
    try:
        graph = _ChildrenAsLeaves().trace(parent)
    except Exception as err:  # torch.fx raises many kinds; any of them means "cannot tell"
        return None, f"torch.fx could not read {type(parent).__name__}.forward ({type(err).__name__})"
    calls = {n: [x for x in graph.nodes if x.op == "call_module" and x.target == n] for n in [*columns, row]}
    if any(len(found) != 1 for found in calls.values()):
        return False, "the projections are not each called once"
    starts = [calls[c][0] for c in columns]
    end = calls[row][0]
    reached, frontier = set(starts), list(starts)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user is end or user in reached:
                continue
            if not _elementwise_node(user, parent):
                return False, f"{user.format_node()} between them is not elementwise"
            reached.add(user)
            frontier.append(user)
    if not (set(end.all_input_nodes) & reached):
        return False, f"{row} does not read the output of {', '.join(columns)}"
    for node in reached - set(starts):
        others = [a for a in node.all_input_nodes if a not in reached]
        if others and not (node.op == "call_method" and node.target in _UNARY_METHODS):
            return False, f"{node.format_node()} combines them with a tensor that is not split"
    return True, ""


def _elementwise_node(node: torch.fx.Node, parent: nn.Module) -> bool:
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    if node.op == "call_module":
        return _elementwise_module(parent.get_submodule(node.target))
    return False
