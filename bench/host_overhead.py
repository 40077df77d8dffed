"""The runtime's host time per step on GPT-2, measured on a CPU: what a GPU waits for when it is host-bound.

On a GPU with small micro-batches the kernels finish before the host has issued the next ones,
and every millisecond of Python the runtime adds per step shows in the step time (a lent H200,
GPT-2 small at 8 x 512 tokens in 4 micro-batches: unsplit step 127 ms for 44 ms of kernels;
smpart's stages on that GPU added 44-63 ms a step, `bench/RESULTS.md`). This measures the same
thing without a GPU: GPT-2 small's module tree (12 blocks, tied embeddings) at a tiny width, so
the matrix products cost next to nothing and the step is the host's own work, split as smpart
splits GPT-2 small at full size (the partition pinned, as in `bench/backward_work.py`), on
threads. Printed: the unsplit model's step on the same 4 micro-batches one after the other, and
smpart's: its step programs with every stage on one thread (``Config.stage_threads="one"``) and
with a thread per stage (the default), and the reference runtime with programs off; wall and CPU time
(every thread of the process) per step, what smpart adds per step and per micro-batch; medians
over ``--steps`` after warm-up, the configurations alternating over ``--rounds``, each one's
ratios to an unsplit step measured right before it (this box's speed drifts from minute to minute).

``--bytecodes`` counts instead the Python bytecodes of one step (the program with every stage on one
thread, and the unsplit model): what smpart adds to the host's Python, the same on every run; and
the same with the partition cut between transformer blocks (`whole_blocks`), for what a block
split across stages costs.

    .venv/bin/python bench/host_overhead.py [--stages 2 4] [--steps 20] [--rounds 2] [--bytecodes]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.backward_work import (  # noqa: E402
    MICROBATCHES,
    TINY,
    WARMUP_STEPS,
    accumulate_microbatches,
    full_size_partition,
)
from bench.bytecodes import count_bytecodes  # noqa: E402
from examples.models import gpt2_small  # noqa: E402

BATCH = 2 * MICROBATCHES


#: The runtimes compared: name -> `smpart.init` switches.
RUNTIMES = {
    "program, one thread": dict(step_programs=True, stage_threads="one"),
    "program, thread per stage": dict(step_programs=True, stage_threads="per-stage"),
    "reference": dict(step_programs=False),
}


def _median_ms(step, steps: int) -> tuple[float, float]:
    """Median wall and CPU (every thread of this process) milliseconds of ``step``."""
    for _ in range(WARMUP_STEPS):  # the first places the model; holding learns from the rest
        step()
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3


def unsplit_step(example):
    model = copy.deepcopy(example.model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    args, _, target = example.batch(BATCH, seed=0)

    def step() -> None:
        accumulate_microbatches(model, example, args, target)
        opt.step()
        opt.zero_grad()

    return step


def unsplit_ms(example, steps: int) -> tuple[float, float]:
    return _median_ms(unsplit_step(example), steps)


@contextmanager
def smpart_step(example, stages: int, schedule: str, pins: dict[str, int], runtime: str) -> Iterator:
    """smpart's training step on threads (``runtime``: a key of `RUNTIMES`), set up and shut down."""
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, pipeline=schedule, pin=pins,
                **RUNTIMES[runtime])
    try:
        model = smpart.DistributedModel(copy.deepcopy(example.model))
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
        args, _, target = example.batch(BATCH, seed=0)

        @smpart.step
        def train_step(model, args, target):
            loss = example.loss(model(*args), target)
            model.backward(loss)
            return loss

        def step() -> None:
            train_step(model, args, target)
            opt.step()
            opt.zero_grad()

        yield step
    finally:
        smpart.shutdown()


def smpart_ms(example, steps: int, stages: int, schedule: str, pins: dict[str, int],
              runtime: str = "program, one thread") -> tuple[float, float]:
    with smpart_step(example, stages, schedule, pins, runtime) as step:
        return _median_ms(step, steps)


