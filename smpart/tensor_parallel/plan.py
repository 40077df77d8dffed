"""`plan_tensor_parallel(model, degree)`: the tensor-parallel plan of a model, checked and warned.

It runs the `Planner` (`smpart.tensor_parallel.planner`, whose docstring gives the steps: the
model's published plan, attention, MLPs, embeddings and the LM head, tied weights), emits the
plan's warnings as `TensorParallelWarning`, and refuses a degree that splits nothing.
"""

from __future__ import annotations

import warnings

from torch import nn

from smpart.tensor_parallel.decisions import TensorParallelPlan, TensorParallelWarning, module_kind
from smpart.tensor_parallel.layers import DistributedEmbedding, DistributedLinear, TensorParallelError
from smpart.tensor_parallel.planner import Planner
from smpart.tracing.tree import ModuleTree


def plan_tensor_parallel(
    model: nn.Module,
    degree: int,
    tree: ModuleTree | None = None,
    *,
    only_marked: bool = False,
    use_published: bool = True,
    require_split: bool = True,
    warn: bool = True,
    example_inputs: ModuleTree | None = None,
) -> TensorParallelPlan:
    """Decide, for every Linear / Conv1D / Embedding of ``model``, how ``degree`` ranks split it.

    ``tree``: the model's traced `ModuleTree` (``smpart.trace``), for call order and data flow.
    ``only_marked``: split only subtrees marked by `set_tensor_parallelism` / `tensor_parallelism`.
    ``use_published``: follow the model's own Hugging Face plan where it has one.
    ``require_split``: raise `TensorParallelError` when ``degree > 1`` splits nothing at all.
    ``warn``: emit the plan's warnings (`TensorParallelWarning`); they are in ``plan.warnings`` anyway.
    ``example_inputs``: a traced tree whose nodes recorded their calls' arguments
    (``call_inputs``), used only to run an attention no adapter knows alone and prove its split
    (``tree``'s are used when it is given); without either, such an attention is tried on one
    made-up input of its width.

    Needs only shapes, so a model on the meta device plans as well as a real one.
    """
    if not isinstance(model, nn.Module):
        raise TensorParallelError(f"plan_tensor_parallel needs an nn.Module, got {type(model).__name__}")
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise TensorParallelError(f"the tensor-parallel degree must be a positive int, got {degree!r}")
    planner = Planner(model, degree, tree, only_marked, use_published, example_inputs)
    if degree == 1:
        for name, _, _ in planner.leaves():
            planner.keep(name, "tensor-parallel degree 1")
        return planner.finish()
    planner.published()
    planner.structure("")
    planner.embeddings_and_heads()
    planner.ties()
    plan = planner.finish()
    if warn:
        for message in plan.warnings:
            warnings.warn(message, TensorParallelWarning, stacklevel=2)
    if require_split and not plan.split_modules() and not _already_split(model):
        raise TensorParallelError(_nothing_split(plan, model))
    return plan


def _already_split(model: nn.Module) -> bool:
    """Whether the model holds tensor-parallel layers its author put there (``smpart.nn``)."""
    return any(isinstance(m, (DistributedLinear, DistributedEmbedding)) for m in model.modules())


def _nothing_split(plan: TensorParallelPlan, model: nn.Module) -> str:
    sizes = [max(getattr(m, "out_features", 0), getattr(m, "num_embeddings", 0), getattr(m, "nf", 0))
             for m in model.modules() if module_kind(m)]
    largest = max(sizes, default=0)
    reasons = sorted({d.reason for d in plan.decisions.values()})[:4]
    if largest and largest < plan.degree:
        hint = f"the largest splittable dimension is {largest}, smaller than the degree"
    else:
        hint = "; ".join(reasons) or "it has no Linear, Conv1D or Embedding"
    return (f"tensor-parallel degree {plan.degree} splits none of {plan.model_class}'s modules ({hint}). "
            "Use tensor_parallel_degree=1 for this model, a degree that divides its heads and hidden sizes, "
            "or mark the modules to split with set_tensor_parallelism")
