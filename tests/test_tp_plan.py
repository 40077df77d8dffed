"""The tensor-parallel plan's decisions, module by module (no processes: decisions only)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smpart
from examples.models import MLP, albert, gpt2, moe, resnet, t5, transgan
from smpart.errors import SmpartError
from smpart.tensor_parallel import (
    TensorParallelWarning,
    plan_tensor_parallel,
    set_tensor_parallelism,
    split_totals,
    splittable_fraction,
    tensor_parallelism,
)

transformers = pytest.importorskip("transformers")


def _plan(model, degree=2, **kwargs):
    """The plan and the warnings it emitted (as strings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_tensor_parallel(model, degree, **kwargs)
    return plan, [str(w.message) for w in caught if issubclass(w.category, TensorParallelWarning)]


def _styles(plan, prefix=""):
    """``{name without prefix: (style, fused, gather)}`` of every planned module under ``prefix``."""
    return {n[len(prefix):]: (d.style, d.fused, d.gather_output)
            for n, d in plan.decisions.items() if n.startswith(prefix)}


# ==================================================================== the zoo
def test_zoo_gpt2_splits_attention_by_heads_mlp_by_pairs_and_ties_the_head():
    plan, warned = _plan(gpt2().model)
    assert warned == []
    assert _styles(plan, "transformer.h.3.") == {
        "attn.c_attn": ("column", 3, False),
        "attn.c_proj": ("row", 1, False),
        "mlp.c_fc": ("column", 1, False),
        "mlp.c_proj": ("row", 1, False),
    }
    assert plan["transformer.wte"].style == "vocab"
    assert plan["transformer.wpe"].style == "vocab"
    # the LM head is the embedding's weight: both hold vocabulary rows, so it splits with it
    assert (plan["lm_head"].style, plan["lm_head"].gather_output) == ("column", True)
    assert plan.attention["transformer.h.3.attn"].q_heads == 4
    assert "elementwise" in plan["transformer.h.3.mlp.c_fc"].reason
    assert plan.split_param_fraction() == pytest.approx(1.0, abs=0.01)


def test_zoo_t5_cross_attention_and_shared_embedding():
    plan, warned = _plan(t5().model)
    assert warned == []
    assert _styles(plan, "decoder.block.0.cross_attn.") == {
        "q": ("column", 1, False), "kv": ("column", 2, False), "o": ("row", 1, False)}
    assert plan["shared"].style == "vocab"
    assert set(plan["shared"].names) == {"shared", "encoder.embed_tokens", "decoder.embed_tokens"}
    assert (plan["lm_head"].style, plan["lm_head"].gather_output) == ("column", True)


def test_zoo_moe_splits_each_expert_and_keeps_the_router():
    plan, _ = _plan(moe().model)
    assert plan["transformer.h.0.mlp.router"].style == "none"
    assert "partner" in plan["transformer.h.0.mlp.router"].reason
    for e in range(8):
        assert _styles(plan, f"transformer.h.0.mlp.experts.{e}.") == {
            "c_fc": ("column", 1, False), "c_proj": ("row", 1, False)}


def test_zoo_transgan_keeps_its_narrow_one_head_attention_whole_and_warns():
    plan, warned = _plan(transgan().model)
    column, row, whole = ("column", 1, False), ("row", 1, False), ("none", 1, False)
    assert _styles(plan, "wide_blocks.0.attn.") == {"c_attn": ("column", 3, False), "c_proj": row}
    assert _styles(plan, "narrow_blocks.5.attn.") == {"c_attn": whole, "c_proj": whole}
    assert _styles(plan, "narrow_blocks.5.mlp.") == {"c_fc": column, "c_proj": row}
    assert plan["embed"].style == "none" and plan["to_pixels"].style == "none"
    # one warning for the class, with the count, not one per layer
    narrow = [w for w in warned if "narrow_blocks" in w]
    assert narrow == ["12 SelfAttention modules stay whole (narrow_blocks.0.attn ... narrow_blocks.11.attn): "
                      "1 head cannot be shared out evenly over tensor-parallel degree 2"]
    assert not any("wide_blocks" in w for w in warned)


def test_zoo_albert_reused_layer_and_untied_head():
    plan, _ = _plan(albert().model)
    assert _styles(plan, "layer.") == {
        "attn.c_attn": ("column", 3, False), "attn.c_proj": ("row", 1, False),
        "mlp.c_fc": ("column", 1, False), "mlp.c_proj": ("row", 1, False)}
    assert plan["embedding_projection"].style == "none"
    assert (plan["head"].style, plan["head"].gather_output) == ("column", True)


def test_a_model_with_nothing_to_split_is_an_error():
    with pytest.raises(SmpartError, match="splits none of ResNet"):
        plan_tensor_parallel(resnet().model, 2, warn=False)
    plan = plan_tensor_parallel(resnet().model, 2, require_split=False, warn=False)
    assert plan.styles() == {}


def test_a_degree_larger_than_any_splittable_dimension_is_a_clear_error():
    with pytest.raises(SmpartError) as info:
        plan_tensor_parallel(gpt2().model, 512, warn=False)
    message = str(info.value)
    assert "512" in message and "largest splittable dimension is 128, smaller than the degree" in message
    with pytest.raises(SmpartError, match="positive int"):
        plan_tensor_parallel(gpt2().model, 0)


def test_heads_not_divisible_keep_the_attention_whole_but_split_the_mlp():
    plan, warned = _plan(gpt2(n_head=2).model, 4)
    assert plan["transformer.h.0.attn.c_attn"].style == "none"
    assert plan["transformer.h.0.mlp.c_fc"].style == "column"
    why = "2 heads cannot be shared out evenly over tensor-parallel degree 4"
    assert any("transformer.h.0.attn" in w and why in w for w in warned)


def test_tied_head_whose_vocabulary_does_not_divide_stays_whole_with_the_embedding():
    model = gpt2(vocab_size=63).model
    plan, warned = _plan(model)
    assert plan["lm_head"].style == "none"
    # the embedding falls back to a dimension split, which the tied head cannot share
    assert plan["transformer.wte"].style == "none"
    assert any("lm_head" in w and "shared" in w for w in warned)
    assert any("transformer.wte" in w and "shared" in w for w in warned)
    assert plan["transformer.h.0.mlp.c_fc"].style == "column"


def test_an_untied_embedding_whose_vocabulary_does_not_divide_splits_by_dimension():
    model = t5(vocab_size=63).model
    plan, _ = _plan(model)
    assert plan["shared"].style == "dim"
    assert plan["lm_head"].style == "none"


# ==================================================================== Hugging Face
def _llama(**sizes):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=64,
                                      bos_token_id=0, eos_token_id=0, **sizes)
    return transformers.LlamaForCausalLM(config)


