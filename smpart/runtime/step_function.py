"""``@smpart.step``: run the user's own training step over micro-batches on the pipeline.

The decorated function is called once per micro-batch, each call in its own driver thread, with
the tensor arguments split along their batch axis; the model argument must be a
`DistributedModel`. What each call returns is gathered into `StepOutput` objects.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from smpart.errors import SmpartError
from smpart.runtime.microbatches import StepOutput, batch_samples, split_arguments, step_outputs
from smpart.runtime.model import DistributedModel
from smpart.runtime.placement.place import keep_hf_checkpoints_within_stages
from smpart.runtime.runtime import current_runtime


class StepFunction:
    def __init__(self, fn: Callable, non_split_inputs: Iterable[str] = (),
                 input_split_axes: dict[str, int] | None = None) -> None:
        self.fn = fn
        self.non_split_inputs = tuple(non_split_inputs)
        self.input_split_axes = dict(input_split_axes or {})
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> StepOutput | tuple[StepOutput, ...]:
        runtime = current_runtime()
        model = _the_model(self.fn, args, kwargs)
        if model._partition is not None:
            keep_hf_checkpoints_within_stages(model.module, model._partition)
        split = dict(skip=lambda v: isinstance(v, DistributedModel | nn.Module),
                     non_split=self.non_split_inputs, axes=self.input_split_axes)
        try:
            pieces = split_arguments(self.fn, args, kwargs, runtime.config.microbatches, **split)
        except SmpartError as err:  # raised on every rank that steps with this one, not only here
            runtime.refuse_step(self.fn, err, model)
            raise
        samples = batch_samples(self.fn, args, kwargs, **split)
        results, timeline = runtime.run_step(self.fn, pieces, model, samples=samples)
        _warn_if_unsplit(self.fn, model)
        return step_outputs(results, timeline)


def step(fn: Callable | None = None, *, non_split_inputs: Iterable[str] = (),
         input_split_axes: dict[str, int] | None = None) -> Any:
    """Decorate a training (or evaluation) step: ``@smpart.step`` or ``@smpart.step(non_split_inputs=[...])``.

    ``non_split_inputs``: argument names given whole to every micro-batch. ``input_split_axes``:
    argument name -> axis to split along (default 0).
    """
    if fn is None:
        return lambda f: StepFunction(f, non_split_inputs, input_split_axes)
    return StepFunction(fn, non_split_inputs, input_split_axes)


def _warn_if_unsplit(fn: Callable, model: DistributedModel) -> None:
    """A model is split at its first call inside a step; a body that only used one of its methods
    (``model.generate(...)``) ran it whole where the body runs. Said once per model."""
    if model._partition is None and not model._warned_unsplit:
        model._warned_unsplit = True
        warnings.warn(f"step {fn.__name__}() did not call the model itself (model(...)), so the model was "
                      "not split: it ran whole where the step body runs. smpart splits a model at its "
                      "first call inside a step; call it once first (e.g. a step returning model(x)), "
                      "then model.generate(...) and the like run split", stacklevel=3)


def _the_model(fn: Callable, args: tuple, kwargs: dict) -> DistributedModel:
    """The step's one `DistributedModel` argument (plain modules, or none or several, refused)."""
    values = list(args) + list(kwargs.values())
    plain = [v for v in values if isinstance(v, nn.Module)]
    if plain:
        raise SmpartError(
            f"step {fn.__name__}() got a plain torch.nn.Module ({type(plain[0]).__name__}); wrap it first: "
            "model = smpart.DistributedModel(model)")
    models = [v for v in values if isinstance(v, DistributedModel)]
    if len(models) != 1:
        raise SmpartError(f"step {fn.__name__}() needs exactly one smpart.DistributedModel among its "
                          "arguments")
    return models[0]
