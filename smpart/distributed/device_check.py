"""Did ``torchrun``'s ranks land on the device types the plan meant? Checked once, at ``init``.

A plan for a mixed cluster lays its stages and replicas over the devices in a node order of its
choosing (`Plan.launch_order`) and records the type each rank is meant to run on, in the rank
order ``torchrun`` numbers them (node by node, ``--node-rank``): ``Config.device_types``. If the
nodes are launched in another order, a slow stage's uneven share of layers lands on a fast GPU and
the other way round; nothing fails, every step is just slow. So every rank says what it runs on
and the launch is refused when a rank's type is not the plan's, naming the ranks and both types.

What a rank runs on: ``SMPART_DEVICE_TYPE`` when set (a type's name: for CPUs, emulated types, or
GPUs whose names say nothing), else its CUDA device, which matches a type when the type's family
(``"A100"`` of ``"A100-80"``) is in the device's name and its memory is within 10 % of the type's.
A rank on the CPU without the variable cannot tell: its check is skipped, with a warning.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from smpart.devices import DeviceType, as_device_type
from smpart.errors import ConfigError

#: The environment variable that declares a rank's device type.
DEVICE_TYPE_VARIABLE = "SMPART_DEVICE_TYPE"


def check_rank_devices(expected: list[Any], rank: int, device: torch.device, group: Any,
                       coordinates: list[tuple[int, int, int]]) -> None:
    """Refuse the launch when a rank's device is not of the type ``expected[rank]`` (collective
    over ``group``, every rank). ``coordinates[r]`` is rank ``r``'s (stage, replica, shard)."""
    world = dist.get_world_size()
    if len(expected) != world:
        raise ConfigError(f"device_types lists {len(expected)} type(s) but the job has {world} ranks; give "
                          "one per rank, in torchrun's rank order")
    kinds = [as_device_type(spec) for spec in expected]
    seen, fits = observed_device(kinds[rank], device)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (seen, fits), group=group)
    wrong = [r for r, (_, ok) in enumerate(every) if ok is False]
    if wrong:
        lines = "; ".join(f"rank {r} (stage {coordinates[r][0]}, replica {coordinates[r][1]}) runs on "
                          f"{every[r][0]} but the plan meant {kinds[r].name}" for r in wrong[:8])
        more = f"; and {len(wrong) - 8} more" if len(wrong) > 8 else ""
        raise ConfigError(
            f"the ranks are not on the device types the plan laid out: {lines}{more}. torchrun numbers "
            f"ranks node by node: launch the nodes in the plan's order (Plan.launch_order, --node-rank), or "
            f"plan for the cluster as it is launched (set {DEVICE_TYPE_VARIABLE} where a device's name does "
            f"not say its type)")
    unknown = [r for r, (_, ok) in enumerate(every) if ok is None]
    if unknown and rank == min(unknown):
        meant = sorted({kinds[r].name for r in unknown})
        warnings.warn(f"smpart: rank(s) {unknown} run on the CPU, so whether they are on the plan's device "
                      f"types ({meant}) was not checked; set {DEVICE_TYPE_VARIABLE} in a rank's environment "
                      "to declare its type", stacklevel=4)


def observed_device(kind: DeviceType, device: torch.device) -> tuple[str, bool | None]:
    """(what this rank runs on, whether that is of type ``kind``: None when it cannot tell)."""
    declared = os.environ.get(DEVICE_TYPE_VARIABLE)
    if declared:
        return declared, _same_name(declared, kind.name)
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        family = kind.name.split("-")[0].upper()
        close = abs(props.total_memory - kind.memory_bytes) <= 0.1 * kind.memory_bytes
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)", family in props.name.upper() and close
    return f"the CPU ({device})", None


def _same_name(declared: str, name: str) -> bool:
    try:
        return as_device_type(declared).name.upper() == name.upper()
    except ConfigError:  # a type of the user's own, not a preset: compare the names
        return declared.upper() == name.upper()
