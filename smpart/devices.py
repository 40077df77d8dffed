"""`DeviceType`: a kind of accelerator, its speed and its memory, and the presets people name.

Three rooms speak of device types, so they live below all of them: the partitioner balances each
stage's time on its own device (`smpart.partition`), the planner builds clusters of them
(`smpart.planner.Cluster`), and the runtime checks that ``torchrun``'s ranks landed on the types a
plan meant (`smpart.distributed.device_check`). Nothing here imports torch.

A device type is named three ways, all accepted wherever one is asked for (`as_device_type`): a
`DeviceType`, a preset's name (``"V100"``, ``"A100-80"``; case-insensitive, ``"A100"`` is the
80 GB part), or a dict ``{"name": "mine", "tflops": 50, "memory_gib": 24}`` (how `Config` carries
a type that is no preset, since a config stays plain JSON: `device_spec` writes it back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smpart.errors import ConfigError

GIB = 1 << 30
GBS = 1e9  # bytes per second in one GB/s (how memory bandwidth is quoted)


@dataclass(frozen=True)
class DeviceType:
    """A kind of accelerator: its name, peak dense fp16/bf16 throughput, memory and (when known)
    memory bandwidth in bytes/s, which prices layers of low arithmetic intensity."""

    name: str
    tflops: float
    memory_bytes: int
    memory_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if self.tflops <= 0 or self.memory_bytes <= 0:
            raise ConfigError(f"device type {self.name!r} needs tflops > 0 and memory > 0")
        if self.memory_bandwidth is not None and self.memory_bandwidth <= 0:
            raise ConfigError(f"device type {self.name!r} needs memory bandwidth > 0 (or none)")

    @property
    def flops(self) -> float:
        return self.tflops * 1e12

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def describe(self) -> str:
        """``V100 (125 TFLOPS, 16 GiB)``: what a view prints next to a stage."""
        return f"{self.name} ({self.tflops:g} TFLOPS, {self.memory_gib:.3g} GiB)"


#: Peak dense fp16/bf16 tensor-core throughput (no sparsity), memory and memory bandwidth, from
#: vendor data sheets.
PRESETS: dict[str, DeviceType] = {
    d.name: d
    for d in (
        DeviceType("H100", 989.0, 80 * GIB, 3350 * GBS),  # SXM5, bf16 dense
        DeviceType("A100-80", 312.0, 80 * GIB, 2039 * GBS),
        DeviceType("A100-40", 312.0, 40 * GIB, 1555 * GBS),
        DeviceType("L4", 121.0, 24 * GIB, 300 * GBS),
        DeviceType("V100", 125.0, 16 * GIB, 900 * GBS),  # SXM2 16 GB, as in AWS p3.8xlarge
        DeviceType("T4", 65.0, 16 * GIB, 320 * GBS),
        DeviceType("P100", 18.7, 16 * GIB, 732 * GBS),  # PCIe, fp16
    )
}


def device_type(name: str) -> DeviceType:
    """A preset by name (case-insensitive; "A100" means the 80 GB part)."""
    key = {"A100": "A100-80"}.get(name.upper(), name.upper())
    for preset in PRESETS.values():
        if preset.name.upper() == key:
            return preset
    raise ConfigError(f"unknown device type {name!r}; presets are {sorted(PRESETS)} "
                      f"(or define it under [device.{name}] with tflops and memory_gib)")


def as_device_type(spec: Any) -> DeviceType:
    """A `DeviceType` from a `DeviceType`, a preset's name or a dict (see the module docstring)."""
    if isinstance(spec, DeviceType):
        return spec
    if isinstance(spec, str):
        return device_type(spec)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - {"name", "tflops", "memory_gib", "memory_bytes", "memory_gbs"})
        memory_given = {"memory_gib", "memory_bytes"} & set(spec)
        if unknown or "name" not in spec or "tflops" not in spec or not memory_given:
            raise ConfigError(f"a device type as a dict needs name, tflops and memory_gib (or memory_bytes), "
                              f"and optionally memory_gbs; got {dict(spec)!r}")
        try:
            memory = (int(spec["memory_bytes"]) if "memory_bytes" in spec
                      else int(float(spec["memory_gib"]) * GIB))
            bandwidth = float(spec["memory_gbs"]) * GBS if spec.get("memory_gbs") is not None else None
            return DeviceType(str(spec["name"]), float(spec["tflops"]), memory, bandwidth)
        except (TypeError, ValueError):
            raise ConfigError(f"device type {dict(spec)!r}: tflops and memory must be numbers") from None
    raise ConfigError(f"a device type is a DeviceType, a preset's name such as 'V100' ({sorted(PRESETS)}) "
                      f"or a dict with name, tflops and memory_gib; got {spec!r}")


def device_spec(kind: DeviceType) -> str | dict[str, Any]:
    """How a `Config` carries ``kind``: the preset's name when it is one, else a plain dict."""
    if PRESETS.get(kind.name) == kind:
        return kind.name
    spec: dict[str, Any] = {"name": kind.name, "tflops": kind.tflops, "memory_bytes": kind.memory_bytes}
    if kind.memory_bandwidth is not None:
        spec["memory_gbs"] = kind.memory_bandwidth / GBS
    return spec
