"""Pipeline runtime: `DistributedModel`, ``@step``, one execution server per stage.

Data flow: ``init`` starts one `ExecutionServer` per stage; the first call of a
`DistributedModel` inside a step traces and partitions it and places each module on its stage;
each micro-batch's step body runs in a `Driver` thread; module calls that cross stages and their
gradients travel as messages (`messages`) over a `Transport`.
"""

from smpart.runtime.microbatches import StepOutput
from smpart.runtime.model import DistributedModel
from smpart.runtime.optimizer import DistributedOptimizer
from smpart.runtime.runtime import init, partition_of, set_partition, shutdown
from smpart.runtime.step_function import step
from smpart.runtime.timeline import Timeline
from smpart.runtime.transport import ThreadTransport, Transport

__all__ = [
    "DistributedModel",
    "DistributedOptimizer",
    "StepOutput",
    "ThreadTransport",
    "Timeline",
    "Transport",
    "init",
    "partition_of",
    "set_partition",
    "shutdown",
    "step",
]
