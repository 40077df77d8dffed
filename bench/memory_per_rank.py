"""Peak memory per rank where a rank could hold more than its part, and what a 1 B-parameter
checkpoint costs each rank to load.

Three cases, each on processes of its own (`bench.rank_pool.RankPool`, gloo, CPU):

- ``reinit``: 16 layers ``Linear(2048, 2048)`` (268 MB of float32 weights, twice that of Adam
  state) built on meta, one step and one Adam step on 4 stages, ``smpart.shutdown()``, then
  ``smpart.init`` on 2 stages x 2 replicas and the first step (forward only: it places the
  model, and each rank takes back what it will hold, `replicas.make_whole`);
- ``meta-tp``: 4 MLP blocks ``Linear(2048, 8192)``, GELU, ``Linear(8192, 2048)`` (537 MB) built
  on meta, on 2 tensor-parallel ranks: the first step (forward only) places it, each rank making
  its shards and initialising them from the unsplit layer (`placement._initialise`); and the
  same blocks of width 64, whose weights are nothing: the first step's own cost (the trace,
  the tensor-parallel plan, the modules imported);
- ``load-1b``: 60 layers ``Linear(4096, 4096, bias=False)`` in bfloat16, 1.007 B parameters
  (2.01 GB), written by this bench as a sharded safetensors directory (8 files and their
  ``model.safetensors.index.json``) under the system's temporary directory (removed after), then
  read three ways: every key by one rank (``safetensors.torch.load_file`` of every file: what a
  rank pays that reads the whole checkpoint, as ``load_state_dict`` before placement does), and
  ``smpart.load_weights`` before the first step on 4 stages of a model built on meta, and on 2
  stages of a model built for real on every rank (``--built-for-real``; 2 GB per rank).

The peak is the growth of the process's memory during the phase (`_Peak`): each rank collects
garbage, gives freed memory back (``malloc_trim``), resets its peak (Linux: ``5`` into
``/proc/self/clear_refs``) and reads ``VmHWM`` after the phase, less ``VmRSS`` at its start
(``peak growth``), and samples its anonymous memory every 2 ms (``anon growth``: without the
pages of the safetensors files it maps, which count in its resident set while mapped but are
the kernel's page cache, dropped and reread at will). The bytes a rank read from the checkpoint
are counted where smpart's safetensors source returns them, and the bytes it received of rank
0's values before placement where `replicas` broadcasts them (the bench wraps both; the library
counts nothing). ``every key`` copies what it reads, as a load into a model does.

    .venv/bin/python bench/memory_per_rank.py [--cases reinit meta-tp load-1b] [--built-for-real]

To measure the code of another tree (the figures before a change), run the copy of this file
put in that tree's ``bench/``: it imports the smpart beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402

MB = 1e6


# ================================================================================= measuring
class _Peak:
    """The growth of this process's memory over a phase: of its resident set (``VmHWM``, exact),
    and of its anonymous memory alone (``RssAnon`` sampled every 2 ms: what the process itself
    allocated, without the pages of files it maps, which the kernel can drop and reread)."""

    def __enter__(self) -> _Peak:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
        self.rss, self.anon = _status("VmRSS"), _status("RssAnon")
        self.most_anon = self.anon
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        self.began = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.most_anon = max(self.most_anon, _status("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.began
        self._stop.set()
        self._sampler.join()
        self.most_anon = max(self.most_anon, _status("RssAnon"))
        self.growth = _status("VmHWM") - self.rss
        self.anon_growth = self.most_anon - self.anon

    def row(self) -> dict:
        return {"peak growth": self.growth, "anon growth": self.anon_growth, "seconds": self.seconds}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _held(model: smpart.DistributedModel, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the tensors this rank holds: its parameters and buffers (a shard's own part), and
    its optimizer's state."""
    seen: dict[int, torch.Tensor] = {}
    for t in model.module.state_dict(keep_vars=True).values():
        if not t.is_meta:
            local = t.to_local() if hasattr(t, "to_local") else t
            seen[id(t)] = local
    total = sum(t.numel() * t.element_size() for t in seen.values())
    if optimizer is not None:
        total += sum(v.numel() * v.element_size() for entry in optimizer.state.values()
                     for v in entry.values() if isinstance(v, torch.Tensor) and not v.is_meta)
    return total


