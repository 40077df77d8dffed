"""smpart: split any PyTorch model across devices, the way SageMaker model parallelism did.

The public API, re-exported; nothing inside the package imports from here.
"""

import functools
import importlib

from smpart.config import Config
from smpart.errors import (
    CheckpointError,
    ConfigError,
    PartitionError,
    PeerLost,
    PipelineError,
    PlanError,
    SmpartError,
    TraceError,
)
from smpart.partitioning.api import partition
from smpart.partitioning.result import VIEWS as _partition_views
from smpart.partitioning.result import Partition, StageLoad
from smpart.planner import Cluster, DeviceType, Plan, Plans, plan
from smpart.runtime import (
    DistributedModel,
    DistributedOptimizer,
    StepOutput,
    barrier,
    device_mesh,
    dp_rank,
    dp_size,
    get_dp_group,
    get_pp_group,
    get_tp_group,
    init,
    local_rank,
    partition_of,
    pp_rank,
    pp_size,
    program_of,
    rank,
    set_partition,
    shutdown,
    size,
    step,
    tp_rank,
    tp_size,
)
from smpart.runtime.placement.activation_checkpointing import set_activation_checkpointing
from smpart.runtime.processes.shares import ReplicaBatchSampler, replica_batch_size, replica_batch_sizes
from smpart.runtime.reference.boundary import register_carried_state
from smpart.tensor_parallel import record_split_shares, set_tensor_parallelism, tensor_parallelism
from smpart.tracing import tracer as _tracer
from smpart.tracing.tree import DataEdge, ModuleNode, ModuleTree

__version__ = "0.1.0"

#: Imported at first use: checkpoints need ``torch.distributed.checkpoint``, whose import (with
#: ``torch.distributed.tensor``) costs ~1.4 s, a third of ``import smpart``.
_CHECKPOINT_API = ("save_checkpoint", "load_checkpoint", "load_weights")


#: The views of a partition, imported at first use too (rich's console costs ~50 ms).
_VIEWS = ("show", "to_html")

#: Public modules, imported at first use too: ``smpart.nn.DistributedLinear``, ``smpart.amp.GradScaler``.
_MODULES = ("nn", "amp")


def __getattr__(name: str):
    if name in _CHECKPOINT_API:
        from smpart import checkpoint

        return getattr(checkpoint, name)
    if name in _VIEWS:
        from smpart import viz

        return getattr(viz, name)
    if name in _MODULES:
        return importlib.import_module(f"smpart.{name}")
    raise AttributeError(f"module 'smpart' has no attribute {name!r}")


class _Views:
    """`smpart.viz`, imported when a partition first draws itself (``part.show()``)."""

    def __getattr__(self, name: str):
        from smpart import viz

        return getattr(viz, name)


_partition_views.append(_Views())


def __dir__() -> list[str]:
    return sorted({*globals(), *_CHECKPOINT_API, *_VIEWS, *_MODULES})


@functools.wraps(_tracer.trace)
def trace(model, example_args, example_kwargs=None, device="meta", **options) -> ModuleTree:
    module = model.module if isinstance(model, DistributedModel) else model
    tree = _tracer.trace(module, example_args, example_kwargs, device, **options)
    return record_split_shares(tree, module)


trace.__doc__ = (_tracer.trace.__doc__ or "") + """
    A `DistributedModel` is traced as the model it wraps, before its first step or after it.
    The tree also records, for tensor-parallel degrees 2, 4 and 8, what the swap-in would split
    of each node (`smpart.tensor_parallel.record_split_shares`), so `smpart.plan` prices it.
"""

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "PeerLost",
    "DataEdge",
    "ModuleNode",
    "ModuleTree",
    "Partition",
    "PartitionError",
    "PipelineError",
    "PlanError",
    "SmpartError",
    "StageLoad",
    "TraceError",
    "trace",
    "partition",
    "show",
    "to_html",
    "DistributedModel",
    "DistributedOptimizer",
    "StepOutput",
    "init",
    "partition_of",
    "program_of",
    "set_partition",
    "shutdown",
    "step",
    "rank",
    "size",
    "local_rank",
    "pp_rank",
    "pp_size",
    "dp_rank",
    "dp_size",
    "get_dp_group",
    "get_pp_group",
    "get_tp_group",
    "tp_rank",
    "tp_size",
    "barrier",
    "device_mesh",
    "set_activation_checkpointing",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "register_carried_state",
    "ReplicaBatchSampler",
    "replica_batch_size",
    "replica_batch_sizes",
    "save_checkpoint",
    "load_checkpoint",
    "load_weights",
    "Cluster",
    "DeviceType",
    "Plan",
    "Plans",
    "plan",
]
