"""Bytes crossing stage boundaries per step, against a chain's ideal, on the GPT-2 zoo model.

The zoo's GPT-2 (8 layers, width 32, 16 tokens, vocabulary 64, tied embeddings: ``lm_head`` lives
with ``wte``), batch 8, 4 micro-batches, split by smpart's own partitioner into 2 and into 4 stages
on threads (the thread transport counts the bytes a process transport would send; ``--processes``
confirms it on 2 processes, and `--processes 4` on 4). One step after the placing one is counted.

Ideal: the model's leaf modules in call order (as the unsplit model runs them) each have a stage;
every change of stage between consecutive leaves is a cut a chain would have, and each cut moves
the activation (micro-batch x seq x n_embd x 4 bytes) forward and its gradient backward, once per
micro-batch. The partitioner's own estimate, ``partition.cut_bytes()`` (the trace's producer ->
consumer data flow, one traced micro-batch, forward), is printed beside it.

Where bytes beyond the ideal come from, every tensor-carrying message crossing between stages is
logged: its kind (``Request``: a call's arguments, ``Response``: its outputs, ``Gradients``), the
module called, and its stages, then summed over the step. A ``Response`` whose outputs are next
sent back as the arguments of a call to the stage that made them is a *bounce*: the caller (the
root module's stage) relays a tensor it does not compute with.

    .venv/bin/python bench/bytes_crossing.py [--stages 2 4] [--processes 2]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from examples.models import gpt2  # noqa: E402
from smpart.runtime.runtime import current_runtime  # noqa: E402
from smpart.runtime.wire.transport import payload_bytes  # noqa: E402

BATCH, MICROBATCHES = 8, 4


def example() -> Any:
    return gpt2(batch_size=BATCH)


@smpart.step
def train_step(model, ex, idx, target):
    loss = ex.loss(model(idx), target)
    model.backward(loss)
    return loss


def leaf_order(model: torch.nn.Module, args: tuple) -> list[str]:
    """Names of the leaf modules in the order the unsplit model calls them."""
    order: list[str] = []
    hooks = [module.register_forward_pre_hook(lambda _m, _a, name=name: order.append(name))
             for name, module in model.named_modules() if not any(True for _ in module.children())]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for hook in hooks:
            hook.remove()
    return order


def chain_cuts(order: list[str], stages: dict[str, int]) -> list[tuple[str, str, int, int]]:
    cuts = []
    for a, b in zip(order, order[1:], strict=False):
        if stages[a] != stages[b]:
            cuts.append((a, b, stages[a], stages[b]))
    return cuts


def measure(stages: int, log_messages: bool = True, pin: dict[str, int] | None = None) -> dict[str, Any]:
    """One counted step on whatever this process is (threads, or a rank of a pool)."""
    ex = example()
    order = leaf_order(ex.model, ex.args)
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, pipeline="1f1b", timeout_s=120,
                pin=pin or {})
    try:
        model = smpart.DistributedModel(ex.model)
        train_step(model, ex, *ex.args, ex.target)  # trace, partition, place
        partition = smpart.partition_of(model)
        module_stages = dict(partition.module_stages())
        log: list[tuple[str, str, int, int, int, int, Any]] = []
        transport = current_runtime().transport
        if log_messages:
            send, modules = transport.send, {}

            def logged_send(src: int, address: Any, message: Any) -> None:
                if type(message).__name__ == "Batch":  # messages sent together
                    for each in message.messages:
                        logged_send(src, address, each)
                    return
                kind = type(message).__name__
                call_id = getattr(message, "call_id", None)
                if kind == "Request":
                    modules[call_id] = message.module
                elif kind == "Fetch":  # a handle materialised: its answer carries the held output
                    modules[call_id] = f"{modules.get(message.of_call, '?')} (fetched)"
                size = payload_bytes(message)
                if address[0] != src and size:
                    log.append((kind, modules.get(call_id, "?"), message.microbatch, src, address[0], size,
                                call_id))
                send(src, address, message)

            transport.send = logged_send  # an instance attribute: senders look it up at every call
        runs: dict[str, int] = defaultdict(int)  # backward computations of each block's first weight
        hooks = [block.attn.c_attn.weight.register_hook(lambda g, i=i: runs.__setitem__(i, runs[i] + 1))
                 for i, block in enumerate(ex.model.transformer.h)] if log_messages else []
        try:
            out = train_step(model, ex, *ex.args, ex.target)
        finally:
            if log_messages:
                del transport.send
            for hook in hooks:
                hook.remove()
        return {"bytes_sent": dict(out.timeline.bytes_sent), "log": log, "module_stages": module_stages,
                "order": order, "cut_bytes": partition.cut_bytes(), "loss": out.reduce_mean().item(),
                "events": list(out.timeline.events), "weight_grads": dict(runs)}
    finally:
        smpart.shutdown()


def on_rank(rank: int, stages: int, pin: dict[str, int] | None = None) -> dict[str, int] | None:
    result = measure(stages, log_messages=False, pin=pin)
    return result["bytes_sent"] if rank == 0 else None


def whole_blocks(module_stages: dict[str, int]) -> dict[str, int] | None:
    """Pins that keep the partition's stages but never cut inside a block (each block goes whole to
    its own code's stage); None if no block is cut inside."""
    top = {n: s for n, s in module_stages.items() if n.count(".") <= 2 and n != "transformer.h"}
    split = any(module_stages[n] != module_stages[n.rsplit(".", 1)[0]] for n in module_stages
                if n.startswith("transformer.h.") and n.count(".") == 3)
    return top if split else None


