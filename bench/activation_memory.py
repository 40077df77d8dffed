"""Activation checkpointing on a GPT: the memory it saves and the time it costs, measured against
the trace's prediction.

For a GPT-2-like model (float32, CPU) with and without its blocks checkpointed:

- **saved bytes**: what autograd keeps for the backward after the forward, counted on the real
  run with ``saved_tensors_hooks`` (each storage once, parameters never, the output counted as the
  loss keeps it: `smpart.tracing.saved_bytes.SavedBytesCounter`), against the trace's prediction
  (the plain trace, rewritten by `with_activation_checkpointing`);
- **peak memory**: the peak resident memory of one forward + backward above the memory before it,
  in a fresh process (glibc's mmap threshold pinned low so freed tensors leave the resident set at
  once; Linux's ``clear_refs`` resets the peak), against saved bytes + (with checkpointing) the
  largest block's saved bytes, which its recomputation brings back for its own backward;
- **step time**: median of several forward + backward, and the ratio, against the trace's
  ``1 + recomputed FLOPs / (3 × all FLOPs)`` (backward = 2 × forward).

    .venv/bin/python bench/activation_memory.py [--layers 8 --embd 512 --seq 256 --batch 4 --repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import gpt2  # noqa: E402
from smpart.runtime.placement.activation_checkpointing import apply, checkpointed_names, remove  # noqa: E402
from smpart.tracing.saved_bytes import SavedBytesCounter  # noqa: E402
from smpart.tracing.tracer import trace  # noqa: E402
from smpart.tracing.tree import with_activation_checkpointing  # noqa: E402

PATTERN = "transformer.h.*"
MIB = 1 << 20


def build(args: argparse.Namespace):
    return gpt2(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                n_embd=args.embd, batch_size=args.batch)


def step(example) -> None:
    loss = example.loss(example.model(*example.args), example.target)
    loss.backward()


def measured_saved_bytes(example) -> int:
    """Bytes autograd keeps after the forward (+ the output, which the loss keeps)."""
    model = example.model
    counter = SavedBytesCounter(lambda: None, [*model.parameters(), *model.buffers()], example.args)
    with counter, torch.enable_grad():
        out = model(*example.args)
        counter.count(out, None)
        total = sum(counter.by_module.values())
    del out
    return total


def predicted(example, checkpointed: list[str]) -> dict[str, float]:
    tree = trace(example.model, example.args)  # meta device: no weight touched
    done = with_activation_checkpointing(tree, checkpointed)
    blocks = [tree.node(name) for name in checkpointed]
    largest_block = max(sum(tree.activation_memory_of(n) for n in b.walk()) for b in blocks)
    plain_saved = sum(tree.activation_memory_of(n) for n in tree.nodes())
    ckpt_saved = sum(done.activation_memory_of(n) for n in done.nodes())
    return {
        "plain_saved": plain_saved,
        "ckpt_saved": ckpt_saved,
        "plain_peak": plain_saved,
        "ckpt_peak": ckpt_saved + largest_block,
        "time_ratio": 1 + sum(n.flops for n in done.nodes() if n.recomputed) / (3 * tree.total_compute()),
    }


def step_seconds(example, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        example.model.zero_grad(set_to_none=False)
        start = time.perf_counter()
        step(example)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------ peak RSS (child)
def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child_peak(args: argparse.Namespace) -> None:
    """In a fresh process: peak resident bytes of one forward + backward above the baseline."""
    torch.manual_seed(0)
    example = build(args)
    if args.checkpoint:
        apply(example.model, checkpointed_names(example.model, [PATTERN]))
    step(example)  # gradients allocated, allocator warm
    example.model.zero_grad(set_to_none=False)
    gc.collect()
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    step(example)
    print(json.dumps({"peak": _status("VmHWM") - baseline}))


def peak_in_child(args: argparse.Namespace, checkpoint: bool) -> int | None:
    if not Path("/proc/self/clear_refs").exists():
        return None
    command = [sys.executable, __file__, "--child", *_size_args(args)]
    if checkpoint:
        command.append("--checkpoint")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak"]


def _size_args(args: argparse.Namespace) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in ("layers", "embd", "heads", "seq", "batch", "vocab")]


# ------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_peak(args)
        return

    torch.manual_seed(0)
    example = build(args)
    names = checkpointed_names(example.model, [PATTERN])
    prediction = predicted(example, names)
    rows = {}
    for checkpoint in (False, True):
        if checkpoint:
            apply(example.model, names)
        step(example)  # warm-up
        rows[checkpoint] = {"saved": measured_saved_bytes(example),
                            "time": step_seconds(example, args.repeats),
                            "peak": peak_in_child(args, checkpoint)}
        remove(example.model)
    params = sum(p.numel() for p in example.model.parameters())
    print(f"GPT: {args.layers} blocks, width {args.embd}, {args.heads} heads, {args.seq} tokens, batch "
          f"{args.batch}, vocab {args.vocab} ({params / 1e6:.1f} M parameters, float32, CPU, "
          f"{torch.get_num_threads()} threads); checkpointing {PATTERN} ({len(names)} modules)")
    print(f"{'':24}{'measured':>14}{'predicted':>14}{'error':>9}")
    lines = [
        ("saved, plain (MiB)", rows[False]["saved"] / MIB, prediction["plain_saved"] / MIB),
        ("saved, checkpointed (MiB)", rows[True]["saved"] / MIB, prediction["ckpt_saved"] / MIB),
    ]
    if rows[False]["peak"] is not None:
        lines += [("peak, plain (MiB)", rows[False]["peak"] / MIB, prediction["plain_peak"] / MIB),
                  ("peak, checkpointed (MiB)", rows[True]["peak"] / MIB, prediction["ckpt_peak"] / MIB)]
    lines += [
        ("step, plain (ms)", rows[False]["time"] * 1e3, None),
        ("step, checkpointed (ms)", rows[True]["time"] * 1e3, None),
        ("time ratio", rows[True]["time"] / rows[False]["time"], prediction["time_ratio"]),
    ]
    for label, value, expected in lines:
        error = f"{(value - expected) / expected:+.1%}" if expected else ""
        shown = f"{expected:14.2f}" if expected is not None else f"{'':14}"
        print(f"{label:24}{value:14.2f}{shown}{error:>9}")
    saved_ratio = rows[False]["saved"] / max(rows[True]["saved"], 1)
    print(f"checkpointing keeps {saved_ratio:.1f}x fewer bytes for the backward")


if __name__ == "__main__":
    main()
