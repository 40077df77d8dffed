"""Pipeline runtime: `DistributedModel`, ``@step``, one execution server per stage.

Data flow: ``init`` starts one `StageServer` per stage (every stage on threads, this rank's under
``torchrun``); the first call of a `DistributedModel` inside a step traces and partitions it and
places each module on its stage; each micro-batch's step body runs in a `Driver` thread; module
calls that cross stages and their gradients travel as messages (`messages`) over a `Transport`,
and every stage starts its work in the order its `Schedule` lists. See docs/architecture.md.
"""

from smpart.runtime.microbatches import StepOutput
from smpart.runtime.model import DistributedModel
from smpart.runtime.optimizer import DistributedOptimizer
from smpart.runtime.ranks import (
    barrier,
    device_mesh,
    dp_rank,
    dp_size,
    get_dp_group,
    get_pp_group,
    get_tp_group,
    local_rank,
    pp_rank,
    pp_size,
    rank,
    size,
    tp_rank,
    tp_size,
)
from smpart.runtime.runtime import partition_of, program_of, set_partition
from smpart.runtime.schedule import Schedule, schedule_named
from smpart.runtime.session import init, shutdown
from smpart.runtime.step_function import step
from smpart.runtime.timeline import Timeline
from smpart.runtime.wire.transport import ThreadTransport, Transport

__all__ = [
    "Schedule",
    "barrier",
    "device_mesh",
    "dp_rank",
    "dp_size",
    "get_dp_group",
    "get_pp_group",
    "get_tp_group",
    "local_rank",
    "pp_rank",
    "pp_size",
    "rank",
    "schedule_named",
    "size",
    "tp_rank",
    "tp_size",
    "DistributedModel",
    "DistributedOptimizer",
    "StepOutput",
    "ThreadTransport",
    "Timeline",
    "Transport",
    "init",
    "partition_of",
    "program_of",
    "set_partition",
    "shutdown",
    "step",
]
