"""The reference runtime's speed-only mechanisms, each turned off in turn: what each still earns.

Step programs run every step from a model's second one; the reference runtime runs its first step
and any step a program cannot run (a fallback). This times both on GPT-2 small's module tree at a
tiny width (host-bound, as `bench/host_overhead.py`; the partition GPT-2 small gets at full size,
pinned), 4 micro-batches, 1f1b, on threads and on 2 processes (gloo), with step programs off:

- *first step*: a fresh model's first step (trace, partition, placement and the step itself);
- *fallback step*: the median of later steps on the reference runtime.

Each row turns one mechanism off against all of them on (``--variants`` picks rows; a row whose
switch this tree no longer has, the mechanism removed, is left out: the same script measures the
tree before a removal and after it); after one uncounted warm-up, the configurations alternate
over ``--rounds``, each round starting with the next, so that the machine's load hits all alike.

    .venv/bin/python bench/reference_runtime.py [--stages 2] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.backward_work import MICROBATCHES, TINY, full_size_partition  # noqa: E402
from bench.processes import RankPool  # noqa: E402
from bench.step_path import model_and_step  # noqa: E402

#: Row name -> (Config switches, environment switches) turning one mechanism off.
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "all on": ({}, {}),
    "no output handles (nor promises)": ({"output_handles": False}, {}),
    "no promised calls": ({"promised_calls": False}, {}),
    "no direct dispatch": ({"direct_dispatch": False}, {}),
    "no holding": ({}, {"SMPART_HOLDING": "0"}),
    "none of them": ({"output_handles": False, "direct_dispatch": False}, {"SMPART_HOLDING": "0"}),
}
WARMUP = 2


def available(variant: str) -> bool:
    """Whether this tree still has the switches of ``variant`` (holding's is its environment variable)."""
    known = {f.name for f in dataclasses.fields(smpart.Config)}
    return set(VARIANTS[variant][0]) <= known


def measure(stages: int, pins: dict[str, int], steps: int, variant: str) -> tuple[float, list[float]]:
    """The first step's seconds and the later steps' (after `WARMUP`), on the reference runtime."""
    switches, env = VARIANTS[variant]
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        model, train_step = model_and_step(stages, pins, False, **switches)
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4))

        def step() -> float:
            start = time.perf_counter()
            train_step()
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - start

        first = step()
        for _ in range(WARMUP):
            step()
        return first, [step() for _ in range(steps)]
    finally:
        smpart.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def on_rank(rank: int, *args: Any) -> tuple[float, list[float]]:
    return measure(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="full-size batch the partition is traced for")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--no-processes", dest="processes", action="store_false")
    a = parser.parse_args()
    a.variants = [v for v in a.variants if available(v)]
    torch.set_num_threads(1)
    pins = full_size_partition(a.stages, a.batch)
    places = ["threads", "processes"] if a.processes else ["threads"]
    firsts: dict[tuple[str, str], list[float]] = {(p, v): [] for p in places for v in a.variants}
    later: dict[tuple[str, str], list[float]] = {(p, v): [] for p in places for v in a.variants}
    pool = RankPool(a.stages) if a.processes else None
    try:
        measure(a.stages, pins, 1, a.variants[0])  # warm-up, not counted: first imports, first trace
        if pool is not None:
            pool.run(on_rank, a.stages, pins, 1, a.variants[0])
        for round_ in range(a.rounds):  # each round starts with another configuration
            for variant in a.variants[round_ % len(a.variants):] + a.variants[:round_ % len(a.variants)]:
                first, times = measure(a.stages, pins, a.steps, variant)
                firsts[("threads", variant)].append(first)
                later[("threads", variant)].append(statistics.median(times))
                if pool is not None:
                    first, times = pool.run(on_rank, a.stages, pins, a.steps, variant)[0]
                    firsts[("processes", variant)].append(first)
                    later[("processes", variant)].append(statistics.median(times))
    finally:
        if pool is not None:
            pool.close()
    title = (f"The reference runtime (step programs off), GPT-2 small's tree at width {TINY['n_embd']}, "
             f"{a.stages} stages, {MICROBATCHES} micro-batches, 1f1b; medians of {a.rounds} rounds")
    table = Table(title=title)
    for column in ("where", "mechanisms", "first step ms", "÷ all on", "fallback step ms", "÷ all on"):
        table.add_column(column, justify="left" if column in ("where", "mechanisms") else "right")
    for place in places:
        base_first = statistics.median(firsts[(place, a.variants[0])])
        base_later = statistics.median(later[(place, a.variants[0])])
        for variant in a.variants:
            first = statistics.median(firsts[(place, variant)])
            step = statistics.median(later[(place, variant)])
            table.add_row(place, variant, f"{first * 1e3:.0f}", f"{first / base_first:.2f}",
                          f"{step * 1e3:.1f}", f"{step / base_later:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
