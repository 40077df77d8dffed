"""Round-trip latency: torch's own dist.send/recv against ProcessTransport, 2 gloo processes.

    .venv/bin/python bench/p2p_roundtrip.py [--rounds N]

(a) rank 0 sends a 1x256 float32 tensor to rank 1 with dist.send, rank 1 sends it back; (b) the
same tensor inside a small dataclass through ProcessTransport, echoed by rank 1; (c) the same
tensor as a replayed step program sends it (`smpart.runtime.program.routes`): its bytes and a
flag byte in one isend on a `DirectChannel`, into a receive posted before the other side sends,
waited for on the caller's thread. Prints the medians in microseconds and the ratios to (a).
Figures, not asserts (see DESIGN.md: bench/).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smpart.runtime.wire.direct import DirectChannel
from smpart.runtime.wire.processes import ProcessTransport

BLOCKS = 20
TAG = 0x20000000


@dataclass
class Activation:
    microbatch: int
    stage: int
    tensor: torch.Tensor


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def raw_round_trips(rank: int, rounds: int, x: torch.Tensor) -> list[float]:
    """``dist.send`` + ``dist.recv`` of ``x`` 0 -> 1 -> 0, ``rounds`` times; rank 0's seconds each."""
    buffer = torch.empty_like(x)
    times = []
    for _ in range(rounds):
        if rank == 0:
            started = time.perf_counter()
            dist.send(x, 1)
            dist.recv(buffer, 1)
            times.append(time.perf_counter() - started)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
    return times


def _through(rank: int, rounds: int, x: torch.Tensor, transport: ProcessTransport) -> list[float]:
    times = []
    for i in range(rounds):
        if rank == 0:
            started = time.perf_counter()
            transport.send(1, Activation(i, 0, x))
            reply = transport.receive(0, 30.0)
            times.append(time.perf_counter() - started)
            assert reply is not None and reply.microbatch == i
        else:
            message = transport.receive(1, 30.0)
            assert message is not None
            transport.send(0, message)
    return times


def _direct(rank: int, rounds: int, x: torch.Tensor, channel: DirectChannel) -> list[float]:
    flag = torch.zeros(1, dtype=torch.uint8)
    size = x.numel() * x.element_size() + 1
    peer = 1 - rank
    times = []
    for _ in range(rounds):
        buffer = torch.empty(size, dtype=torch.uint8)
        posted = channel.receive(peer, buffer, TAG)
        if rank == 0:
            started = time.perf_counter()
            sent = channel.send(peer, torch.cat((x.reshape(-1).view(torch.uint8), flag)), TAG)
            channel.wait(posted, peer, "the echo")
            reply = buffer[:-1].view(x.dtype).view(x.shape)
            times.append(time.perf_counter() - started)
            assert int(buffer[-1]) == 0 and bool((reply == x).all())
        else:
            channel.wait(posted, peer, "the tensor")
            sent = channel.send(peer, buffer, TAG)
        channel.wait(sent, peer, "a send")
    return times


def _worker(rank: int, port: int, rounds: int, results) -> None:
    """Alternates blocks of (a) and (b), so that a change in the machine's load hits both alike.
    Both use the default group: torch's sends use tag 0, the transport its own tags."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    transport = ProcessTransport(rank, 2, dist.group.WORLD)
    channel = DirectChannel(dist.new_group(backend="gloo"), rank, 30.0, transport)
    x = torch.randn(1, 256)
    raw: list[float] = []
    through: list[float] = []
    direct: list[float] = []
    try:
        block = max(1, rounds // BLOCKS)
        raw_round_trips(rank, block, x)  # warm-up
        _through(rank, block, x, transport)
        _direct(rank, block, x, channel)
        for _ in range(BLOCKS):
            raw += raw_round_trips(rank, block, x)
            through += _through(rank, block, x, transport)
            direct += _direct(rank, block, x, channel)
        if rank == 0:
            results.put((raw, through, direct))
    finally:
        transport.close()
        channel.close()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    rounds = parser.parse_args().rounds
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, rounds, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    raw, through, direct = results.get(timeout=600)
    for proc in procs:
        proc.join(60)
    a = statistics.median(raw) * 1e6
    b = statistics.median(through) * 1e6
    c = statistics.median(direct) * 1e6
    load = os.getloadavg()[0]
    print(f"round trip 0 -> 1 -> 0 of a 1x256 float32 tensor, gloo, {len(raw)} rounds each, medians")
    print(f"  ({os.cpu_count()} cores, load average {load:.1f} at the end: a busy machine makes them noisy)")
    print(f"  (a) dist.send + dist.recv        {a:9.1f} us")
    print(f"  (b) ProcessTransport (dataclass) {b:9.1f} us")
    print(f"  (c) DirectChannel (bytes + flag) {c:9.1f} us")
    print(f"  b/a                              {b / a:9.2f}")
    print(f"  c/a                              {c / a:9.2f}")


if __name__ == "__main__":
    main()
