"""The same user script, launched with ``python`` (threads) and with the real ``torchrun`` (one
process per stage), learns, and trains to the same loss. Both run as subprocesses with a hard
timeout (`tests.launch.run_scripts`)."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from examples.models import gpt2
from tests.launch import free_port, run_scripts, torchrun_command

SCRIPT = ["-m", "examples.train_gpt", "--steps", "8"]


def _losses(output: str) -> tuple[float, float]:
    """The first step's loss and the final one, as the example script prints them."""
    first = float(re.search(r"step +0 +loss ([0-9.]+)", output).group(1))
    return first, float(re.search(r"final loss ([0-9.]+)", output).group(1))


def _run(command: list[str]) -> tuple[float, float]:
    done = run_scripts([command], timeout_s=240)[0]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _losses(done.stdout)


def _final_loss(command: list[str]) -> float:
    return _run(command)[1]


@pytest.mark.timeout(300)
def test_the_example_script_learns_alike_on_threads_and_under_torchrun(tmp_path):
    first, threads = _run([sys.executable, *SCRIPT, "--stages", "2", "--save", str(tmp_path / "threads.pt")])
    torchrun = torchrun_command([*SCRIPT, "--save", str(tmp_path / "torchrun.pt")], nproc_per_node=2)
    processes = _final_loss(torchrun)
    assert abs(threads - processes) <= 1e-5, (threads, processes)
    # Its sequences count up: 8 steps take the loss from log(64) = 4.16 to about 3.86.
    assert threads < first - 0.2, (first, threads)
    # What the first rank saved under torchrun is what the threads saved, and loads unsplit.
    saved, expected = torch.load(tmp_path / "torchrun.pt"), torch.load(tmp_path / "threads.pt")
    for key, value in expected["model"].items():
        assert torch.allclose(saved["model"][key], value, atol=1e-5), key
    assert saved["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    model = gpt2().model
    model.load_state_dict(saved["model"])
    torch.optim.AdamW(model.parameters(), lr=3e-3).load_state_dict(saved["optimizer"])


@pytest.mark.timeout(300)
def test_the_example_script_trains_alike_on_two_torchrun_nodes():
    """Two torchrun agents, as on two machines (both on this one): 2 processes each, one stage
    per process. The ranks of the second node are 2 and 3, their local ranks 0 and 1."""
    port = free_port()
    script = [*SCRIPT[:-1], "3"]  # fewer steps than the learning test: this one is about the layout
    nodes = run_scripts([torchrun_command([*script, "--stages", "4"], nproc_per_node=2, port=port, nnodes=2,
                                          node_rank=node) for node in (0, 1)], timeout_s=240)
    outputs = [node.stdout + node.stderr for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    for node, output in enumerate(outputs):  # (rank, local rank, stage) of each process of the node
        found = sorted(tuple(map(int, seen)) for seen in
                       re.findall(r"rank (\d+) \(local rank (\d+)\) runs stage (\d+)", output))
        assert found == [(2 * node + local, local, 2 * node + local) for local in (0, 1)], output[-3000:]
    processes = _losses(outputs[0])[1]
    threads = _final_loss([sys.executable, *script, "--stages", "4"])
    assert abs(threads - processes) <= 1e-5, (threads, processes)


@pytest.mark.timeout(120)
def test_the_first_rank_alone_saves_the_state_dict_after_the_others_scripts_ended(tmp_path):
    """``if smpart.rank() == 0: torch.save(model.state_dict(), path)`` after the last step: the other
    rank's script ends meanwhile, and smpart's shutdown at its exit answers before it goes."""
    out = tmp_path / "state.pt"
    done = run_scripts([torchrun_command(["-m", "tests.torchrun_save", str(out)], nproc_per_node=2)],
                       timeout_s=100)[0]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = torch.load(out)
    assert saved["keys"] == saved["expected_keys"]
    assert saved["worst"] <= 1e-12, saved["worst"]
