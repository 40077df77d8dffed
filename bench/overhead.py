"""Runtime overhead: one cross-stage round trip, and a real MLP pipelined vs unsplit.

1. Round trip: a root module on stage 0 calls a tiny module on stage 1 ``n`` times in its forward
   (with a tiny module of its own between the calls); every call is a forward request + response
   and, in the backward, a gradient message each way.
   (step time with n calls - step time with 0 calls) / n = one forward+backward round trip
   (goal < 100 µs); median over several steps.
2. A 4-layer MLP step pipelined over 2 stages (4 micro-batches) vs the same model unsplit in one
   thread (one full-batch forward+backward), medians.

    .venv/bin/python bench/overhead.py [--calls 200] [--steps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import smpart


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


class PingPong(nn.Module):
    def __init__(self):
        super().__init__()
        self.local = Tiny()
        self.remote = Tiny()
        self.calls = 0

    def forward(self, x):
        x = self.local(x)
        for _ in range(self.calls):  # local work between calls: no gradient shortcut, a real round trip
            x = self.local(self.remote(x))
        return x


@smpart.step
def train_step(model, x):
    loss = model(x).sum()
    model.backward(loss)
    return loss


def timed_steps(model, x, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(model, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def round_trip(calls: int, steps: int) -> float:
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin={"": 0, "local": 0, "remote": 1})
    net = PingPong()
    model = smpart.DistributedModel(net)
    x = torch.randn(2, 4)
    train_step(model, x)
    net.calls = 0
    base = timed_steps(model, x, steps)
    net.calls = calls
    loaded = timed_steps(model, x, steps)
    smpart.shutdown()
    return (loaded - base) / calls


def mlp(width: int = 1024, depth: int = 4) -> nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def mlp_comparison(steps: int, batch: int = 256) -> tuple[float, float]:
    torch.manual_seed(0)
    plain = mlp()
    x = torch.randn(batch, 1024)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        plain(x).square().mean().backward()
        times.append(time.perf_counter() - start)
    unsplit = statistics.median(times[1:])
    smpart.init(pipeline_parallel_degree=2, microbatches=4)
    model = smpart.DistributedModel(mlp())

    @smpart.step
    def mlp_step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    mlp_step(model, x)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mlp_step(model, x)
        times.append(time.perf_counter() - start)
    smpart.shutdown()
    return unsplit, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--steps", type=int, default=7)
    a = parser.parse_args()
    rt = round_trip(a.calls, a.steps)
    print(f"cross-stage forward+backward round trip (4 floats): {rt * 1e6:.0f} µs  (goal < 100 µs)")
    unsplit, pipelined = mlp_comparison(a.steps)
    print(f"MLP 4x1024, batch 256: unsplit one thread {unsplit * 1e3:.1f} ms, pipelined 2 stages x 4 "
          f"micro-batches {pipelined * 1e3:.1f} ms (x{pipelined / unsplit:.2f}; both stages share this CPU)")


if __name__ == "__main__":
    main()
