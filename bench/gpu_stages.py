"""The thread runtime with its stages on one GPU: what splitting costs when kernels run on a GPU.

GPT-2 small (124M parameters, float32 with TF32 matrix products), a batch of ``--batch`` sequences
of ``--seq`` tokens in 4 micro-batches: the unsplit model (the same 4 micro-batches, gradients
accumulated) against smpart on threads with 2 and 4 stages, all on ``cuda:0``. Stages sharing one
GPU cannot run faster than the unsplit model (their kernels share it): the ratio is the runtime's
overhead with GPU kernels, for the step programs (every stage on one thread, and a thread per
stage) and for the reference runtime (programs off). Median step time over ``--steps`` after 6
warm-up steps, the GPU's kernel time in one profiled step (above the unsplit model's: the GPU did
more work; equal, with a slower step: the host held it up), and the peak allocated memory. Needs a CUDA GPU.

    python bench/gpu_stages.py [--batch 8] [--seq 512] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.backward_work import MICROBATCHES, accumulate_microbatches  # noqa: E402
from examples.models import gpt2_small  # noqa: E402

WARMUP_STEPS = 6


def _timed(step, steps: int) -> tuple[float, float, float]:
    """Median seconds per step, peak GiB allocated, and the GPU's kernel time in one more step
    (seconds, from `torch.profiler`: more than the unsplit model's means more work on the GPU).
    Warm-up: the first step places the model, and the stages learn from each step how many
    gradient messages to wait for (`gradients.Holding`; 4 stages settle in 4 steps)."""
    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernel_us = sum(e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    return statistics.median(times), peak, kernel_us / 1e6


def unsplit(example, batch, steps: int) -> tuple[float, float, float]:
    model = copy.deepcopy(example.model).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    args, _, target = batch
    args, target = [a.cuda() for a in args], target.cuda()

    def step():
        accumulate_microbatches(model, example, args, target)
        opt.step()
        opt.zero_grad()

    return _timed(step, steps)


#: The runtimes compared: the step programs with every stage on one thread and with a thread per
#: stage (`Config.stage_threads`), and the reference runtime (programs off).
RUNTIMES = {
    "program, one thread": dict(step_programs=True, stage_threads="one"),
    "program, thread per stage": dict(step_programs=True, stage_threads="per-stage"),
    "reference": dict(step_programs=False),
}


def split(example, batch, steps: int, stages: int, schedule: str, **init) -> tuple[float, float, float]:
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, pipeline=schedule,
                devices=["cuda:0"] * stages, **init)
    model = smpart.DistributedModel(copy.deepcopy(example.model))
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
    args, _, target = batch
    args, target = [a.cuda() for a in args], target.cuda()

    @smpart.step
    def train_step(model, args, target):
        loss = example.loss(model(*args), target)
        model.backward(loss)
        return loss

    def step():
        train_step(model, args, target)
        opt.step()
        opt.zero_grad()

    try:
        return _timed(step, steps)
    finally:
        smpart.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    a = parser.parse_args()
    if not torch.cuda.is_available():  # `make bench` runs every benchmark: skip, do not fail
        print("bench/gpu_stages.py needs a CUDA GPU, and this machine has none: skipped")
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    example = gpt2_small(seq_len=a.seq)
    batch = example.batch(a.batch, seed=0)
    table = Table(title=f"GPT-2 small on {torch.cuda.get_device_name()}: batch {a.batch} x {a.seq} tokens, "
                        f"{MICROBATCHES} micro-batches, float32 (TF32); smpart's stages on threads, "
                        "all on cuda:0")
    for column in ("configuration", "step ms", "÷ unsplit", "GPU kernel ms", "÷ unsplit ", "peak GiB"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    base, base_mem, base_kernels = unsplit(example, batch, a.steps)
    table.add_row("unsplit", f"{base * 1e3:.1f}", "1.00", f"{base_kernels * 1e3:.1f}", "1.00",
                  f"{base_mem:.2f}")
    for stages in (2, 4):
        for schedule in ("gpipe", "1f1b"):
            for runtime, init in RUNTIMES.items():
                seconds, mem, kernels = split(example, batch, a.steps, stages, schedule, **init)
                table.add_row(f"smpart, {stages} stages, {schedule}, {runtime}", f"{seconds * 1e3:.1f}",
                              f"{seconds / base:.2f}", f"{kernels * 1e3:.1f}",
                              f"{kernels / base_kernels:.2f}", f"{mem:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
