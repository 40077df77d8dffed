"""`Plan` (one priced strategy) and `Plans` (the ranked list `smpart.plan` returns)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from smpart.config import Config
from smpart.devices import device_spec
from smpart.errors import PlanError
from smpart.partitioning.result import Partition
from smpart.planner.cluster import Device
from smpart.planner.cost import StageDevices
from smpart.planner.layers import LayerSeq


@dataclass
class Plan:
    """One strategy with its optimal stage boundaries, predicted time and memory."""

    pp: int
    tp: int
    dp: int
    microbatches: int
    microbatch_size: int
    stages: tuple[StageDevices, ...]
    #: First layer of each stage (indices into `layer_names`).
    starts: tuple[int, ...]
    #: Predicted seconds per iteration: pipeline + data-parallel gradient all-reduce.
    time_s: float
    pipeline_s: float
    dp_sync_s: float
    #: Seconds per micro-batch (forward + backward) of each stage.
    stage_times: tuple[float, ...]
    #: Bytes on the fullest device of each stage, and that device's usable bytes.
    stage_memory: tuple[tuple[float, float], ...]
    layers: LayerSeq = field(repr=False)
    memory_weight: float = 0.8
    pipeline: str = "interleaved"
    #: Per stage: whether it checkpoints its layers; () when no stage does.
    checkpointed: tuple[bool, ...] = ()
    #: Samples in a micro-batch of each data-parallel replica: shared by speed on mixed devices
    #: (the runtime's ``data_parallel_shares``), all ``microbatch_size`` otherwise.
    replica_sizes: tuple[int, ...] = ()
    #: Stages per pipeline rank (``Config.virtual_stages``): 2 runs ``2 pp`` stages interleaved.
    virtual_stages: int = 1

    # ---------------------------------------------------------------- derived
    @property
    def layer_names(self) -> list[str]:
        return self.layers.names

    @property
    def stage_of_layer(self) -> list[int]:
        bounds = [*self.starts, len(self.layers)]
        return [j for j in range(self.pp) for _ in range(bounds[j], bounds[j + 1])]

    @property
    def checkpointed_stages(self) -> list[int]:
        """Stages that checkpoint their layers (recompute them in the backward)."""
        return [j for j, flag in enumerate(self.checkpointed) if flag]

    @property
    def activation_checkpointing(self) -> list[str]:
        """Module names the checkpointed stages checkpoint (their layers that keep fewer bytes so)."""
        stage_of_layer = self.stage_of_layer
        stages = set(self.checkpointed_stages)
        return self.layers.checkpoint_names([i for i, j in enumerate(stage_of_layer) if j in stages])

    @property
    def memory_use(self) -> float:
        """The fullest device's share of its usable memory (<= 1 for every plan proposed)."""
        return max(used / budget for used, budget in self.stage_memory)

    @cached_property
    def partition(self) -> Partition:
        """The model's `Partition` under this plan (the runtime runs it as is).

        Its ``meta`` carries each stage's devices: ``device_names`` and ``device_memory``, the
        usable bytes of one replica of the stage — its tensor-parallel group, which holds the
        whole stage split ``tp`` ways — so the explorer can draw every stage against its capacity;
        and, under tensor parallelism, ``tensor_parallel``: the degree and how each split node is
        split (``{"degree": 2, "split": {"h.0.attn.c_attn": "column", ...}}``).
        """
        meta = {"made_by": "smpart.plan", "plan": self.summary(),
                "device_memory": self.stage_capacity(), "device_names": self.stage_labels()}
        if self.tp > 1 and self.layers.tree.tp_degrees:
            meta["tensor_parallel"] = {"degree": self.tp, "split": {
                node.name: node.tp_split[self.tp].style for node in self.layers.tree.nodes()
                if self.tp in node.tp_split and node.tp_split[self.tp].split}}
        return self.layers.partition(self.stage_of_layer, self.pp, self.memory_weight, meta=meta,
                                     checkpointed=self.activation_checkpointing)

    def parameters_per_rank(self) -> list[float]:
        """Per stage: the parameter elements each of its ranks holds (its tensor-parallel shard)."""
        split = self.layers.tensor_split(self.tp)
        ratio = 1 / self.tp if split is None else split.param_ratio
        per_layer = self.layers.param_count * ratio
        bounds = [*self.starts, len(self.layers)]
        return [float(per_layer[bounds[j]:bounds[j + 1]].sum()) for j in range(self.pp)]

    def stage_capacity(self) -> list[float]:
        """Per stage: the usable bytes of one tensor-parallel group (its fullest device's budget × tp)."""
        return [budget * self.tp for _, budget in self.stage_memory]

    def stage_labels(self) -> list[str]:
        """Per stage: its devices, like ``2×V100 (node 0)``, plus the tensor-parallel degree."""
        suffix = f", tp={self.tp}" if self.tp > 1 else ""
        return [stage.describe() + suffix for stage in self.stages]

    @property
    def rank_devices(self) -> list[Device]:
        """The device each rank runs on, in ``torchrun``'s rank order (stage, then replica, then
        tensor-parallel shard: the runtime's layout)."""
        return [d for stage in self.stages for replica in stage.replicas for d in replica]

    @property
    def launch_order(self) -> list[int]:
        """The cluster's nodes in the order to launch them (``torchrun --node-rank`` 0, 1, ...): the
        order in which the plan laid its stages over them."""
        return list(dict.fromkeys(d.node for d in self.rank_devices))

    @property
    def mixed(self) -> bool:
        """Whether the plan runs on more than one device type."""
        return len({d.type for d in self.rank_devices}) > 1

    @property
    def data_parallel_shares(self) -> list[int] | None:
        """Each replica's share of the batch (its micro-batch size) when they differ, else None."""
        sizes = self.replica_sizes
        return list(sizes) if sizes and len(set(sizes)) > 1 else None

    @property
    def config(self) -> Config:
        """A `Config` for `smpart.init` that reproduces this plan: pins fix every layer's stage
        (the uneven split on mixed devices included); on mixed devices also each replica's batch
        share and each rank's device type, which ``init`` checks (`Plan.launch_order`). A plan over
        virtual stages pins nothing: the runtime cuts its ``2 pp`` stages itself."""
        return Config(
            pipeline_parallel_degree=self.pp,
            microbatches=self.microbatches,
            pipeline=self.pipeline,
            tensor_parallel_degree=self.tp,
            data_parallel_degree=self.dp,
            data_parallel_shares=self.data_parallel_shares,
            device_types=[device_spec(d.type) for d in self.rank_devices] if self.mixed else None,
            memory_weight=self.memory_weight,
            # virtual stages: the runtime cuts the 2 pp stages itself (pins name its stages)
            pin=self.layers.pins(self.stage_of_layer) if self.pp > 1 and self.virtual_stages == 1 else {},
            activation_checkpointing=self.activation_checkpointing,
            virtual_stages=self.virtual_stages,
        )

    def summary(self) -> str:
        checkpointing = ""
        if self.checkpointed_stages:
            checkpointing = f", checkpointing stage(s) {_stage_list(self.checkpointed_stages)}"
        virtual = f" x{self.virtual_stages} virtual" if self.virtual_stages > 1 else ""
        return (f"pp={self.pp}{virtual} tp={self.tp} dp={self.dp} B={self.microbatches} "
                f"mbs={_sizes(self)}{checkpointing}: {seconds(self.time_s)}/iter")

    def to_dict(self) -> dict[str, Any]:
        bounds = [*self.starts, len(self.layers)]
        names = self.layer_names
        return {
            "pp": self.pp, "tp": self.tp, "dp": self.dp, "virtual_stages": self.virtual_stages,
            "microbatches": self.microbatches, "microbatch_size": self.microbatch_size,
            "time_s": self.time_s, "pipeline_s": self.pipeline_s, "dp_sync_s": self.dp_sync_s,
            "replica_microbatch_sizes": list(self.replica_sizes), "launch_order": self.launch_order,
            "stages": [
                {
                    "devices": [d.rank for d in stage.devices],
                    "device_types": sorted({d.type.name for d in stage.devices}),
                    "first_layer": names[bounds[j]], "last_layer": names[bounds[j + 1] - 1],
                    "num_layers": bounds[j + 1] - bounds[j],
                    "time_s": self.stage_times[j],
                    "memory_bytes": self.stage_memory[j][0],
                    "memory_budget_bytes": self.stage_memory[j][1],
                    "activation_checkpointing": j in self.checkpointed_stages,
                }
                for j, stage in enumerate(self.stages)
            ],
            "config": self.config.to_dict(),
        }


