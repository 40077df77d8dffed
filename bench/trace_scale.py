"""How far tracing and partitioning scale: GPT-3 175B on the meta device, and a 100,000-node tree.

    .venv/bin/python bench/trace_scale.py

Figures printed (one table):
- GPT-3 175B's shape (96 layers, width 12288, vocab 50257, 2048 tokens) built under
  ``torch.device("meta")``: build, trace and 8-stage partition time, node count, peak memory of
  the process (``ru_maxrss``) and peak Python heap during a second, untimed trace (tracemalloc).
  Goal: trace well under a minute with < 2 GiB peak.
- A synthetic tree of 1000 blocks x 100 leaves (101,001 nodes, varied costs): partition time
  into 8 stages. Goal: < 2 s.
"""

from __future__ import annotations

import random
import resource
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `examples`, run from anywhere

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import smpart  # noqa: E402
from examples.models import gpt3_175b  # noqa: E402

GIB = 1024**3


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (``ru_maxrss`` is in KiB on Linux)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def synthetic_tree(blocks: int, leaves: int, seed: int = 0) -> smpart.ModuleTree:
    """A root with ``blocks`` children of ``leaves`` leaves each, with varied random costs."""
    rng = random.Random(seed)

    def leaf(b: int, i: int) -> dict:
        size = rng.choice([1, 2, 4, 16, 64])
        return {
            "name": f"b{b}.l{i}",
            "flops": size * rng.uniform(0.5, 1.5) * 1e9,
            "param_bytes": size * rng.randint(1, 4) * 1024**2,
            "activation_bytes": rng.randint(1, 8) * 1024**2,
        }

    spec = {"name": "", "children": [
        {"name": f"b{b}", "flops": rng.uniform(0, 1e8), "children": [leaf(b, i) for i in range(leaves)]}
        for b in range(blocks)
    ]}
    return smpart.ModuleTree.from_spec(spec)


def main() -> None:
    console = Console()
    table = Table(title="smpart trace & partition scale")
    table.add_column("workload")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")

    rss_start = peak_rss_bytes()
    example, build_s = timed(gpt3_175b)
    params = sum(p.numel() for p in example.model.parameters())
    tree, trace_s = timed(lambda: smpart.trace(example.model, example.args))
    tracemalloc.start()  # a second trace: tracemalloc slows Python down, so it is not timed
    smpart.trace(example.model, example.args)
    _, heap_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    part, part_s = timed(lambda: smpart.partition(tree, 8, memory_weight=0.8))
    rss_peak = peak_rss_bytes()
    name = "GPT-3 175B on meta"
    table.add_row(name, "parameters", f"{params / 1e9:.1f} B", "")
    table.add_row(name, "build (meta)", f"{build_s:.2f} s", "")
    table.add_row(name, "trace", f"{trace_s:.2f} s", "< 60 s")
    table.add_row(name, "nodes", f"{len(tree):,}", "")
    table.add_row(name, "forward TFLOPs (batch 1)", f"{tree.total_compute() / 1e12:,.0f}", "")
    table.add_row(name, "peak RSS (process)", f"{rss_peak / GIB:.2f} GiB", "< 2 GiB")
    table.add_row(name, "RSS before building", f"{rss_start / GIB:.2f} GiB", "")
    table.add_row(name, "Python heap peak during trace", f"{heap_peak / 1024**2:.1f} MiB", "")
    table.add_row(name, "partition, 8 stages", f"{part_s:.3f} s", "")
    table.add_row(name, "imbalance (max/mean stage cost)", f"{part.imbalance:.3f}", "")

    synthetic = synthetic_tree(blocks=1000, leaves=100)
    part, part_s = timed(lambda: smpart.partition(synthetic, 8, memory_weight=0.8))
    name = "synthetic 1000 x 100"
    table.add_row(name, "nodes", f"{len(synthetic):,}", "")
    table.add_row(name, "partition, 8 stages", f"{part_s:.2f} s", "< 2 s")
    table.add_row(name, "imbalance (max/mean stage cost)", f"{part.imbalance:.3f}", "")
    console.print(table)


if __name__ == "__main__":
    main()
