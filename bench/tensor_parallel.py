"""Tensor parallelism on 2 gloo processes: smpart's swap-in against torch's ``parallelize_module``.

    .venv/bin/python bench/tensor_parallel.py [--iters N] [--warmup 1] [--only mlp|block] [--unsplit]

Two processes (one thread each) time forward + backward of the same module split two ways:

(a) smpart: ``plan_tensor_parallel`` + ``apply_tensor_parallel`` (`DistributedLinear` layers whose
    DTensor parameters are used through ``.to_local()``: plain autograd collectives);
(b) torch: ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` /
    ``RowwiseParallel`` on the same layers (DTensor all the way through the layers' forward);

and, with ``--unsplit``, the unsplit module on each process for scale. Workloads: an MLP block
1024 -> 4096 -> 1024 on 64 x 128 tokens, and a pre-norm transformer block (width 768, 12 heads,
8 x 128 tokens), all float32. Iterations of (a) and (b) alternate so that a busy machine slows
both alike; the figure is the median, and the goal is a/b <= 1.05.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from smpart.tensor_parallel import (
    AttentionAdapter,
    AttentionLayout,
    apply_tensor_parallel,
    plan_tensor_parallel,
    register_attention_adapter,
    tp_mesh,
)

WORLD = 2


# ==================================================================== the workloads
class MLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Attention(nn.Module):
    """Separate q/k/v projections and views with ``-1`` heads, so that torch's colwise split of
    q/k/v runs it unchanged: both sides compute the same thing."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class BenchAttention(AttentionAdapter):
    """How a user teaches the planner an attention class (nothing to localise: views use -1)."""

    name = "bench Attention"

    def matches(self, module: nn.Module) -> bool:
        return isinstance(module, Attention)

    def layout(self, module: nn.Module) -> AttentionLayout:
        return AttentionLayout((("q", 1), ("k", 1), ("v", 1)), "o", module.heads, module.heads)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


#: name -> (make the module, input shape, torch's plan for it, default iterations)
WORKLOADS = {
    "mlp": (lambda: MLP(1024, 4096), (64, 128, 1024),
            {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}, 3),
    "block": (lambda: Block(768, 12), (8, 128, 768),
              {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
               "attn.o": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()},
              10),
}


# ==================================================================== timing
def _step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds of one forward + backward."""
    start, cpu = time.perf_counter(), time.process_time()
    model(x).backward(grad)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    model.zero_grad(set_to_none=True)
    return seconds, cpu


def _measure(name: str, iters: int | None, warmup: int, unsplit: bool) -> dict[str, float]:
    make, shape, torch_plan, default_iters = WORKLOADS[name]
    iters = iters or default_iters
    torch.manual_seed(0)
    original = make()
    x = torch.randn(shape)
    grad = torch.randn(shape)
    mesh = tp_mesh(None, "cpu")
    ours = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_tensor_parallel(ours, plan_tensor_parallel(ours, WORLD), mesh)
    theirs = parallelize_module(copy.deepcopy(original), mesh, torch_plan)
    contenders = [("smpart", ours), ("torch", theirs)] + ([("unsplit", original)] if unsplit else [])
    times: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in contenders}
    for i in range(warmup + iters):
        for label, model in contenders:
            dist.barrier()
            measured = _step(model, x, grad)
            if i >= warmup:
                times[label].append(measured)
    medians = {label: statistics.median(wall for wall, _ in values) for label, values in times.items()}
    cpu = {f"{label}_cpu": statistics.median(c for _, c in values) for label, values in times.items()}
    return {"iters": iters, **medians, **cpu}


def _worker(rank: int, port: int, names: list[str], iters: int | None, warmup: int, unsplit: bool,
            queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        register_attention_adapter(BenchAttention())
        results = {name: _measure(name, iters, warmup, unsplit) for name in names}
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, help="timed iterations (default: 3 for mlp, 10 for block)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--only", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--unsplit", action="store_true", help="also time the unsplit module (slow)")
    args = parser.parse_args()
    unsplit = args.unsplit
    names = args.only or list(WORKLOADS)
    # torch's functional collectives warn at exit about collectives whose results zero_grad dropped
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    context = mp.start_processes(_worker, args=(_free_port(), names, args.iters, args.warmup, unsplit, queue),
                                 nprocs=WORLD, join=False, start_method="spawn")
    try:
        results = queue.get(timeout=1800)
        while not context.join(timeout=60):
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
            process.join()
    print(f"tensor parallelism, {WORLD} gloo processes x 1 thread, float32, forward+backward, "
          f"median of the timed iterations (after {args.warmup} warm-up)")
    header = f"{'workload':<8} {'iters':>5} {'(a) smpart':>12} {'(b) torch':>12} {'a/b':>6} {'a/b cpu':>8}"
    print(header + (f" {'unsplit':>10} {'speed-up (a)':>13}" if unsplit else ""))
    for name, r in results.items():
        line = (f"{name:<8} {r['iters']:>5} {r['smpart'] * 1e3:>10.1f}ms {r['torch'] * 1e3:>10.1f}ms "
                f"{r['smpart'] / r['torch']:>6.3f} {r['smpart_cpu'] / r['torch_cpu']:>8.3f}")
        if unsplit:
            line += f" {r['unsplit'] * 1e3:>8.1f}ms {r['unsplit'] / r['smpart']:>12.2f}x"
        print(line)
    print("a/b: wall-clock medians (the goal is <= 1.05); a/b cpu: each process's CPU time, which a busy "
          "machine disturbs less")


if __name__ == "__main__":
    main()
