"""Sharded optimizer state (ZeRO stage 1, SMP's ``shard_optimizer_state=True``).

Data-parallel replicas hold the same parameters and, once gradients are averaged, the same
gradients, so each would run the same optimizer update on the same state. Instead each replica
*owns* a share of its stage's parameters (balanced by size, decided the same way on every
replica): its optimizer keeps state for, and updates, only those; then every parameter is
broadcast from its owner over the data-parallel group. Optimizer memory per rank drops by the
data-parallel degree; the cost is one broadcast of the parameters per step.

The broadcast waits at most ``timeout_s``: a replica that never comes to it (hung, or gone
without closing its connections) is named in the `SmpartError` (`smpart.distributed.attendance`).

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it builds its own optimizer from a
class and the parameters at construction, before smpart has placed the model (the user builds
the optimizer first), and broadcasts ``param.data``, which a tensor-parallel shard (a DTensor)
does not offer. Here the user's optimizer keeps running; only its parameter list shrinks.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from smpart.distributed.attendance import Attendance
from smpart.runtime.processes.data_parallel import OPTIMIZER, ordinal


class ShardedState:
    """The owner of each parameter among ``dp`` replicas, and the broadcast after a step."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: Any, dp: int,
                 attendance: Attendance | None = None, timeout_s: float = 1800.0) -> None:
        self.group = group
        self.dp = dp
        self.attendance = attendance or Attendance(dist.get_rank(), store=False)
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group)
        #: Every parameter this rank holds, in optimizer order (the optimizer keeps only its own).
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.device.type != "meta"]
        self.owner = owners([_local(p).numel() for p in self.params], dp)
        mine = {id(p) for p, o in zip(self.params, self.owner, strict=True) if o == self.rank}
        for group_ in optimizer.param_groups:
            group_["params"] = [p for p in group_["params"] if id(p) in mine]
        for p in list(optimizer.state):
            if id(p) not in mine:
                del optimizer.state[p]

    def broadcast(self, step: int = 0) -> None:
        """Every parameter from its owner to the other replicas (asynchronously, then wait), after
        the optimizer's step that followed step ``step`` (numbered from 0)."""
        mark, where = ordinal(step, OPTIMIZER), f"the sharded optimizer's broadcast after step {step + 1}"
        self.attendance.arrive(mark, where)
        works = [dist.broadcast(_local(p).data, self.ranks[owner], group=self.group, async_op=True)
                 for p, owner in zip(self.params, self.owner, strict=True)]
        deadline = time.monotonic() + self.timeout_s
        for work in works:
            self.attendance.wait(work, max(0.001, deadline - time.monotonic()), mark, where, self.ranks)


def owners(sizes: list[int], dp: int) -> list[int]:
    """Each parameter's owner: the largest first, each to the least loaded replica (ties: the
    lowest rank), so every replica computes the same assignment and the loads stay within one
    parameter of even."""
    load = [0] * dp
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        chosen = min(range(dp), key=lambda r: (load[r], r))
        owner[index] = chosen
        load[chosen] += sizes[index]
    return owner


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p
