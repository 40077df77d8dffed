"""`RankPool`: spawned processes in one gloo job, kept up between commands, for the process benches.

Every wait is bounded and `RankPool.close` joins (or kills) every process. `bench/processes.py`,
`bench/overhead.py`, `bench/pipeline_efficiency.py` and the other process benches launch with it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import smpart


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, inbox: Any, results: Any, idle_s: float,
           pin: bool = False) -> None:
    """A worker: join the gloo job, then run the commands the parent sends until told to stop.
    ``pin``: on a core of its own, before any thread starts (threads inherit their creator's)."""
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        while True:
            try:
                command = inbox.get(timeout=idle_s)
            except queue.Empty:
                return  # the parent went away without saying goodbye
            if command is None:
                return
            fn, args = command
            try:
                results.put((rank, fn(rank, *args), None))
            except BaseException as err:  # noqa: BLE001 - reported to the parent
                results.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
                return
    finally:
        with contextlib.suppress(Exception):
            smpart.shutdown()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _ready(rank: int) -> int:
    return rank


class RankPool:
    """``world_size`` spawned processes in one gloo job (the parent hosts the store, as torchrun's
    agent does), kept up between commands: ``pool.run(fn, *args)`` calls ``fn(rank, *args)`` on
    every rank (``fn`` must be a module-level function) and returns the per-rank results; every
    wait is bounded and `close` joins (or kills) every process.

    The pool is made only once every rank has joined the job: workers still importing torch
    would take the cores from whatever this process measures next (on 2 cores, 4 starting
    workers slowed a threaded pipeline measured meanwhile by ~20%)."""

    def __init__(self, world_size: int, idle_s: float = 900.0, pin: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        port = _free_port()
        self._store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
        self._results = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_serve, daemon=True, name=f"bench-rank-{r}",
                                   args=(r, world_size, port, self._inboxes[r], self._results, idle_s, pin))
                       for r in range(world_size)]
        for proc in self._procs:
            proc.start()
        try:
            self.run(_ready)
        except BaseException:
            self.close()
            raise

    def run(self, fn: Any, *args: Any, timeout_s: float = 300.0) -> list[Any]:
        for inbox in self._inboxes:
            inbox.put((fn, args))
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(out))
                raise TimeoutError(f"{fn.__name__}: ranks {missing} did not answer within {timeout_s:.0f} s")
            try:
                rank, value, error = self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{fn.__name__}: {dead} died") from None
                continue
            if error is not None:
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{error}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def close(self, timeout_s: float = 30.0) -> None:
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
