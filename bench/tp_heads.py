"""Attention no adapter knows, split by heads: what tensor parallelism now splits, and what a proof costs.

    .venv/bin/python bench/tp_heads.py [--repeats 3]

1. nanoGPT at GPT-2 small's size (12 layers, width 768, 12 heads, 1024 tokens, vocab 50304),
   built and traced on the meta device: the share of parameters and FLOPs a tp 2 split divides
   (`split_totals`, what the planner prices), the attention layers split, the warnings, and the
   time `smpart.trace` takes (it plans degrees 2, 4 and 8), with smpart's head finder on and off
   (off: what happened before it, every attention kept whole).
2. One proof (`find_head_split`, uncached) of nanoGPT's attention at GPT-2 small's size, timm's
   at ViT-B's (768, 12 heads, 197 tokens) and torchtitan's at Llama-3-8B's (4096, 32 q / 8 kv
   heads, 8192 tokens), each built on meta, at degrees 2, 4 and 8: median wall seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from smpart.tensor_parallel import TensorParallelWarning, heads, plan_tensor_parallel, split_totals  # noqa: E402
from smpart.tensor_parallel import planner as tp_planner  # noqa: E402
from smpart.tracing.call_inputs import describe_call  # noqa: E402
from tests.foreign_attention import (  # noqa: E402
    Attention,
    CausalSelfAttention,
    NanoConfig,
    NanoGPT,
    TitanArgs,
    TitanAttention,
    precompute_freqs_cis,
)

GPT2_SMALL = NanoConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)


def _planned(finder_on: bool) -> dict[str, object]:
    original = tp_planner.find_head_split
    if not finder_on:
        tp_planner.find_head_split = lambda *_: "the head finder is off"
    heads._PROVEN.clear()
    try:
        with torch.device("meta"):
            model = NanoGPT(GPT2_SMALL)
        ids = torch.zeros(8, 1024, dtype=torch.long, device="meta")
        start = time.perf_counter()
        tree = smpart.trace(model, (ids,))
        seconds = time.perf_counter() - start
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = plan_tensor_parallel(model, 2, example_inputs=tree)
    finally:
        tp_planner.find_head_split = original
    share = split_totals(plan, tree)
    warned = sum(issubclass(w.category, TensorParallelWarning) for w in caught)
    return {"params": share.params, "flops": share.flops, "attention": len(plan.attention),
            "warnings": warned, "trace_s": seconds}


def _proof_cases() -> dict[str, tuple[torch.nn.Module, dict]]:
    with torch.device("meta"):
        nano = CausalSelfAttention(GPT2_SMALL)
        vit = Attention(768, 12, qkv_bias=True)
        llama = TitanAttention(TitanArgs(dim=4096, n_heads=32, n_kv_heads=8))
    freqs = precompute_freqs_cis(128, 8192, 500000.0)
    return {
        "nanoGPT GPT-2 small": (nano, describe_call((torch.empty(8, 1024, 768, device="meta"),), {})),
        "timm ViT-B": (vit, describe_call((torch.empty(64, 197, 768, device="meta"),), {})),
        "torchtitan Llama-3-8B": (llama, describe_call((torch.empty(1, 8192, 4096, device="meta"),
                                                        freqs.to("meta")), {})),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("nanoGPT at GPT-2 small's size on meta, planned at tp 2:")
    for on in (True, False):
        r = _planned(on)
        print(f"  head finder {'on ' if on else 'off'}: {r['params']:.2%} of parameters and "
              f"{r['flops']:.2%} of FLOPs split, {r['attention']} of 12 attention layers, "
              f"{r['warnings']} warning(s); smpart.trace {r['trace_s']:.2f} s")
    print("one proof, uncached (median wall seconds over", args.repeats, "runs):")
    for name, (module, example) in _proof_cases().items():
        cells = []
        for degree in (2, 4, 8):
            times, found = [], None
            for _ in range(args.repeats):
                heads._PROVEN.clear()
                start = time.perf_counter()
                found = heads.find_head_split(module, degree, example)
                times.append(time.perf_counter() - start)
            assert isinstance(found, heads.HeadSplit), found
            if found.q_heads % degree or found.kv_heads % degree:
                cells.append(f"tp {degree}: {found.q_heads} heads do not divide, nothing to prove")
            else:
                cells.append(f"tp {degree}: {statistics.median(times):.2f} s")
        print(f"  {name:<24} " + ", ".join(cells))


if __name__ == "__main__":
    main()
