"""The 2-stage MLP workload the process benches share: the model, its batch and split, smpart's
step on it, torch.distributed.pipelining on it, the unsplit model, and the step timer.

The MLP: 8 blocks of Linear 256->1024, GELU, Linear 1024->256, then a head Linear 256->10,
float32, batch 512, 4 micro-batches, cross-entropy, split in 2 at the same layer (blocks 0-3 on
stage 0, blocks 4-7 and the head on stage 1). `timed` measures steps: wall clock, and the CPU
every thread of the process used (see `bench/processes.py`'s docstring for what that tells).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import smpart

WIDTH, HIDDEN, BLOCKS, CLASSES = 256, 1024, 8, 10
BATCH, MICROBATCHES, STAGES = 512, 4, 2
PINS = {"": 0, "head": 1, **{f"blocks.{i}": 0 if i < BLOCKS // 2 else 1 for i in range(BLOCKS)}}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(),
                                                  nn.Linear(HIDDEN, WIDTH)) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> MLP:
    torch.manual_seed(0)  # every rank builds the same weights
    return MLP()


class Halves(nn.Module):
    """Diagnostic: the same layers (same weights) grouped into two ``nn.Sequential`` halves, so the
    root makes one cross-stage call per micro-batch (a chain's one activation each way) instead
    of one per block of stage 1: what the MLP would cost if outputs stayed on the stage that made
    them."""

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        half = BLOCKS // 2
        self.first = nn.Sequential(*mlp.blocks[:half])
        self.second = nn.Sequential(*mlp.blocks[half:], mlp.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


#: Virtual stages (``Config(virtual_stages=2)``): four stages of two blocks, rank r holding stages
#: r and r + 2, as torch's ``ScheduleInterleaved1F1B`` runs them.
INTERLEAVED_PINS = {"": 0, "head": 3, **{f"blocks.{i}": i // 2 for i in range(BLOCKS)}}

HALVES_PINS = {"": 0, "first": 0, "second": 1, **{f"first.{i}": 0 for i in range(BLOCKS // 2)},
               **{f"second.{i}": 1 for i in range(BLOCKS // 2 + 1)}}


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


@smpart.step


def smpart_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


#: The threads that run the stage and the step body: torch's pipeline runs everything on the main
#: thread; smpart runs a stage on its server's threads (its dispatcher and workers) and each
#: micro-batch's step body on a driver thread of its own.
COMPUTE_THREADS = ("MainThread", "smpart-stage", "smpart-step")


def _thread_times() -> dict[int, tuple[float, float, bool, str]]:
    """Per live thread of this process: seconds on a core, seconds runnable but waiting for one
    (Linux's ``/proc/self/task/*/schedstat``; empty where it is missing), whether it is one of
    the `COMPUTE_THREADS` (threads torch or gloo started have no Python name: they are not), and
    its role (`_role`)."""
    tasks = "/proc/self/task"
    names = {t.native_id: t.name for t in threading.enumerate()}
    times = {}
    for tid in os.listdir(tasks) if os.path.isdir(tasks) else []:
        try:
            with open(f"{tasks}/{tid}/schedstat") as f:
                on_core, waiting = f.read().split()[:2]
            name = names.get(int(tid)) or "native " + Path(f"{tasks}/{tid}/comm").read_text().strip()
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        computes = name.startswith(COMPUTE_THREADS)
        times[int(tid)] = (int(on_core) / 1e9, int(waiting) / 1e9, computes, _role(name))
    return times


def _role(name: str) -> str:
    """What a thread does, from its name: ``smpart-stage1-2`` (a worker of stage 1) -> ``stage workers``."""
    if re.fullmatch(r"smpart-stage\d+-\d+", name):
        return "stage workers"
    if re.fullmatch(r"smpart-stage\d+", name):
        return "stage dispatcher"
    if name.startswith("smpart-receive"):
        return "transport receiver"
    if name.startswith("smpart-send"):
        return "transport sender"
    return re.sub(r"[-_]?\d+$", "", name)


def timed(one_step: Any, warmup: int, steps: int, usage: dict[str, float] | None = None) -> list[float]:
    """Wall-clock seconds of each of ``steps`` steps after ``warmup``. Fills ``usage`` with seconds
    per step: ``cpu``, what this whole process (every thread) used; ``beside``, what its threads
    other than the `COMPUTE_THREADS` used; ``waited``, how long its threads waited for a core;
    ``roles``, both per kind of thread (`_role`), ``[cpu, waited]``."""
    for _ in range(warmup):
        one_step()
    times = []
    cpu_start, threads_start = time.process_time(), _thread_times()
    for _ in range(steps):
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    if usage is not None:
        threads = _thread_times()
        before = {tid: threads_start.get(tid, (0.0, 0.0)) for tid in threads}
        used = (time.process_time() - cpu_start) / steps
        usage.update(cpu=used,
                     beside=sum(threads[t][0] - before[t][0] for t in threads if not threads[t][2]) / steps,
                     waited=sum(threads[t][1] - before[t][1] for t in threads) / steps)
        roles: dict[str, list[float]] = {}
        for tid, (on_core, waiting, _computes, role) in threads.items():
            totals = roles.setdefault(role, [0.0, 0.0])
            totals[0] += (on_core - before[tid][0]) / steps
            totals[1] += (waiting - before[tid][1]) / steps
        # Threads that ended within the steps (a step's drivers) are in the process's CPU only.
        roles["ended within the step"] = [max(0.0, used - sum(t[0] for t in roles.values())), float("nan")]
        usage["roles"] = roles
    return times


def run_torch(rank: int, schedule: str, warmup: int, steps: int, count: bool = False) -> dict[str, Any]:
    """torch.distributed.pipelining over hand-built stages on the pool's default (gloo) group;
    ``count``: the bytecodes of one step after ``warmup`` (`bench.bytecodes`) instead of times."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule == "interleaved":  # four stages of two blocks, rank r holding r and r + 2
        from torch.distributed.pipelining import ScheduleInterleaved1F1B

        mlp = make_model()
        chunks = [nn.Sequential(*mlp.blocks[2 * i:2 * i + 2]) for i in range(BLOCKS // 2)]
        chunks[-1].append(mlp.head)
        mine = [chunks[rank], chunks[rank + STAGES]]
        stages = [PipelineStage(chunk, index, 2 * STAGES, torch.device("cpu"))
                  for chunk, index in zip(mine, (rank, rank + STAGES), strict=True)]
        sched = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=F.cross_entropy)
        module = nn.ModuleList(mine)
    else:
        halves = Halves(make_model())
        module = halves.first if rank == 0 else halves.second
        stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        sched = kind(stage, MICROBATCHES, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    x, y = make_batch()
    losses: list[torch.Tensor] = []

    def one_step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            losses.clear()
            sched.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad()

    dist.barrier()
    if count:
        from bench.bytecodes import count_bytecodes

        counted = count_bytecodes(one_step, warmup)
        dist.barrier()
        return {"bytecodes": counted}
    usage: dict[str, float] = {}
    times = timed(one_step, warmup, steps, usage)
    dist.barrier()
    return {"times": times, "loss": torch.stack(losses).mean().item() if losses else None, **usage}


def pipelining_step(schedule: Any, rank: int, stages: int, x: torch.Tensor, target: torch.Tensor) -> None:
    """One step of a torch.distributed.pipelining schedule with one stage per rank: the first
    stage's rank feeds the batch, the last one's the target, the others neither."""
    if rank == 0:
        schedule.step(x)
    elif rank == stages - 1:
        schedule.step(target=target)
    else:
        schedule.step()


def run_unsplit(warmup: int, steps: int, microbatched: bool,
                usage: dict[str, float] | None = None) -> list[float]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = make_batch()

    def one_step() -> None:
        if microbatched:
            for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
                (F.cross_entropy(model(xs), ys) / MICROBATCHES).backward()
        else:
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return timed(one_step, warmup, steps, usage)
