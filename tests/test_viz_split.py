"""Both views of a partition say which modules tensor parallelism splits, and how.

The split comes from ``partition.meta["tensor_parallel"]`` (a plan's partition, or the runtime's
under tensor parallelism); a partition without it shows none, even though its tree records what
each degree would split, since the degree is unknown.
"""

from __future__ import annotations

import pytest
from rich.console import Console

import smpart
from examples.models import gpt2
from smpart.cli import main
from smpart.partitioning.api import partition
from smpart.partitioning.result import Partition
from smpart.planner.cluster import Cluster
from smpart.viz import show
from smpart.viz.html import explorer_data
from smpart.viz.split import describe, tensor_split

SPLIT = {"transformer.h.0.attn.c_attn": "column", "transformer.h.0.attn.c_proj": "row",
         "transformer.h.0.mlp.c_fc": "column", "transformer.h.0.mlp.c_proj": "row",
         "transformer.h.0.attn": "heads", "transformer.wpe": "vocab", "transformer.wte": "column+vocab"}
WHOLE = ("transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.ln_f")


@pytest.fixture(scope="module")
def tp_partition() -> Partition:
    """The zoo GPT's partition under the best plan with tensor parallelism 2 and two stages."""
    ex = gpt2()
    tree = smpart.trace(ex.model, ex.args, ex.kwargs)  # records what each degree splits
    plans = smpart.plan(tree, Cluster.homogeneous("A100-40", 1, 4), global_batch=8, tp_degrees=[2], top=50)
    best = next(p for p in plans.plans if p.tp == 2 and p.pp == 2)
    return best.partition


def shown(part: Partition, **kwargs) -> str:
    console = Console(record=True, width=200)
    show(part, console=console, **kwargs)
    return console.export_text()


def test_the_terminal_view_tags_split_modules_and_counts_them(tp_partition: Partition) -> None:
    text = shown(tp_partition)
    split = tp_partition.meta["tensor_parallel"]["split"]
    assert split.items() >= SPLIT.items() and not set(WHOLE) & set(split)
    lines = text.splitlines()
    block0 = lines.index(next(line for line in lines if " 0 Block" in line))
    block0_lines = lines[block0:block0 + 9]  # the first block is expanded: its 8 modules follow it
    for local, style in (("c_attn", "column"), ("attn", "heads"), ("c_fc", "column")):
        line = next(line for line in block0_lines if f" {local} " in line)
        assert line.rstrip().endswith(f"tp×2 {style}"), line
    assert sum("tp×2 row" in line for line in block0_lines) == 2  # attn.c_proj, mlp.c_proj
    for local in ("ln_1", "ln_2"):
        assert "tp×2" not in next(line for line in block0_lines if f" {local} " in line)
    assert "tp×2 column+vocab" in next(line for line in lines if "wte, lm_head" in line)
    assert "tp×2 vocab" in next(line for line in lines if " wpe " in line)
    assert "tp×2" not in next(line for line in lines if " ln_f " in line)
    assert "tp×2: 5 split inside" in next(line for line in lines if " 7 Block" in line)  # folded
    counts = tensor_split(tp_partition)
    assert counts is not None and len(counts.styles) == len(split) == 2 + 8 * 5
    assert f"tensor parallel ×2: {len(split)} modules split (column 17, row 16, heads 8, vocab 2)" in text
    assert "tp×2 split" in text  # the stage table's column
    per_stage = [sum(1 for n in split if tp_partition.node_stage[n] == s) for s in range(2)]
    for stage, count in enumerate(per_stage):
        row = next(line for line in lines if line.startswith(f"│ stage {stage}"))
        assert row.split("│")[3].strip() == str(count)


def test_without_the_plans_meta_nothing_is_shown_split(tp_partition: Partition) -> None:
    bare = Partition(tp_partition.tree, tp_partition.node_stage, 2, 0.8)
    assert bare.tree.node("transformer.h.0.mlp.c_fc").tp_split[2].split  # the tree knows, the degree not
    assert "tp×" not in shown(bare) and "tensor parallel" not in shown(bare)
    assert tensor_split(bare) is None and explorer_data(bare, grid=False)["base"]["tp"] is None
    plain = partition(bare.tree, 2)
    assert "tp×" not in shown(plain)


def test_the_html_data_carries_each_nodes_split(tp_partition: Partition) -> None:
    data = explorer_data(tp_partition, grid=False)
    tp, names = data["base"]["tp"], data["tree"]["name"]
    assert tp["degree"] == 2
    by_name = {names[int(i)]: style for i, style in tp["split"].items()}
    assert by_name == tp_partition.meta["tensor_parallel"]["split"]
    assert by_name.items() >= SPLIT.items() and not set(WHOLE) & set(by_name)
    assert tp["explain"]["column"] == describe("column", 2)
    assert "each rank holds 1/2 of the weight" in tp["explain"]["column"]
    assert "column: " in tp["explain"]["column+vocab"] and "vocab: " in tp["explain"]["column+vocab"]
    assert tp["summary"].startswith("tensor parallel ×2: 42 modules split")


def test_a_module_name_in_the_meta_counts_for_its_node(tp_partition: Partition) -> None:
    """The runtime and hand-made metas may name any module of a node (``lm_head`` of the tied pair)."""
    meta = {"degree": 4, "split": {"lm_head": "column", "transformer.wte": "vocab", "nowhere": "row",
                                   "transformer.ln_f": ""}}
    part = Partition(tp_partition.tree, tp_partition.node_stage, 2, 0.8, meta={"tensor_parallel": meta})
    assert tensor_split(part).styles == {"transformer.wte": "column+vocab"}
    assert "split 4 ways by columns" in describe("column", 4)


def test_smpart_show_prints_a_saved_plans_split(tp_partition: Partition, tmp_path, capsys) -> None:
    path = tmp_path / "plan-part.json"
    tp_partition.to_json(str(path))
    assert main(["show", str(path), "--max-depth", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp×2 column+vocab" in out and "tensor parallel ×2: 42 modules split" in out
