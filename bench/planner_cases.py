"""AMP's three experiment settings (NeurIPS 2022, §4.3 and appendix tables 6-11), re-planned by smpart.

    .venv/bin/python bench/planner_cases.py

For each setting: smpart's chosen plan and predicted time beside the paper's measured best, and
every strategy the paper lists (Megatron's and AMP's top 5) priced by smpart's cost model (each with
smpart's optimal stage boundaries), with the Spearman rank correlation between smpart's predictions
and the paper's measurements. Predictions use peak fp16 FLOP/s × `efficiency` (default 0.4); the
paper's testbeds ran far below that, so absolute times differ by a constant factor and the ranks
are what to compare. Models are traced in fp16 on the meta device, as the paper trained them
(DeepSpeed with fp16), so activation and memory-traffic bytes are those of fp16 tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smpart.planner import Cluster, Node, device_type, plan  # noqa: E402
from smpart.planner.cluster import GBPS  # noqa: E402
from smpart.planner.plan import seconds  # noqa: E402

# (micro-batch size, pp, tp, measured s/iter, source) from the paper's tables 6-11 and §4.5
HOMOGENEOUS = [
    (1, 1, 1, 1.32, "Megatron T6"), (2, 2, 1, 1.37, "Megatron T6"), (2, 1, 2, 1.58, "Megatron T6"),
    (4, 2, 1, 1.63, "Megatron T6"), (4, 1, 2, 1.53, "Megatron T6"),
    (1, 2, 1, 1.28, "AMP T7"), (1, 4, 1, 1.20, "AMP T7"), (1, 8, 1, 1.23, "AMP T7"),
    (2, 2, 1, 1.38, "AMP T7"), (1, 16, 1, 1.55, "AMP T7"),
]
HETERO_CLUSTER = [
    (2, 2, 1, 2.27, "Megatron T8"), (4, 2, 1, 2.32, "Megatron T8"), (8, 4, 1, 1.97, "Megatron T8"),
    (8, 2, 2, 2.43, "Megatron T8"), (16, 4, 2, 2.34, "Megatron T8"), (1, 1, 1, 2.72, "Megatron dp=16 §4.5"),
    (1, 4, 1, 1.47, "AMP T9"), (1, 8, 1, 1.28, "AMP T9"), (1, 16, 1, 1.52, "AMP T9"),
    (2, 4, 1, 1.52, "AMP T9"), (2, 8, 1, 1.54, "AMP T9"),
]
HETERO_MODEL = [
    (1, 1, 1, 1.89, "Megatron T10"), (2, 2, 1, 1.99, "Megatron T10"),
    (1, 4, 1, 1.07, "AMP T11"), (2, 4, 1, 1.08, "AMP T11"), (2, 16, 1, 1.13, "AMP T11"),
    (1, 16, 1, 1.30, "AMP T11"), (2, 8, 1, 1.39, "AMP T11"),
]


def gpt2_24_tree():
    from examples.models import gpt2
    from smpart.tensor_parallel import record_split_shares
    from smpart.tracing.tracer import trace

    ex = gpt2(n_layer=24, n_embd=1024, n_head=16, seq_len=1024, vocab_size=52256, batch_size=1, device="meta",
              dtype=torch.float16)
    return record_split_shares(trace(ex.model, ex.args, ex.kwargs, device="meta"), ex.model)


def transgan_tree():
    from examples.models import transgan
    from smpart.tensor_parallel import record_split_shares
    from smpart.tracing.tracer import trace

    ex = transgan(wide=1024, narrow=16, bottom_width=9, wide_heads=16, narrow_heads=1, batch_size=1,
                  device="meta", dtype=torch.float16)
    return record_split_shares(trace(ex.model, ex.args, ex.kwargs, device="meta"), ex.model)


def p3_8xlarge() -> Node:
    return Node(device_type("V100"), 4, 170 * GBPS)


def g4dn_12xlarge() -> Node:
    return Node(device_type("T4"), 4, 50 * GBPS)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        x = np.asarray(x)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for value in np.unique(x):  # ties share their average rank
            r[x == value] = r[x == value].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def run_case(console: Console, title: str, tree, cluster: Cluster, global_batch: int, paper: list) -> None:
    plans = plan(tree, cluster, global_batch, top=10_000)
    best = plans.best
    bounds = [*best.starts, len(best.layers)]
    console.rule(f"[bold]{title}[/bold]")
    console.print(f"{cluster.describe()}, global batch {global_batch}, {len(best.layers)} layers, "
                  f"{plans.searched} strategies priced in {plans.search_s:.2f} s")
    console.print(f"smpart's best: {best.summary()}, micro-batch size {best.microbatch_size}, "
                  f"stage boundaries {bounds}, stages on "
                  + ", ".join(s.describe() for s in best.stages))
    paper_best = min(paper, key=lambda row: row[3])
    console.print(f"paper's measured best: mbs={paper_best[0]} pp={paper_best[1]} tp={paper_best[2]} "
                  f"dp={cluster.num_devices // paper_best[1] // paper_best[2]}: {paper_best[3]} s/iter "
                  f"({paper_best[4]})")
    table = Table()
    for column in ("source", "mbs", "pp", "tp", "dp", "paper s/iter", "smpart predicted", "smpart rank"):
        table.add_column(column, justify="right")
    measured, predicted = [], []
    for mbs, pp, tp, seconds_paper, source in paper:
        dp = cluster.num_devices // pp // tp
        ranked = [(i, p) for i, p in enumerate(plans, 1)
                  if (p.pp, p.tp, p.dp, p.microbatch_size) == (pp, tp, dp, mbs)]
        if not ranked:
            table.add_row(source, str(mbs), str(pp), str(tp), str(dp), f"{seconds_paper:.2f}", "no fit", "-")
            continue
        rank, match = ranked[0]
        measured.append(seconds_paper)
        predicted.append(match.time_s)
        table.add_row(source, str(mbs), str(pp), str(tp), str(dp), f"{seconds_paper:.2f}",
                      seconds(match.time_s), f"{rank} of {len(plans)}")
    console.print(table)
    console.print(f"Spearman rank correlation, smpart predicted vs paper measured "
                  f"({len(measured)} strategies): {spearman(predicted, measured):.2f}")


def main() -> None:
    console = Console(width=120)
    gpt = gpt2_24_tree()
    run_case(console, "Homogeneous: GPT-2 (24 layers, h=1024) on 4 × g4dn.12xlarge (4 × T4), 50 Gb/s",
             gpt, Cluster([g4dn_12xlarge() for _ in range(4)], 50 * GBPS), 32, HOMOGENEOUS)
    mixed = Cluster([p3_8xlarge() for _ in range(3)] + [g4dn_12xlarge()], 10 * GBPS)
    run_case(console, "Heterogeneous cluster: GPT-2 on 3 × p3.8xlarge (4 × V100) + g4dn.12xlarge, 10 Gb/s",
             gpt, mixed, 32, HETERO_CLUSTER)
    run_case(console, "Heterogeneous model: TransGAN-like (12 × h=1024 then 12 × h=16) on 4 × p3.8xlarge",
             transgan_tree(), Cluster([p3_8xlarge() for _ in range(4)], 10 * GBPS), 64, HETERO_MODEL)


if __name__ == "__main__":
    main()
