"""Mixed devices, run and not only priced: 2 fast + 2 slow emulated devices on 4 gloo processes.

    .venv/bin/python bench/mixed_devices.py [--rounds 2] [--steps 3] [--warmup 1]

**The emulated cluster** (`Cluster`): one node of two ``fast`` devices and one of two ``slow``
ones, ``fast`` twice the TFLOPS of ``slow``. 4 processes on this CPU play them: the model is
`bench/planner_processes.py`'s sleep-kernel stack (12 blocks of unequal widths here), whose
sleeps each rank stretches by its device's slowdown (``fast.tflops / its type's tflops``: 1 or
2), the ratio the `Cluster` declares, and each rank declares its type as ``SMPART_DEVICE_TYPE``,
so ``init`` checks a mixed plan's ranks. The emulation lives here and in that bench, not in the
library. Ranks are numbered as ``torchrun`` numbers them: node by node, in the order the nodes
are launched: the cluster file's order (fast first) unless a plan says otherwise
(``Plan.launch_order``, which (a) follows: it is what the plan tells the user to do).

**What runs**, for each of 10 strategies (pp, tp, dp, micro-batches; pp·tp·dp = 4):

- **(a)** the best plan smpart finds knowing the types (uneven layers per stage, batch shares
  per replica, the node order), run from its own ``plan.config``;
- **(b)** the best plan of the same strategy made believing all four devices ``fast``, run on the
  fast-first ranks; its prediction is the same plan repriced on the real devices
  (`smpart.planner.price`);

plus each planner's overall best plan, and **(c)** torch's ``Schedule1F1B`` (``pp = 4``, three
blocks per rank, the even layer split it takes; where it applies: one stage per rank, no data
or tensor parallelism), predicted as the even split priced on the real devices.

**Calibration**, as `bench/planner_processes.py` does it: the planner's fixed costs (per
micro-batch, per boundary crossing, bandwidth, data-parallel sync, per collective call) are fitted
on another model run on four *fast* ranks (no mixed device in sight), before anything scored.

Prints, per strategy, predicted and measured step times of (a) and (b), measured ÷ predicted, and
(a)'s speedup over (b), measured against predicted; Spearman's rank correlation of predicted vs
measured over the mixed-aware plans (goal >= 0.9); the best (a) over the best (b), measured
against predicted (goal: >= 90 % of the predicted speedup, and >= 1.3×); and (c). Each figure is
the least loaded round's median warm step of rank 0; the load average is printed before and after.
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

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench import planner_processes as sleepers  # noqa: E402
from bench.mlp_pipeline import pipelining_step, timed  # noqa: E402
from bench.planner_fidelity import spearman  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402
from smpart.devices import GIB, DeviceType, as_device_type  # noqa: E402
from smpart.planner import Cluster, Node, price  # noqa: E402

WORLD = 4
GLOBAL_BATCH = 24
#: As `bench/planner_processes.py`'s device (1 TFLOPS at 40 %: a node's traced time is its time on
#: it), and one half as fast.
FAST = DeviceType("fast", 1.0, 8 * GIB)
SLOW = DeviceType("slow", 0.5, 8 * GIB)
WIDTHS = (64, 128, 64, 256, 96, 128, 64, 192, 32, 128, 96, 64)
SCORED = (WIDTHS, sleepers.UNIT_S, sleepers.NORM_S)
#: (pp, tp, dp, micro-batches) run; pp·tp·dp = 4, tp inside a node (2 devices each).
STRATEGIES = [
    (4, 1, 1, 2), (4, 1, 1, 4), (4, 1, 1, 8),
    (2, 1, 2, 2), (2, 1, 2, 4),
    (2, 2, 1, 2), (2, 2, 1, 4),
    (1, 1, 4, 1), (1, 1, 4, 2),
    (1, 2, 2, 2),
]
TORCH_MICROBATCHES = 4


def cluster(kinds: tuple[DeviceType, DeviceType], bandwidth: float) -> Cluster:
    """Two nodes of two devices, every link the calibrated bandwidth (one box, loopback gloo)."""
    return Cluster([Node(kinds[0], 2, bandwidth), Node(kinds[1], 2, bandwidth)], bandwidth)


def plans_for(tree, where: Cluster, calibration) -> dict:
    """The best plan of each strategy, and the overall best (key ``"best"``)."""
    options = calibration.options()
    bandwidth = options.pop("bandwidth")
    assert bandwidth == where.inter_bandwidth
    plans = smpart.plan(tree, where, GLOBAL_BATCH, top=100_000, tp_degrees=[1, 2],
                        reference_flops=FAST.flops * 0.4, efficiency=0.4, bytes_per_param=None, **options)
    best: dict = {"best": plans.best}
    for candidate in plans:  # fastest first
        best.setdefault((candidate.pp, candidate.tp, candidate.dp, candidate.microbatches), candidate)
    missing = [s for s in STRATEGIES if s not in best]
    if missing:
        raise SystemExit(f"the planner has no plan for {missing}")
    return best


def emulated(plan) -> list[tuple[str, float]]:
    """Each rank's (declared type, slowdown): a mixed plan's own types, in its launch order."""
    kinds = [as_device_type(spec) for spec in plan.config.device_types]
    return [(k.name, FAST.tflops / k.tflops) for k in kinds]


PHYSICAL = [(FAST.name, 1.0)] * 2 + [(SLOW.name, FAST.tflops / SLOW.tflops)] * 2  # the cluster file's order


def even_split(plan):
    """``plan`` with torch's even split: three blocks per stage (pp = 4)."""
    names = plan.layer_names
    per = len(WIDTHS) // plan.pp
    starts = tuple(next(i for i, name in enumerate(names) if name == f"blocks.{per * j}"
                        or name.startswith(f"blocks.{per * j}.")) for j in range(plan.pp))
    return dataclasses.replace(plan, starts=starts)


