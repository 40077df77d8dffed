"""Following the projections: one run of an attention module alone, under a ``TorchFunctionMode``
that tracks what each ``nn.Linear`` child's output becomes, up to the first reshape by heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map


class _Lineage(TorchFunctionMode):
    """Follows which projections each tensor derives from, and records the reshapes of them."""

    RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten,
                torch.unflatten}

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[int, tuple[Tensor, frozenset[str]]] = {}
        #: projection -> [(shape before, shape after)] of every reshape of a tensor derived from it.
        self.reshapes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

    def of(self, value: Any) -> frozenset[str]:
        found: frozenset[str] = frozenset()
        for leaf in tree_leaves(value):
            if isinstance(leaf, Tensor) and id(leaf) in self.sources:
                found |= self.sources[id(leaf)][1]
        return found

    def mark(self, value: Any, sources: frozenset[str]) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, Tensor):
                self.sources[id(leaf)] = (leaf, sources)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sources = self.of((args, kwargs))
        if sources:
            self.mark(out, sources)
            if func in self.RESHAPES and isinstance(args[0], Tensor) and isinstance(out, Tensor):
                for source in sources:
                    self.reshapes.setdefault(source, []).append((tuple(args[0].shape), tuple(out.shape)))
        return out


@dataclass
class ObservedRun:
    """What one whole run of the module showed: projections in call order, how often each ran,
    which projections each one's input came from, its output, and the gradients a random
    cotangent on that output gives its parameters and its inputs."""

    order: list[str]
    calls: dict[str, int]
    fed_by: dict[str, frozenset[str]]
    reshapes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
    output: Any = None
    grads: dict[str, Tensor] = field(default_factory=dict)
    input_grads: list[Tensor | None] = field(default_factory=list)


def observed_run(module: nn.Module, linears: list[str], args: tuple, kwargs: dict) -> ObservedRun:
    lineage = _Lineage()
    run = ObservedRun([], {}, {}, lineage.reshapes)
    handles = []
    for name in linears:
        child = module.get_submodule(name)

        def before(_m: nn.Module, inputs: tuple, name: str = name) -> None:
            run.calls[name] = run.calls.get(name, 0) + 1
            if name not in run.order:
                run.order.append(name)
            run.fed_by[name] = run.fed_by.get(name, frozenset()) | lineage.of(inputs)

        def after(_m: nn.Module, _inputs: tuple, output: Any, name: str = name) -> None:
            lineage.mark(output, frozenset({name}))

        handles += [child.register_forward_pre_hook(before), child.register_forward_hook(after)]
    args, kwargs = fresh_inputs(args, kwargs)
    try:
        with lineage:
            run.output = module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    run_backward(run.output)
    run.grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    run.input_grads = [t.grad for t in tensors_of((args, kwargs))]
    run.output = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, run.output)
    return run


def fresh_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The same arguments, their tensors new leaves (requiring grad as before)."""
    def leaf(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.detach().clone().requires_grad_(value.requires_grad)
        return value
    return tree_map(leaf, (args, kwargs))


def tensors_of(value: Any) -> list[Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, Tensor)]


def run_backward(output: Any, retain_graph: bool = False) -> None:
    """Backward of the output against a fixed random cotangent (the same for every run)."""
    generator = torch.Generator().manual_seed(2)
    outputs = [t for t in tensors_of(output) if t.requires_grad and t.is_floating_point()]
    cotangents = [torch.randn(t.shape, dtype=t.dtype, generator=generator) for t in outputs]
    if outputs:
        torch.autograd.backward(outputs, cotangents, retain_graph=retain_graph)


def head_reshape(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...] | None:
    """The trailing axes ``after`` cut ``before``'s last dimension into (at least two), or None."""
    if not before or len(after) < 2:
        return None
    product = 1
    for start in range(len(after) - 1, -1, -1):
        product *= after[start]
        if product == before[-1] and len(after) - start >= 2:
            return after[start:] if math.prod(after[:start]) == math.prod(before[:-1]) else None
        if product > before[-1]:
            return None
    return None
