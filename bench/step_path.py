"""How far a step travels through smpart's files: the files one step runs code in.

A Python profile hook (every thread) notes the smpart file of each frame a step enters, on GPT-2
small's module tree at a tiny width (the partition GPT-2 small gets at full size, pinned; 2 stages,
4 micro-batches, 1f1b): the smpart files with code run during one step, a replayed one (step
programs, the model's fourth step) and one on the reference runtime (programs off), on threads
and on 2 processes (the most on one rank).

The stays of one cross-stage call (how often it returns to a file it had left) are read from
the code by ``farm-studio walk smpart/runtime/reference/forward.py:ForwardCalls._run_call:request``.

    .venv/bin/python bench/step_path.py [--no-processes]
"""

from __future__ import annotations

import argparse
import copy
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.backward_work import MICROBATCHES, TINY, full_size_partition  # noqa: E402
from bench.processes import RankPool  # noqa: E402
from examples.models import gpt2_small  # noqa: E402

PACKAGE = str(Path(smpart.__file__).resolve().parent)


def _relative(filename: str) -> str | None:
    return filename[len(PACKAGE) - len("smpart"):] if filename.startswith(PACKAGE) else None


class FileTrail:
    """The smpart files frames run in, per thread, while on (``threading.setprofile`` too)."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.sequence: dict[int, list[str]] = {}
        self.on = False

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event not in ("call", "return"):
            return
        if event == "return":
            frame = frame.f_back
            if frame is None:
                return
        name = _relative(frame.f_code.co_filename)
        if name is None:
            return
        self.files.add(name)
        trail = self.sequence.setdefault(threading.get_ident(), [])
        if not trail or trail[-1] != name:
            trail.append(name)

    def __enter__(self) -> FileTrail:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def model_and_step(stages: int, pins: dict[str, int], programs: bool,
                   **switches: Any) -> tuple[Any, Callable[[], None]]:
    """``smpart.init`` (1f1b, ``pins``, ``switches``), the tiny GPT-2 tree placed on it, and a
    function running one training step of it (also `bench.reference_runtime`'s)."""
    example = gpt2_small(**TINY)
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, pipeline="1f1b", pin=pins,
                step_programs=programs, **switches)
    model = smpart.DistributedModel(copy.deepcopy(example.model))
    args, _, target = example.batch(2 * MICROBATCHES, seed=0)

    @smpart.step
    def train_step(model, args, target):
        loss = example.loss(model(*args), target)
        model.backward(loss)
        return loss

    return model, lambda: train_step(model, args, target)


def files_of_a_step(stages: int, pins: dict[str, int], programs: bool) -> list[str]:
    """The smpart files a step runs code in, once the model ran 3 steps (placed, recorded, discovered)."""
    try:
        _, step = model_and_step(stages, pins, programs)
        for _ in range(3):
            step()
        with FileTrail() as trail:
            trail.on = True
            step()
            trail.on = False
        return sorted(trail.files)
    finally:
        smpart.shutdown()


def on_rank(rank: int, stages: int, pins: dict[str, int], programs: bool) -> list[str]:
    return files_of_a_step(stages, pins, programs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="full-size batch the partition is traced for")
    parser.add_argument("--no-processes", dest="processes", action="store_false")
    parser.add_argument("--list", action="store_true", help="print the files too")
    a = parser.parse_args()
    torch.set_num_threads(1)
    stages = 2
    pins = full_size_partition(stages, a.batch)
    rows = []
    for programs in (True, False):
        files = files_of_a_step(stages, pins, programs)
        rows.append(("threads", programs, files))
    if a.processes:
        pool = RankPool(stages)
        try:
            for programs in (True, False):
                per_rank = pool.run(on_rank, stages, pins, programs)
                rows.append(("processes", programs, max(per_rank, key=len)))
        finally:
            pool.close()
    for where, programs, files in rows:
        runtime = "program (replayed)" if programs else "reference"
        print(f"{where:9s} {runtime:18s} files a step crosses: {len(files)}")
        if a.list:
            print("    " + " ".join(files))


if __name__ == "__main__":
    main()
