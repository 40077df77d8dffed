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
# --- partition (issue 2) ---
# --- runtime (issue 3) ---
# --- planner (issue 4) ---

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
]
