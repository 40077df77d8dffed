"""smpart: split any PyTorch model across devices, the way SageMaker model parallelism did.

The public API, re-exported; nothing inside the package imports from here.
"""

from smpart.config import Config
from smpart.errors import (
    ConfigError,
    PartitionError,
    PipelineError,
    PlanError,
    SmpartError,
    TraceError,
)
from smpart.partition.result import Partition, StageLoad
from smpart.tracing.tree import DataEdge, ModuleNode, ModuleTree

# --- tracing (issue 2) ---
# isort: split
from smpart.tracing.tracer import trace

# --- partition (issue 2) ---
# isort: split
from smpart.partition.api import partition

# --- runtime (issue 3) ---
# isort: split
from smpart.runtime import (
    DistributedModel,
    DistributedOptimizer,
    StepOutput,
    init,
    partition_of,
    set_partition,
    shutdown,
    step,
)

# --- planner (issue 4) ---
# isort: split
from smpart.planner import Cluster, DeviceType, Plan, Plans, plan

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
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
    # runtime (issue 3)
    "DistributedModel",
    "DistributedOptimizer",
    "StepOutput",
    "init",
    "partition_of",
    "set_partition",
    "shutdown",
    "step",
    # planner (issue 4)
    "Cluster",
    "DeviceType",
    "Plan",
    "Plans",
    "plan",
]
