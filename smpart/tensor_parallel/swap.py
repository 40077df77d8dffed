"""`apply_tensor_parallel`: carry out a `TensorParallelPlan` on this rank's copy of the model.

Every split module is replaced, in place and under every name it is registered with, by a
`DistributedLinear` / `DistributedEmbedding` built from it: the new layer's parameter is this
rank's shard *of the weights the module holds now*, so ranks that start from the same full
weights (same seed, or one checkpoint) end up with consistent shards and no communication is
needed. Tied weights become one distributed parameter shared by the modules that tie them.
Then each split attention is localised through its adapter (its head counts divided by the
degree, so its reshapes see the local heads), or, for one no adapter knows, as the plan found and
proved it (`smpart.tensor_parallel.heads`).

The model keeps its structure and parameter names; parameters of split modules become
DTensors of the original global shape (see `smpart.tensor_parallel.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from smpart.tensor_parallel import heads
from smpart.tensor_parallel.attention import PublishedAttention, adapter_named
from smpart.tensor_parallel.decisions import TensorParallelPlan, module_kind
from smpart.tensor_parallel.layers import (
    COLUMN,
    DIM,
    ROW,
    VOCAB,
    DistributedEmbedding,
    DistributedLinear,
    TensorParallelError,
    tp_mesh,
)


@dataclass
class SwapReport:
    """What `apply_tensor_parallel` did on this rank."""

    degree: int
    rank: int
    #: module name -> style, for every name a replaced module is registered under.
    replaced: dict[str, str] = field(default_factory=dict)
    #: attention module name -> {attribute: (old, new)}.
    attention: dict[str, dict[str, tuple[Any, Any]]] = field(default_factory=dict)
    #: Groups of parameter names that share one distributed parameter (tied weights).
    shared: list[tuple[str, ...]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"tensor parallelism, rank {self.rank} of {self.degree}: "
                 f"{len(self.replaced)} modules replaced"]
        lines += [f"  {name}: {style}" for name, style in self.replaced.items()]
        for name, changes in self.attention.items():
            what = ", ".join(f"{attr} {old} -> {new}" for attr, (old, new) in changes.items())
            lines.append(f"  attention {name}: {what or 'no attribute to change'}")
        lines += [f"  tied: {' = '.join(group)}" for group in self.shared]
        return "\n".join(lines)


def apply_tensor_parallel(model: nn.Module, plan: TensorParallelPlan, group: Any = None) -> SwapReport:
    """Split ``model`` in place as ``plan`` says, over ``group`` (a ProcessGroup, a 1-D DeviceMesh
    or None for the default group, whose size must be ``plan.degree``). Returns a `SwapReport`.

    Call it on every rank of the group with the same plan and the same (full) weights.
    """
    mesh = _mesh(model, group)
    if mesh.size() != plan.degree:
        raise TensorParallelError(f"the plan splits {plan.degree} ways but the tensor-parallel group has "
                                  f"{mesh.size()} ranks: plan with degree={mesh.size()}")
    report = SwapReport(plan.degree, mesh.get_local_rank())
    if plan.degree == 1:
        return report
    modules = dict(model.named_modules())
    aliases: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(m), []).append(name)
    shared: dict[int, nn.Parameter] = {}
    owners = _parameter_owners(model)
    for name, decision in plan.decisions.items():
        if not decision.split:
            continue
        original = _planned_module(modules, name, plan)
        new = _build(original, name, decision, mesh, shared)
        for alias in aliases[id(original)]:
            _replace(model, alias, new)
            report.replaced[alias] = decision.style
    report.shared = [names for pid, names in owners.items() if pid in shared and len(names) > 1]
    for name in plan.attention:
        report.attention[name] = _localize(modules[name], plan, name, mesh.get_group())
    return report


def _mesh(model: nn.Module, group: Any) -> DeviceMesh:
    if isinstance(group, DeviceMesh):
        return tp_mesh(group)
    device = next((p.device.type for p in model.parameters() if p.device.type != "meta"), None)
    return tp_mesh(group, device)


def _planned_module(modules: dict[str, nn.Module], name: str, plan: TensorParallelPlan) -> nn.Module:
    module = modules.get(name)
    if module is None or module_kind(module) not in ("linear", "embedding"):
        found = "no such module" if module is None else type(module).__name__
        raise TensorParallelError(f"the plan splits {name!r} but this model has {found} there: was the plan "
                                  f"made for another model ({plan.model_class}), or applied twice?")
    return module


def _build(module: nn.Module, name: str, decision, mesh: DeviceMesh, shared: dict[int, nn.Parameter]):
    if decision.style in (VOCAB, DIM):
        return DistributedEmbedding.from_module(module, decision.style, group=mesh, name=name, shared=shared)
    if decision.style in (COLUMN, ROW):
        return DistributedLinear.from_module(
            module, decision.style, group=mesh, name=name, shared=shared, fused=decision.fused,
            gather_output=decision.gather_output, input_is_parallel=decision.input_is_parallel)
    raise TensorParallelError(f"{name}: unknown tensor-parallel style {decision.style!r}")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _parameter_owners(model: nn.Module) -> dict[int, tuple[str, ...]]:
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return {pid: tuple(names) for pid, names in owners.items()}


def _localize(module: nn.Module, plan: TensorParallelPlan, name: str,
              group: Any) -> dict[str, tuple[Any, Any]]:
    split = plan.attention[name]
    if split.heads is not None:  # an attention no adapter knows: its heads as smpart found them
        return heads.localize(module, split.heads, plan.degree, group)
    adapter = adapter_named(split.adapter)
    if adapter is None:
        if split.adapter != PublishedAttention.name:
            raise TensorParallelError(f"{name}: the plan split its heads with the {split.adapter!r} adapter, "
                                      "which is no longer registered")
        return {}
    return adapter.localize(module, plan.degree)