@smpart.step
def _forward(model, x):
    with torch.no_grad():
        return model(x).float().sum()


@smpart.step
def _train(model, x):
    loss = model(x).float().square().mean()
    model.backward(loss)
    return loss


# ================================================================================= the cases
def _reinit(rank: int) -> dict:
    with torch.device("meta"):
        built = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)])
    model = smpart.DistributedModel(built)
    opt = smpart.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    x = torch.randn(8, 2048)
    smpart.init(pipeline_parallel_degree=4, microbatches=2, timeout_s=300)
    _train(model, x)
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = _held(model, opt.optimizer)
    smpart.shutdown()
    smpart.init(pipeline_parallel_degree=2, data_parallel_degree=2, microbatches=2, timeout_s=300)
    with _Peak() as peak:
        _forward(model, x[:4])
    after = _held(model, opt.optimizer)
    smpart.shutdown()
    return {"held before": before, "held after": after, "one layer": 3 * (2048 * 2048 + 2048) * 4,
            **peak.row()}


def _meta_tp(rank: int, width: int) -> dict:
    smpart.init(tensor_parallel_degree=2, microbatches=2, timeout_s=300)
    with torch.device("meta"):
        built = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                              nn.Linear(4 * width, width)) for _ in range(4)])
    model = smpart.DistributedModel(built)
    with _Peak() as peak:
        _forward(model, torch.randn(4, width))
    held = _held(model)
    smpart.shutdown()
    return {"held after": held, "one layer": (width * 4 * width + 4 * width) * 4, **peak.row()}


LAYERS_1B, WIDTH_1B, FILES_1B = 60, 4096, 8


def _one_billion() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH_1B, WIDTH_1B, bias=False, dtype=torch.bfloat16)
                           for _ in range(LAYERS_1B)])


def _write_1b(directory: Path) -> int:
    """A sharded safetensors checkpoint of `_one_billion`, a file at a time: its bytes."""
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    per_file = LAYERS_1B // FILES_1B + (LAYERS_1B % FILES_1B > 0)
    g = torch.Generator().manual_seed(0)
    for f in range(FILES_1B):
        name = f"model-{f + 1:05d}-of-{FILES_1B:05d}.safetensors"
        layers = range(f * per_file, min(LAYERS_1B, (f + 1) * per_file))
        tensors = {f"{i}.weight": (torch.rand(WIDTH_1B, WIDTH_1B, generator=g) * 0.02).to(torch.bfloat16)
                   for i in layers}
        save_file(tensors, str(directory / name))
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _every_key(rank: int, directory: str) -> dict | None:
    """One rank reads the whole checkpoint (the others wait: 4 x 2 GB would not fit beside them)."""
    if rank != 0:
        return None
    from safetensors.torch import load_file

    with _Peak() as peak:
        loaded = {}
        for file in sorted(Path(directory).glob("*.safetensors")):  # copied, as a load into a model
            loaded.update({key: t.clone() for key, t in load_file(str(file)).items()})
    read = sum(t.numel() * t.element_size() for t in loaded.values())
    del loaded
    return {"read": read, "received": 0, "held after": read, **peak.row()}


