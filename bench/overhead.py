"""Runtime overhead: one cross-stage round trip (threads and processes), a real MLP pipelined vs unsplit.

1. Round trip on threads: a root module on stage 0 calls a tiny module on stage 1 ``n`` times in
   its forward (with a tiny module of its own between the calls); every call is a forward request
   + response and, in the backward, a gradient message each way.
   (step time with n calls - step time with 0 calls) / n = one forward+backward round trip
   (goal < 100 µs); median over several steps. Once with 4 floats (the historical figure) and
   once with a 1x256 float32 tensor (the process figure's size).
2. The same round trip with the two stages on 2 processes (gloo, spawned from this script, one
   intra-op thread each), 1x256 float32, against, in the same processes and alternating with it,
   torch's own ``dist.send`` + ``dist.recv`` of the same tensor there and back (goal: smpart's
   forward+backward round trip <= 2x that: it is two messages each way, the raw one one), and
   smpart's ``ProcessTransport`` alone echoing the tensor in a small dataclass (what the transport
   costs under the runtime). ``--hops`` also times every send and receive of the driver's rank.
3. A 4-layer MLP step pipelined over 2 stages on threads (4 micro-batches) vs the same model
   unsplit in one thread: one full-batch forward+backward, and the same 4 micro-batches one after
   the other (the fair baseline: the pipeline's own work, without the pipeline), medians. Once
   with torch's default intra-op threads and once with one: torch's intra-op thread count is
   process-wide, so every stage thread runs its kernels on that many threads, and stages sharing
   a CPU oversubscribe it (on CPU give each stage ``cores // stages`` threads).

    .venv/bin/python bench/overhead.py [--calls 200] [--steps 7] [--reps 5] [--hops]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.p2p_roundtrip import raw_round_trips  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402
from smpart.runtime.runtime import current_runtime  # noqa: E402

PINS = {"": 0, "local": 0, "remote": 1}


class Tiny(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.scale


class PingPong(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.local = Tiny(width)
        self.remote = Tiny(width)
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


def round_trip(calls: int, steps: int, hops: bool = False, width: int = 4) -> tuple[float, list[str]]:
    """Seconds per round trip on threads, and (with ``hops``) the lines of `hop_report`."""
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin=PINS)
    try:
        return _round_trip(calls, steps, hops, width, 1)
    finally:
        smpart.shutdown()


def _round_trip(calls: int, steps: int, hops: bool, width: int, rows: int) -> tuple[float, list[str]]:
    net = PingPong(width)
    model = smpart.DistributedModel(net)
    x = torch.randn(rows, width)
    net.calls = calls
    train_step(model, x)  # place, warm up
    net.calls = 0
    base = timed_steps(model, x, steps)
    net.calls = calls
    loaded = timed_steps(model, x, steps)
    report = hop_report(model, x) if hops else []
    return (loaded - base) / calls, report


def hop_report(model, x) -> list[str]:
    """One more step with every send and every message a stage server (or a driver) takes timestamped:
    per pair of consecutive events, the median gap (send -> received: the hop, wake-up included;
    received -> sent: the processing in between). Timestamping adds ~1 µs per event."""
    transport = current_runtime().transport
    log: list[tuple[float, str]] = []
    send, receive = transport.send, transport.receive
    handlers = {address: endpoint.handler for address, endpoint in transport.endpoints.items()}

    def timed_send(src, address, message):
        log.append((time.perf_counter(), "sent " + type(message).__name__))
        send(src, address, message)

    def timed_receive(address, timeout):
        message = receive(address, timeout)
        if message is not None:
            log.append((time.perf_counter(), "received " + type(message).__name__))
        return message

    def timed_handler(handler):
        def handle(message):
            log.append((time.perf_counter(), "received " + type(message).__name__))
            handler(message)
        return handle

    transport.send, transport.receive = timed_send, timed_receive  # instance attributes: the servers
    for address, handler in handlers.items():                       # look them up at every call
        transport.endpoints[address].handler = timed_handler(handler)
    try:
        train_step(model, x)
    finally:
        del transport.send, transport.receive
        for address, handler in handlers.items():
            transport.endpoints[address].handler = handler
    gaps: dict[tuple[str, str], list[float]] = {}
    for (t0, a), (t1, b) in itertools.pairwise(log):
        gaps.setdefault((a, b), []).append(t1 - t0)
    lines = [f"    {a:>26} -> {b:<26} {statistics.median(times) * 1e6:7.1f}  x{len(times)}"
             for (a, b), times in sorted(gaps.items(), key=lambda kv: -sum(kv[1])) if len(times) >= 10]
    return ["  per hop (median µs, count):", *(lines or ["    none"])]


# ================================================================ round trips on 2 processes
WIDTH = 256


def smpart_rank(rank: int, calls: int, steps: int, hops: bool) -> tuple[float, list[str]]:
    """On every rank of the pool: smpart's round trip between 2 processes (rank 0's figure counts)."""
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin=PINS, timeout_s=120)
    try:
        return _round_trip(calls, steps, hops, WIDTH, 1)
    finally:
        smpart.shutdown()


def raw_rank(rank: int, rounds: int) -> list[float]:
    """``dist.send`` + ``dist.recv`` of a 1x256 float32 tensor 0 -> 1 -> 0 on the default group."""
    dist.barrier()
    return raw_round_trips(rank, rounds, torch.randn(1, WIDTH))


@dataclass
class Echo:
    index: int
    tensor: torch.Tensor


def transport_rank(rank: int, rounds: int) -> list[float]:
    """smpart's `ProcessTransport` alone (no runtime): the tensor in a small dataclass, echoed."""
    from smpart.runtime.wire.processes import ProcessTransport

    group = dist.new_group(backend="gloo")
    transport = ProcessTransport(rank, 2, group, timeout_s=60)
    x = torch.randn(1, WIDTH)
    times = []
    try:
        for i in range(rounds):
            if rank == 0:
                started = time.perf_counter()
                transport.send(1, Echo(i, x))
                reply = transport.receive(0, 30.0)
                times.append(time.perf_counter() - started)
                assert reply is not None and reply.index == i
            else:
                message = transport.receive(1, 30.0)
                assert message is not None
                transport.send(0, message)
    finally:
        transport.close()
    return times


