"""How the tests start ranks, the only way they do: a free port, a hard deadline, every process
joined (and killed if it overstays).

- `run_ranks(fn, world_size, *args)`: a function on N processes as ``torchrun`` would start
  them, gloo on the CPU; what almost every multi-process test uses.
- `run_scripts(commands)` with `torchrun_command(...)`: the real ``torchrun`` (or ``python``) on a
  user's script, for the tests of that path itself; each command runs in a session of its own,
  so a deadline stops an agent together with its workers.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, *args)`` in each of ``world_size`` fresh
processes with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set,
and returns, per rank, a `RankResult`: what ``fn`` returned or the text of what it raised, and
the process's exit code. Ranks in ``stray`` hang on purpose: they are killed once every other
rank has reported or ended.

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
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Collection
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
    #: Whether ``fn`` returned or raised (a rank that died or hung did neither).
    reported: bool = False
    #: Whether it was still running at the deadline (and killed then); stray ranks never are.
    overstayed: bool = False


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
        # Pickled here, by value: the queue's own pickler would share tensors through this
        # process (gone by the time they are read), and refuse some (a non-leaf needing grad)
        # in a feeder thread whose error nobody sees.
        results.put((rank, pickle.dumps(fn(rank, *args)), None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        import smpart

        with contextlib.suppress(Exception):  # the result is what matters
            smpart.shutdown()


def run_ranks(fn: Any, world_size: int, *args: Any, timeout_s: float = 120.0,
              env: dict[str, str] | None = None, stray: Collection[int] = ()) -> list[RankResult]:
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
    awaited = [rank for rank in range(world_size) if rank not in stray]
    received = 0
    while received < len(awaited) and time.monotonic() < deadline:
        try:
            rank, value, error = results.get(timeout=0.2)
        except queue.Empty:  # check whether everyone awaited died silently
            if all(not procs[r].is_alive() for r in awaited) and results.empty():
                break
            continue
        try:
            out[rank].value = None if value is None else pickle.loads(value)
        except Exception as err:  # noqa: BLE001 - e.g. a class this process cannot import
            error = error or f"its result could not be read back: {type(err).__name__}: {err}"
        out[rank].error, out[rank].reported = error, True
        received += rank in awaited
    for rank in stray:
        procs[rank].kill()
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            out[rank].overstayed = True
            proc.kill()
            proc.join(5)
    for rank, proc in enumerate(procs):
        out[rank].exitcode = proc.exitcode
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
    failed = [r for r in results if r.error is not None or r.exitcode != 0 or not r.reported]
    assert not failed, "\n".join(f"rank {r.rank} (exit {r.exitcode}): {r.error or 'no result came back'}"
                                  for r in failed)
    return [r.value for r in results]


# ==================================================================== the real torchrun
ROOT = Path(__file__).resolve().parents[1]
#: What a script runs with: one intra-op thread a process, the repository importable.
SCRIPT_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@dataclass
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str


def torchrun_command(args: list[str], *, nproc_per_node: int, port: int | None = None, nnodes: int = 1,
                     node_rank: int = 0) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``) on ``args``, on a free port unless given
    (the nodes of one job share theirs)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank",
            str(node_rank), "--nproc-per-node", str(nproc_per_node), "--master-addr", "127.0.0.1",
            "--master-port", str(port or free_port()), *args]


def run_scripts(commands: list[list[str]], *, timeout_s: float) -> list[ScriptRun]:
    """Run the commands at once (the nodes of one job, or one script) and wait for all of them.

    Each runs in the repository with `SCRIPT_ENV`, in a session of its own; its output goes to
    files, so no full pipe stalls a node that the others wait for. At the deadline, or when a
    command ended, its whole process group (a torchrun agent and its workers) is stopped.
    """
    env = {**os.environ, **SCRIPT_ENV}
    with tempfile.TemporaryDirectory(prefix="smpart-scripts-") as folder:
        outputs = [(Path(folder) / f"{i}.out", Path(folder) / f"{i}.err") for i in range(len(commands))]
        procs: list[subprocess.Popen] = []
        timed_out: set[int] = set()
        try:
            for command, (out, err) in zip(commands, outputs, strict=True):
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=stdout, stderr=stderr,
                                                  start_new_session=True))
            deadline = time.monotonic() + timeout_s
            for i, proc in enumerate(procs):
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out.add(i)
        finally:
            for proc in procs:
                _stop_group(proc)
        runs = []
        for i, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
            note = f"\n[timed out after {timeout_s:.0f} s]" if i in timed_out else ""
            runs.append(ScriptRun(proc.returncode, out.read_text(errors="replace"),
                                  err.read_text(errors="replace") + note))
        return runs


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop ``proc``'s session: SIGTERM first (a torchrun agent stops its workers), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):  # whatever of the session outlived its leader
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
