"""``@smp.step``: SMP's step decorator on smpart's `smpart.step`.

What SMP did beyond smpart's own step, and how it is done here:

- **Every returned tensor becomes a** `StepOutput`, also inside lists, tuples and dicts (a Hugging
  Face ``ModelOutput`` too): ``out["loss"].reduce_mean()``, ``out["logits"].concat()``; any other
  value, a list of its per-micro-batch values (``sum(correct)`` for a ``.item()`` returned).
- **Objects with ``smp_slice(num_mb, mb, axis)``** are split by that method, one slice per
  micro-batch.
- **Tensor parallelism without** ``prescaled_batch``: SMP let each rank of a tensor-parallel group
  read its own examples (sharding data by ``dp_rank``, which counts them), and its distributed
  layers worked on the group's examples together. smpart's tensor-parallel ranks compute on one
  batch, so the step concatenates the group's batches first (micro-batch ``i`` holds every rank's
  ``i``-th slice): the same examples, the same gradients; the step's outputs are the whole group's.
- **fp16 / bf16** in the configuration: the body runs under ``torch.autocast`` of that dtype (the
  weights stay float32, the role of SMP's float32 master copy); with fp16, ``model.backward``
  scales the loss by the `DistributedOptimizer`'s loss scale.

The splitting into micro-batches is smpart's (`smpart.runtime.microbatches.split_arguments`); the
pieces travel to each micro-batch's driver whole, picked by a split ``arange`` index, so the body
sees exactly the arguments SMP would have given it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import smpart.runtime as runtime_api
from smpart.errors import SmpartError
from smpart.runtime.microbatches import StepOutput, split_arguments
from smpart.runtime.model import DistributedModel
from smpart.runtime.runtime import current_runtime
from smpart.smp import groups
from smpart.smp.state import state


class Step:
    """An ``@smp.step`` function (see the module docstring)."""

    def __init__(self, fn: Callable, non_split_inputs: Iterable[str] | None = None,
                 input_split_axes: dict[str, int] | None = None, detach_outputs: bool = True) -> None:
        self.fn = fn
        self.non_split_inputs = tuple(non_split_inputs or ())
        self.input_split_axes = dict(input_split_axes or {})
        self.detach_outputs = detach_outputs
        self._run = runtime_api.step(self._body, non_split_inputs=["pieces"])
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = current_runtime().config
        microbatches = config.microbatches
        model = _the_model(args, kwargs)
        if groups.tp_size() > 1 and not state.cfg.prescaled_batch:
            args, kwargs = self._scaled_batch(args, kwargs, microbatches)
        try:
            pieces = split_arguments(self.fn, args, kwargs, microbatches, skip=_not_split,
                                     non_split=self.non_split_inputs, axes=self.input_split_axes)
        except SmpartError as err:  # raised on every rank that steps with this one (`refuse_step`)
            current_runtime().refuse_step(self.fn, err, model)
            raise
        pieces = [self._sliced(piece, i, microbatches) for i, piece in enumerate(pieces)]
        out = self._run(model, torch.arange(microbatches), pieces)
        return _step_outputs(out[0].outputs, out[0].timeline)

    def _body(self, model: DistributedModel, index: torch.Tensor, pieces: list) -> list:
        args, kwargs = pieces[int(index)]
        with _autocast(args, kwargs):
            result = self.fn(*args, **kwargs)
        if self.detach_outputs:
            result = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result)
        return [result]

    def _sliced(self, piece: tuple[tuple, dict], mb: int, microbatches: int) -> tuple[tuple, dict]:
        """``piece`` with every object that has ``smp_slice`` replaced by its ``mb``-th slice."""
        args, kwargs = piece
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            if name not in self.non_split_inputs:
                axis = self.input_split_axes.get(name, 0)
                bound.arguments[name] = pytree.tree_map(
                    lambda v, a=axis: v.smp_slice(microbatches, mb, a) if _sliceable(v) else v, value)
        return bound.args, bound.kwargs

    def _scaled_batch(self, args: tuple, kwargs: dict, microbatches: int) -> tuple[tuple, dict]:
        """The tensor-parallel group's batches in one: micro-batch ``i`` = every rank's ``i``-th slice."""
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        names = [n for n, v in bound.arguments.items()
                 if n not in self.non_split_inputs and not isinstance(v, DistributedModel | nn.Module)]
        leaves, spec = pytree.tree_flatten([bound.arguments[n] for n in names])
        batched = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
        every_rank = groups.allgather([leaves[i].cpu() for i in batched], groups.TP_GROUP)
        for slot, i in enumerate(batched):
            axis = self.input_split_axes.get(_owner(names, spec, i), 0)
            parts = [theirs[slot].to(leaves[i].device) for theirs in every_rank]
            for part in parts:
                if part.shape[axis] % microbatches:
                    raise SmpartError(f"a batch of {part.shape[axis]} along axis {axis} does not split into "
                                      f"{microbatches} micro-batches")
            chunks = [part.chunk(microbatches, dim=axis) for part in parts]
            leaves[i] = torch.cat([c[mb] for mb in range(microbatches) for c in chunks], dim=axis)
        for name, value in zip(names, pytree.tree_unflatten(leaves, spec), strict=True):
            bound.arguments[name] = value
        return bound.args, bound.kwargs


def _owner(names: list[str], spec: Any, leaf: int) -> str:
    """The argument name leaf number ``leaf`` of the flattened ``[arguments...]`` belongs to."""
    counts = [child.num_leaves for child in spec.children_specs]
    for name, count in zip(names, counts, strict=True):
        if leaf < count:
            return name
        leaf -= count
    raise IndexError(leaf)


def step(fn: Callable | None = None, *, non_split_inputs: Iterable[str] | None = None,
         input_split_axes: dict[str, int] | None = None, detach_outputs: bool = True) -> Any:
    """``@smp.step`` or ``@smp.step(non_split_inputs=[...], input_split_axes={...})``."""
    if fn is None:
        return lambda f: Step(f, non_split_inputs, input_split_axes, detach_outputs)
    return Step(fn, non_split_inputs, input_split_axes, detach_outputs)


def _not_split(value: Any) -> bool:
    """What `split_arguments` leaves whole: the model, modules, and objects that slice themselves."""
    return isinstance(value, DistributedModel | nn.Module) or _sliceable(value)


def _sliceable(value: Any) -> bool:
    return callable(getattr(value, "smp_slice", None)) and not isinstance(value, torch.Tensor)


def _the_model(args: tuple, kwargs: dict) -> DistributedModel:
    models = [v for v in (*args, *kwargs.values()) if isinstance(v, DistributedModel)]
    if len(models) != 1:
        raise SmpartError("an @smp.step function needs exactly one smp.DistributedModel among its arguments "
                          "(model = smp.DistributedModel(model), then train_step(model, ...))")
    return models[0]


def _autocast(args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
    """``torch.autocast`` of the configuration's half dtype (fp16 / bf16), else nothing."""
    cfg = state.cfg
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None
    if dtype is None:
        return contextlib.nullcontext()
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    device = tensors[0].device.type if tensors else ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.autocast(device, dtype=dtype)


class StepOutputs(dict):
    """A dict of step outputs whose keys also read as attributes (``out.loss``), for a model output
    class that cannot be rebuilt around `StepOutput` values."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _step_outputs(results: list[Any], timeline: Any) -> Any:
    """The micro-batches' results merged: each tensor leaf a `StepOutput` of its per-micro-batch values."""
    first = results[0]
    if isinstance(first, torch.Tensor):
        return StepOutput(list(results), timeline)
    if isinstance(first, dict):
        values = {k: _step_outputs([r[k] for r in results], timeline) for k in first}
        if type(first) is dict:
            return values
        try:
            rebuilt = type(first)(**values)
        except Exception:  # noqa: BLE001 - a class that does not take its items back as keywords
            return StepOutputs(values)
        return rebuilt if list(rebuilt.keys()) == list(values) else StepOutputs(values)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_step_outputs([r[i] for r in results], timeline) for i in range(len(first))))
    if isinstance(first, list | tuple):
        return type(first)(_step_outputs([r[i] for r in results], timeline) for i in range(len(first)))
    return list(results)