def test_llama_follows_its_published_plan_with_grouped_kv_heads():
    plan, warned = _plan(_llama())
    assert warned == []
    assert _styles(plan, "model.layers.1.") == {
        "self_attn.q_proj": ("column", 1, False), "self_attn.k_proj": ("column", 1, False),
        "self_attn.v_proj": ("column", 1, False), "self_attn.o_proj": ("row", 1, False),
        "mlp.gate_proj": ("column", 1, False), "mlp.up_proj": ("column", 1, False),
        "mlp.down_proj": ("row", 1, False)}
    attention = plan.attention["model.layers.1.self_attn"]
    assert (attention.q_heads, attention.kv_heads) == (4, 2)
    assert plan["model.embed_tokens"].style == "vocab"
    assert plan["model.embed_tokens"].source == "published"
    assert (plan["lm_head"].style, plan["lm_head"].gather_output) == ("column", True)
    assert plan["model.layers.1.mlp.down_proj"].source == "published"


def test_llama_kv_heads_not_divisible_keep_attention_whole():
    plan, warned = _plan(_llama(), 4)
    assert plan["model.layers.0.self_attn.q_proj"].style == "none"
    assert plan["model.layers.0.mlp.gate_proj"].style == "column"
    assert any("4 q heads and 2 kv heads cannot be shared out evenly over tensor-parallel degree 4" in w
               for w in warned)


def test_llama_without_its_published_plan_decides_the_same_from_structure():
    published = plan_tensor_parallel(_llama(), 2, warn=False)
    structural = plan_tensor_parallel(_llama(), 2, use_published=False, warn=False)
    assert structural.styles() == published.styles()
    assert structural["model.layers.0.mlp.gate_proj"].source == "mlp"


def test_qwen2_and_mixtral_attention_split_and_fused_experts_stay_whole():
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=64))
    plan, warned = _plan(qwen)
    assert warned == []
    assert plan["model.layers.0.self_attn.k_proj"].style == "column"
    assert plan["model.layers.0.mlp.down_proj"].style == "row"
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=64, num_local_experts=4))
    plan, warned = _plan(mixtral)
    assert plan["model.layers.0.self_attn.o_proj"].style == "row"
    assert any("mlp.experts" in w and "moe_tp_experts" in w for w in warned)
    assert any("gate_up_proj" in w and "packed_colwise" in w for w in warned)


