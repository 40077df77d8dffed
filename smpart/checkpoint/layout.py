"""What a rank holds: its tensors by ``state_dict`` name and how they are tied, the names of the
whole model, its optimizer's parameters by name (never by position, which differs from one
layout to the next), and whether the model is still waiting for its placement.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from smpart.checkpoint.collective import _some
from smpart.errors import CheckpointError
from smpart.runtime.optimizer import DistributedOptimizer
from smpart.runtime.runtime import process_setup


@dataclass


class _Layout:
    """The tensors this rank holds, by ``state_dict`` name, and the names of the whole model."""

    module: nn.Module
    local: dict[str, torch.Tensor]
    all_names: list[str]


def _layout(model: Any) -> _Layout:
    """What ``model`` holds on this rank: a plain ``nn.Module``, or a wrapper with the user's module
    in ``module`` (an ``smpart.DistributedModel``, or torch's ``DistributedDataParallel``).

    A wrapper with ``local_state_dict()`` (a model under processes) holds only its stage's tensors
    (the rest are on the meta device) and says which there; those are taken from
    ``module.state_dict()`` when it has them, so a load writes into the live parameters.
    Otherwise every tensor of the module is this rank's.
    """
    wrapped = getattr(model, "module", None)
    is_wrapper = isinstance(wrapped, nn.Module) and (
        not isinstance(model, nn.Module) or isinstance(model, nn.parallel.DistributedDataParallel))
    module = wrapped if is_wrapper else model
    if not isinstance(module, nn.Module):
        raise CheckpointError("a checkpoint is made of an nn.Module or an smpart.DistributedModel, "
                              f"got {type(model).__name__}")
    live = module.state_dict()
    local_state_dict = getattr(model, "local_state_dict", None) if is_wrapper else None
    if callable(local_state_dict):
        local = {name: live.get(name, tensor) for name, tensor in local_state_dict().items()}
        return _Layout(module, local, list(live))
    meta = [name for name, t in live.items() if t.device.type == "meta"]
    if meta:
        raise CheckpointError(f"{len(meta)} tensor(s) of {type(module).__name__} are on the meta device "
                              f"({_some(meta)}): materialise the model (or wrap it in "
                              "smpart.DistributedModel, whose ranks know what they hold) first")
    return _Layout(module, dict(live), list(live))


def _optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside ``optimizer`` (an ``smpart.DistributedOptimizer`` wraps one, and
    is an ``Optimizer`` itself to schedulers: unwrap it first)."""
    if isinstance(optimizer, DistributedOptimizer):
        optimizer._adopt_replaced_parameters()  # placement may have replaced parameters (tp shards)
        return optimizer.optimizer
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise CheckpointError(f"optimizer must be a torch.optim.Optimizer or smpart.DistributedOptimizer, "
                          f"got {type(optimizer).__name__}")


def _parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Each optimizer parameter this rank holds with its name in the model (a tied weight: its
    first name); parameters of other stages (on the meta device) are not this rank's to save."""
    names = {id(p): name for name, p in module.named_parameters()}
    out, unknown = [], 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type == "meta":
                continue
            if id(p) in names:
                out.append((names[id(p)], p))
            else:
                unknown += 1
    if unknown:
        raise CheckpointError(f"the optimizer holds {unknown} parameter(s) that are not the model's: build "
                              "the optimizer from model.parameters() of the model being checkpointed")
    return out


def _awaits_placement(model: Any) -> bool:
    """A `DistributedModel` not placed yet with tensors on the meta device: nothing holds their
    values until its placement makes each stage's (threads and processes alike)."""
    if getattr(model, "_after_placement", None) is None or getattr(model, "_runtime", None) is not None:
        return False
    from smpart.runtime.runtime import running_runtime

    on_meta = any(t.is_meta for t in itertools.chain(model.module.parameters(), model.module.buffers()))
    if on_meta and running_runtime() is None:
        raise CheckpointError("this model's tensors are on the meta device, and smpart is not running to "
                              "place it: call smpart.init(...) first, and the load waits for the model's "
                              "placement at its first step")
    return on_meta


def _placed_later(model: Any) -> bool:
    """A `DistributedModel` the process runtime has not placed yet (at placement each rank keeps
    its own stage only, and tensor-parallel layers become shards)."""
    if getattr(model, "_after_placement", None) is None or getattr(model, "_runtime", None) is not None:
        return False
    return process_setup() is not None


def _tie_groups(local: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by the tensor they share (a tied weight is one group)."""
    groups: dict[tuple, list[str]] = {}
    for name, t in local.items():
        key = _storage_key(t)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _storage_key(t: torch.Tensor) -> tuple:
    local = t.to_local() if _is_dtensor(t) else t
    if local.is_meta:  # no storage: a tied weight is one object
        return (id(t),)
    try:
        return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.dtype)
    except (RuntimeError, NotImplementedError):
        return (id(t),)


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _is_fused(t: Any) -> bool:
    """A fused q/k/v shard: this rank's slice of each part (a ``_StridedShard``)."""
    if not _is_dtensor(t):
        return False
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in t.placements)