def report(stages: int, r: dict[str, Any], n_embd: int, seq: int,
           title: str = "") -> dict[tuple[int, int], int]:
    ms = r["module_stages"]
    top = [name for name in ms if name.count(".") <= 2 and name not in ("transformer.h",)]
    placed = ", ".join(f"{n or '<root>'}:{ms[n]}" for n in top)
    print(f"\n== {stages} stages{title}: {placed}")
    blocks = [n for n in ms if n.startswith("transformer.h.") and n.count(".") == 3]
    split_inside = sorted({n.rsplit(".", 1)[0] for n in blocks if ms[n] != ms[n.rsplit(".", 1)[0]]})
    for name in split_inside:
        inner = {n.removeprefix(name + "."): ms[n] for n in blocks if n.startswith(name + ".")}
        print(f"   {name} is split: its own code on stage {ms[name]}, children {inner}")
    sent = r["bytes_sent"]
    total = sum(sent.values())
    for pair in sorted(sent):
        print(f"   {pair[0]} -> {pair[1]}: {sent[pair]:8d} B")
    activation = BATCH // MICROBATCHES * seq * n_embd * 4
    cuts = chain_cuts(r["order"], ms)
    ideal = len(cuts) * activation * 2 * MICROBATCHES
    print("   chain cuts (leaves in call order): "
          + ", ".join(f"{a} ({s}) -> {b} ({t})" for a, b, s, t in cuts))
    print(f"   total {total} B per step; ideal {len(cuts)} cuts x {activation} B (micro-batch activation) "
          f"x 2 (forward, backward) x {MICROBATCHES} micro-batches = {ideal} B;  ratio {total / ideal:.2f} "
          f"(goal 1.00)")
    print(f"   partition.cut_bytes() (the trace's data flow, one micro-batch, forward): {r['cut_bytes']} B "
          f"= {r['cut_bytes'] / activation:.1f} activations")
    # Where the bytes go: per (kind, module, src -> dst), summed over micro-batches.
    by_key: dict[tuple[str, str, int, int], list[int]] = defaultdict(lambda: [0, 0])
    for kind, module, _mb, src, dst, size, _cid in r["log"]:
        entry = by_key[(kind, module, src, dst)]
        entry[0] += size
        entry[1] += 1
    logged = sum(v[0] for v in by_key.values())
    print(f"   messages crossing stages ({logged} B logged), per step:")
    print(f"     {'kind':<10} {'module':<26} {'stages':>7} {'bytes':>8} {'msgs':>5} {'x activ.':>8}")
    rows = sorted(by_key.items(), key=lambda kv: (kv[0][0] != "Request", kv[0][0], kv[0][1]))
    for (kind, module, src, dst), (size, count) in rows:
        print(f"     {kind:<10} {module:<26} {src:>3}->{dst:<3} {size:>8} {count:>5} "
              f"{size / (activation * MICROBATCHES):8.2f}")
    explain(r["log"], activation, ideal, total)
    spans: dict[int, int] = defaultdict(int)
    for event in r["events"]:
        if event["kind"] == "backward":
            spans[event["stage"]] += 1
    print("   backward spans per micro-batch (timeline), by stage: "
          + ", ".join(f"{s}: {spans[s] / MICROBATCHES:.2f}" for s in sorted(spans))
          + "  (1.00 each when every stage's backward runs as one segment)")
    runs = r["weight_grads"]
    print("   backward passes through each block per micro-batch (gradient hook on h.i.attn.c_attn.weight): "
          + ", ".join(f"h.{i}: {runs[i] / MICROBATCHES:.2f}" for i in sorted(runs)) + "  (ideal 1.00)")
    return sent