def _load_weights(rank: int, directory: str, pp: int, built_for_real: bool) -> dict:
    """``smpart.load_weights`` before the first step: what this rank read and received, its peak
    and the first step's time (placement and the load)."""
    import smpart.checkpoint.stores as ckpt
    import smpart.runtime.processes.replicas as replicas

    counted = {"read": 0, "received": 0}
    real_read, real_broadcast = ckpt._SafetensorsStore.read, replicas._broadcast

    def read(self, key, index):
        tensor = real_read(self, key, index)
        counted["read"] += tensor.numel() * tensor.element_size()
        return tensor

    def broadcast(bucket, group, src, timeout_s):
        flat = real_broadcast(bucket, group, src, timeout_s)
        counted["received"] += flat.numel() * flat.element_size()
        return flat

    ckpt._SafetensorsStore.read, replicas._broadcast = read, broadcast
    try:
        smpart.init(pipeline_parallel_degree=pp, microbatches=1, timeout_s=600)
        torch.manual_seed(rank)
        with torch.device("cpu" if built_for_real else "meta"):
            model = smpart.DistributedModel(_one_billion())
        with _Peak() as peak:
            smpart.load_weights(model, directory)
            _forward(model, torch.randn(1, WIDTH_1B, dtype=torch.bfloat16))
        held = _held(model)
        smpart.shutdown()
    finally:
        ckpt._SafetensorsStore.read, replicas._broadcast = real_read, real_broadcast
    return {**counted, "held after": held, **peak.row()}


# ================================================================================= printing
def _table(title: str, rows: list[tuple[str, dict]], columns: list[str]) -> None:
    print(f"\n{title}")
    print("  " + f"{'':<34}" + "".join(f"{c:>14}" for c in columns))
    for label, row in rows:
        cells = [f"{row[c]:>14.2f}" if c == "seconds" else f"{row[c] / MB:>11.0f} MB" for c in columns]
        print(f"  {label:<34}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["reinit", "meta-tp", "load-1b"],
                        choices=["reinit", "meta-tp", "load-1b"])
    parser.add_argument("--built-for-real", action="store_true",
                        help="also load into a 1 B model built for real on 2 ranks (2 GB each)")
    args = parser.parse_args()
    print(f"smpart from {Path(smpart.__file__).parent}, torch {torch.__version__}")
    if "reinit" in args.cases:
        pool = RankPool(4)
        try:
            rows = pool.run(_reinit, timeout_s=900)
        finally:
            pool.close()
        _table("re-init: 4 stages -> 2 stages x 2 replicas, first step (whole model 268 MB + Adam 537 MB)",
               [(f"rank {r}", row) for r, row in enumerate(rows)],
               ["held before", "held after", "one layer", "peak growth", "anon growth", "seconds"])
    if "meta-tp" in args.cases:
        pool = RankPool(2)
        try:  # the same model 32 times narrower: what the first step costs beside the weights
            tiny = pool.run(_meta_tp, 64, timeout_s=900)
            rows = pool.run(_meta_tp, 2048, timeout_s=900)
        finally:
            pool.close()
        _table("built on meta, tensor parallel 2, first step (whole model 537 MB)",
               [(f"rank {r}, width 64", row) for r, row in enumerate(tiny)]
               + [(f"rank {r}", row) for r, row in enumerate(rows)],
               ["held after", "one layer", "peak growth", "anon growth", "seconds"])
    if "load-1b" in args.cases:
        directory = Path(tempfile.mkdtemp(prefix="smpart-1b-"))
        try:
            began = time.perf_counter()
            size = _write_1b(directory)
            print(f"\nwrote a {size / 1e9:.2f} GB checkpoint ({LAYERS_1B} x {WIDTH_1B}^2 bfloat16, "
                  f"{FILES_1B} files) in {time.perf_counter() - began:.0f} s")
            pool = RankPool(4)
            try:
                every = pool.run(_every_key, str(directory), timeout_s=900)[0]
                meta = pool.run(_load_weights, str(directory), 4, False, timeout_s=900)
            finally:
                pool.close()
            rows = [("every key (one rank)", every)]
            rows += [(f"load_weights, meta, pp 4, rank {r}", row) for r, row in enumerate(meta)]
            if args.built_for_real:
                pool = RankPool(2)
                try:
                    real = pool.run(_load_weights, str(directory), 2, True, timeout_s=900)
                finally:
                    pool.close()
                rows += [(f"load_weights, real, pp 2, rank {r}", row) for r, row in enumerate(real)]
            _table("a 1.007 B-parameter checkpoint (2.01 GB), per rank", rows,
                   ["read", "received", "held after", "peak growth", "anon growth", "seconds"])
        finally:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
