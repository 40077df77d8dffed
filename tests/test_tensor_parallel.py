"""Tensor-parallel layers and swapped models on 2 gloo processes against the unsplit originals.

One group of two processes runs every check once (`CHECKS`) and writes each rank's results to a
file; the tests below read them. Everything is float64, so a split that is right agrees with
the original to rounding (1e-10 for single layers, 1e-8 for whole models after two SGD steps).
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.launch import run_ranks, values

pytestmark = pytest.mark.timeout(180)

WORLD = 2
LAYER_TOL = 1e-10
MODEL_TOL = 1e-8


# ==================================================================== the group
def _worker(rank: int, out: str) -> dict[str, object]:
    """Every check on this rank, by name: what it returned, or the traceback it raised. ``out`` is
    a directory all ranks share."""
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results: dict[str, object] = {}
    try:
        for name, check in CHECKS.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    results[name] = check(rank, Path(out))
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, object]]:
    """Every rank's results, by check name; the group is joined (or killed) before returning."""
    return values(run_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("tp")), timeout_s=150))


def _result(results, name: str) -> dict:
    for rank, per_rank in enumerate(results):
        entry = per_rank[name]
        assert "error" not in entry, f"rank {rank}, check {name}:\n{entry['error']}"
    return results[0][name]


# ==================================================================== layer checks
def _compare_layer(reference: nn.Module, split: nn.Module, x: torch.Tensor, rank: int,
                   x_split: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                   y_split: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
    """Output, input gradient and full weight gradient of ``split`` against ``reference``."""
    from smpart.tensor_parallel import full_state_dict, full_tensor

    floating = x.is_floating_point()
    x_ref = x.clone().requires_grad_(floating)
    x_tp = x_split(x).clone().requires_grad_(floating)
    y_ref, y_tp = reference(x_ref), split(x_tp)
    grad = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(7))
    (y_ref * grad).sum().backward()
    (y_tp * y_split(grad)).sum().backward()
    errors = {"output": (y_split(y_ref) - y_tp).abs().max().item()}
    if floating:
        errors["input_grad"] = (x_split(x_ref.grad) - x_tp.grad).abs().max().item()
    for name, p in reference.named_parameters():
        errors[f"{name}_grad"] = (full_tensor(getattr(split, name).grad) - p.grad).abs().max().item()
    full = full_state_dict(split)
    errors["full_state"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    errors["local_weight_shape"] = tuple(split.weight.to_local().shape)
    errors["global_weight_shape"] = tuple(split.weight.shape)
    return errors


def _last(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.chunk(WORLD, dim=-1)[rank]


def _fused_last(rank: int, parts: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: torch.cat([p.chunk(WORLD, dim=-1)[rank] for p in t.chunk(parts, dim=-1)], dim=-1)


def check_layers(rank: int, out: Path) -> dict[str, dict]:
    from transformers.pytorch_utils import Conv1D

    from smpart.tensor_parallel import DistributedEmbedding, DistributedLinear

    f64 = torch.float64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=f64, generator=g)
    ids = torch.randint(12, (3, 5), generator=g)
    torch.manual_seed(1)
    linear, conv = nn.Linear(8, 12, dtype=f64), Conv1D(12, 8).to(f64)
    nn.init.normal_(conv.bias)
    conv_row, linear_row = Conv1D(8, 8).to(f64), nn.Linear(8, 6, dtype=f64)
    emb = nn.Embedding(12, 8, dtype=f64)
    cases = {
        "column": (linear, DistributedLinear.from_module(linear, "column"), {"y_split": _last(rank)}),
        "column_gather": (linear, DistributedLinear.from_module(linear, "column", gather_output=True), {}),
        "row": (linear_row, DistributedLinear.from_module(linear_row, "row"), {"x_split": _last(rank)}),
        "row_scatter": (linear_row, DistributedLinear.from_module(linear_row, "row", input_is_parallel=False),
                        {}),
        "conv1d_fused_qkv": (conv, DistributedLinear.from_module(conv, "column", fused=3),
                             {"y_split": _fused_last(rank, 3)}),
        "conv1d_fused_gather": (conv, DistributedLinear.from_module(conv, "column", fused=3,
                                                                     gather_output=True), {}),
        "conv1d_row": (conv_row, DistributedLinear.from_module(conv_row, "row"), {"x_split": _last(rank)}),
        "embedding_vocab": (emb, DistributedEmbedding.from_module(emb, "vocab"), {}),
        "embedding_dim": (emb, DistributedEmbedding.from_module(emb, "dim"), {}),
    }
    results = {}
    for name, (reference, split, how) in cases.items():
        reference.zero_grad()
        results[name] = _compare_layer(reference, split, ids if "embedding" in name else x, rank, **how)
    results["conv1d_fused_qkv"]["local_weight"] = cases["conv1d_fused_qkv"][1].weight.to_local().clone()
    results["conv1d_fused_qkv"]["weight"] = conv.weight.detach().clone()
    padded = nn.Embedding(12, 8, padding_idx=7, dtype=f64)
    results["embedding_padding"] = _compare_layer(padded, DistributedEmbedding.from_module(padded), ids, rank)
    return results


def check_bad_input(rank: int, out: Path) -> dict[str, str]:
    from smpart.errors import SmpartError
    from smpart.tensor_parallel import (
        DistributedEmbedding,
        DistributedLinear,
        apply_tensor_parallel,
        plan_tensor_parallel,
    )

    messages = {}
    attempts = {
        "column": lambda: DistributedLinear.from_module(nn.Linear(8, 7), "column", name="mlp.up"),
        "row": lambda: DistributedLinear.from_module(nn.Linear(5, 8), "row", name="mlp.down"),
        "fused": lambda: DistributedLinear.from_module(nn.Linear(8, 9), "column", fused=3, name="attn.qkv"),
        "vocab": lambda: DistributedEmbedding.from_module(nn.Embedding(11, 4), "vocab", name="wte"),
        "style": lambda: DistributedLinear.from_module(nn.Linear(8, 8), "diagonal"),
        "degree": lambda: apply_tensor_parallel(nn.Sequential(nn.Linear(8, 8)),
                                                plan_tensor_parallel(_mlp_model(), 4, warn=False)),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except SmpartError as err:
            messages[name] = str(err)
    return messages


def _mlp_model() -> nn.Module:
    from examples.models import MLP

    return nn.Sequential(MLP(16))


# ==================================================================== model checks
def _model_case(name: str):
    """``(model, loss_of(model))`` built identically on every rank (same seed)."""
    torch.manual_seed(0)
    if name == "zoo_gpt2":
        from examples.models import gpt2

        ex = gpt2(dtype=torch.float64)
        return ex.model, lambda m: ex.loss(m(*ex.args), ex.target)
    ids = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(1))
    return hf_causal_lm(name), lambda m: m(input_ids=ids, labels=ids).loss


def hf_causal_lm(name: str) -> nn.Module:
    """A tiny float64 Hugging Face causal LM, vocabulary 64, no dropout: ``"llama_gqa"`` (4 heads
    over 2 key/value heads) or ``"hf_gpt2"`` (fused q/k/v ``Conv1D``). Seed it before calling."""
    import transformers

    common = {"vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0}
    if name == "llama_gqa":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, num_hidden_layers=2, **common)
        return transformers.LlamaForCausalLM(config).to(torch.float64)
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, **common)
    return transformers.GPT2LMHeadModel(config).to(torch.float64)


def _check_model(name: str, rank: int) -> dict[str, object]:
    from smpart.tensor_parallel import (
        apply_tensor_parallel,
        full_state_dict,
        full_tensor,
        grad_norm,
        plan_tensor_parallel,
    )

    reference, loss_of = _model_case(name)
    split = copy.deepcopy(reference)
    report = apply_tensor_parallel(split, plan_tensor_parallel(split, WORLD, warn=False))
    loss_ref, loss_tp = loss_of(reference), loss_of(split)
    loss_ref.backward()
    loss_tp.backward()
    ref_params = dict(reference.named_parameters())
    grads = {n: (full_tensor(p.grad) - ref_params[n].grad).abs().max().item()
             for n, p in split.named_parameters()}
    norm = abs(grad_norm(split.parameters()).item()
               - torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item())
    sgd_ref = torch.optim.SGD(reference.parameters(), lr=0.5)
    sgd_tp = torch.optim.SGD(split.parameters(), lr=0.5)
    for _ in range(2):
        for optimizer, model in ((sgd_ref, reference), (sgd_tp, split)):
            optimizer.zero_grad()
            loss_of(model).backward()
            optimizer.step()
    full = full_state_dict(split)
    after = {k: (full[k] - v).abs().max().item() for k, v in reference.state_dict().items()}
    return {"loss": abs(loss_ref.item() - loss_tp.item()), "grads": grads, "grad_norm": norm,
            "params_after_sgd": after,
            "replaced": dict(report.replaced), "attention": dict(report.attention),
            "shared": list(report.shared), "param_names": sorted(ref_params), "grad_names": sorted(grads),
            "loss_after": abs(loss_of(reference).item() - loss_of(split).item())}


def check_checkpoint(rank: int, out: Path) -> dict[str, float]:
    """A DCP save of the split GPT-2 (fused Conv1D q/k/v, tied head) loads into the plain model and
    back into a split one."""
    import torch.distributed.checkpoint as dcp

    from smpart.tensor_parallel import (
        apply_tensor_parallel,
        dcp_state_dict,
        full_state_dict,
        load_dcp_state_dict,
        plan_tensor_parallel,
    )

    reference, _ = _model_case("hf_gpt2")
    split = copy.deepcopy(reference)
    apply_tensor_parallel(split, plan_tensor_parallel(split, WORLD, warn=False))
    path = out / "checkpoint"
    dcp.save(dcp_state_dict(split), checkpoint_id=path)
    plain = {k: torch.zeros_like(v) for k, v in reference.state_dict().items()}
    dcp.load(plain, checkpoint_id=path)
    fresh = copy.deepcopy(reference)
    for p in fresh.parameters():
        nn.init.zeros_(p)
    apply_tensor_parallel(fresh, plan_tensor_parallel(fresh, WORLD, warn=False))
    state = dcp_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    load_dcp_state_dict(fresh, state)
    full = full_state_dict(fresh)
    return {"into_plain": max((plain[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
            "into_split": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())}


CHECKS: dict[str, Callable[[int, Path], object]] = {
    "layers": check_layers,
    "bad_input": check_bad_input,
    "zoo_gpt2": lambda rank, out: _check_model("zoo_gpt2", rank),
    "llama_gqa": lambda rank, out: _check_model("llama_gqa", rank),
    "hf_gpt2": lambda rank, out: _check_model("hf_gpt2", rank),
    "checkpoint": check_checkpoint,
}


# ==================================================================== the tests
@pytest.mark.parametrize("case", ["column", "column_gather", "row", "row_scatter", "conv1d_fused_qkv",
                                  "conv1d_fused_gather", "conv1d_row", "embedding_vocab", "embedding_dim",
                                  "embedding_padding"])
def test_layer_matches_the_original(results, case):
    errors = _result(results, "layers")[case]
    for what, error in errors.items():
        if not what.endswith("shape") and what != "local_weight" and what != "weight":
            assert error <= LAYER_TOL, f"{case}: {what} differs by {error}"


def test_layer_parameters_keep_their_global_shape(results):
    layers = _result(results, "layers")
    assert layers["column"]["global_weight_shape"] == (12, 8)
    assert layers["column"]["local_weight_shape"] == (6, 8)
    assert layers["row"]["local_weight_shape"] == (6, 4)
    assert layers["conv1d_fused_qkv"]["global_weight_shape"] == (8, 12)  # Conv1D's [in, out] layout kept
    assert layers["embedding_vocab"]["local_weight_shape"] == (6, 8)
    assert layers["embedding_dim"]["local_weight_shape"] == (12, 4)


def test_fused_qkv_shard_holds_a_slice_of_each_of_q_k_v(results):
    fused = _result(results, "layers")["conv1d_fused_qkv"]
    q, k, v = fused["weight"].chunk(3, dim=1)
    expected = torch.cat([q[:, :2], k[:, :2], v[:, :2]], dim=1)  # rank 0's two columns of each
    assert torch.equal(fused["local_weight"], expected)


@pytest.mark.parametrize("model", ["zoo_gpt2", "llama_gqa", "hf_gpt2"])
def test_swapped_model_trains_like_the_unsplit_one(results, model):
    got = _result(results, model)
    assert got["loss"] <= MODEL_TOL
    assert got["grad_names"] == got["param_names"]
    worst = max(got["grads"].items(), key=lambda kv: kv[1])
    assert worst[1] <= MODEL_TOL, f"gradient of {worst[0]} differs by {worst[1]}"
    worst = max(got["params_after_sgd"].items(), key=lambda kv: kv[1])
    assert worst[1] <= MODEL_TOL, f"{worst[0]} differs by {worst[1]} after 2 SGD steps"
    assert got["loss_after"] <= MODEL_TOL
    assert got["grad_norm"] <= MODEL_TOL


def test_swap_reports_what_it_did(results):
    zoo = _result(results, "zoo_gpt2")
    assert zoo["replaced"]["transformer.h.0.attn.c_attn"] == "column"
    assert zoo["replaced"]["lm_head"] == "column"
    assert zoo["attention"]["transformer.h.0.attn"]["n_head"] == (4, 2)
    assert ("transformer.wte.weight", "lm_head.weight") in zoo["shared"]
    hf = _result(results, "hf_gpt2")
    assert hf["attention"]["transformer.h.1.attn"] == {"num_heads": (4, 2), "embed_dim": (32, 16),
                                                      "split_size": (32, 16)}
    llama = _result(results, "llama_gqa")
    assert llama["replaced"]["model.layers.1.self_attn.k_proj"] == "column"
    assert llama["replaced"]["model.layers.1.mlp.down_proj"] == "row"


def test_checkpoint_reshards_between_split_and_plain(results):
    got = _result(results, "checkpoint")
    assert got["into_plain"] == 0.0
    assert got["into_split"] == 0.0


@pytest.mark.parametrize("case, words", [
    ("column", ["'mlp.up'", "out_features=7", "degree 2"]),
    ("row", ["'mlp.down'", "in_features=5", "degree 2"]),
    ("fused", ["'attn.qkv'", "out_features=9", "3 fused parts"]),
    ("vocab", ["'wte'", "num_embeddings=11", "degree 2"]),
    ("style", ["style must be"]),
    ("degree", ["4 ways", "2 ranks"]),
])
def test_bad_input_raises_a_clear_error(results, case, words):
    message = _result(results, "bad_input")[case]
    assert message != "no error"
    for word in words:
        assert word in message, message
