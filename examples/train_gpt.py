"""Train the zoo GPT with smpart: the same script on a laptop and on a cluster.

    python -m examples.train_gpt --stages 2                       # every stage on threads
    torchrun --nproc-per-node 2 -m examples.train_gpt             # one process per stage
    torchrun --nproc-per-node 4 -m examples.train_gpt --stages 2  # 2 stages x 2 replicas
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 --master-port 29500 \
        -m examples.train_gpt --stages 4                          # on HOST0; node-rank 1 on the other

Each sequence counts up from a random token (mod the vocabulary), so there is something to learn
and the loss falls (on random tokens it would stay at log(vocab)). Prints the loss every few steps
(on the first rank) and the final loss as ``final loss <value>``; ``--save PATH`` saves the
model's and the optimizer's state dicts from the first rank, as a plain script would.
"""

from __future__ import annotations

import argparse
import os

import torch

import smpart
from examples.models import gpt2


def counting_batch(size: int, vocab: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` sequences of ``length`` tokens counting up from a random one (mod ``vocab``), and
    their next tokens, the targets. The same ``seed`` gives the same batch on every rank."""
    start = torch.randint(vocab, (size, 1), generator=torch.Generator().manual_seed(seed))
    counting = (start + torch.arange(length + 1)) % vocab
    return counting[:, :-1], counting[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parser.add_argument("--stages", type=int, default=world if world > 1 else 2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "simple", "interleaved"])
    parser.add_argument("--save", metavar="PATH", help="at the end, save the model's and the optimizer's "
                        "state dicts there (the unsplit model and its optimizer load them)")
    args = parser.parse_args()

    torch.manual_seed(0)  # every rank builds the same weights and draws the same batches
    example = gpt2()
    smpart.init(pipeline_parallel_degree=args.stages, microbatches=args.microbatches, pipeline=args.schedule)
    model = smpart.DistributedModel(example.model)
    optimizer = smpart.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))

    @smpart.step
    def train_step(model, tokens, targets):
        loss = example.loss(model(tokens), targets)
        model.backward(loss)
        return loss

    config = example.model.config
    replicas, replica = smpart.dp_size(), smpart.dp_rank()
    if smpart.size() > 1:
        print(f"rank {smpart.rank()} (local rank {smpart.local_rank()}) runs stage {smpart.pp_rank()} "
              f"of replica {replica}", flush=True)
    for step in range(args.steps):
        tokens, targets = counting_batch(8 * replicas, config.vocab_size, config.block_size, seed=step)
        mine = slice(8 * replica, 8 * (replica + 1))  # each data-parallel replica takes its share
        loss = train_step(model, tokens[mine], targets[mine]).reduce_mean()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if smpart.rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if smpart.rank() == 0:
        print(f"final loss {loss.item():.6f}", flush=True)
        if args.save:  # the other ranks send their stages' parts; their scripts need not wait here
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.save)
    smpart.shutdown()


if __name__ == "__main__":
    main()
