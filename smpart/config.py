"""`Config`: one validated dataclass for every knob smpart has.

`smpart.init` accepts a `Config`, a dict, or the same fields as keyword arguments; all three go
through `Config.from_any`, which names the bad key or value and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from smpart.devices import as_device_type
from smpart.errors import ConfigError

#: Schedule names: the field's names and SMP's aliases (simple = gpipe, interleaved = 1f1b).
PIPELINES = ("gpipe", "1f1b", "simple", "interleaved")
PIPELINE_ALIASES = {"simple": "gpipe", "interleaved": "1f1b"}
PLACEMENT_STRATEGIES = ("cluster", "spread")
BACKENDS = ("auto", "gloo", "nccl")
TRACE_DEVICES = ("meta", "real")
STAGE_THREADS = ("per-stage", "one")


@dataclass
class Config:
    #: Number of pipeline stages the model is cut into.
    pipeline_parallel_degree: int = 1
    #: Micro-batches each step's batch is split into.
    microbatches: int = 1
    #: "simple": all forwards, then all backwards (GPipe). "interleaved": a stage prefers ready
    #: backward work (1F1B-like), keeping few micro-batches' activations alive.
    pipeline: str = "interleaved"
    #: Cap on micro-batches in flight at once (None: the schedule's own bound).
    active_microbatches: int | None = None
    #: Stages per pipeline rank: the model is cut into ``pipeline_parallel_degree x virtual_stages``
    #: stages, rank ``r`` holding stages ``r``, ``r + pp``, ... (round-robin), run as torch's
    #: ``Interleaved1F1B`` runs them (step programs; the first step runs them on the reference
    #: runtime, a rank serving its stages as one). ``pin`` names these stages.
    virtual_stages: int = 1
    tensor_parallel_degree: int = 1
    #: None: derived from the world size (world = pp x tp x dp); 1 on threads.
    data_parallel_degree: int | None = None
    #: Relative batch share of each data-parallel replica, e.g. ``[1, 2]`` (replicas on devices of
    #: unequal speed): replica ``r`` is fed ``shares[r] / sum(shares)`` of every step's global
    #: batch, split into as many micro-batches as the others (each proportionally larger), and
    #: the gradients are averaged weighted by samples, as one process on the global batch would.
    #: `smpart.ReplicaBatchSampler` feeds each replica its share. None: equal shares.
    data_parallel_shares: list[float] | None = None
    #: The device type each rank is meant to run on, in ``torchrun``'s rank order (one per stage on
    #: threads): preset names such as ``"V100"`` or ``{"name", "tflops", "memory_gib"}`` dicts. A
    #: plan for a mixed cluster sets it. Stages are cut for them (each on its slowest type), and
    #: under ``torchrun`` init refuses a launch whose ranks run on other types, naming them.
    device_types: list[Any] | None = None
    #: How ranks map onto the mesh: "cluster" keeps a tensor-parallel group on adjacent ranks
    #: (inside one node), "spread" puts adjacent ranks in different tensor-parallel groups.
    placement_strategy: str = "cluster"
    #: Shard optimizer state across the data-parallel group (ZeRO-1).
    shard_optimizer_state: bool = False
    #: Modules (qualified names or fnmatch patterns like "transformer.h.*") whose forward is
    #: recomputed in the backward (torch.utils.checkpoint) instead of keeping activations.
    activation_checkpointing: list[str] = field(default_factory=list)
    #: Process-group backend under torchrun: "auto" (nccl with CUDA, else gloo), "gloo", "nccl".
    backend: str = "auto"
    #: Weight of memory against compute in each module's cost (0: compute only, 1: memory only).
    memory_weight: float = 0.8
    #: Device of each stage, e.g. ["cuda:0", "cuda:1"] or ["cpu", "cpu"]; None: one CUDA device
    #: per stage when there are enough, else CPU. Under torchrun it applies with gloo (stages may
    #: share a GPU); under NCCL each rank takes its own GPU, the LOCAL_RANK-th.
    devices: list[str] | None = None
    #: Trace on the "meta" device (no weights touched) or on the "real" devices (measures time).
    trace_device: str = "meta"
    #: Module name -> stage, fixed before the automatic partition runs.
    pin: dict[str, int] = field(default_factory=dict)
    #: Average gradients over micro-batches (True, as SMP) or sum them.
    average_grads_across_microbatches: bool = True
    #: Bytes held per parameter byte while training (weights, grads, optimizer state).
    param_memory_factor: float = 4.0
    #: Seconds any wait inside a step may take before it is reported as a hang.
    timeout_s: float = 300.0
    #: A module's output stays on the stage that made it until a stage computes with it (the
    #: caller gets a handle), so activations cross each cut once per direction, as on a chain.
    #: False: every output crosses back to its caller as data. ``SMPART_HANDLES=0`` sets the default.
    output_handles: bool = field(default_factory=lambda: os.environ.get("SMPART_HANDLES", "1") != "0")
    #: On the reference runtime, a stage holds back the gradients that reach a part of its graph
    #: until every gradient message expected there is in, so that part runs its backward once
    #: (`smpart.runtime.reference.gradients`). Only speed changes. ``SMPART_HOLDING=0`` sets the default.
    gradient_holding: bool = field(default_factory=lambda: os.environ.get("SMPART_HOLDING", "1") != "0")
    #: From a model's second step on, every rank runs its part of the step as a fixed list of
    #: actions on one thread, with one-way transfers (`smpart.runtime.program`); the first step of
    #: each kind, and any step its program cannot run, runs on the reference runtime. Only speed
    #: changes. ``SMPART_PROGRAMS=0`` sets the default.
    step_programs: bool = field(default_factory=lambda: os.environ.get("SMPART_PROGRAMS", "1") != "0")
    #: Under ``torchrun`` on gloo, a program's tensors travel as their bytes alone, into receives
    #: posted ahead (`smpart.runtime.program.routes`), from its second run on (a model's fourth
    #: step), where its first run's transfers were alike on both ends of every pair. Only speed
    #: changes. ``SMPART_DIRECT=0`` sets the default.
    direct_transfers: bool = field(default_factory=lambda: os.environ.get("SMPART_DIRECT", "1") != "0")
    #: On threads, where a step program runs its stages: "per-stage" threads (their work outside
    #: the GIL, CUDA launches, the backward, CPU compute, runs side by side), or "one" thread, the
    #: caller's, switching where a stage waits for a transfer (less CPU where the stages' host work
    #: is all Python: `smpart.runtime.program.one_thread`). Only speed changes.
    #: ``SMPART_STAGE_THREADS`` sets the default.
    stage_threads: str = field(default_factory=lambda: os.environ.get("SMPART_STAGE_THREADS", "per-stage"))

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ building
    @classmethod
    def from_any(cls, config: Config | dict[str, Any] | None = None, **kwargs: Any) -> Config:
        if isinstance(config, Config):
            base = dataclasses.asdict(config)
        elif config is None:
            base = {}
        elif isinstance(config, dict):
            base = dict(config)
        else:
            raise ConfigError(
                f"smpart.init takes a Config, a dict or keyword arguments, not {type(config).__name__}"
            )
        base.update(kwargs)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**base)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def partition_stages(self) -> int:
        """How many stages the model is cut into: ``pipeline_parallel_degree x virtual_stages``."""
        return self.pipeline_parallel_degree * self.virtual_stages

    @property
    def schedule(self) -> str:
        """The schedule's canonical name ("gpipe" or "1f1b"), whichever alias was configured."""
        return PIPELINE_ALIASES.get(self.pipeline, self.pipeline)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        for name in (
            "pipeline_parallel_degree",
            "microbatches",
            "tensor_parallel_degree",
            "virtual_stages",
        ):
            _positive_int(name, getattr(self, name))
        if self.data_parallel_degree is not None:
            _positive_int("data_parallel_degree", self.data_parallel_degree)
        self._validate_shares()
        self._validate_device_types()
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                              f"got {self.placement_strategy!r}")
        for switch in ("output_handles", "gradient_holding", "step_programs", "direct_transfers"):
            if not isinstance(getattr(self, switch), bool):
                raise ConfigError(f"{switch} must be True or False, got {getattr(self, switch)!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.activation_checkpointing, list | tuple) or not all(
                isinstance(p, str) for p in self.activation_checkpointing):
            raise ConfigError("activation_checkpointing must be a list of module names or patterns, got "
                              f"{self.activation_checkpointing!r}")
        if self.active_microbatches is not None:
            _positive_int("active_microbatches", self.active_microbatches)
        if self.pipeline not in PIPELINES:
            raise ConfigError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        if self.stage_threads not in STAGE_THREADS:
            raise ConfigError(f"stage_threads must be one of {STAGE_THREADS}, got {self.stage_threads!r}")
        if self.trace_device not in TRACE_DEVICES:
            raise ConfigError(f"trace_device must be one of {TRACE_DEVICES}, got {self.trace_device!r}")
        if isinstance(self.memory_weight, bool) or not isinstance(self.memory_weight, int | float):
            raise ConfigError(f"memory_weight must be a number in [0, 1], got {self.memory_weight!r}")
        if not 0.0 <= float(self.memory_weight) <= 1.0:
            raise ConfigError(f"memory_weight must be in [0, 1], got {self.memory_weight}")
        if self.devices is not None:
            devices = self.devices
            if not isinstance(devices, list | tuple) or not all(isinstance(d, str) for d in devices):
                raise ConfigError(f"devices must be a list of device strings, got {self.devices!r}")
            if len(self.devices) < self.pipeline_parallel_degree:
                raise ConfigError(
                    f"{self.pipeline_parallel_degree} pipeline stages need {self.pipeline_parallel_degree} "
                    f"devices, but devices lists {len(self.devices)}: {list(self.devices)}"
                )
        if not isinstance(self.pin, dict):
            raise ConfigError(f"pin must be a dict of module name -> stage, got {type(self.pin).__name__}")
        for module, stage in self.pin.items():
            if not isinstance(stage, int) or not 0 <= stage < self.partition_stages:
                raise ConfigError(
                    f"pin {module!r} -> {stage!r}: stage must be an int in "
                    f"0..{self.partition_stages - 1}"
                )
        if self.param_memory_factor <= 0:
            raise ConfigError(f"param_memory_factor must be > 0, got {self.param_memory_factor}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")


    def _validate_shares(self) -> None:
        shares = self.data_parallel_shares
        if shares is None:
            return
        if not isinstance(shares, list | tuple) or not shares or not all(
                isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s) and s > 0
                for s in shares):
            raise ConfigError(f"data_parallel_shares must be a list of positive numbers, one per "
                              f"data-parallel replica (e.g. [1, 2]), got {shares!r}")
        if self.data_parallel_degree is not None and len(shares) != self.data_parallel_degree:
            raise ConfigError(f"data_parallel_shares lists {len(shares)} share(s) for data_parallel_degree="
                              f"{self.data_parallel_degree}; give one per replica")

    def _validate_device_types(self) -> None:
        kinds = self.device_types
        if kinds is None:
            return
        if not isinstance(kinds, list | tuple) or not kinds:
            raise ConfigError(f"device_types must be a list with one device type per rank, got {kinds!r}")
        for index, kind in enumerate(kinds):
            try:
                as_device_type(kind)
            except ConfigError as err:
                raise ConfigError(f"device_types[{index}]: {err}") from None
        ranks = self.pipeline_parallel_degree * self.tensor_parallel_degree * (self.data_parallel_degree or 1)
        if self.data_parallel_degree is not None and len(kinds) != ranks:
            raise ConfigError(f"device_types lists {len(kinds)} type(s) for pp x tp x dp = {ranks} ranks; "
                              "give one per rank, in torchrun's rank order")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