@dataclass
class Plans:
    """Feasible plans, fastest first; ``baselines`` holds the best plan of each pp and tp seen."""

    plans: list[Plan]
    num_devices: int
    searched: int
    search_s: float
    baselines: dict[str, Plan] = field(default_factory=dict)

    @property
    def best(self) -> Plan:
        if not self.plans:
            raise PlanError("no plan fits")
        return self.plans[0]

    def __iter__(self) -> Iterator[Plan]:
        return iter(self.plans)

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, index: int) -> Plan:
        return self.plans[index]

    def reasons(self) -> list[str]:
        """Why the best plan wins, in words."""
        best = self.best
        out = []
        for label, key in (("pp=1", "pp=1"), ("tp=1", "tp=1"), ("dp=1", "dp=1")):
            other = self.baselines.get(key)
            if other is not None and other is not best and other.time_s > best.time_s:
                out.append(f"{other.time_s / best.time_s:.2f}× faster than the best {label} plan "
                           f"({other.summary()})")
        if len(self.plans) > 1:
            second = self.plans[1]
            out.append(f"{(second.time_s / best.time_s - 1) * 100:.1f}% ahead of the runner-up "
                       f"({second.summary()})")
        out.append(f"all stages fit (fullest device at {best.memory_use:.0%} of its usable memory)")
        if best.checkpointed_stages:
            out.append(f"stage(s) {_stage_list(best.checkpointed_stages)} fit only with activation "
                       "checkpointing: their layers keep their inputs and run their forward twice")
        bubble = (best.pp - 1) / (best.microbatches + best.pp - 1)
        out.append(f"{best.microbatches} micro-batches keep the pipeline bubble near {bubble:.0%}")
        return out

    def show(self, top: int = 10, console: Any = None) -> None:
        """Print the top plans as a rich table, and the reasons the best one wins."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=f"smpart plans: {self.num_devices} devices, {self.searched} strategies "
                            f"priced in {self.search_s:.2f} s")
        for column in ("#", "pp", "tp", "dp", "B", "mbs", "s/iter", "pipe", "dp sync", "memory",
                       "ckpt", "layers per stage"):
            table.add_column(column, justify="left" if column == "layers per stage" else "right")
        for rank, plan in enumerate(self.plans[:top], 1):
            table.add_row(str(rank), str(plan.pp), str(plan.tp), str(plan.dp), str(plan.microbatches),
                          _sizes(plan), seconds(plan.time_s), seconds(plan.pipeline_s),
                          seconds(plan.dp_sync_s), f"{plan.memory_use:.0%}",
                          _stage_list(plan.checkpointed_stages) or "-", _layer_counts(plan),
                          style="bold green" if rank == 1 else None)
        console.print(table)
        if self.plans:
            best = self.best
            console.print("[bold]Best plan's stages:[/bold] " + "; ".join(
                f"{j}: {stage.describe()}" for j, stage in enumerate(best.stages[:8]))
                + (f"; … {best.pp - 8} more" if best.pp > 8 else ""))
            console.print("[bold]Why the best plan wins:[/bold]")
            for reason in self.reasons():
                console.print(f"  • {reason}")

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        return {
            "format": "smpart.plans/1",
            "num_devices": self.num_devices,
            "searched": self.searched,
            "search_s": self.search_s,
            "plans": [p.to_dict() for p in self.plans[:top]],
            "reasons": self.reasons() if self.plans else [],
        }

    def to_json(self, top: int | None = None) -> str:
        return json.dumps(self.to_dict(top), indent=2)


def _stage_list(stages: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    runs: list[list[int]] = []
    for j in stages:
        if runs and runs[-1][-1] == j - 1:
            runs[-1].append(j)
        else:
            runs.append([j])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _sizes(plan: Plan) -> str:
    """The micro-batch size, or each replica's (``4:4:2:2``) when they differ."""
    shares = plan.data_parallel_shares
    return ":".join(map(str, shares)) if shares else str(plan.microbatch_size)


def _layer_counts(plan: Plan, shown: int = 8) -> str:
    bounds = [*plan.starts, len(plan.layers)]
    counts = [str(bounds[j + 1] - bounds[j]) for j in range(plan.pp)]
    if len(counts) > shown:
        counts = counts[:shown] + [f"…(+{len(counts) - shown})"]
    return "·".join(counts)


def seconds(value: float) -> str:
    """A duration with a unit people read at a glance: 1.23 s, 45.6 ms, 789 µs."""
    if value == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value * 1e9:.3g} ns"
