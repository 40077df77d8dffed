"""How close the pipeline runtime gets to the ideal schedule, on a model of "sleep kernels".

Each of 4 blocks sleeps ``t`` in its forward and ``2t`` in its backward (``time.sleep`` releases
the GIL like a GPU kernel), one block per stage. With ``m`` micro-batches both schedules have the
ideal makespan ``(m + stages - 1) * 3t``; we print measured step time / ideal (goal <= 1.05),
the timeline's bubble fraction, medians over several steps, and the CPU time per step of every
thread of every process of the configuration (the kernels sleep: nearly all of it is the
runtime's). ``time.sleep`` itself overshoots a little, so the ratio to the ideal computed from
the sleep times measured on this machine (outside the runtime) is printed too: that one is the
runtime's own overhead.

Five times: the stages on threads of this process; on one process per stage (gloo, spawned from
this script, one intra-op thread each; step times of the driver's rank), with step programs, with
programs whose tensors go as the transport's messages (``framed``: ``direct_transfers=False``) and
with the reference runtime (programs off, ``ref. procs``); and, as the yardstick of
what a pipeline over processes reaches on this machine, torch.distributed.pipelining's own
``ScheduleGPipe`` / ``Schedule1F1B`` over the same blocks in the same processes (one block per
rank, the loss on the last stage; step times of the first stage's rank, whose last backward ends
the step), alternating round by round so that a change in the machine's load hits all alike.
smpart places the root module (the loop over the blocks) on stage 0.

The activation is 2 rows of ``--width`` float32 per micro-batch: 8 (the default, 64 B) is at most
`handles.SMALL_BYTES`, so on the reference runtime every block's output travels with its
reference; 256 (2 KiB) is above it, so it stays on its stage until the next block fetches it.

    .venv/bin/python bench/pipeline_efficiency.py [--t-ms 5] [--microbatches 16] [--steps 5] [--rounds 2]
                                                  [--width 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.mlp_pipeline import pipelining_step, timed  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402


class SleepKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepBlock(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return SleepKernel.apply(x * self.scale, self.seconds)


class SleepPipeline(nn.Module):
    def __init__(self, stages: int, seconds: float):
        super().__init__()
        self.blocks = nn.ModuleList(SleepBlock(seconds) for _ in range(stages))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@smpart.step
def train_step(model, x):
    loss = model(x).sum()
    model.backward(loss)
    return loss


def measure(schedule: str, stages: int, microbatches: int, seconds: float, steps: int, width: int = 8,
            programs: bool = True, direct: bool = True,
            where: str = "threads") -> tuple[list[float], list[float], str, float]:
    """Step times and bubble fractions of ``steps`` steps, where the last step's timeline was
    saved, and the CPU seconds per step of this process (all its threads). ``stages`` warm-up
    steps go first: the first places the model, and holding (`smpart.runtime.reference.gradients`) learns
    its counts from the step before, so the first steps of ``stages`` stages repeat backward
    work (`bench/backward_work.py`)."""
    smpart.init(pipeline_parallel_degree=stages, microbatches=microbatches, pipeline=schedule,
                pin={f"blocks.{i}": i for i in range(stages)}, timeout_s=120, step_programs=programs,
                direct_transfers=direct)
    try:
        model = smpart.DistributedModel(SleepPipeline(stages, seconds))
        x = torch.randn(microbatches * 2, width)
        for _ in range(max(stages, 3)):  # trace, partition, place, record; discover the program
            train_step(model, x)
        times, bubbles = [], []
        cpu_before = _cpu_seconds()
        for _ in range(steps):
            start = time.perf_counter()
            out = train_step(model, x)
            times.append(time.perf_counter() - start)
            bubbles.append(out.timeline.bubble_fraction)
        cpu = (_cpu_seconds() - cpu_before) / steps
        path = f"/tmp/smpart_sleep_{schedule}_{where}.json"
        if smpart.rank() == 0:
            out.timeline.save(path)
        return times, bubbles, path, cpu
    finally:
        smpart.shutdown()


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def on_rank(rank: int, *args) -> tuple[list[float], list[float], str, float]:
    return measure(*args, where="processes")


def on_processes(pool: RankPool, *args, programs: bool = True,
                 direct: bool = True) -> tuple[list[float], list[float], str, float]:
    """The driver's rank's step times, bubbles and timeline; the CPU per step of every rank, summed;
    ``programs`` off: on the reference runtime; ``direct`` off: programs with framed transfers."""
    ranks = pool.run(on_rank, *args, programs, direct)
    times, bubbles, path, _ = ranks[0]
    return times, bubbles, path, sum(rank[3] for rank in ranks)


def on_rank_torch(rank: int, schedule: str, stages: int, microbatches: int, seconds: float, steps: int,
                  width: int = 8) -> tuple[list[float], list[float], str, float]:
    """The same blocks under torch.distributed.pipelining, one per rank (``PipelineStage`` by hand,
    as `bench.mlp_pipeline.run_torch`), with the loss ``sum`` on the last stage."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    block = SleepBlock(seconds)
    stage = PipelineStage(block, rank, stages, torch.device("cpu"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    pipeline = kind(stage, microbatches, loss_fn=lambda out, _target: out.sum())
    x = torch.randn(microbatches * 2, width)
    target = torch.zeros(microbatches)  # split like x; the loss ignores it

    def one_step() -> None:
        pipelining_step(pipeline, rank, stages, x, target)

    torch.distributed.barrier()
    usage: dict[str, Any] = {}
    times = timed(one_step, stages, steps, usage)
    torch.distributed.barrier()
    return times, [float("nan")] * steps, "", usage["cpu"]


def on_torch_processes(pool: RankPool, *args) -> tuple[list[float], list[float], str, float]:
    """The first stage's rank's step times; the CPU per step of every rank, summed."""
    ranks = pool.run(on_rank_torch, *args)
    return ranks[0][0], ranks[0][1], "", sum(rank[3] for rank in ranks)


def slept_seconds(seconds: float, samples: int = 40) -> float:
    """What one micro-batch's kernels on one stage really take here: ``time.sleep(t)`` plus
    ``time.sleep(2t)``, means over ``samples`` (sleep overshoots by the OS's timer slack and
    wake-up latency, which is no overhead of the runtime's)."""
    total = 0.0
    for duration in (seconds, 2 * seconds):
        start = time.perf_counter()
        for _ in range(samples):
            time.sleep(duration)
        total += (time.perf_counter() - start) / samples
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-ms", type=float, default=5.0)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of threads and processes")
    parser.add_argument("--width", type=int, default=8, help="features per activation row (see above)")
    a = parser.parse_args()
    t = a.t_ms / 1e3
    ideal = (a.microbatches + a.stages - 1) * 3 * t
    ideal_bubble = (a.stages - 1) / (a.microbatches + a.stages - 1)
    print(f"{a.stages} stages x {a.microbatches} micro-batches, t = {a.t_ms} ms (forward t, backward 2t): "
          f"ideal makespan (m + stages - 1) x 3t = {ideal * 1e3:.1f} ms, ideal bubble {ideal_bubble:.1%}")
    kernels_s = slept_seconds(t)
    measured_ideal = (a.microbatches + a.stages - 1) * kernels_s
    print(f"  time.sleep(t) + time.sleep(2t) take {kernels_s * 1e3:.2f} ms here, not {3 * a.t_ms:.1f}: "
          f"ideal makespan from the measured kernel times {measured_ideal * 1e3:.1f} ms")
    torch.set_num_threads(1)
    results: dict[tuple[str, str], tuple[list[float], list[float], str, list[float]]] = {}
    with RankPool(a.stages) as pool:
        for _ in range(a.rounds):
            for schedule in ("gpipe", "1f1b"):
                for where, run in (("threads", measure), ("processes", partial(on_processes, pool)),
                                   ("reference", partial(on_processes, pool, programs=False)),
                                   ("framed", partial(on_processes, pool, direct=False)),
                                   ("torch", partial(on_torch_processes, pool))):
                    got = run(schedule, a.stages, a.microbatches, t, a.steps, a.width)
                    old = results.get((where, schedule), ([], [], "", []))
                    results[(where, schedule)] = (old[0] + got[0], old[1] + got[1], got[2], old[3] + [got[3]])
    order = ("threads", "processes", "framed", "reference", "torch")
    for (where, schedule), (times, bubbles, path, cpus) in sorted(results.items(),
                                                                   key=lambda kv: order.index(kv[0][0])):
        step_s, bubble = statistics.median(times), statistics.median(bubbles)
        shown = f"bubble {bubble:5.1%}" if path else " " * 13
        where_shown = {"torch": "torch procs", "reference": "ref. procs"}.get(where, where)
        saved = f"  timeline {path}" if path else ""
        print(f"  {where_shown:<11} {schedule:<5} step {step_s * 1e3:6.1f} ms (median of {len(times)})  "
              f"{shown}  CPU {statistics.median(cpus) * 1e3:5.1f} ms/step{saved}")
        print(f"  {'':<17} step / ideal from nominal t:                 {step_s / ideal:5.3f}  (goal 1.05)")
        print(f"  {'':<17} step / ideal from the measured kernel times: {step_s / measured_ideal:5.3f}  "
              "(the runtime's own overhead)")
    for schedule in ("gpipe", "1f1b"):
        ours = statistics.median(results[("processes", schedule)][0])
        theirs = statistics.median(results[("torch", schedule)][0])
        reference = statistics.median(results[("reference", schedule)][0])
        framed = statistics.median(results[("framed", schedule)][0])
        print(f"  smpart processes / torch procs ({schedule}): {ours / theirs:.3f} (goal <= 1.00); "
              f"the reference runtime (step programs off): {reference / theirs:.3f}; programs with "
              f"framed transfers (direct_transfers=False): {framed / theirs:.3f}")

if __name__ == "__main__":
    main()
