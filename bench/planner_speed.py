"""How fast the planner is: `assign_layers` alone, and the whole strategy search.

    .venv/bin/python bench/planner_speed.py

Layer costs are random (uniform in [0.5, 1.5)), stage speeds drawn from {1, 2, 3.5} (a mixed
cluster), per-boundary cut costs random, 16 micro-batches. The whole search plans GPT-3 175B
(the zoo's `gpt3_175b`, traced on the meta device: 96 blocks) on A100-80 clusters.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smpart.planner import Cluster, assign_layers, plan  # noqa: E402


def best_of(repeats: int, *args, **kwargs) -> float:
    """Fastest of ``repeats`` calls of assign_layers(*args, **kwargs), in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        assign_layers(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return min(times)


def assign_table(console: Console) -> None:
    rng = np.random.default_rng(0)
    table = Table(title="assign_layers: exact optimum, best of 3 (ms)")
    for column in ("layers", "stages", "equal speeds", "mixed speeds", "mixed speeds + cut costs"):
        table.add_column(column, justify="right")
    for layers in (24, 48, 96, 1000):
        for stages in (2, 4, 8, 64):
            if stages > layers:
                continue
            costs = rng.random(layers) + 0.5
            speeds = rng.choice([1.0, 2.0, 3.5], stages)
            cuts = rng.random((layers - 1, stages - 1)) * 0.2
            row = [
                best_of(3, costs, stages, 16),
                best_of(3, costs, stages, 16, stage_speeds=speeds),
                best_of(3, costs, stages, 16, cut_costs=cuts, stage_speeds=speeds),
            ]
            table.add_row(str(layers), str(stages), *(f"{t * 1e3:.1f}" for t in row))
    console.print(table)


def search_table(console: Console) -> None:
    from examples.models import gpt3_175b
    from smpart.tracing.tracer import trace

    example = gpt3_175b()
    start = time.perf_counter()
    tree = trace(example.model, example.args, example.kwargs, device="meta")
    console.print(f"traced gpt3_175b on meta in {time.perf_counter() - start:.2f} s")
    table = Table(title="whole search: GPT-3 175B on A100-80 nodes of 8 (NVLink 2400 Gb/s, IB 200 Gb/s)")
    for column in ("GPUs", "global batch", "strategies", "search (s)", "best plan", "max memory"):
        table.add_column(column, justify="right")
    for nodes, batch in ((1, 512), (8, 512), (128, 1536)):
        cluster = Cluster.homogeneous("A100-80", nodes, 8, intra_gbps=2400, inter_gbps=200)
        start = time.perf_counter()
        try:
            plans = plan(tree, cluster, batch, trace_batch=int(example.args[0].shape[0]))
            best, memory, searched = plans.best.summary(), f"{plans.best.memory_use:.0%}", plans.searched
        except Exception as err:  # a cluster too small for 175B: report it, time it anyway
            best, memory, searched = f"none fits ({type(err).__name__})", "-", "-"
        elapsed = time.perf_counter() - start
        table.add_row(str(nodes * 8), str(batch), str(searched), f"{elapsed:.2f}", best, memory)
    console.print(table)


if __name__ == "__main__":
    console = Console()
    assign_table(console)
    search_table(console)
