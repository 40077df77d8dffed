"""The planner: choose pp × tp × dp, micro-batches, device groups and stage boundaries.

``plan(tree, cluster, global_batch)`` prices every strategy with the cost model (`cost.py`),
solves each strategy's stage boundaries exactly (`assign.py`) and returns ranked `Plans`.
"""

from smpart.planner.assign import LayerAssignment, assign_layers
from smpart.planner.cluster import PRESETS, Cluster, Device, DeviceType, Node, device_type
from smpart.planner.cost import CostModel, CostOptions, StageDevices
from smpart.planner.layers import LayerSeq, layer_sequence
from smpart.planner.plan import Plan, Plans
from smpart.planner.search import plan, price

__all__ = [
    "PRESETS",
    "Cluster",
    "CostModel",
    "CostOptions",
    "Device",
    "DeviceType",
    "LayerAssignment",
    "LayerSeq",
    "Node",
    "Plan",
    "Plans",
    "StageDevices",
    "assign_layers",
    "device_type",
    "layer_sequence",
    "plan",
    "price",
]
