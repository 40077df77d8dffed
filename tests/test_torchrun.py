"""The same user script, launched with ``python`` (threads) and with the real ``torchrun`` (one
process per stage), trains to the same loss. Both run as subprocesses with a hard timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def _final_loss(command: list[str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return float(re.search(r"final loss ([0-9.]+)", done.stdout).group(1))


@pytest.mark.timeout(300)
def test_the_example_script_trains_alike_on_threads_and_under_torchrun():
    script = ["-m", "examples.train_gpt", "--steps", "8"]
    threads = _final_loss([sys.executable, *script, "--stages", "2"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()), *script]
    processes = _final_loss(torchrun)
    assert abs(threads - processes) <= 1e-5, (threads, processes)