# ================================================================================= the runs
def run_torch(rank: int, spec: tuple, microbatches: int, warmup: int, steps: int) -> list[float]:
    """torch's Schedule1F1B over the same blocks, three per rank, on the cluster file's ranks."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    sleepers.SLOWDOWN[0] = PHYSICAL[rank][1]
    try:
        blocks = sleepers.build(spec).blocks
        per = len(blocks) // WORLD
        stage = PipelineStage(torch.nn.Sequential(*blocks[rank * per:(rank + 1) * per]), rank, WORLD,
                              torch.device("cpu"))
        schedule = Schedule1F1B(stage, microbatches, loss_fn=lambda out, _target: out.square().mean())
        x = torch.randn(GLOBAL_BATCH, sleepers.D, generator=torch.Generator().manual_seed(1))
        target = torch.zeros(GLOBAL_BATCH)

        dist.barrier()
        times = timed(lambda: pipelining_step(schedule, rank, WORLD, x, target), warmup, steps)
        dist.barrier()
        return times
    finally:
        sleepers.SLOWDOWN[0] = 1.0


def measure(pool: RankPool, runs: dict, r: int, warmup: int, steps: int, per_round: dict) -> None:
    """One round over ``runs`` (key -> ``("smpart", config, emulated)`` or ``("torch",)``), in an
    order rotating from round to round; each run's median warm step appended to ``per_round``."""
    keys = list(runs)
    shift = r * 7 % len(keys)
    for key in keys[shift:] + keys[:shift]:
        kind, *args = runs[key]
        if kind == "torch":
            times = pool.run(run_torch, SCORED, TORCH_MICROBATCHES, warmup, steps)[0]
        else:
            config, ranks = args
            times = pool.run(sleepers.run_config, SCORED, config, warmup, steps, GLOBAL_BATCH, ranks)[0]
        per_round.setdefault(key, []).append(statistics.median(times))


def calibrate(pool: RankPool, rounds: int, warmup: int, steps: int, console: Console):
    """`bench/planner_processes.py`'s calibration: its model on four fast ranks, its fit."""
    spec = (sleepers.CALIBRATION_WIDTHS, sleepers.UNIT_S * sleepers.CALIBRATION_SLEEP,
            sleepers.NORM_S * sleepers.CALIBRATION_SLEEP)
    tree = sleepers.costed_tree(spec)
    plans = sleepers.predictions(tree, sleepers.CALIBRATION, **sleepers.NOMINAL)
    idle: dict = {}
    for r in range(rounds):
        sleepers.measure_round(pool, spec, {s: p.config for s, p in plans.items()}, r, warmup, steps, idle)
    calibration, _ = sleepers.fit(tree, sleepers.settle(idle, "min"))
    console.print(f"calibration ({len(sleepers.CALIBRATION)} configurations of another model, all ranks "
                  f"fast): {sleepers.describe(calibration)}")
    return calibration


# ================================================================================= the report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    console = Console(width=160)
    started = time.perf_counter()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it (see planner_processes)
    console.print(f"load average {_load()} on {os.cpu_count()} cores; 4 processes play 2 fast + 2 slow "
                  f"devices (speed ratio {FAST.tflops / SLOW.tflops:g}); global batch {GLOBAL_BATCH}")
    tree = sleepers.costed_tree(SCORED)
    with RankPool(WORLD) as pool:
        calibration = calibrate(pool, args.rounds, args.warmup, args.steps, console)
        bandwidth = calibration.bandwidth
        mixed_cluster = cluster((FAST, SLOW), bandwidth)
        aware = plans_for(tree, mixed_cluster, calibration)
        uniform = plans_for(tree, cluster((FAST, FAST), bandwidth), calibration)
        options = {k: v for k, v in calibration.options().items() if k != "bandwidth"}
        repriced = {key: price(plan, mixed_cluster, reference_flops=FAST.flops * 0.4, efficiency=0.4,
                               bytes_per_param=None, **options) for key, plan in uniform.items()}
        torch_plan = price(even_split(uniform[(4, 1, 1, TORCH_MICROBATCHES)]), mixed_cluster,
                           reference_flops=FAST.flops * 0.4, efficiency=0.4, bytes_per_param=None, **options)
        runs: dict[Any, tuple] = {}
        for key in ["best", *STRATEGIES]:
            runs[("a", key)] = ("smpart", aware[key].config, emulated(aware[key]))
            runs[("b", key)] = ("smpart", uniform[key].config, PHYSICAL)
        runs["c"] = ("torch",)
        per_round: dict = {}
        for r in range(args.rounds):
            measure(pool, runs, r, args.warmup, args.steps, per_round)
            console.print(f"  round {r + 1}/{args.rounds} done ({time.strftime('%H:%M:%S')}, load {_load()})",
                          style="dim")
    measured = {key: min(times) for key, times in per_round.items()}
    report(console, aware, repriced, torch_plan, measured, per_round)
    console.print(f"whole bench: {time.perf_counter() - started:.0f} s; load average now {_load()}")


