"""SMP v1's PyTorch API under its own names, on smpart: ``import smpart.smp as smp``.

A training script written for SageMaker's model-parallel library
(``import smdistributed.modelparallel.torch as smp``) runs with that one line changed, on threads
(``python train.py``) or one process per rank (``torchrun``). What each name does here, the same,
mapped or refused, is listed in ``docs/smp.md``.
"""

from __future__ import annotations

from typing import Any

import smpart.runtime as _runtime_api
from smpart.errors import SmpartError
from smpart.runtime.grad_scaler import GradScaler as _GradScaler
from smpart.runtime.microbatches import StepOutput
from smpart.runtime.runtime import running_runtime as _running_runtime
from smpart.smp import config as _config
from smpart.smp import nn
from smpart.smp.groups import (
    DP_GROUP,
    DP_RANK,
    MP_GROUP,
    MP_RANK,
    PP_GROUP,
    PP_RANK,
    RDP_GROUP,
    RDP_RANK,
    TP_GROUP,
    TP_RANK,
    WORLD,
    WORLD_RANK,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    dp_rank,
    dp_size,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_barrier,
    mp_rank,
    mp_size,
    pp_barrier,
    pp_rank,
    pp_size,
    rank,
    rdp_barrier,
    rdp_rank,
    rdp_size,
    recv_from,
    send,
    size,
    tp_barrier,
    tp_rank,
    tp_size,
)
from smpart.smp.model import (
    DistributedModel,
    DistributedOptimizer,
    delay_param_initialization,
    model_creation,
    partition,
    set_activation_checkpointing,
    set_partition,
    set_tensor_parallelism,
    tensor_parallelism,
)
from smpart.smp.saving import load, resume_from_checkpoint, save, save_checkpoint
from smpart.smp.state import state
from smpart.smp.step import step
from smpart.tracing.tracer import is_tracing


def init(config: dict[str, Any] | None = None) -> _config.SMPConfig:
    """Start smpart from SMP's configuration dictionary, or with none, from ``SM_HP_MP_PARAMETERS``
    (JSON) as SageMaker set it. Every rank calls it; returns ``smp.state.cfg``."""
    from smpart.smp.groups import GROUPS

    cfg = _config.read(config)
    state.cfg, state.model, state.optimizer = cfg, None, None  # a new job: its model is made after
    _runtime_api.init(_config.to_config(cfg))
    runtime = _running_runtime()
    if runtime is not None and runtime.layout is not None:
        GROUPS.make_all(runtime)
    state.initialized = True
    return cfg


def is_initialized() -> bool:
    return state.initialized and _running_runtime() is not None


class amp:  # noqa: N801 - SMP's namespace: smp.amp.GradScaler
    GradScaler = _GradScaler


_TP_REGISTER = ("registered SMP's own distributed modules for a class; smpart splits torch's layers "
                "itself, and learns a new attention class from "
                "smpart.tensor_parallel.register_attention_adapter")

#: SMP names that need what exists only inside SageMaker (or its own kernels), and what to use.
_REFUSED = {
    "tp_register": _TP_REGISTER,
    "tp_register_with_module": _TP_REGISTER,
    "checkpoint": "call smp.set_activation_checkpointing(module) before the first step, and the module as "
                  "usual",
    "checkpoint_sequential": "call smp.set_activation_checkpointing(sequential) before the first step",
}


class _Refused:
    """A namespace whose every attribute is refused with the same advice."""

    def __init__(self, name: str, advice: str) -> None:
        self._name, self._advice = name, advice

    def __getattr__(self, attribute: str) -> Any:
        raise SmpartError(f"smp.{self._name}.{attribute} {self._advice}")


#: ``smp.optimizers.FusedLamb`` / ``FusedNovoGrad`` wrapped apex's fused optimizers for SMP.
optimizers = _Refused("optimizers", "wrapped apex's fused optimizer for SMP; smpart steps any torch "
                      "optimizer: use apex.optimizers' own class (or torch.optim.AdamW) in "
                      "smp.DistributedOptimizer")
#: ``smp.patches.checkpoint.checkpoint(module, *args)`` checkpointed a module call.
patches = _Refused("patches", "checkpointed a module call inside SMP; call "
                   "smp.set_activation_checkpointing(module) before the first step, and the module as usual")


def __getattr__(name: str) -> Any:
    if name in _REFUSED:
        raise SmpartError(f"smp.{name}: {_REFUSED[name]}")
    raise AttributeError(f"module 'smpart.smp' has no attribute {name!r}")


__all__ = [
    "CommGroup", "DP_GROUP", "DP_RANK", "DistributedModel", "DistributedOptimizer", "MP_GROUP", "MP_RANK",
    "PP_GROUP", "PP_RANK", "RDP_GROUP", "RDP_RANK", "RankType", "StepOutput", "TP_GROUP", "TP_RANK", "WORLD",
    "WORLD_RANK", "allgather", "amp", "barrier", "broadcast", "delay_param_initialization", "dp_barrier",
    "dp_rank", "dp_size", "get_dp_group", "get_dp_process_group", "get_mp_group", "get_mp_process_group",
    "get_pp_group", "get_pp_process_group", "get_rdp_group", "get_rdp_process_group", "get_tp_group",
    "get_tp_process_group", "get_world_group", "get_world_process_group", "init", "is_initialized",
    "is_tracing", "load", "local_rank", "local_size", "model_creation", "mp_barrier", "mp_rank", "mp_size",
    "nn", "optimizers", "partition", "patches", "pp_barrier", "pp_rank", "pp_size", "rank", "rdp_barrier",
    "rdp_rank", "rdp_size", "recv_from", "resume_from_checkpoint", "save", "save_checkpoint", "send",
    "set_activation_checkpointing", "set_partition", "set_tensor_parallelism", "size", "state", "step",
    "tensor_parallelism", "tp_barrier", "tp_rank", "tp_size",
]
