"""A yardstick: the MLP pipelined with one thread per rank over smpart's own `ProcessTransport`.

`bench/processes.py` runs it beside smpart and torch. It asks: how fast could smpart's runtime be
on this transport, with smpart's semantics, if a rank did all its work on one thread, as torch's
schedules do? It keeps what smpart keeps and drops only the runtime:

- the same transport: every message a pickled dataclass, received by the transport's receiver
  thread and read from its inbox;
- the same order of work: each stage runs smpart's action list for the schedule
  (`smpart.runtime.schedule`), e.g. ``F0 F1 B0 F2 B1 F3 B2 B3`` on the last of 2 stages under 1f1b;
- the same place for the loss: the first stage's rank computes it, as smpart's step body does,
  so a micro-batch makes 4 messages (activation, logits back, their gradient, the input's
  gradient) where torch's makes 2.

What it drops is everything the runtime does to run any model: no drivers, jobs, turns, handles
or credit; the split, the messages and their order are written out for this MLP. The
first stage's rank computes a loss as soon as its logits arrive: before each action, and while it
waits for an action's input.

    .venv/bin/python bench/one_thread.py [--rounds 3] [--steps 7] [--warmup 3]

runs it against torch's ``Schedule1F1B`` alone (alternating, on the same 2 processes);
`bench/processes.py` runs it beside everything else.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mlp_pipeline import MICROBATCHES, Halves, make_batch, make_model, run_torch, timed  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402
from smpart.runtime.schedule import FORWARD, schedule_named  # noqa: E402
from smpart.runtime.wire.processes import ProcessTransport  # noqa: E402

ACTIVATION, LOGITS, LOSS_GRADIENT, INPUT_GRADIENT = "activation", "logits", "loss gradient", "input gradient"
WAIT_S = 60.0


@dataclass


class Message:
    kind: str
    microbatch: int
    tensor: torch.Tensor


class OneThreadStage:
    """One rank of the 2-stage pipeline: its half of the model, its actions, its inbox."""

    def __init__(self, rank: int, module: nn.Module, transport: ProcessTransport, schedule: str,
                 microbatches: int) -> None:
        self.rank = rank
        self.module = module
        self.transport = transport
        self.actions = schedule_named(schedule).actions(rank, 2, microbatches)
        self.arrived: dict[tuple[str, int], torch.Tensor] = {}

    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        outputs: dict[int, torch.Tensor] = {}
        received: dict[int, torch.Tensor] = {}
        for action in self.actions:
            i = action.microbatch
            if self.rank == 0:
                self._take_arrived(targets, timeout=0.0)
                if action.kind == FORWARD:
                    outputs[i] = self.module(inputs[i])
                    self._send(ACTIVATION, i, outputs[i].detach())
                else:
                    outputs.pop(i).backward(self._wait(INPUT_GRADIENT, i, targets))
            elif action.kind == FORWARD:
                received[i] = self._wait(ACTIVATION, i).requires_grad_()
                outputs[i] = self.module(received[i])
                self._send(LOGITS, i, outputs[i].detach())
            else:
                outputs.pop(i).backward(self._wait(LOSS_GRADIENT, i))
                self._send(INPUT_GRADIENT, i, received.pop(i).grad)

    def _send(self, kind: str, microbatch: int, tensor: torch.Tensor) -> None:
        self.transport.send(1 - self.rank, Message(kind, microbatch, tensor))

    def _wait(self, kind: str, microbatch: int, targets: list[torch.Tensor] | None = None) -> torch.Tensor:
        while (kind, microbatch) not in self.arrived:
            if not self._take_arrived(targets, timeout=WAIT_S):
                raise TimeoutError(f"rank {self.rank}: no {kind} of micro-batch {microbatch} in {WAIT_S} s")
        return self.arrived.pop((kind, microbatch))

    def _take_arrived(self, targets: list[torch.Tensor] | None, timeout: float) -> bool:
        """Take what arrived (waiting up to ``timeout`` for one message; False if none came); on
        the first stage's rank, logits become a loss at once and their gradient goes back."""
        message = self.transport.receive(self.rank, timeout)
        if message is None:
            return False
        while message is not None:
            if message.kind == LOGITS and targets is not None:
                logits = message.tensor.requires_grad_()
                # smpart's default: the step's gradient is the mean over its micro-batches
                (F.cross_entropy(logits, targets[message.microbatch]) / len(targets)).backward()
                self._send(LOSS_GRADIENT, message.microbatch, logits.grad)
            else:
                self.arrived[(message.kind, message.microbatch)] = message.tensor
            message = self.transport.receive(self.rank, 0.0)
        return True


def run(rank: int, first: nn.Module, second: nn.Module, x: torch.Tensor, y: torch.Tensor, schedule: str,
        microbatches: int, timed: Any) -> Any:
    """Train on ``x, y`` with SGD, ``first`` on rank 0 and ``second`` on rank 1, on a transport of
    its own; ``timed(one_step)`` measures (and returns what it returns)."""
    module = first if rank == 0 else second
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    group = dist.new_group(backend="gloo")
    transport = ProcessTransport(rank, 2, group, heartbeat_s=0)
    stage = OneThreadStage(rank, module, transport, schedule, microbatches)
    inputs, targets = list(x.chunk(microbatches)), list(y.chunk(microbatches))

    def one_step() -> None:
        stage.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()

    try:
        dist.barrier()
        result = timed(one_step)
        dist.barrier()  # every rank has measured before any closes (a closed peer's receiver ends)
        return result
    finally:
        transport.close()
        dist.destroy_process_group(group)


def run_one_thread(rank: int, schedule: str, warmup: int, steps: int) -> dict[str, Any]:
    """The yardstick of `bench.one_thread`: smpart's transport and order of work, one thread a rank."""
    halves = Halves(make_model())
    usage: dict[str, Any] = {}
    times = run(rank, halves.first, halves.second, *make_batch(), schedule, MICROBATCHES,
                lambda one_step: timed(one_step, warmup, steps, usage))
    return {"times": times, **usage}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    a = parser.parse_args()
    medians: dict[str, list[float]] = {"one thread/rank": [], "torch Schedule1F1B": []}
    runs = {"one thread/rank": run_one_thread, "torch Schedule1F1B": run_torch}
    with RankPool(2) as pool:
        for r in range(a.rounds):
            for name in sorted(runs, reverse=r % 2 == 1):
                times = pool.run(runs[name], "1f1b", a.warmup, a.steps)[0]["times"]
                medians[name].append(statistics.median(times))
    paired = [ours / theirs for ours, theirs in zip(*medians.values(), strict=True)]
    for name, values in medians.items():
        print(f"{name:<20} median step {statistics.median(values) * 1e3:7.1f} ms")
    print(f"one thread/rank / torch Schedule1F1B, round by round: {', '.join(f'{r:.3f}' for r in paired)} "
          f"(median {statistics.median(paired):.3f})")


if __name__ == "__main__":
    main()
