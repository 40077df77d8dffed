"""A script for `tests.test_torchrun`: under ``torchrun``, the first rank alone saves
``model.state_dict()`` after the last step, while the other ranks' scripts have ended (smpart shuts
down at their exit, and answers first). It saves the state and how far it is from the unsplit
model trained alike.

    torchrun --nproc-per-node 2 -m tests.torchrun_save OUT.pt
"""

from __future__ import annotations

import copy
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import smpart


@smpart.step
def train_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def main(path: str) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    reference = copy.deepcopy(module)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    model = smpart.DistributedModel(module)
    optimizer = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g,
                                                                                dtype=torch.float64)
        train_step(model, x, y)
        optimizer.step()
        optimizer.zero_grad()
        (sum(F.mse_loss(reference(a), b) for a, b in zip(x.chunk(2), y.chunk(2), strict=True)) / 2).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    if smpart.rank() == 0:
        time.sleep(1.0)  # the other rank's script has ended by now
        state = model.state_dict()
        worst = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        torch.save({"keys": list(state), "expected_keys": list(reference.state_dict()), "worst": worst}, path)


if __name__ == "__main__":
    main(sys.argv[1])
