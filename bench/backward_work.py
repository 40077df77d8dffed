"""How much backward work a pipelined step does, against the unsplit model (goal: 1.00).

Every parameter's gradient is accumulated once per micro-batch per use in the unsplit model. When
a module's children are split between stages (a residual stream that crosses back and forth),
its gradient comes back in pieces; a stage that back-propagated each piece on its own walked the
graph upstream of it once per piece, and the blocks before the cut ran their backward several
times per micro-batch. Holding (`smpart.runtime.reference.gradients`) runs each part once. This counts
accumulations (``register_post_accumulate_grad_hook``) per step, split and unsplit, and prints
their ratio per module and its mean over the transformer blocks (where the matrix products are).

The partition is the one smpart picks for GPT-2 small at full size (``--batch`` sequences of 1024
tokens in 4 micro-batches, traced on the meta device); the run that counts uses the same module
tree at a tiny width (pinned to that partition), so it takes seconds on a CPU. Before holding, the
mean was 1.75 (2 stages) and 3.44-4.08 (4), and on a lent H200 the same partitions made GPT-2
small's GPU kernel time 1.38x and up to 2.13x the unsplit model's (``bench/RESULTS.md``).

    .venv/bin/python bench/backward_work.py [--stages 2 4] [--batch 16]
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from examples.models import gpt2_small  # noqa: E402

MICROBATCHES = 4
#: Steps before the one counted: a stage learns from each step how many gradient messages each
#: of its calls gets, and the counts settle as the other stages hold back too (4 stages: 4 steps).
WARMUP_STEPS = 5
#: ``lm_head.weight`` is ``wte.weight``: its two uses reach it in two passes here, in one unsplit.
TIED = "transformer.wte"
TINY = {"seq_len": 16, "vocab_size": 256, "n_embd": 32, "n_head": 2}


def full_size_partition(stages: int, batch: int) -> dict[str, int]:
    """Module -> stage, as smpart partitions GPT-2 small traced on one full-size micro-batch."""
    example = gpt2_small(device="meta")
    args, kwargs, _ = example.batch(batch // MICROBATCHES)
    tree = smpart.trace(example.model, args, kwargs, device="meta")
    return dict(smpart.partition(tree, stages).node_stage)


def accumulate_microbatches(model: torch.nn.Module, example, args: list, target: torch.Tensor) -> None:
    """The unsplit model's forward and backward over ``MICROBATCHES`` micro-batches one after the
    other, gradients averaged: the work a pipelined step does, without the pipeline."""
    for i in range(MICROBATCHES):
        piece = [a.chunk(MICROBATCHES)[i] for a in args]
        loss = example.loss(model(*piece), target.chunk(MICROBATCHES)[i])
        (loss / MICROBATCHES).backward()


def count_accumulations(model: torch.nn.Module, run) -> dict[str, int]:
    """How many times each parameter's gradient was accumulated while ``run()`` ran."""
    counts: collections.Counter = collections.Counter()
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.update([name]))
             for name, p in model.named_parameters()]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return dict(counts)


def unsplit_counts(example) -> dict[str, int]:
    model = copy.deepcopy(example.model)
    args, _, target = example.batch(2 * MICROBATCHES, seed=0)

    return count_accumulations(model, lambda: accumulate_microbatches(model, example, args, target))


def split_counts(example, stages: int, pins: dict[str, int]) -> dict[str, int]:
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, pipeline="1f1b", pin=pins)
    try:
        model = smpart.DistributedModel(copy.deepcopy(example.model))
        args, _, target = example.batch(2 * MICROBATCHES, seed=0)

        @smpart.step
        def step(model, args, target):
            loss = example.loss(model(*args), target)
            model.backward(loss)
            return loss

        for _ in range(WARMUP_STEPS):  # the first places the model; holding learns from the last
            step(model, args, target)
        model.zero_grad()
        return count_accumulations(model, lambda: step(model, args, target))
    finally:
        smpart.shutdown()


def _group(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith("transformer.h.") else ".".join(parts[:2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=16, help="full-size batch the partition is traced for")
    a = parser.parse_args()
    torch.set_num_threads(1)
    example = gpt2_small(**TINY)
    reference = unsplit_counts(example)
    for stages in a.stages:
        pins = full_size_partition(stages, a.batch)
        counts = split_counts(example, stages, pins)
        ratio = {name: counts.get(name, 0) / reference[name] for name in reference}
        by_group: dict[str, list[float]] = collections.defaultdict(list)
        for name, r in ratio.items():
            by_group[_group(name)].append(r)
        blocks = [max(v) for g, v in by_group.items() if g.startswith("transformer.h.")]
        print(f"GPT-2 small, {stages} stages (partition for batch {a.batch} x 1024, {MICROBATCHES} "
              f"micro-batches): backward passes per micro-batch, mean over the {len(blocks)} blocks: "
              f"{sum(blocks) / len(blocks):.2f}  (unsplit 1.00)")
        split_modules = sorted({n.rsplit(".", 1)[0] for n, s in pins.items() if "." in n and n.count(".") == 3
                                and s != pins.get(n.rsplit(".", 1)[0])})
        line = "  ".join(f"{g.replace('transformer.', '')} s{pins.get(g, '?')} x{max(v):.2f}"
                         + (" (the tied weight: one accumulation per use, not a repeat)" if g == TIED else "")
                         for g, v in by_group.items() if max(v) != 1.0)
        print(f"  modules whose backward repeats (stage, times per micro-batch): {line or 'none'}")
        print(f"  blocks split between stages: {', '.join(split_modules) or 'none'}")


if __name__ == "__main__":
    main()