def print_bytecodes(example, stage_counts: list[int], pins: dict[int, dict[str, int]]) -> None:
    """The ``--bytecodes`` table: the program on one thread (every stage's Python runs on it)."""
    base = count_bytecodes(unsplit_step(example), WARMUP_STEPS)
    table = Table(title=f"Python bytecodes a step (one thread; {MICROBATCHES} micro-batches), GPT-2 small's "
                        f"module tree at width {TINY['n_embd']}")
    for column in ("configuration", "bytecodes", "÷ unsplit", "added / micro-batch"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    table.add_row("unsplit", f"{base:,}", "1.00", "")
    for stages in stage_counts:
        cuts = {"": pins[stages], ", cut between blocks": whole_blocks(pins[stages])}
        for schedule in ("gpipe", "1f1b"):
            for cut, pinned in cuts.items():
                with smpart_step(example, stages, schedule, pinned, "program, one thread") as step:
                    count = count_bytecodes(step, WARMUP_STEPS)
                table.add_row(f"smpart, {stages} stages, {schedule}, program, one thread{cut}", f"{count:,}",
                              f"{count / base:.2f}", f"{(count - base) // MICROBATCHES:,}")
    Console().print(table)


def whole_blocks(pins: dict[str, int]) -> dict[str, int]:
    """The partition with every transformer block it splits given whole to the block's own stage
    (where its own load went). A block split across stages runs its forward as glue on each of
    them, placeholders where the other holds the data (`smpart.runtime.program.glue`): the rows
    with this cut show what that costs the host, for a worse balance of the compute at full size."""
    out = dict(pins)
    for block in {".".join(name.split(".")[:3]) for name in pins if name.startswith("transformer.h.")}:
        for name in pins:
            if name.startswith(block + "."):
                out[name] = pins[block]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of every configuration")
    parser.add_argument("--batch", type=int, default=16, help="full-size batch the partition is traced for")
    parser.add_argument("--bytecodes", action="store_true",
                        help="count the Python bytecodes of one step instead of timing (no noise)")
    a = parser.parse_args()
    torch.set_num_threads(1)
    example = gpt2_small(**TINY)
    configs = [(stages, schedule, runtime) for stages in a.stages for schedule in ("gpipe", "1f1b")
               for runtime in RUNTIMES]
    pins = {stages: full_size_partition(stages, a.batch) for stages in a.stages}
    if a.bytecodes:
        print_bytecodes(example, a.stages, pins)
        return
    # The unsplit step is measured next to every configuration, and each ratio is of that pair:
    # this box's speed drifts by tens of percent between minutes, which a single baseline would add.
    unsplit: list[tuple[float, float]] = []
    split: dict[tuple[int, str, str], list[tuple[float, float, float, float]]] = {c: [] for c in configs}
    for _ in range(a.rounds):
        for stages, schedule, runtime in configs:
            base_ms, base_cpu = unsplit_ms(example, a.steps)
            ms, cpu = smpart_ms(example, a.steps, stages, schedule, pins[stages], runtime)
            unsplit.append((base_ms, base_cpu))
            split[(stages, schedule, runtime)].append((ms, cpu, ms / base_ms, cpu / base_cpu))
    base, base_cpu = (statistics.median(column) for column in zip(*unsplit, strict=True))
    title = (f"GPT-2 small's module tree at width {TINY['n_embd']} on this CPU (1 intra-op thread), "
             f"{MICROBATCHES} micro-batches, smpart on threads; medians of {a.rounds} rounds, each ratio "
             "to the unsplit step measured beside it")
    table = Table(title=title)
    for column in ("configuration", "step ms", "÷ unsplit", "CPU ms", "CPU ÷ unsplit", "added ms / step",
                   "added ms / micro-batch"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    table.add_row("unsplit", f"{base:.1f}", "1.00", f"{base_cpu:.1f}", "1.00", "", "")
    for (stages, schedule, runtime), times in split.items():
        ms, cpu, ratio, cpu_ratio = (statistics.median(column) for column in zip(*times, strict=True))
        added = ms - base
        table.add_row(f"smpart, {stages} stages, {schedule}, {runtime}", f"{ms:.1f}", f"{ratio:.2f}",
                      f"{cpu:.1f}", f"{cpu_ratio:.2f}", f"{added:.1f}", f"{added / MICROBATCHES:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
