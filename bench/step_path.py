"""How far a step travels through smpart's files: the files a step crosses, and the stays of one call.

A Python profile hook (every thread) notes the smpart file of each frame a step enters, on GPT-2
small's module tree at a tiny width (the partition GPT-2 small gets at full size, pinned; 2 stages,
4 micro-batches, 1f1b):

- *files a step crosses*: the smpart files with code run during one step, a replayed one (step
  programs, the model's fourth step) and one on the reference runtime (programs off), on threads
  and on 2 processes (the most on one rank);
- *one cross-stage call*, on the reference runtime on threads: from a stage-0 module's call of a
  stage-1 block until it returns (it runs on the caller's thread: the transport lends it to the
  callee's job), the sequence of files its frames are in, as *stays* (a run of frames in one
  file); *returns* = stays in a file that an earlier stay was in already (stays - files).

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


def _model_and_step(stages: int, pins: dict[str, int], programs: bool) -> tuple[Any, Callable[[], None]]:
    example = gpt2_small(**TINY)
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, pipeline="1f1b", pin=pins,
                step_programs=programs)
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
        _, step = _model_and_step(stages, pins, programs)
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


def stays_of_a_call(stages: int, pins: dict[str, int]) -> list[str]:
    """The files, stay by stay, of a stage-0 module's call of the first block on stage 1."""
    try:
        from smpart.runtime.reference.stage import StageServer
    except ImportError:  # before the runtime's folders (main before issue 38)
        from smpart.runtime.stage import StageServer  # type: ignore[no-redef]

    first = min((name for name, stage in pins.items() if stage == 1 and name.startswith("transformer.h.")),
                key=lambda name: (name.count("."), name))
    trail = FileTrail()
    call = StageServer.call

    def traced(self: Any, frame: Any, stage: int, model: int, module: str, args: tuple, kwargs: dict) -> Any:
        if module != first or trail.sequence:
            return call(self, frame, stage, model, module, args, kwargs)
        with trail:
            trail.on = True
            try:
                return call(self, frame, stage, model, module, args, kwargs)
            finally:
                trail.on = False

    StageServer.call = traced  # type: ignore[method-assign]
    try:
        _, step = _model_and_step(stages, pins, programs=False)
        step()  # places the model
        step()  # the call traced: a step like a fallback, the model placed
    finally:
        StageServer.call = call  # type: ignore[method-assign]
        smpart.shutdown()
    return trail.sequence.get(threading.get_ident()) or max(trail.sequence.values(), key=len)


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
    stays = stays_of_a_call(stages, pins)
    print(f"one cross-stage call, reference runtime, threads: {len(stays)} stays in {len(set(stays))} files, "
          f"{len(stays) - len(set(stays))} returns to a file already left")
    if a.list:
        print("    " + " -> ".join(name.rsplit("/", 1)[-1] for name in stays))


if __name__ == "__main__":
    main()
