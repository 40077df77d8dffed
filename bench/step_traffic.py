"""What a step sends across each cut, per micro-batch: messages and bytes, against torch's.

Two language models cut into 2 stages at a block boundary (the pins below), batch 8 in 4
micro-batches, on 2 processes (gloo; ``--threads`` on threads of this process):

- the zoo's GPT-2 (``lm_head`` tied to ``wte``: the head lives on stage 0 with the embedding, so
  the hidden state goes 0 -> 1 and comes back 1 -> 0);
- a Hugging Face Llama with an untied head (``tie_word_embeddings=False``): the head and the loss
  sit on the last stage, whose logits (batch x sequence x vocabulary, here 8x the hidden state)
  torch's schedules never send anywhere.

torch's traffic, the yardstick: per micro-batch and cut, one activation forward and its gradient
back, each the hidden state (micro-batch x sequence x width), plus, on processes, the labels to
the stage computing the loss (torch's last stage reads its ``target`` from its own arguments; smpart
sends them once per micro-batch from the first stage's rank, where the batch is read). Printed per
configuration: messages and bytes per micro-batch on each ordered pair of stages, for the step
program and for the reference runtime (step programs off), and the program's bytes over torch's.

The same run times the recording: a reference step recording what its calls return (as the
first step of every kind of step does), against the same step not recording, alternating, with
step programs off (the first step also traces and places the model: timed apart, for context).

    .venv/bin/python bench/step_traffic.py [--threads] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402

MICROBATCHES, BATCH, SEQ = 4, 8, 16
VOCAB, WIDTH, LAYERS = 256, 32, 4


def zoo_gpt2() -> tuple[torch.nn.Module, dict[str, int], Any]:
    from examples.models import gpt2

    example = gpt2(vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_embd=WIDTH)
    pins = {"": 0, "transformer.wte": 0, "transformer.wpe": 0, "lm_head": 0, "transformer.ln_f": 1,
            **{f"transformer.h.{i}": 0 if i < LAYERS // 2 else 1 for i in range(LAYERS)}}

    def step(model, ids, labels):
        loss = example.loss(model(ids), labels)
        model.backward(loss)
        return loss

    return example.model, pins, step


def hf_llama() -> tuple[torch.nn.Module, dict[str, int], Any]:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    pins = {"": 0, "model": 0, "model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1,
            **{f"model.layers.{i}": 0 if i < LAYERS // 2 else 1 for i in range(LAYERS)}}

    def step(model, ids, labels):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    return model, pins, step


MODELS = {"zoo GPT-2 (tied head)": zoo_gpt2, "HF Llama (untied head)": hf_llama}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and the next tokens (the Llama step gives its ids as labels: it shifts them itself)."""
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def measure(rank: int | None, name: str, programs: bool, steps: int) -> dict[str, Any]:
    """A few steps of one model; the last step's traffic and the first step's time."""
    model, pins, body = MODELS[name]()
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, pin=pins, timeout_s=120,
                step_programs=programs)
    try:
        dm = smpart.DistributedModel(model)
        step = smpart.step(body)
        ids, labels = batch()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = step(dm, ids, labels)
            times.append(time.perf_counter() - start)
            dm.zero_grad()
        timeline = out.timeline
        found = {"runtime": timeline.runtime, "messages": dict(timeline.messages),
                 "bytes": dict(timeline.bytes_sent), "first": times[0]}
        if not programs:
            found["recording"] = recording_ratio(dm, step, ids, labels, steps)
        return found
    finally:
        smpart.shutdown()


def recording_ratio(model: Any, step: Any, ids: torch.Tensor, labels: torch.Tensor, rounds: int) -> float:
    """A reference step recording its calls' templates ÷ the same step not recording (medians)."""
    from smpart.runtime.program import templates

    timed: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(max(rounds, 3)):
        for record in (True, False):
            templates.start_recording(templates.Recorder() if record else None)
            start = time.perf_counter()
            step(model, ids, labels)
            timed[record].append(time.perf_counter() - start)
            templates.start_recording(None)
            model.zero_grad()
    return statistics.median(timed[True]) / statistics.median(timed[False])


def torch_bytes(name: str, processes: bool) -> dict[tuple[int, int], int]:
    """torch's schedules' bytes per micro-batch on each ordered pair of stages (see the docstring)."""
    hidden = BATCH // MICROBATCHES * SEQ * WIDTH * 4
    labels = BATCH // MICROBATCHES * SEQ * 8 if processes else 0
    if name.startswith("zoo"):  # 0 -> 1 -> 0: two cuts, each an activation and a gradient
        return {(0, 1): 2 * hidden, (1, 0): 2 * hidden}
    return {(0, 1): hidden + labels, (1, 0): hidden}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", action="store_true", help="stages on threads of this process")
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[tuple[str, bool], dict[str, Any]] = {}
    pool = None if a.threads else RankPool(2)
    try:
        for name in MODELS:
            for programs in (True, False):
                if pool is None:
                    results[(name, programs)] = measure(None, name, programs, a.steps)
                else:
                    results[(name, programs)] = pool.run(measure, name, programs, a.steps)[0]
    finally:
        if pool is not None:
            pool.close()
    where = "threads" if a.threads else "2 processes"
    title = f"per micro-batch, 2 stages on {where}, batch {BATCH} in {MICROBATCHES} micro-batches"
    table = Table(title=title)
    for column in ("model", "runtime", "cut", "messages", "bytes", "torch's bytes", "÷ torch"):
        table.add_column(column, justify="left" if column in ("model", "runtime") else "right")
    for (name, _), found in results.items():
        ideal = torch_bytes(name, not a.threads)
        for pair in sorted(set(found["bytes"]) | set(found["messages"]) | set(ideal)):
            sent = found["bytes"].get(pair, 0) / MICROBATCHES
            messages = found["messages"].get(pair)
            table.add_row(name, found["runtime"], f"{pair[0]} -> {pair[1]}",
                          "" if messages is None else f"{messages / MICROBATCHES:g}", f"{sent:,.0f}",
                          f"{ideal.get(pair, 0):,}", f"{sent / ideal[pair]:.2f}" if ideal.get(pair) else "")
    Console().print(table)
    for name in MODELS:
        found = results[(name, False)]
        print(f"{name}: a reference step that records ÷ one that does not: {found['recording']:.2f} "
              f"(goal <= 1.5); the first step, which also traces and places the model: "
              f"{results[(name, True)]['first'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
