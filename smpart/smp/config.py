"""SMP's configuration dictionary, read as SMP read it, and turned into smpart's `Config`.

SageMaker handed a job its model-parallel parameters in the ``SM_HP_MP_PARAMETERS`` environment
variable (JSON), and ``smp.init()`` read them there; a script may also pass the same dictionary,
``smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, ...})``. `SMPConfig` holds every key
SMP's PyTorch library knew, with SMP's defaults, and is what ``smp.state.cfg`` shows (the Hugging
Face ``Trainer`` reads ``smp.state.cfg.fp16`` there). `to_config` maps it onto smpart's `Config`.

Keys that only tuned SMP's own machinery (activation offloading, its tracing step, its execution
server) change nothing here: accepted, and said once. Keys that need what exists only inside
SageMaker (its sharded data parallelism, its ``smddp`` backend) raise a `ConfigError` naming the
replacement.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

from smpart.config import Config
from smpart.errors import ConfigError

#: Where SageMaker put the ``modelparallel`` parameters of a training job.
ENVIRONMENT_VARIABLE = "SM_HP_MP_PARAMETERS"


@dataclass
class SMPConfig:
    """Every key of SMP v1's PyTorch configuration, with SMP's default (``smp.state.cfg``)."""

    pipeline_parallel_degree: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    optimize: str = "memory"
    placement_strategy: str = "cluster"
    auto_partition: bool = True
    default_partition: int = 0
    tensor_parallel_degree: int = 1
    #: None: 0.2 when optimizing for speed, else 0.8, as SMP chose.
    memory_weight: float | None = None
    ddp: bool = False
    ddp_port: int | None = None
    ddp_dist_backend: str = "auto"
    active_microbatches: int | None = None
    shard_optimizer_state: bool = False
    prescaled_batch: bool = False
    fp16: bool = False
    bf16: bool = False
    fp16_params: bool = False
    delayed_parameter_initialization: bool = False
    sharded_data_parallel_degree: int = 1
    skip_tracing: bool = False
    offload_activations: bool = False
    activation_loading_horizon: int = 4
    deterministic_server: bool = False
    fast_mode: bool = False
    static_mode: bool = False

    @property
    def partitions(self) -> int:
        """SMP's older name for ``pipeline_parallel_degree``."""
        return self.pipeline_parallel_degree

    @property
    def horovod(self) -> bool:
        return False


#: Keys that only tuned SMP's own implementation: accepted, said once when set off their default.
NO_EFFECT = {
    "skip_tracing": "smpart traces on the meta device, which costs no memory",
    "offload_activations": "activations stay on their device; activation checkpointing "
                           "(smp.set_activation_checkpointing) is how smpart saves their memory",
    "activation_loading_horizon": "activations are not offloaded here",
    "deterministic_server": "every stage always runs its work in the schedule's order",
    "fast_mode": "it tuned SMP's own execution server",
    "static_mode": "it tuned SMP's own execution server",
    "fp16_params": "distributed layers are made in the model's dtype",
    "ddp_port": "torchrun's rendezvous (MASTER_ADDR, MASTER_PORT) is used",
}

_said: set[str] = set()


def say_once(key: str, message: str) -> None:
    """Warn about ``key`` once per process."""
    if key not in _said:
        _said.add(key)
        warnings.warn(f"smpart.smp: {message}", stacklevel=3)


