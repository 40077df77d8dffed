"""Runtime overhead: one cross-stage round trip, and a real MLP pipelined vs unsplit.

1. Round trip: a root module on stage 0 calls a tiny module on stage 1 ``n`` times in its forward
   (with a tiny module of its own between the calls); every call is a forward request + response
   and, in the backward, a gradient message each way.
   (step time with n calls - step time with 0 calls) / n = one forward+backward round trip
   (goal < 100 µs); median over several steps.
2. A 4-layer MLP step pipelined over 2 stages (4 micro-batches) vs the same model unsplit in one
   thread: one full-batch forward+backward, and the same 4 micro-batches one after the other (the
   fair baseline: the pipeline's own work, without the pipeline), medians. Once with torch's
   default intra-op threads and once with one: torch's intra-op thread count is process-wide,
   so every stage thread runs its kernels on that many threads, and stages sharing a CPU
   oversubscribe it (on CPU give each stage ``cores // stages`` threads).

    .venv/bin/python bench/overhead.py [--calls 200] [--steps 7] [--hops]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from torch import nn

import smpart
from smpart.runtime.runtime import current_runtime


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


def round_trip(calls: int, steps: int, hops: bool = False) -> tuple[float, list[str]]:
    """Seconds per round trip, and (with ``hops``) the lines of `hop_report`."""
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin={"": 0, "local": 0, "remote": 1})
    net = PingPong()
    model = smpart.DistributedModel(net)
    x = torch.randn(2, 4)
    train_step(model, x)
    net.calls = 0
    base = timed_steps(model, x, steps)
    net.calls = calls
    loaded = timed_steps(model, x, steps)
    report = hop_report(model, x) if hops else []
    smpart.shutdown()
    return (loaded - base) / calls, report


def hop_report(model, x) -> list[str]:
    """One more step with every send and receive timestamped: per message kind, the median time in
    the queue (send -> received, wake-up included) and the processing that follows (received -> the
    next message sent). Timestamping adds ~1 µs per event. Work run on the thread that offered it
    (a gradient message, `ExecutionServer.deliver`; a forward call, `ExecutionServer._call_elsewhere`)
    never passes the transport: not listed (between idle stages, that is every hop)."""
    transport = current_runtime().transport
    log: list[tuple[float, str]] = []
    send, receive = transport.send, transport.receive

    def timed_send(address, message):
        log.append((time.perf_counter(), "sent " + type(message).__name__))
        send(address, message)

    def timed_receive(address, timeout):
        message = receive(address, timeout)
        if message is not None:
            log.append((time.perf_counter(), "received " + type(message).__name__))
        return message

    transport.send, transport.receive = timed_send, timed_receive  # instance attributes: the servers
    try:                                                            # look them up at every call
        train_step(model, x)
    finally:
        del transport.send, transport.receive
    gaps: dict[tuple[str, str], list[float]] = {}
    for (t0, a), (t1, b) in itertools.pairwise(log):
        gaps.setdefault((a, b), []).append(t1 - t0)
    lines = [f"    {a:>26} -> {b:<26} {statistics.median(times) * 1e6:6.1f}  x{len(times)}"
             for (a, b), times in sorted(gaps.items(), key=lambda kv: -sum(kv[1])) if len(times) >= 10]
    lines = lines or ["    none: every hop ran on the thread that offered it"]
    return ["  per hop (median µs, count):", *lines]


def mlp(width: int = 1024, depth: int = 4) -> nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def timed(fn, steps: int) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mlp_comparison(steps: int, batch: int = 256, microbatches: int = 4) -> dict[str, float]:
    """The same MLP step three ways: unsplit on the full batch, unsplit over the same micro-batches
    one after the other in one thread (the pipeline's own work without the pipeline: the fair
    baseline), and pipelined over 2 stages."""
    torch.manual_seed(0)
    plain = mlp()
    x = torch.randn(batch, 1024)

    def unsplit():
        plain(x).square().mean().backward()

    def unsplit_microbatches():
        for piece in x.chunk(microbatches):
            (plain(piece).square().mean() / microbatches).backward()

    smpart.init(pipeline_parallel_degree=2, microbatches=microbatches)
    model = smpart.DistributedModel(mlp())

    @smpart.step
    def mlp_step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    try:
        return {"unsplit": timed(unsplit, steps), "micro-batched": timed(unsplit_microbatches, steps),
                "pipelined": timed(lambda: mlp_step(model, x), steps)}
    finally:
        smpart.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--hops", action="store_true", help="also print where a round trip's time goes")
    a = parser.parse_args()
    rt, hops = round_trip(a.calls, a.steps, a.hops)
    print(f"cross-stage forward+backward round trip (4 floats): {rt * 1e6:.0f} µs  (goal < 100 µs)")
    for line in hops:
        print(line)
    default_threads = torch.get_num_threads()
    print("MLP 4x1024, batch 256, 4 micro-batches, 2 stages (both on this CPU), median step times:")
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        t = mlp_comparison(a.steps)
        print(f"  torch intra-op threads {threads}: unsplit {t['unsplit'] * 1e3:.1f} ms, unsplit over the 4 "
              f"micro-batches in one thread {t['micro-batched'] * 1e3:.1f} ms, pipelined "
              f"{t['pipelined'] * 1e3:.1f} ms (x{t['pipelined'] / t['micro-batched']:.2f} the micro-batched "
              f"one, x{t['pipelined'] / t['unsplit']:.2f} the unsplit one)")
    torch.set_num_threads(default_threads)

if __name__ == "__main__":
    main()
