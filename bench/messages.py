"""A step's messages between processes, kind by kind: how many, and the CPU each rank spends on them.

The MLP of `bench/mlp_pipeline.py` on 2 processes (gloo, 1 intra-op thread per rank, 4
micro-batches, 1f1b by default). For every kind of message a rank sends to the other (a `Batch`
by what it holds), per step: how many, the CPU to *pack* it (pickle the header, copy the tensors
into the frame, `smpart.runtime.wire.frames.pack`) and to *post* it (hand its transfers to gloo);
for every kind it receives: how many, the CPU to *rebuild* it (unpickle) and to *handle* it (the
stage's dispatcher). CPU is the thread's own (``time.thread_time``) around those functions, wrapped
for the measurement (a few µs each).

The last column packs one message of each kind again after the steps, while the other rank only
waits: the same work on an otherwise idle machine. On 2 cores with both ranks computing, the
same Python work takes several times the CPU it takes alone; that ratio is what a message costs a
busy pipeline beyond its own work.

    .venv/bin/python bench/messages.py [--schedule 1f1b] [--steps 8] [--warmup 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.mlp_pipeline import MICROBATCHES, PINS, STAGES, make_batch, make_model, smpart_step  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402
from smpart.runtime.reference import stage  # noqa: E402
from smpart.runtime.wire import frames as wire  # noqa: E402
from smpart.runtime.wire import processes as transport  # noqa: E402
from smpart.runtime.wire.messages import Batch  # noqa: E402

ALONE_REPEATS = 200


def kind(message: Any) -> str:
    """A message's kind: its class, a `Batch` by the classes it holds."""
    if isinstance(message, Batch):
        held = defaultdict(int)
        for each in message.messages:
            held[type(each).__name__] += 1
        parts = (f"{n}×{name}" if n > 1 else name for name, n in sorted(held.items()))
        return "Batch[" + ", ".join(parts) + "]"
    return type(message).__name__


class Meter:
    """CPU per (what, kind), counted while ``on``; and one sample message of each kind sent."""

    def __init__(self) -> None:
        self.on = False
        self.cpu: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])  # [count, seconds]
        self.samples: dict[str, Any] = {}

    def wrap(self, owner: Any, name: str, what: str, kind_of: Any) -> None:
        original = getattr(owner, name)

        def measured(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            result = original(*args, **kwargs)
            if self.on:
                spent = time.thread_time() - start
                entry = self.cpu[(what, kind_of(args, result))]
                entry[0] += 1
                entry[1] += spent
            return result

        setattr(owner, name, measured)

    def sample(self, args: tuple, result: Any) -> str:
        routed = args[0]  # (endpoint, message): what `RoutedTransport` sends between ranks
        name = kind(routed[1])
        self.samples.setdefault(name, routed)
        return name


def measure(rank: int, schedule: str, warmup: int, steps: int) -> dict[str, Any]:
    meter = Meter()
    meter.wrap(wire, "pack", "pack", meter.sample)
    meter.wrap(wire, "rebuild", "rebuild", lambda args, result: kind(result[1]))
    meter.wrap(transport.ProcessTransport, "_post", "post", lambda args, result: "")
    meter.wrap(stage.StageServer, "_dispatch", "handle", lambda args, result: kind(args[1]))
    smpart.init(pipeline_parallel_degree=STAGES, microbatches=MICROBATCHES, pipeline=schedule, pin=PINS,
                timeout_s=120)
    try:
        model = smpart.DistributedModel(make_model())
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        x, y = make_batch()
        for i in range(warmup + steps):
            meter.on = i >= warmup
            smpart_step(model, x, y)
            opt.step()
            opt.zero_grad()
        meter.on = False
        alone = {}
        for turn in range(STAGES):  # one rank packs while the other waits at the barrier
            dist.barrier()
            if turn == rank:
                alone = {name: _pack_alone(message) for name, message in meter.samples.items()}
        dist.barrier()
        per_step = {key: (n / steps, seconds * 1e3 / steps) for key, (n, seconds) in meter.cpu.items()}
        return {"per_step": per_step, "alone": alone}
    finally:
        smpart.shutdown()


def _pack_alone(message: Any) -> float:
    """ms of CPU to pack ``message`` once: the mean of `ALONE_REPEATS` packs."""
    for _ in range(10):
        wire.pack(message)
    start = time.thread_time()
    for _ in range(ALONE_REPEATS):
        wire.pack(message)
    return (time.thread_time() - start) / ALONE_REPEATS * 1e3


def table(rank: int, result: dict[str, Any], other: dict[str, Any]) -> Table:
    per_step, alone = result["per_step"], result["alone"]
    sent = sorted({k for what, k in per_step if what == "pack"}, key=lambda k: -per_step[("pack", k)][1])
    received = sorted({k for what, k in other["per_step"] if what == "pack"},
                      key=lambda k: -per_step.get(("rebuild", k), (0, 0.0))[1])
    out = Table(title=f"rank {rank} (stage {rank}), per step")
    for column in ("message", "sent", "pack ms", "pack alone ms", "received", "rebuild ms", "handle ms"):
        out.add_column(column, justify="left" if column == "message" else "right")

    def cell(key: tuple[str, str], index: int, digits: int = 2) -> str:
        value = per_step.get(key)
        return "" if value is None else f"{value[index]:.{digits}f}"

    for name in sent + [k for k in received if k not in sent]:
        count = per_step.get(("pack", name), (0, 0.0))[0]
        out.add_row(name, f"{count:g}" if count else "", cell(("pack", name), 1),
                    f"{alone[name] * count:.2f}" if name in alone else "",
                    cell(("rebuild", name), 0, 0), cell(("rebuild", name), 1), cell(("handle", name), 1))
    posts = per_step.get(("post", ""), (0, 0.0))
    out.add_row("(all sent: posting to gloo)", f"{posts[0]:g}", f"{posts[1]:.2f}", "", "", "", "")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    with RankPool(STAGES) as pool:
        results = pool.run(measure, args.schedule, args.warmup, args.steps)
    console = Console(width=120)
    console.print(f"MLP of bench/processes.py, 2 processes, {MICROBATCHES} micro-batches, {args.schedule}, "
                  f"{args.steps} steps after {args.warmup} warm-up; CPU ms per step "
                  f"('pack alone': the same packs on an idle machine)")
    for rank, result in enumerate(results):
        console.print(table(rank, result, results[1 - rank]))


if __name__ == "__main__":
    main()