def read(config: dict[str, Any] | None) -> SMPConfig:
    """The `SMPConfig` of ``config``, or of ``SM_HP_MP_PARAMETERS`` when ``config`` is None."""
    if config is None:
        text = os.environ.get(ENVIRONMENT_VARIABLE)
        if text is None:
            raise ConfigError("smp.init() with no argument reads SMP's configuration from "
                              f"{ENVIRONMENT_VARIABLE} (JSON), as SageMaker set it, and it is not set: "
                              "pass the dictionary, "
                              "smp.init({'pipeline_parallel_degree': 2, 'microbatches': 4}), or set "
                              f"{ENVIRONMENT_VARIABLE}='{{\"partitions\": 2, \"microbatches\": 4}}'")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{ENVIRONMENT_VARIABLE} is not JSON ({err}): {text[:200]!r}") from err
    if not isinstance(config, dict):
        raise ConfigError(f"smp.init takes SMP's configuration dictionary, got {type(config).__name__}")
    values = dict(config)
    if "partitions" in values:
        partitions = values.pop("partitions")
        if values.setdefault("pipeline_parallel_degree", partitions) != partitions:
            raise ConfigError(f"partitions ({partitions}) and pipeline_parallel_degree "
                              f"({values['pipeline_parallel_degree']}) are the same setting and differ")
    values.pop("horovod", None)
    values.pop("contiguous", None)  # TensorFlow's
    known = {f.name for f in dataclasses.fields(SMPConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown SMP configuration key(s) {unknown}; SMP's PyTorch keys are "
                          f"{sorted(known | {'partitions'})}")
    cfg = SMPConfig(**values)
    _check(cfg)
    return cfg


def _check(cfg: SMPConfig) -> None:
    if cfg.fp16 and cfg.bf16:
        raise ConfigError("fp16 and bf16 cannot both be enabled (as in SMP): choose one")
    if cfg.optimize not in ("memory", "speed"):
        raise ConfigError(f"optimize must be 'memory' or 'speed', got {cfg.optimize!r}")
    if cfg.sharded_data_parallel_degree not in (0, 1):
        raise ConfigError("sharded_data_parallel_degree: SMP's sharded data parallelism exists only inside "
                          "SageMaker. smpart shards the optimizer state over the data-parallel replicas "
                          "(shard_optimizer_state=True, ZeRO-1); for sharded parameters, use torch's FSDP")
    if cfg.ddp_dist_backend == "smddp":
        raise ConfigError("ddp_dist_backend='smddp' is SageMaker's own collective library; use 'nccl' on "
                          "GPUs (or 'auto', which picks nccl when every process has a GPU, else gloo)")
    if cfg.ddp_dist_backend not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"ddp_dist_backend must be 'auto', 'nccl' or 'gloo', got {cfg.ddp_dist_backend!r}")
    if not cfg.auto_partition and not 0 <= cfg.default_partition < cfg.pipeline_parallel_degree:
        raise ConfigError(f"default_partition {cfg.default_partition} is not a partition of "
                          f"{cfg.pipeline_parallel_degree} (0..{cfg.pipeline_parallel_degree - 1})")


def placement(strategy: str) -> str:
    """smpart's placement for SMP's: ``cluster``, ``spread``, or a permutation of ``D``, ``P``, ``T``."""
    if strategy in ("cluster", "spread"):
        return strategy
    if sorted(strategy) != ["D", "P", "T"]:
        raise ConfigError(f"placement_strategy must be 'cluster', 'spread' or a permutation of 'DPT', "
                          f"got {strategy!r}")
    mapped = "cluster" if strategy.endswith("T") else "spread"
    say_once("placement_strategy", f"placement_strategy {strategy!r} is placed as smpart's {mapped!r} (the "
             "tensor-parallel ranks of a stage adjacent with 'cluster', apart with 'spread'); read a rank's "
             "coordinates with smp.pp_rank(), smp.tp_rank(), smp.rdp_rank()")
    return mapped


def to_config(cfg: SMPConfig) -> Config:
    """smpart's `Config` for ``cfg``; says once what SMP tuned that has no effect here."""
    defaults = SMPConfig()
    for key, why in NO_EFFECT.items():
        if getattr(cfg, key) != getattr(defaults, key):
            say_once(key, f"{key}={getattr(cfg, key)!r} has no effect: {why}")
    memory_weight = cfg.memory_weight
    if memory_weight is None:
        memory_weight = 0.2 if cfg.optimize == "speed" else 0.8
    return Config(
        pipeline_parallel_degree=cfg.pipeline_parallel_degree,
        microbatches=cfg.microbatches,
        pipeline=cfg.pipeline,
        active_microbatches=cfg.active_microbatches,
        tensor_parallel_degree=cfg.tensor_parallel_degree,
        placement_strategy=placement(cfg.placement_strategy),
        shard_optimizer_state=cfg.shard_optimizer_state,
        memory_weight=memory_weight,
        backend=cfg.ddp_dist_backend,
    )
