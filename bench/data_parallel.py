"""Data parallelism: smpart with dp = 2 against torch's ``DistributedDataParallel`` on 2 processes.

The model of `bench/mlp_pipeline.py` (8 MLP blocks 256 -> 1024 -> 256 and a head, float32, about
4.2 M parameters), batch 256 per replica, cross-entropy, forward + backward + SGD step, one
intra-op thread per rank, gloo. Three configurations alternate round by round in one run:

- ``smpart dp=2``: ``smpart.init(pipeline_parallel_degree=1, microbatches=1)`` on 2 processes
  (dp derived: 2); smpart averages gradients in buckets as they become final; from the second step
  a step program (with pp 1: the micro-batch loop and the buckets); ``smpart dp=2, reference``:
  the same with step programs off;
- ``ddp``: ``DistributedDataParallel`` (its default 25 MB buckets, overlapped with backward);
- ``ddp no_sync``: DDP without its all-reduce: the compute alone, for the share of sync exposed.

Share of the gradient sync hidden behind compute: ``1 - (step - compute) / sync``, with ``sync``
the time of the same all-reduces run on their own (measured in this run).

    .venv/bin/python bench/data_parallel.py [--rounds 5] [--steps 10] [--warmup 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.mlp_pipeline import MLP  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402

BATCH = 256


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, 256, generator=g), torch.randint(10, (BATCH,), generator=g)


def _timed(step, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def smpart_rank(rank: int, steps: int, warmup: int, programs: bool = True) -> list[float]:
    torch.manual_seed(0)
    smpart.init(pipeline_parallel_degree=1, microbatches=1, timeout_s=120, step_programs=programs)
    try:
        model = smpart.DistributedModel(MLP())
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
        x, y = _batch(rank)

        @smpart.step
        def train(model, x, y):
            loss = F.cross_entropy(model(x), y)
            model.backward(loss)
            return loss

        def step() -> None:
            train(model, x, y)
            opt.step()
            opt.zero_grad()

        return _timed(step, steps, warmup)
    finally:
        smpart.shutdown()


def ddp_rank(rank: int, steps: int, warmup: int, sync: bool) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = _batch(rank)

    def step() -> None:
        if sync:
            F.cross_entropy(model(x), y).backward()
        else:
            with model.no_sync():
                F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return _timed(step, steps, warmup)


def allreduce_rank(rank: int, steps: int) -> list[float]:
    """The gradients' all-reduce alone: every parameter's size, in DDP-sized (25 MB) buckets."""
    grads = [p.detach().clone() for p in MLP().parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    bucket = 25 * 2**20 // 4
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(flat[i:i + bucket], async_op=True) for i in range(0, flat.numel(), bucket)]
        for work in works:
            work.wait()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = ("smpart dp=2", "smpart dp=2, reference", "ddp", "ddp no_sync", "all-reduce alone")
    results: dict[str, list[float]] = {name: [] for name in names}
    with RankPool(2) as pool:
        for _ in range(args.rounds):
            results["smpart dp=2"] += pool.run(smpart_rank, args.steps, args.warmup)[0]
            results["smpart dp=2, reference"] += pool.run(smpart_rank, args.steps, args.warmup, False)[0]
            results["ddp"] += pool.run(ddp_rank, args.steps, args.warmup, True)[0]
            results["ddp no_sync"] += pool.run(ddp_rank, args.steps, args.warmup, False)[0]
            results["all-reduce alone"] += pool.run(allreduce_rank, args.steps)[0]
    median = {name: statistics.median(times) for name, times in results.items()}
    for name, value in median.items():
        print(f"{name:<18} {value * 1e3:8.2f} ms/step (median of {len(results[name])})")
    compute, sync = median["ddp no_sync"], median["all-reduce alone"]
    print(f"smpart dp=2 / ddp: {median['smpart dp=2'] / median['ddp']:.3f}  (goal <= 1.03); the reference "
          f"runtime (step programs off): {median['smpart dp=2, reference'] / median['ddp']:.3f}")
    for name in ("smpart dp=2", "smpart dp=2, reference", "ddp"):
        hidden = 1 - (median[name] - compute) / sync
        print(f"share of the gradient sync hidden behind compute, {name}: {hidden:.2f}")


if __name__ == "__main__":
    main()
