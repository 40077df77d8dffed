"""Splitting a step's arguments into micro-batches, and `StepOutput`, what a step returns.

Tensors (also inside lists, tuples and dicts) are split along their batch axis (0 unless
``input_split_axes`` says otherwise) into ``microbatches`` equal pieces; arguments named in
``non_split_inputs``, non-tensor values and 0-d tensors are given whole to every micro-batch.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

from smpart.errors import SmpartError
from smpart.runtime.timeline import Timeline


def split_arguments(fn: Callable, args: tuple, kwargs: dict, microbatches: int, *,
                    skip: Callable[[Any], bool], non_split: Iterable[str] = (),
                    axes: dict[str, int] | None = None) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` of each micro-batch. ``skip(value)`` marks values passed whole (the model)."""
    signature = _signature(fn)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise SmpartError(f"step {fn.__name__}() called with arguments it does not accept: {err}") from None
    non_split, axes = set(non_split), dict(axes or {})
    unknown = (non_split | set(axes)) - set(signature.parameters)
    if unknown:
        raise SmpartError(f"non_split_inputs/input_split_axes name {sorted(unknown)}, which are not "
                          f"parameters of {fn.__name__}{signature}")
    pieces: dict[str, list[Any]] = {}
    for name, value in bound.arguments.items():
        if name in non_split or skip(value):
            pieces[name] = [value] * microbatches
        else:
            pieces[name] = _split_value(name, value, microbatches, axes.get(name, 0))
    out = []
    for i in range(microbatches):
        bound_i = inspect.BoundArguments(bound.signature, {k: v[i] for k, v in pieces.items()})
        out.append((bound_i.args, bound_i.kwargs))
    return out


def batch_samples(fn: Callable, args: tuple, kwargs: dict, *, skip: Callable[[Any], bool],
                  non_split: Iterable[str] = (), axes: dict[str, int] | None = None) -> int | None:
    """The step's batch size: the length of its first split tensor along its split axis (None
    when nothing is split). Call it after `split_arguments`, which checked the arguments."""
    bound = _signature(fn).bind(*args, **kwargs)
    non_split, axes = set(non_split), dict(axes or {})
    for name, value in bound.arguments.items():
        if name in non_split or skip(value):
            continue
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                return int(leaf.shape[axes.get(name, 0)])
    return None


_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(fn: Callable) -> inspect.Signature:
    """``inspect.signature(fn)``, read once per step function (it walks the function's code)."""
    try:
        signature = _SIGNATURES.get(fn)
    except TypeError:  # a callable that takes no weak reference
        return inspect.signature(fn)
    if signature is None:
        signature = _SIGNATURES[fn] = inspect.signature(fn)
    return signature


def _split_value(name: str, value: Any, microbatches: int, axis: int) -> list[Any]:
    leaves, spec = pytree.tree_flatten(value)
    columns = [_split_leaf(name, leaf, microbatches, axis) for leaf in leaves]
    return [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(microbatches)]


def _split_leaf(name: str, leaf: Any, microbatches: int, axis: int) -> list[Any]:
    if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or microbatches == 1:
        return [leaf] * microbatches
    if not -leaf.dim() <= axis < leaf.dim():
        raise SmpartError(f"argument {name!r} has shape {tuple(leaf.shape)}: no axis {axis} to split along")
    size = leaf.shape[axis]
    if size % microbatches:
        raise SmpartError(
            f"argument {name!r} has {size} samples along axis {axis} (shape {tuple(leaf.shape)}), "
            f"which does not split into {microbatches} equal micro-batches; use a batch size divisible "
            f"by {microbatches}, or list {name!r} in non_split_inputs / set its axis in input_split_axes"
        )
    return list(leaf.split(size // microbatches, dim=axis))


class StepOutput:
    """One value the step returned, per micro-batch (``outputs[i]`` is micro-batch ``i``'s)."""

    def __init__(self, outputs: list[Any], timeline: Timeline | None = None) -> None:
        self.outputs = outputs
        self.timeline = timeline

    def _tensors(self) -> list[torch.Tensor]:
        return [o if isinstance(o, torch.Tensor) else torch.as_tensor(o) for o in self.outputs]

    def stack(self) -> torch.Tensor:
        """The per-micro-batch values stacked along a new axis 0."""
        return torch.stack(self._tensors())

    def concat(self) -> torch.Tensor:
        """The per-micro-batch values concatenated along axis 0 (the batch axis)."""
        return torch.cat(self._tensors())

    def reduce_mean(self) -> torch.Tensor:
        """Mean over micro-batches (e.g. the step's loss)."""
        return self.stack().mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        return self.stack().sum(dim=0)

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self):
        return iter(self.outputs)

    def __getitem__(self, i: int) -> Any:
        return self.outputs[i]

    def __repr__(self) -> str:
        return f"StepOutput({len(self.outputs)} micro-batches)"


def step_outputs(results: list[Any], timeline: Timeline) -> StepOutput | tuple[StepOutput, ...]:
    """A tuple of `StepOutput` when the step returns a tuple or list, else one `StepOutput`."""
    first = results[0] if results else None
    if isinstance(first, tuple | list):
        return tuple(StepOutput([r[i] for r in results], timeline) for i in range(len(first)))
    return StepOutput(results, timeline)


def detached(value: Any) -> Any:
    """``value`` with its tensors detached (a step's results must not keep graphs alive)."""
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)
