"""Run a function on N processes as ``torchrun`` would, for tests: gloo on the CPU, a free port,
a hard deadline, every process joined (and killed if it overstays).

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, *args)`` in each of ``world_size`` fresh
processes with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set,
and returns, per rank, a `RankResult`: what ``fn`` returned or the text of what it raised, and
the process's exit code.

The processes come from a fork server (`CONTEXT`) that imported torch once, so a rank starts in
a fraction of a second instead of the ~5 s a spawned interpreter spends importing torch (most of
the suite's time on two cores). The server has done nothing but import torch (and Hugging Face's
Trainer and the models the tests train, where installed): no threads, no CUDA, no process
group, so each rank is as fresh as a spawned one, with those modules already loaded.
Each rank gets the environment ``run_ranks`` was called in (a fork server's children would
otherwise have the server's, from when it started), plus ``env``. What a rank prints goes to a
file of its own, copied to this process's standard error once the ranks are joined, so it shows
under the test that launched them (a fork server's children would otherwise print wherever the
server's output went when it started).
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


#: Where every test's processes come from (see the module docstring).
CONTEXT = mp.get_context("forkserver")
#: Hugging Face's modules (when installed: a preload that fails to import is skipped) cost every
#: rank of the tests that train its models seconds of imports; loaded once, they start no thread.
CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor",
                                "transformers.trainer", "transformers.models.gpt2.modeling_gpt2",
                                "transformers.models.llama.modeling_llama"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn: Any, rank: int, world_size: int, port: int, results: Any, args: tuple, env: dict,
           output: str) -> None:
    printed = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(printed, 1)
    os.dup2(printed, 2)
    os.close(printed)
    os.environ.clear()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), **env})
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, fn(rank, *args), None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        import smpart

        with contextlib.suppress(Exception):  # the result is what matters
            smpart.shutdown()


def run_ranks(fn: Any, world_size: int, *args: Any, timeout_s: float = 120.0,
              env: dict[str, str] | None = None) -> list[RankResult]:
    ctx = CONTEXT
    results = ctx.Queue()
    port = free_port()
    # As torchrun's agent does: the parent hosts the rendezvous store, so a rank that destroys its
    # process group and initialises a new one (smpart.shutdown, then init) finds it still there.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
    env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", **(env or {})}
    printed = tempfile.TemporaryDirectory(prefix="smpart-ranks-")
    outputs = [os.path.join(printed.name, f"rank{rank}.txt") for rank in range(world_size)]
    procs = [ctx.Process(target=_child, args=(fn, rank, world_size, port, results, args, env, outputs[rank]),
                         daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    out = {rank: RankResult(rank) for rank in range(world_size)}
    deadline = time.monotonic() + timeout_s
    received = 0
    unreadable: list[str] = []
    while received < world_size and time.monotonic() < deadline:
        try:
            rank, value, error = results.get(timeout=0.2)
        except queue.Empty:  # check whether everyone died silently
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        except Exception as err:  # noqa: BLE001 - a result that did not unpickle (whose, unknown)
            unreadable.append(f"{type(err).__name__}: {err}")
            received += 1
            continue
        out[rank].value, out[rank].error = value, error
        received += 1
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    for rank, proc in enumerate(procs):
        out[rank].exitcode = proc.exitcode
        if unreadable and out[rank].value is None and out[rank].error is None:
            out[rank].error = f"a rank's result could not be read back: {unreadable}"
    del store
    _copy_to_stderr(outputs)
    printed.cleanup()
    return [out[r] for r in range(world_size)]


def _copy_to_stderr(outputs: list[str]) -> None:
    for rank, path in enumerate(outputs):
        with contextlib.suppress(OSError):  # a rank that never started wrote nothing
            text = Path(path).read_text(errors="replace")
            if text:
                sys.stderr.write(f"---- rank {rank} printed:\n{text}")


def values(results: list[RankResult]) -> list[Any]:
    """Every rank's value, or an AssertionError that shows what went wrong where."""
    failed = [r for r in results if r.error is not None or r.exitcode != 0]
    assert not failed, "\n".join(f"rank {r.rank} (exit {r.exitcode}): {r.error}" for r in failed)
    return [r.value for r in results]
