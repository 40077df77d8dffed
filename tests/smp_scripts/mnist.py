"""An SMP v1 training script as SMP's documentation wrote them (its MNIST example's shape), with
``import smdistributed.modelparallel.torch as smp`` changed to ``import smpart.smp as smp``.

The data is MNIST-shaped noise with a learnable rule (the class is the brightest of ten bands),
made from a seed, so the script runs offline. ``main(argv)`` returns what rank 0 saw: each step's
loss, the test loss, and the final state dict. ``python -m tests.smp_scripts.mnist`` or under
``torchrun``; the SMP configuration comes from ``--smp '{"partitions": 2, ...}'`` or, as on
SageMaker, from ``SM_HP_MP_PARAMETERS``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import smpart.smp as smp


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 2)
        self.conv2 = nn.Conv2d(8, 16, 3, 2)
        self.dropout1 = nn.Dropout(dropout)
        self.fc1 = nn.Linear(16 * 6 * 6, 32)
        self.dropout2 = nn.Dropout(dropout)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), 1)


def dataset(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 1, 28, 28, generator=generator)
    labels = images[:, 0, :20, :].reshape(count, 10, -1).mean(-1).argmax(-1)
    return images, labels


# smdistributed: define smp.step; return what is needed outside it.
@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()
    pred = output.argmax(dim=1, keepdim=True)
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smp", default=None,
                        help="SMP's configuration (JSON); default: SM_HP_MP_PARAMETERS")
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args(argv)

    smp.init(json.loads(args.smp) if args.smp else None)
    torch.manual_seed(1)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)

    images, labels = dataset(0, args.batch_size * smp.dp_size() * args.steps)
    losses = []
    model.train()
    for step in range(args.steps):
        first = (step * smp.dp_size() + smp.dp_rank()) * args.batch_size
        data, target = images[first:first + args.batch_size], labels[first:first + args.batch_size]
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        loss = loss_mb.reduce_mean()
        optimizer.step()
        losses.append(smp.allgather(loss.item(), smp.DP_GROUP))

    model.eval()
    test_images, test_labels = dataset(1, 16)
    with torch.no_grad():
        test_loss, correct = test_step(model, test_images, test_labels)
    result = {"losses": losses, "test_loss": sum(test_loss) / len(test_labels),
              "correct": sum(correct), "state": model.state_dict()}
    smp.barrier()
    return result


if __name__ == "__main__":
    out = main()
    if smp.rank() == 0:
        print(json.dumps({"losses": out["losses"], "test_loss": out["test_loss"]}))
