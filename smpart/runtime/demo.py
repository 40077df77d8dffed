"""``smpart demo``: train a small GPT pipelined over 2 stages on the CPU, in about a minute.

The corpus is made on the fly, character by character, from smpart's own source files. The
demo trains with the README's step (``@smpart.step``, ``model.backward``), shows a rich progress
bar with the loss and samples/s, then prints the partition and saves the last step's timeline.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from smpart.errors import SmpartError
from smpart.runtime.model import DistributedModel
from smpart.runtime.optimizer import DistributedOptimizer
from smpart.runtime.runtime import partition_of
from smpart.runtime.session import init, shutdown
from smpart.runtime.step_function import step
from smpart.viz import show

VOCAB = 128  # ASCII; anything else becomes "?"


def source_corpus() -> torch.Tensor:
    """Every character of smpart's own .py files as a 1-D tensor of ASCII codes."""
    root = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.rglob("*.py")))
    codes = [c if c < VOCAB else ord("?") for c in text.encode("ascii", errors="replace")]
    return torch.tensor(codes, dtype=torch.long)


def batches(corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0):
    """Endless random windows of the corpus: (input ids, next-character targets)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(len(corpus) - seq_len - 1, (batch_size,), generator=g)
        windows = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()])
        yield windows[:, :-1], windows[:, 1:]


@step
def train_step(model, ids, targets):
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    model.backward(loss)
    return loss


def run_demo(steps: int = 300, batch_size: int = 16, microbatches: int = 4, seq_len: int = 32,
             console: Console | None = None) -> str:
    """Train, print the partition, save the timeline; return the timeline's path."""
    try:
        from examples.models import gpt2
    except ImportError as err:
        raise SmpartError("the demo uses the model zoo in examples/: run it from the repository root") \
            from err
    console = console or Console()
    torch.manual_seed(0)
    corpus = source_corpus()
    example = gpt2(vocab_size=VOCAB, seq_len=seq_len, n_layer=4, n_head=4, n_embd=64)
    init(pipeline_parallel_degree=2, microbatches=microbatches, pipeline="interleaved")
    try:
        model = DistributedModel(example.model)
        optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
        size = sum(p.numel() for p in model.parameters())
        console.print(f"[bold]smpart demo[/]: a {size:,}-parameter GPT, 2 pipeline stages, {microbatches} "
                      f"micro-batches, {len(corpus):,} characters of smpart's own source")
        data = batches(corpus, batch_size, seq_len)
        start, out = time.perf_counter(), None
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.3f}"),
                   TextColumn("{task.fields[rate]:.0f} samples/s"), TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("training", total=steps, loss=float("nan"), rate=0.0)
            for i in range(steps):
                ids, targets = next(data)
                out = train_step(model, ids, targets)
                optimizer.step()
                optimizer.zero_grad()
                rate = (i + 1) * batch_size / (time.perf_counter() - start)
                progress.update(task, advance=1, loss=out.reduce_mean().item(), rate=rate)
        show(partition_of(model), console=console, max_depth=2)
        path = os.path.join(tempfile.gettempdir(), "smpart_demo_timeline.json")
        out.timeline.save(path)
        console.print(f"last step: {out.timeline!r}")
        console.print(f"timeline of the last step (open in https://ui.perfetto.dev): [bold]{path}[/]")
        return path
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo()
