"""How close the pipeline runtime gets to the ideal schedule, on a model of "sleep kernels".

Each of 4 blocks sleeps ``t`` in its forward and ``2t`` in its backward (``time.sleep`` releases
the GIL like a GPU kernel), one block per stage. With ``m`` micro-batches both schedules have the
ideal makespan ``(m + stages - 1) * 3t``; we print measured step time / ideal (goal <= 1.05) and
the timeline's bubble fraction, medians over several steps. ``time.sleep`` itself overshoots a
little, so the ratio to the ideal computed from the kernel times actually measured is printed too.

    .venv/bin/python bench/pipeline_efficiency.py [--t-ms 5] [--microbatches 16] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import smpart


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


def measure(schedule: str, stages: int, microbatches: int, seconds: float,
            steps: int) -> tuple[float, float, float, str]:
    smpart.init(pipeline_parallel_degree=stages, microbatches=microbatches, pipeline=schedule,
                pin={f"blocks.{i}": i for i in range(stages)})
    model = smpart.DistributedModel(SleepPipeline(stages, seconds))
    x = torch.randn(microbatches * 2, 8)
    train_step(model, x)  # first step: trace, partition, place
    times, bubbles = [], []
    for _ in range(steps):
        start = time.perf_counter()
        out = train_step(model, x)
        times.append(time.perf_counter() - start)
        bubbles.append(out.timeline.bubble_fraction)
    path = out.timeline.save(f"/tmp/smpart_sleep_{schedule}.json")
    smpart.shutdown()
    return statistics.median(times), statistics.median(bubbles), kernel_seconds(out.timeline, seconds), path


def kernel_seconds(timeline, seconds: float) -> float:
    """Mean measured forward + backward kernel time per micro-batch on the slowest stage
    (``time.sleep`` overshoots a little; short glue spans are left out)."""
    per_stage = []
    for stage in range(timeline.num_stages):
        total = 0.0
        for kind, nominal in (("forward", seconds), ("backward", 2 * seconds)):
            spans = [e["end_s"] - e["start_s"] for e in timeline.events
                     if e["stage"] == stage and e["kind"] == kind and e["end_s"] - e["start_s"] > nominal / 2]
            total += statistics.mean(spans) if spans else nominal
        per_stage.append(total)
    return max(per_stage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-ms", type=float, default=5.0)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    a = parser.parse_args()
    t = a.t_ms / 1e3
    ideal = (a.microbatches + a.stages - 1) * 3 * t
    print(f"{a.stages} stages x {a.microbatches} micro-batches, t = {a.t_ms} ms: "
          f"ideal makespan {ideal * 1e3:.1f} ms")
    for schedule in ("simple", "interleaved"):
        step_s, bubble, kernels_s, path = measure(schedule, a.stages, a.microbatches, t, a.steps)
        ideal_bubble = (a.stages - 1) / (a.microbatches + a.stages - 1)
        measured_ideal = (a.microbatches + a.stages - 1) * kernels_s
        print(f"  {schedule:<12} step {step_s * 1e3:6.1f} ms   measured/ideal {step_s / ideal:5.3f}   "
              f"bubble {bubble:5.1%} (ideal {ideal_bubble:4.1%})   timeline {path}")
        print(f"  {'':<12} kernels slept {kernels_s * 1e3:.2f} ms per micro-batch, not {3 * a.t_ms:.0f}: "
              f"step / ideal from the measured kernel times {step_s / measured_ideal:5.3f}")


if __name__ == "__main__":
    main()
