"""Checkpoint save and load: time and bytes written, smpart (torch.distributed.checkpoint) against
``torch.save`` / ``torch.load`` of the full state dict from one process.

A GPT of a few hundred MB (float32) with AdamW state after one step. Both sides write to the same
file system and sync their files (DCP fsyncs; the baseline file is fsynced too), and read with
``weights_only=True``. Medians of ``--repeats`` runs.

    .venv/bin/python bench/checkpoint.py [--embd 1024 --layers 8 --repeats 3 --dir /tmp]

``--procs N`` (N > 1): the model on N pipeline stages, one process each (smpart's process runtime,
gloo): every rank writes its own stage's tensors in parallel, then reads them back; the same
checkpoint is then read by the plain model in one process (another layout). The rows are rank 0's
medians (every call is collective, so rank 0's time is the slowest rank's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import gpt2  # noqa: E402
from smpart.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

MB = 1e6


def build(args: argparse.Namespace):
    """The model and an AdamW that took one step (so its state exists)."""
    torch.manual_seed(0)
    example = gpt2(vocab_size=args.vocab, seq_len=64, n_layer=args.layers, n_head=8, n_embd=args.embd,
                   batch_size=1)
    optimizer = torch.optim.AdamW(example.model.parameters(), lr=1e-4)
    for p in example.model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return example.model, optimizer


def directory_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(fn: Callable[[], object], repeats: int, before: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------ one process
def torch_save(path: Path, model, optimizer) -> None:
    with open(path, "wb") as file:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, file)
        file.flush()
        os.fsync(file.fileno())


def torch_load(path: Path, model, optimizer) -> None:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def run_one_process(args: argparse.Namespace, root: Path) -> list[tuple[str, float, float, float]]:
    model, optimizer = build(args)
    rows = []
    smpart_dir, torch_file = root / "smpart_ckpt", root / "state.pt"

    def clear(path: Path) -> Callable[[], None]:
        def remove() -> None:
            if path.is_dir():
                shutil.rmtree(path)
            path.unlink(missing_ok=True)

        return remove

    save = timed(lambda: save_checkpoint(smpart_dir, model, optimizer, extra={"step": 1}), args.repeats,
                 clear(smpart_dir))
    load = timed(lambda: load_checkpoint(smpart_dir, model, optimizer), args.repeats)
    rows.append(("smpart (DCP)", save, load, directory_bytes(smpart_dir)))
    save = timed(lambda: torch_save(torch_file, model, optimizer), args.repeats, clear(torch_file))
    load = timed(lambda: torch_load(torch_file, model, optimizer), args.repeats)
    rows.append(("torch.save, 1 file", save, load, directory_bytes(torch_file)))
    return rows


# ------------------------------------------------------------------------------ N processes
def _stage_rank(rank: int, args: argparse.Namespace, root: str) -> tuple[float, float, int]:
    """On every rank: place the model on N stages, take one AdamW step, time save and load."""
    import smpart

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    smpart.init(pipeline_parallel_degree=world, microbatches=1, timeout_s=600)
    try:
        model, optimizer = build(args)  # every rank builds it whole (same seed); placement keeps its stage
        model = smpart.DistributedModel(model)
        optimizer = smpart.DistributedOptimizer(optimizer)
        example = gpt2(vocab_size=args.vocab, seq_len=64, n_layer=args.layers, n_head=8, n_embd=args.embd,
                       batch_size=1)

        @smpart.step
        def evaluate(model, ids):
            return model(ids)

        with torch.no_grad():
            evaluate(model, *example.args)  # places the model
        path = Path(root) / "smpart_ckpt"

        def clear() -> None:
            smpart.barrier()
            if rank == 0 and path.is_dir():
                shutil.rmtree(path)
            smpart.barrier()

        save = timed(lambda: smpart.save_checkpoint(path, model, optimizer, extra={"step": 1}), args.repeats,
                     clear)
        load = timed(lambda: smpart.load_checkpoint(path, model, optimizer), args.repeats, smpart.barrier)
        return save, load, directory_bytes(path)
    finally:
        smpart.shutdown()


def run_processes(args: argparse.Namespace, root: Path) -> list[tuple[str, float, float, float]]:
    from bench.rank_pool import RankPool

    with RankPool(args.procs) as pool:
        save, load, written = pool.run(_stage_rank, args, str(root), timeout_s=1800)[0]
    rows = [(f"smpart, {args.procs} stages", save, load, written)]
    model, optimizer = build(args)
    plain = timed(lambda: load_checkpoint(root / "smpart_ckpt", model, optimizer), args.repeats)
    rows.append(("  read by 1 process", float("nan"), plain, written))
    rows += run_one_process(args, root)
    return rows


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embd", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--procs", type=int, default=1, help="processes, one pipeline stage each")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    if args.procs < 1:
        parser.error("--procs must be >= 1")
    model, optimizer = build(args)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight once
    del model, optimizer
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        rows = (run_one_process if args.procs == 1 else run_processes)(args, Path(root))
    print(f"GPT, {params / 1e6:.0f} M parameters ({state_bytes / MB:.0f} MB of weights, float32) + AdamW "
          f"state; {args.procs} process(es), {torch.get_num_threads()} threads, medians of {args.repeats}")
    print(f"{'':22}{'save (s)':>10}{'load (s)':>10}{'written (MB)':>14}{'save MB/s':>11}")
    for label, save, load, written in rows:
        print(f"{label:22}{save:10.2f}{load:10.2f}{written / MB:14.0f}{written / MB / save:11.0f}")


if __name__ == "__main__":
    main()
