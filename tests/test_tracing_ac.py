"""What activation checkpointing does to a `ModuleTree`'s costs: by hand, by transform, by trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.models import albert, gpt2, t5
from smpart.errors import ConfigError
from smpart.runtime.placement.activation_checkpointing import apply, checkpointed_names, remove
from smpart.tracing.tracer import recomputes_forward, trace
from smpart.tracing.tree import ModuleTree, with_activation_checkpointing


def tiny_tree() -> ModuleTree:
    return ModuleTree.from_spec({"name": "", "children": [
        {"name": "emb", "flops": 10, "saved_bytes": 8, "checkpoint_bytes": 8, "param_bytes": 4},
        {"name": "block", "flops": 100, "saved_bytes": 50, "checkpoint_bytes": 20, "children": [
            {"name": "block.attn", "flops": 60, "saved_bytes": 30, "checkpoint_bytes": 20},
            {"name": "block.mlp", "flops": 40, "saved_bytes": 40, "checkpoint_bytes": 20}]},
        {"name": "head", "flops": 5, "saved_bytes": 20, "checkpoint_bytes": 20}]})


def test_a_checkpointed_module_keeps_its_inputs_and_runs_its_forward_twice():
    tree = tiny_tree()
    assert tree.forward_share == pytest.approx(1 / 3)
    done = with_activation_checkpointing(tree, ["block"])
    # what is kept for the backward: emb 8 + head 20 + the block's input 20 (was 50 + 30 + 40)
    assert sum(done.activation_memory_of(n) for n in done.nodes()) == 8 + 20 + 20
    assert sum(tree.activation_memory_of(n) for n in tree.nodes()) == 8 + 50 + 30 + 40 + 20
    assert [done.node(n).saved_bytes for n in ("block", "block.attn", "block.mlp")] == [20, 0, 0]
    assert done.node("block").checkpointed and not done.node("block.attn").checkpointed
    assert all(done.node(n).recomputed for n in ("block", "block.attn", "block.mlp"))
    assert not done.node("emb").recomputed and not done.node("head").recomputed
    # one more forward: with backward = 2 × forward, a step of 3·F becomes 4·F
    assert done.compute_of(done.node("block.attn")) == pytest.approx(60 * 4 / 3)
    assert done.total_compute() == pytest.approx(215 + 200 / 3)
    assert done.base_compute_of(done.node("block")) == 100 and tree.total_compute() == 215
    assert done.memory_of(done.node("emb")) == tree.memory_of(tree.node("emb"))
    # the original is untouched, the result survives JSON
    assert tree.node("block").saved_bytes == 50 and not tree.node("block").recomputed
    again = ModuleTree.from_json(done.to_json())
    assert again.node("block.mlp").recomputed and again.total_compute() == pytest.approx(done.total_compute())


def test_the_outermost_checkpoint_wins():
    inner_first = with_activation_checkpointing(tiny_tree(), ["block.attn", "block"])
    assert inner_first.node("block").saved_bytes == 20 and inner_first.node("block.attn").saved_bytes == 0
    assert not inner_first.node("block.attn").checkpointed
    inner_after = with_activation_checkpointing(inner_first, ["block.mlp"])  # already recomputed
    assert inner_after.to_dict() == inner_first.to_dict()


def test_partition_costs_see_checkpointing():
    tree = with_activation_checkpointing(tiny_tree(), ["block"])
    costs = tree.node_costs(memory_weight=0.5)
    assert sum(costs.values()) == pytest.approx(1.0)
    plain = tiny_tree().node_costs(memory_weight=0.5)
    assert costs["block.mlp"] < plain["block.mlp"]  # memory gone, compute up by a third
    assert costs["emb"] > plain["emb"]


def test_bad_names():
    with pytest.raises(ConfigError, match="no module 'nope'"):
        with_activation_checkpointing(tiny_tree(), ["nope"])
    spec = tiny_tree().to_dict()
    spec["root"]["children"][1].pop("checkpoint_bytes")
    with pytest.raises(ConfigError, match="'block' has no checkpoint_bytes.*trace the model again"):
        with_activation_checkpointing(ModuleTree.from_dict(spec), ["block"])


def test_older_json_without_the_new_fields_loads():
    data = tiny_tree().to_dict()
    data.pop("forward_share")
    for node in [data["root"], *data["root"]["children"]]:
        for key in ("checkpoint_bytes", "checkpointed", "recomputed"):
            node.pop(key)
    tree = ModuleTree.from_dict(data)
    assert tree.node("emb").checkpoint_bytes is None and not tree.node("emb").recomputed
    assert tree.total_compute() == 215


# ---------------------------------------------------------------------------- traced
def test_trace_counts_what_checkpointing_would_keep():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    tree = trace(model, torch.randn(3, 4))
    # each module's input; the last also returns the model's output, which the loss keeps anyway
    assert [tree.node(n).checkpoint_bytes for n in ("", "0", "1", "2")] == [
        3 * 4 * 4, 3 * 4 * 4, 3 * 8 * 4, 3 * 8 * 4 + 3 * 2 * 4]
    layer = trace((ex := albert()).model, ex.args).node("layer")
    assert layer.checkpoint_bytes == ex.model.n_repeat * 4 * 16 * 32 * 4  # one (B, T, C) input per call


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_tracing_a_checkpointed_model_equals_transforming_its_tree(device):
    """GPT: the transform predicts exactly what a trace with checkpointing installed counts."""
    example = gpt2()
    model = example.model
    names = checkpointed_names(model, ["transformer.h.*"], registry=None)
    plain = trace(model, example.args, device=device)
    apply(model, names)
    try:
        assert all(recomputes_forward(model.get_submodule(n)) for n in names)
        traced = trace(model, example.args, device=device)
    finally:
        remove(model)
    predicted = with_activation_checkpointing(plain, names)
    assert all(p.grad is None for p in model.parameters())
    for node in traced.nodes():
        other = predicted.node(node.name)
        assert (node.saved_bytes, node.recomputed, node.checkpointed) == \
               (other.saved_bytes, other.recomputed, other.checkpointed), node.name
    assert traced.total_compute() == pytest.approx(predicted.total_compute())
    assert traced.total_memory() < plain.total_memory()
    block = traced.node("transformer.h.0")
    assert block.saved_bytes == block.checkpoint_bytes == 4 * 16 * 32 * 4


def test_a_tensor_given_to_every_checkpointed_block_is_kept_once():
    """T5's decoder blocks all take the encoder's output: a trace counts it once, the per-node
    transform once per block (an upper bound)."""
    example = t5()
    model = example.model
    names = checkpointed_names(model, ["decoder.block.*"], registry=None)
    predicted = with_activation_checkpointing(trace(model, example.args, example.kwargs), names)
    apply(model, names)
    try:
        traced = trace(model, example.args, example.kwargs)
    finally:
        remove(model)
    (input_ids,) = example.args
    memory = input_ids.numel() * 32 * 4  # the encoder's output, (B, T, C) in float32
    blocks = len(names)
    kept = sum(traced.node(n).saved_bytes for n in names)
    assert sum(predicted.node(n).saved_bytes for n in names) == kept + (blocks - 1) * memory


def test_measured_trace_of_a_checkpointed_model():
    example = gpt2()
    model = example.model
    apply(model, checkpointed_names(model, ["transformer.h.*"], registry=None))
    try:
        tree = trace(model, example.args, device=None, measure_time=True)
    finally:
        remove(model)
    assert tree.compute_unit == "time" and 0 < tree.forward_share <= 1
    block = tree.node("transformer.h.0.mlp")
    assert block.recomputed
    assert tree.compute_of(block) == pytest.approx(block.time_s * (1 + tree.forward_share))
