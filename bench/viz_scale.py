"""How long the explorer takes to build for GPT-3 175B, and how big the file is.

Traces GPT-3 175B on the meta device (no weights allocated), cuts it into 8 stages, then times
`smpart.viz.to_html` with the full default grid (memory_weight 0.0..1.0 by 0.1 × 1..8 stages:
88 partitions computed and embedded). Goals: under 10 s and under 5 MB.

    .venv/bin/python bench/viz_scale.py [--out gpt3.html]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from examples.models import gpt3_175b  # noqa: E402
from smpart.partitioning.api import partition  # noqa: E402
from smpart.tracing.tracer import trace  # noqa: E402
from smpart.viz import to_html  # noqa: E402

GOAL_SECONDS = 10.0
GOAL_BYTES = 5 * 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="keep the page here (default: a temporary file)")
    args = parser.parse_args()
    out = args.out or os.path.join(tempfile.mkdtemp(), "gpt3_175b.html")

    ex = gpt3_175b()
    started = time.perf_counter()
    tree = trace(ex.model, ex.args, ex.kwargs, device="meta")
    traced = time.perf_counter() - started

    part = partition(tree, 8, memory_weight=0.8)
    part.meta["model"] = "GPT-3 175B"
    started = time.perf_counter()
    to_html(part, out)
    generated = time.perf_counter() - started
    size = os.path.getsize(out)

    table = Table(title=f"explorer for GPT-3 175B ({len(tree)} nodes, 88-partition grid)")
    for column in ("figure", "value", "goal"):
        table.add_column(column)
    table.add_row("trace on meta", f"{traced:.2f} s", "")
    table.add_row("HTML generation (grid included)", f"{generated:.2f} s", f"< {GOAL_SECONDS:.0f} s")
    table.add_row("file size", f"{size / 1024:.0f} KiB", f"< {GOAL_BYTES / 1024 / 1024:.0f} MB")
    Console().print(table)
    print(f"page: {out}")
    ok = generated < GOAL_SECONDS and size < GOAL_BYTES
    print("goals met" if ok else "GOAL MISSED")


if __name__ == "__main__":
    main()