def _gpt2_hf(**sizes):
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=32, vocab_size=64,
                                     bos_token_id=0, eos_token_id=0, **sizes)
    return transformers.GPT2LMHeadModel(config)


def test_hf_gpt2_fused_conv1d_qkv_by_heads_and_tied_head():
    plan, warned = _plan(_gpt2_hf())
    assert warned == []
    assert _styles(plan, "transformer.h.1.") == {
        "attn.c_attn": ("column", 3, False), "attn.c_proj": ("row", 1, False),
        "mlp.c_fc": ("column", 1, False), "mlp.c_proj": ("row", 1, False)}
    assert plan["transformer.wte"].style == "vocab"
    assert (plan["lm_head"].style, plan["lm_head"].gather_output) == ("column", True)
    assert plan.attention["transformer.h.1.attn"].adapter == "transformers GPT2Attention"


def test_opt_attention_and_mlp_inside_the_decoder_layer():
    config = transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_attention_heads=4, num_hidden_layers=1,
                                    vocab_size=64, word_embed_proj_dim=32, max_position_embeddings=32)
    plan, warned = _plan(transformers.OPTForCausalLM(config))
    assert _styles(plan, "model.decoder.layers.0.") == {
        "self_attn.k_proj": ("column", 1, False), "self_attn.v_proj": ("column", 1, False),
        "self_attn.q_proj": ("column", 1, False), "self_attn.out_proj": ("row", 1, False),
        "fc1": ("column", 1, False), "fc2": ("row", 1, False)}
    assert plan["model.decoder.embed_positions"].style == "none"  # a subclass with its own forward
    assert any("embed_positions" in w and "own forward" in w for w in warned)


def test_bert_attention_output_in_a_sibling_and_the_tied_decoder_bias():
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_hidden_layers=1, vocab_size=64, max_position_embeddings=32)
    plan, warned = _plan(transformers.BertForMaskedLM(config))
    assert _styles(plan, "bert.encoder.layer.0.") == {
        "attention.self.query": ("column", 1, False), "attention.self.key": ("column", 1, False),
        "attention.self.value": ("column", 1, False), "attention.output.dense": ("row", 1, False),
        "intermediate.dense": ("column", 1, False), "output.dense": ("row", 1, False)}
    # the decoder's bias is also the prediction head's own parameter: nothing can split it there
    assert plan["cls.predictions.decoder"].style == "none"
    assert plan["bert.embeddings.word_embeddings"].style == "none"
    assert any("cls.predictions.decoder" in w and "shared" in w for w in warned)


# ==================================================================== structure rules
class _Softmaxed(nn.Module):
    """Two Linears d -> h -> d with a softmax over the hidden features between them: not a pair."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.up(x).softmax(dim=-1))


class _Escaping(nn.Module):
    """The up projection's output also leaves the module: splitting it would return a shard."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        return self.down(F.gelu(h)), h


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Attention(nn.Module):
    """An attention class smpart has no adapter for."""

    def __init__(self):
        super().__init__()
        self.num_heads = 4
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(self.qkv(x)[..., :16])


def test_the_path_between_a_pair_must_be_elementwise():
    plan = plan_tensor_parallel(nn.Sequential(_Softmaxed(), MLP(16)), 2, warn=False)
    assert plan["0.up"].style == "none" and "softmax" in plan["0.up"].reason
    assert plan["1.c_fc"].style == "column"
    plan = plan_tensor_parallel(nn.Sequential(_Escaping(), MLP(16)), 2, warn=False)
    assert plan["0.up"].style == "none"
    gated = plan_tensor_parallel(_Gated(), 2, warn=False)
    assert gated.styles() == {"gate": "column", "up": "column", "down": "row"}


def test_an_unknown_attention_stays_whole_with_a_warning():
    plan, warned = _plan(nn.Sequential(_Attention(), MLP(16)))
    assert plan["0.qkv"].style == "none" and plan["0.proj"].style == "none"
    assert warned == ["0 (_Attention) stays whole: smpart has no adapter for this attention "
                      "(register_attention_adapter teaches it one) and could not split its heads itself: the "
                      "output of its projection qkv is never reshaped by heads"]
    assert "never reshaped by heads" in plan["0.qkv"].reason
    assert plan["1.c_fc"].style == "column"