def report(console: Console, aware: dict, repriced: dict, torch_plan, measured: dict,
           per_round: dict) -> None:
    table = Table(title="mixed-aware plans (a) vs plans for identical devices (b), on 2 fast + 2 slow "
                        "emulated devices: step times in ms (predicted / measured)")
    for column in ("pp", "tp", "dp", "m", "(a) layers", "(a) shares", "(a) pred", "(a) meas", "meas/pred",
                   "(b) layers", "(b) pred", "(b) meas", "meas/pred", "speedup pred", "speedup meas",
                   "meas ÷ pred"):
        table.add_column(column, justify="right")
    for key in STRATEGIES:
        a, b = aware[key], repriced[key]
        ta, tb = measured[("a", key)], measured[("b", key)]
        speedup_p, speedup_m = b.time_s / a.time_s, tb / ta
        shares = ":".join(map(str, a.replica_sizes)) if a.dp > 1 else "-"
        table.add_row(*map(str, key), sleepers.split_of(a), shares, _ms(a.time_s),
                      _ms(ta), f"{ta / a.time_s:.2f}", sleepers.split_of(b), _ms(b.time_s), _ms(tb),
                      f"{tb / b.time_s:.2f}", f"{speedup_p:.2f}×", f"{speedup_m:.2f}×",
                      f"{(speedup_m - 1) / (speedup_p - 1):.0%}" if speedup_p > 1.01 else "-")
    console.print(table)
    predicted = [aware[s].time_s for s in STRATEGIES]
    observed = [measured[("a", s)] for s in STRATEGIES]
    both_p = predicted + [repriced[s].time_s for s in STRATEGIES]
    both_m = observed + [measured[("b", s)] for s in STRATEGIES]
    console.print(f"Spearman, predicted vs measured, over the {len(STRATEGIES)} mixed-aware plans: "
                  f"[bold]{spearman(predicted, observed):.3f}[/] (goal >= 0.9); over all {len(both_p)} runs "
                  f"(a and b): {spearman(both_p, both_m):.3f}")
    speedups_p = [repriced[s].time_s / aware[s].time_s for s in STRATEGIES]
    speedups_m = [measured[("b", s)] / measured[("a", s)] for s in STRATEGIES]
    console.print(f"speedup of (a) over (b) per strategy: Spearman predicted vs measured "
                  f"{spearman(speedups_p, speedups_m):.3f}; median measured ÷ predicted "
                  f"{statistics.median(m / p for m, p in zip(speedups_m, speedups_p, strict=True)):.2f}")
    best_a, best_b = aware["best"], repriced["best"]
    ta, tb = measured[("a", "best")], measured[("b", "best")]
    speedup_p, speedup_m = best_b.time_s / best_a.time_s, tb / ta
    console.print(f"best mixed-aware plan (a): {best_a.summary()}, layers {sleepers.split_of(best_a)}, "
                  f"launch order {best_a.launch_order}: predicted {_ms(best_a.time_s)} ms, measured "
                  f"{_ms(ta)} ms ({ta / best_a.time_s:.2f}); rounds {_rounds(per_round[('a', 'best')])}")
    console.print(f"best plan for identical devices (b): {best_b.summary()}, layers "
                  f"{sleepers.split_of(best_b)}: predicted on the real devices {_ms(best_b.time_s)} ms, "
                  f"measured {_ms(tb)} ms ({tb / best_b.time_s:.2f}); rounds "
                  f"{_rounds(per_round[('b', 'best')])}")
    console.print(f"[bold]best (a) over best (b): measured {speedup_m:.2f}×, predicted {speedup_p:.2f}× "
                  f"({speedup_m / speedup_p:.0%} of the predicted speedup)[/] (goal: >= 90 %, and >= 1.3×)")
    tc = measured["c"]
    console.print(f"(c) torch Schedule1F1B, pp=4, {TORCH_MICROBATCHES} micro-batches, 3 blocks per rank: "
                  f"predicted {_ms(torch_plan.time_s)} ms, measured {_ms(tc)} ms "
                  f"({tc / torch_plan.time_s:.2f}); "
                  f"best (a) is {tc / ta:.2f}× faster")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _rounds(times: list[float]) -> str:
    return " ".join(_ms(t) for t in times)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
