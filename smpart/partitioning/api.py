"""`partition(tree, num_stages, memory_weight, pin, devices)`: the public entry point of the partitioner.

It checks the request, turns pins on module names into pins on nodes, weighs every node by
``(1 - w)·compute + w·memory`` and hands the rest to `smpart.partitioning.partitioner`. The answer is
a pure function of its input: the same tree and arguments always give the same `Partition`.

``devices`` (one per stage, in pipeline order: `DeviceType`s or preset names) makes the stages
unequal: stage ``s``'s time is its load ÷ its device's speed (TFLOPS, relative to the fastest),
the slowest time is minimised, and a stage's training memory (the tree's bytes: parameter state,
buffers, the traced batch's saved activations) must fit its device's memory. A model that fits
no cut raises `PartitionError` naming the stage that overflows the least and by how much.

A model that cannot fill every stage (fewer call-ordered leaf modules than stages, a single
module with no children included) raises `PartitionError` saying how many stages it can fill:
an idle pipeline stage is never what a user wants, and choosing fewer stages is their call.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from smpart.devices import DeviceType, as_device_type, device_spec
from smpart.errors import ConfigError, PartitionError
from smpart.partitioning.partitioner import Hardware, partition_tree
from smpart.partitioning.result import Partition
from smpart.tracing.tree import ModuleTree

ALGORITHM = "smp-tree"


def partition(
    tree: ModuleTree,
    num_stages: int,
    memory_weight: float = 0.8,
    pin: Mapping[str, int] | None = None,
    devices: Sequence[DeviceType | str | Mapping[str, Any]] | None = None,
) -> Partition:
    """Cut ``tree`` into ``num_stages`` pipeline stages.

    ``memory_weight`` (0..1) trades compute balance (0) for memory balance (1). ``pin`` fixes
    modules, with their sub-modules, to stages: ``{"lm_head": 3}``. A module that shares a
    parameter with others is pinned together with them. ``devices``: what each stage runs on,
    ``["V100", "V100", "A100-80", "A100-80"]`` (see the module docstring).
    """
    if not isinstance(tree, ModuleTree):
        raise PartitionError(f"partition() needs a ModuleTree (from smpart.trace), got {type(tree).__name__}")
    _check_num_stages(num_stages)
    _check_memory_weight(memory_weight)
    kinds = _device_types(devices, num_stages)
    node_pins = _node_pins(tree, dict(pin or {}), num_stages)
    costs = tree.node_costs(float(memory_weight))
    hardware = None if kinds is None else _hardware(tree, kinds)
    outcome = partition_tree(tree, costs, num_stages, node_pins, hardware)
    meta: dict[str, Any] = {
        "algorithm": ALGORITHM,
        "method": outcome.method,
        "max_stage_cost": outcome.max_stage_cost,
        "candidates": outcome.candidates,
        "pins": dict(pin or {}),
        **outcome.notes,
    }
    if kinds is not None:
        meta.update(devices=[device_spec(k) for k in kinds], device_names=[k.name for k in kinds],
                    device_memory=[k.memory_bytes for k in kinds], device_tflops=[k.tflops for k in kinds])
    over_memory = meta.pop("over_memory", False)
    part = Partition(tree, outcome.node_stage, num_stages, float(memory_weight), meta=meta)
    if over_memory:
        raise _does_not_fit(part, kinds or [])
    return part


def _device_types(devices: object, num_stages: int) -> list[DeviceType] | None:
    if devices is None:
        return None
    if isinstance(devices, str | bytes) or not isinstance(devices, Sequence):
        raise PartitionError(f"devices must be a list with one device type per stage, got {devices!r}")
    if len(devices) != num_stages:
        raise PartitionError(f"devices lists {len(devices)} device type(s) for {num_stages} stage(s); give "
                             f"one per stage, in pipeline order")
    try:
        return [as_device_type(d) for d in devices]
    except ConfigError as err:
        raise PartitionError(f"devices: {err}") from None


def _hardware(tree: ModuleTree, kinds: list[DeviceType]) -> Hardware:
    fastest = max(k.tflops for k in kinds)
    return Hardware(tuple(k.tflops / fastest for k in kinds), tuple(float(k.memory_bytes) for k in kinds),
                    {node.name: tree.memory_of(node) for node in tree.nodes()})


def _does_not_fit(part: Partition, kinds: list[DeviceType]) -> PartitionError:
    """Name the stage that overflows its device in the best cut found, and by how much."""
    over = [(load.memory / kind.memory_bytes, s, load.memory, kind)
            for s, (load, kind) in enumerate(zip(part.stage_loads(), kinds, strict=True))]
    ratio, stage, used, kind = max(over)
    gib = 1 << 30
    return PartitionError(
        f"the model does not fit these devices: every cut overflows some device's memory; the best one "
        f"puts {used / gib:.3g} GiB on stage {stage} ({kind.describe()}), {ratio:.0%} of it. Use more "
        f"stages or devices with more memory (a stage's bytes are the tree's training memory: parameter "
        f"state, buffers and the traced batch's activations)")


def _check_num_stages(num_stages: object) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, numbers.Integral):
        raise PartitionError(f"num_stages must be an int, got {num_stages!r}")
    if num_stages < 1:
        raise PartitionError(f"num_stages must be at least 1, got {num_stages}")


def _check_memory_weight(memory_weight: object) -> None:
    if isinstance(memory_weight, bool) or not isinstance(memory_weight, numbers.Real):
        raise PartitionError(f"memory_weight must be a number in [0, 1], got {memory_weight!r}")
    if not 0.0 <= float(memory_weight) <= 1.0:
        raise PartitionError(
            f"memory_weight must be in [0, 1] (0 balances compute, 1 balances memory), got {memory_weight}"
        )


def _node_pins(tree: ModuleTree, pin: dict[str, int], num_stages: int) -> dict[str, int]:
    """Pins on module names → pins on canonical node names; refuses pins that split a node."""
    node_pins: dict[str, int] = {}
    pinned_by: dict[str, str] = {}
    for module, stage in pin.items():
        if module not in tree:
            raise PartitionError(f"cannot pin {module!r}: no such module{_suggest(module, tree)}")
        if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < num_stages:
            raise PartitionError(
                f"cannot pin {module!r} to stage {stage!r}: stages are 0..{num_stages - 1}"
            )
        node = tree.node(module)
        if node_pins.get(node.name, stage) != stage:
            raise PartitionError(
                f"pins put {pinned_by[node.name]!r} on stage {node_pins[node.name]} and {module!r} on "
                f"stage {stage}, but they share parameters (one node: {', '.join(node.names)}) and "
                f"must live on one stage; pin them to the same stage"
            )
        node_pins[node.name] = int(stage)
        pinned_by[node.name] = module
    return node_pins


def _suggest(module: str, tree: ModuleTree) -> str:
    close = difflib.get_close_matches(module, tree.module_names(), n=3, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(repr(c) for c in close) + "?"
    return f"; module names look like {tree.module_names()[1:4]}"