def explain(log: list[tuple], activation: int, ideal: int, total: int) -> None:
    """Split the bytes into forward-chain, bounced forward outputs and backward ones."""
    forward = [m for m in log if m[0] in ("Request", "Response")]
    backward = [m for m in log if m[0] == "Gradients"]
    # A bounce: a Response from stage s to stage c, followed (same micro-batch) by a Request from c
    # back to s whose argument is that output: counted as Response(s -> c) immediately followed, in
    # the micro-batch's message order, by a Request(c -> s).
    bounced = 0
    by_mb: dict[int, list[tuple]] = defaultdict(list)
    for m in forward:
        by_mb[m[2]].append(m)
    for messages in by_mb.values():
        for a, b in zip(messages, messages[1:], strict=False):
            if a[0] == "Response" and b[0] == "Request" and (a[3], a[4]) == (b[4], b[3]):
                bounced += a[5] + b[5]
    fwd = sum(m[5] for m in forward)
    bwd = sum(m[5] for m in backward)
    grad_msgs: dict[tuple, int] = defaultdict(int)
    for m in backward:
        grad_msgs[(m[2], m[6], m[3], m[4])] += 1
    repeated = sum(n - 1 for n in grad_msgs.values() if n > 1)
    print(f"   forward {fwd} B ({fwd / ideal * 2:.2f}x the forward ideal), of which {bounced} B are bounces "
          f"(an output sent back to its caller's stage, then straight back as the next call's argument); "
          f"backward {bwd} B ({bwd / ideal * 2:.2f}x the backward ideal), {len(backward)} gradient messages, "
          f"{repeated} of them repeat a (micro-batch, call, direction) already sent: partial gradients of "
          "one tensor sent separately")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--processes", type=int, nargs="*", default=[2],
                        help="also count on this many processes (world size = stages)")
    a = parser.parse_args()
    ex = example()
    cfg = ex.model.config
    seq = ex.args[0].shape[1]
    print(f"GPT-2 zoo model: {cfg.n_layer} layers, n_embd {cfg.n_embd}, seq {seq}, vocab {cfg.vocab_size}, "
          f"batch {BATCH}, {MICROBATCHES} micro-batches, 1f1b; bytes of one step (threads)")
    threads, pins = {}, {}
    for s in a.stages:
        r = measure(s)
        threads[(s, None)] = report(s, r, cfg.n_embd, seq)
        pins[s] = whole_blocks(r["module_stages"])
        if pins[s] is not None:  # the same stages, with the block cut inside kept whole
            threads[(s, "whole")] = report(s, measure(s, pin=pins[s]), cfg.n_embd, seq,
                                           " (the same, split blocks kept whole by pins)")
    if a.processes:
        from bench.rank_pool import RankPool

        for world in a.processes:
            if world not in pins:
                pins[world] = whole_blocks(measure(world, log_messages=False)["module_stages"])
            runs = [(None, None)] + ([("whole", pins[world])] if pins[world] is not None else [])
            with RankPool(world) as pool:
                for key, pin in runs:
                    sent = pool.run(on_rank, world, pin)[0]
                    ref = threads.get((world, key), sent)
                    diff = {k: sent.get(k, 0) - ref.get(k, 0) for k in set(sent) | set(ref)}
                    diff = {k: v for k, v in diff.items() if v}
                    what = " (split blocks kept whole)" if key else ""
                    same = diff or "nothing (the same)"
                    print(f"\n{world} processes{what}: bytes_sent {dict(sorted(sent.items()))}, total "
                          f"{sum(sent.values())} B; minus the thread runtime's count: {same}")
                    result_bytes = MICROBATCHES * 4
                    if any(v == result_bytes and k[0] == 0 for k, v in diff.items()):
                        print("   (the process transport also counts the previous step's StepResult, "
                              f"which carries the {MICROBATCHES} float32 losses from the driver's rank to "
                              f"the others: {result_bytes} B per other rank)")
                    if any(not (v == result_bytes and k[0] == 0) for k, v in diff.items()):
                        print("   (the rest varies from run to run: how many partial gradients of one "
                              "tensor go separately depends on whether they arrive before the stage's "
                              "backward segment runs)")


if __name__ == "__main__":
    main()