def test_a_traced_tree_gives_the_call_order_and_checks_the_data_flow():
    ex = gpt2()
    tree = smpart.trace(ex.model, ex.args)
    traced = plan_tensor_parallel(ex.model, 2, tree, warn=False)
    assert traced.styles() == plan_tensor_parallel(ex.model, 2, warn=False).styles()


# ==================================================================== SMP's controls
def test_set_tensor_parallelism_keeps_a_subtree_whole():
    model = gpt2().model
    set_tensor_parallelism(model.transformer.h[2], False)
    plan, warned = _plan(model)
    assert {d.style for n, d in plan.decisions.items() if n.startswith("transformer.h.2.")} == {"none"}
    assert "set_tensor_parallelism" in plan["transformer.h.2.mlp.c_fc"].reason
    assert plan["transformer.h.3.mlp.c_fc"].style == "column"
    assert warned == []  # the user asked for it: nothing to warn about


def test_set_tensor_parallelism_true_splits_a_standalone_linear_and_only_marked_splits_only_those():
    model = nn.Sequential(MLP(16), nn.Linear(16, 8), MLP(16))
    set_tensor_parallelism(model[1], True)
    set_tensor_parallelism(model[2], True)
    plan = plan_tensor_parallel(model, 2, warn=False)
    assert (plan["1"].style, plan["1"].gather_output) == ("column", True)
    assert plan["0.c_fc"].style == "column"
    only = plan_tensor_parallel(model, 2, only_marked=True, warn=False)
    assert only.styles() == {"1": "column", "2.c_fc": "column", "2.c_proj": "row"}
    assert "only_marked" in only["0.c_fc"].reason


def test_the_context_manager_marks_modules_created_inside_it():
    with tensor_parallelism(False):
        kept = MLP(16)
    with tensor_parallelism(True):
        split = MLP(16)
        with tensor_parallelism(False):
            inner = nn.Linear(16, 16)
    model = nn.Sequential(kept, split, inner)
    plan = plan_tensor_parallel(model, 2, only_marked=True, warn=False)
    assert plan.styles() == {"1.c_fc": "column", "1.c_proj": "row"}
    outside = nn.Linear(4, 4)
    assert smpart.tensor_parallel.marks.tensor_parallelism_of(outside) is None


# ==================================================================== the plan object and pricing
def test_plan_prints_and_serialises():
    plan, _ = _plan(transgan().model)
    text = str(plan)
    assert "TensorParallelPlan(TransGAN, degree 2)" in text
    assert "narrow_blocks.0.attn.c_attn" in text and "warning:" in text
    data = plan.to_dict()
    assert data["decisions"]["wide_blocks.0.attn.c_attn"]["fused"] == 3


def test_splittable_fraction_prices_each_node_and_the_whole_model():
    ex = transgan()
    tree = smpart.trace(ex.model, ex.args)
    plan = plan_tensor_parallel(ex.model, 2, tree, warn=False)
    shares = splittable_fraction(plan, tree)
    assert shares["wide_blocks.0.mlp.c_fc"].params == 1.0 and shares["wide_blocks.0.mlp.c_fc"].flops == 1.0
    assert shares["wide_blocks.0.attn"].flops == 1.0  # its own score/softmax FLOPs run on local heads
    assert shares["narrow_blocks.0.attn.c_attn"].params == 0.0
    row_bias = 64 / (256 * 64 + 64)  # a row-parallel bias is replicated
    assert shares["wide_blocks.0.mlp.c_proj"].params == pytest.approx(1 - row_bias)
    totals = split_totals(plan, tree)
    assert 0.9 < totals.params < 1.0
    assert 0.0 < totals.flops < 1.0


def test_planning_works_on_the_meta_device():
    model = gpt2(device="meta").model
    plan = plan_tensor_parallel(model, 4, warn=False)
    assert plan["transformer.h.0.attn.c_attn"].fused == 3
    assert torch.device("meta") == next(model.parameters()).device


def test_a_subtree_marked_on_inside_one_marked_off_is_split():
    model = gpt2(n_layer=2).model
    set_tensor_parallelism(model.transformer, False)
    set_tensor_parallelism(model.transformer.h[1].mlp, True)
    plan = plan_tensor_parallel(model, 2, warn=False)
    assert plan.styles() == {"transformer.h.1.mlp.c_fc": "column", "transformer.h.1.mlp.c_proj": "row"}
    assert "set_tensor_parallelism" in plan["transformer.wte"].reason
    assert "shared" in plan["lm_head"].reason  # tied to the embedding, which stays whole