def process_round_trips(calls: int, steps: int, reps: int, hops: bool) -> dict[str, list[float]]:
    """Alternating repetitions of the three round trips on one pool of 2 processes."""
    out: dict[str, list[float]] = {"smpart": [], "raw": [], "transport": []}
    report: list[str] = []
    with RankPool(2) as pool:
        for rep in range(reps):
            (rt, lines), (_, lines1) = pool.run(smpart_rank, calls, steps, hops and rep == reps - 1)
            out["smpart"].append(rt)
            if lines:
                report = [line.replace("per hop", "per hop on the driver's rank (stage 0)") for line in lines]
                report += [line.replace("per hop", "per hop on rank 1 (stage 1)") for line in lines1]
            out["raw"].append(statistics.median(pool.run(raw_rank, 500)[0]))
            out["transport"].append(statistics.median(pool.run(transport_rank, 500)[0]))
    out["hops"] = report  # type: ignore[assignment]
    return out


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
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions of the process figures")
    parser.add_argument("--hops", action="store_true", help="also print where a round trip's time goes")
    a = parser.parse_args()
    rt, hops = round_trip(a.calls, a.steps, a.hops)
    print(f"threads: cross-stage forward+backward round trip (4 floats): {rt * 1e6:.0f} µs  (goal < 100 µs)")
    for line in hops:
        print(line)
    rt256, _ = round_trip(a.calls, a.steps, False, WIDTH)
    print(f"threads: cross-stage forward+backward round trip (1x256 float32): {rt256 * 1e6:.0f} µs")
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    p = process_round_trips(a.calls, a.steps, a.reps, a.hops)
    torch.set_num_threads(default_threads)
    smp, raw, tr = (statistics.median(p[k]) for k in ("smpart", "raw", "transport"))
    print(f"2 processes (gloo), 1x256 float32, medians of {a.reps} alternating repetitions:")
    print(f"  smpart forward+backward round trip   {smp * 1e6:7.0f} µs  (each rep: "
          f"{', '.join(f'{v * 1e6:.0f}' for v in p['smpart'])})")
    print(f"  dist.send + dist.recv, there and back {raw * 1e6:7.0f} µs  (each rep: "
          f"{', '.join(f'{v * 1e6:.0f}' for v in p['raw'])})")
    print(f"  ProcessTransport echo (no runtime)   {tr * 1e6:7.0f} µs")
    print(f"  smpart / raw: {smp / raw:.2f}  (goal <= 2: a forward+backward round trip is 4 messages, "
          f"the raw one 2);  smpart / (2 x transport echo): {smp / (2 * tr):.2f}")
    for line in p["hops"]:
        print(line)
    print("MLP 4x1024, batch 256, 4 micro-batches, 2 stages on threads (both on this CPU), "
          "median step times:")
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
