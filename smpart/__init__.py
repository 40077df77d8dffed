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

# The functions below are imported after the data classes above, each in its own block, because
# ``smpart.partition`` (the function) must win over the subpackage of the same name, which Python
# binds as an attribute of ``smpart`` when a ``smpart.partition.*`` module is first imported.
# isort: split
from smpart.tracing.tracer import trace

# isort: split
from smpart.partition.api import partition

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
    "DistributedModel",
    "DistributedOptimizer",
    "StepOutput",
    "init",
    "partition_of",
    "set_partition",
    "shutdown",
    "step",
    "Cluster",
    "DeviceType",
    "Plan",
    "Plans",
    "plan",
]
