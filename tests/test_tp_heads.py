"""Tensor parallelism for attention no adapter knows (`smpart.tensor_parallel.heads`).

nanoGPT's, timm's and torchtitan's attention (`tests.foreign_attention`) are split by heads,
proven on the spot, and trained at tp 2 on two processes step for step like the unsplit model;
attention whose split would compute something else stays whole with one warning per class; the
planner prices what the swap splits.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import smpart
from smpart.tensor_parallel import TensorParallelWarning, plan_tensor_parallel
from smpart.tensor_parallel.heads import find_head_split
from tests.foreign_attention import (
    MixingAttention,
    NanoConfig,
    NanoGPT,
    TinyViT,
    TitanArgs,
    Transformer,
)
from tests.launch import run_ranks, values

TOL = 1e-8
STEPS = 3
MICROBATCHES = 2


def _plan(model, degree=2, batch=None):
    """The plan (with the traced calls when ``batch`` is given) and the warnings it emitted."""
    tree = smpart.trace(model, batch) if batch is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_tensor_parallel(model, degree, example_inputs=tree, require_split=False)
    return plan, [str(w.message) for w in caught if issubclass(w.category, TensorParallelWarning)]


def _ids(*shape, seed=0):
    return torch.randint(64, shape, generator=torch.Generator().manual_seed(seed))


# ==================================================================== the plan
def test_nanogpt_attention_splits_by_heads_and_reads_its_width_from_its_share():
    plan, warned = _plan(NanoGPT(NanoConfig(n_layer=4)))
    assert warned == []  # it used to warn twice per layer and keep every attention whole
    assert sorted(plan.attention) == [f"transformer.h.{i}.attn" for i in range(4)]
    split = plan.attention["transformer.h.0.attn"]
    assert (split.q_heads, split.kv_heads, split.heads.attributes) == (4, 4, ("n_head", "n_embd"))
    assert split.heads.local_width == 32  # B, T, C = x.size(): C is handed its share
    c_attn = plan["transformer.h.0.attn.c_attn"]
    assert (c_attn.style, c_attn.fused) == ("column", 3)
    assert plan["transformer.h.0.attn.c_proj"].style == "row"
    assert plan["transformer.h.0.mlp.c_fc"].style == "column"


def test_timm_attention_splits_with_its_attention_width_divided():
    plan, warned = _plan(TinyViT(qk_norm=True))
    assert warned == []
    split = plan.attention["blocks.1.attn"]
    assert split.heads.attributes == ("num_heads", "attn_dim") and split.heads.local_width is None
    assert plan["blocks.1.attn.qkv"].fused == 3 and plan["blocks.1.attn.proj"].style == "row"


def test_torchtitan_grouped_kv_attention_splits_with_its_traced_arguments():
    """Its forward needs ``freqs_cis``: the traced call lends the proof an example of it."""
    model = Transformer(TitanArgs())
    plan, warned = _plan(model, batch=(_ids(2, 12),))
    assert warned == []
    split = plan.attention["layers.1.attention"]
    assert (split.q_heads, split.kv_heads, split.heads.attributes) == (4, 2, ("n_heads", "n_kv_heads"))
    assert {n: plan[f"layers.1.attention.{n}"].style for n in ("wq", "wk", "wv", "wo")} == {
        "wq": "column", "wk": "column", "wv": "column", "wo": "row"}
    # its gated MLP, registered w1, w2, w3 and run w1, w3, w2, pairs too
    assert {n: plan[f"layers.1.feed_forward.{n}"].style for n in ("w1", "w2", "w3")} == {
        "w1": "column", "w2": "row", "w3": "column"}
    # without an example of freqs_cis it cannot be run alone: whole, one warning for both layers
    plan, warned = _plan(model)
    assert plan.attention == {} and len(warned) == 1
    assert warned[0].startswith("2 TitanAttention modules stay whole "
                                "(layers.0.attention ... layers.1.attention)")
    assert "could not be run alone" in warned[0] and "freqs_cis" in warned[0]


def test_an_attention_whose_split_computes_something_else_stays_whole_with_one_warning():
    """Centring over all heads before the output projection: each rank would centre its own."""
    model = NanoGPT(NanoConfig(n_layer=3))
    for block in model.transformer.h:
        block.attn = MixingAttention(NanoConfig())
    plan, warned = _plan(model)
    assert plan.attention == {} and plan["transformer.h.0.attn.c_attn"].style == "none"
    assert plan["transformer.h.0.mlp.c_fc"].style == "column"  # the rest still splits
    (message,) = warned
    assert message.startswith("3 MixingAttention modules stay whole "
                              "(transformer.h.0.attn ... transformer.h.2.attn)")
    assert "computes something else" in message and "off the whole module's" in message


def test_heads_that_do_not_divide_are_refused_without_a_proof_and_warned_once():
    plan, warned = _plan(NanoGPT(NanoConfig(n_layer=2, n_head=2)), degree=4)
    assert plan.attention == {}
    assert warned == ["2 CausalSelfAttention modules stay whole "
                      "(transformer.h.0.attn ... transformer.h.1.attn): "
                      "2 heads cannot be shared out evenly over tensor-parallel degree 4"]


def test_a_norm_over_the_heads_output_cannot_be_split():
    plan, warned = _plan(TinyViT(scale_norm=True))
    assert plan.attention == {} and len(warned) == 1
    assert "2 Attention modules stay whole" in warned[0] and "it fails (RuntimeError" in warned[0]


def test_a_model_built_on_meta_is_proven_as_well_as_a_real_one():
    with torch.device("meta"):
        model = NanoGPT(NanoConfig())
    plan, warned = _plan(model)
    assert warned == [] and len(plan.attention) == 2
    assert all(p.is_meta for p in model.parameters())  # the proof ran on its own copy


def test_a_proof_is_made_once_per_class_and_shape():
    from smpart.tensor_parallel import heads

    heads._PROVEN.clear()
    model = NanoGPT(NanoConfig(n_layer=4))
    calls = []
    original = heads._find
    heads._find = lambda *args: calls.append(args[0]) or original(*args)
    try:
        _plan(model)
    finally:
        heads._find = original
    assert len(calls) == 1
    assert find_head_split(model.transformer.h[3].attn, 2) == find_head_split(model.transformer.h[0].attn, 2)


def test_the_planner_prices_the_attention_the_swap_now_splits():
    tree = smpart.trace(NanoGPT(NanoConfig()), (_ids(2, 12),))
    share = tree.node("transformer.h.0.attn").tp_split[2]
    assert share.style == "heads" and share.flops == 1.0
    assert tree.node("transformer.h.0.attn.c_attn").tp_split[2].style == "column"
    assert tree.node("transformer.h.0.attn.c_proj").tp_split[2].forward_bytes > 0  # its all-reduce
    mixing = NanoGPT(NanoConfig())
    for block in mixing.transformer.h:
        block.attn = MixingAttention(NanoConfig())
    tree = smpart.trace(mixing, (_ids(2, 12),))
    for name in ("transformer.h.0.attn", "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj"):
        share = tree.node(name).tp_split.get(2)
        assert share is None or (not share.split and share.params == share.flops == 0.0), name
    assert tree.node("transformer.h.0.mlp.c_fc").tp_split[2].style == "column"


# ==================================================================== trained at tp 2 on processes
def _nano():
    torch.manual_seed(0)
    model = NanoGPT(NanoConfig(flash=False)).double()

    def batch(seed):
        ids = _ids(4, 12, seed=seed)
        return (ids, ids.roll(-1, dims=1))

    return model, batch, lambda model, x, y: model(x, y)[1], "transformer.h.{}.attn"


def _timm():
    torch.manual_seed(0)
    model = TinyViT(qk_norm=True).double()

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        images = torch.randn(4, 3, 16, 16, generator=g, dtype=torch.float64)
        return images, torch.randint(10, (4,), generator=g)

    return model, batch, lambda model, x, y: F.cross_entropy(model(x), y), "blocks.{}.attn"


def _titan():
    torch.manual_seed(0)
    model = Transformer(TitanArgs()).double()

    def batch(seed):
        ids = _ids(4, 12, seed=seed)
        return (ids, ids.roll(-1, dims=1))

    return model, batch, lambda model, x, y: F.cross_entropy(model(x).flatten(0, 1), y.flatten()), \
        "layers.{}.attention"


MODELS = {"nanogpt": _nano, "timm": _timm, "torchtitan": _titan}


def _split_and_train(rank: int) -> dict:
    out = {}
    for name, make in MODELS.items():
        model, batch, loss_of, attention = make()
        reference = copy.deepcopy(model)
        smpart.init(tensor_parallel_degree=2, microbatches=MICROBATCHES, timeout_s=60)

        @smpart.step
        def train(model, x, y, loss_of=loss_of):
            loss = loss_of(model, x, y)
            model.backward(loss)
            return loss

        split = smpart.DistributedModel(model)
        optimizer = smpart.DistributedOptimizer(torch.optim.SGD(split.parameters(), lr=0.1))
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        loss_diff = 0.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                x, y = batch(step)
                losses = train(split, x, y).stack()
                expected = []
                for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
                    loss = loss_of(reference, xs, ys)
                    (loss / MICROBATCHES).backward()
                    expected.append(loss.detach())
                loss_diff = max(loss_diff, (losses - torch.stack(expected)).abs().max().item())
                for opt in (optimizer, ref_optimizer):
                    opt.step()
                    opt.zero_grad()
        full = split.state_dict()
        state_diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()
                         if k in full)
        plan = split.tensor_parallel_plan
        first = split.module.get_submodule(attention.format(0))
        out[name] = {
            "loss": loss_diff, "state": state_diff, "keys": sorted(full) == sorted(reference.state_dict()),
            "attention": sorted(plan.attention),
            "expected": [attention.format(i) for i in range(2)],
            "local": {a: getattr(first, a) for a in plan.attention[attention.format(0)].heads.attributes},
            "warned": [str(w.message) for w in caught if issubclass(w.category, TensorParallelWarning)],
        }
        smpart.shutdown()
    return out


@pytest.mark.timeout(240)
def test_foreign_attention_trains_at_tp2_on_processes_like_the_unsplit_model():
    for report in values(run_ranks(_split_and_train, 2, timeout_s=220)):
        for name, r in report.items():
            assert r["attention"] == r["expected"], name  # every layer's attention is split
            assert r["loss"] <= TOL and r["state"] <= TOL and r["keys"], (name, r)
            assert not any("stays whole" in w and "ttention" in w for w in r["warned"]), (name, r["warned"])
        assert report["nanogpt"]["local"] == {"n_head": 2, "n_embd": 16}
        assert report["timm"]["local"] == {"num_heads": 2, "attn_dim": 16}
        assert report["torchtitan"]["local"] == {"n_heads": 2, "n_kv_heads": 1}
