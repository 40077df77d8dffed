"""Activation checkpointing in one process, without smpart's runtime: which modules, how it is
installed and removed, and gradients equal to those of the model without it."""

from __future__ import annotations

import gc
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.models import albert, gpt2, t5
from smpart.errors import ConfigError
from smpart.runtime.placement.activation_checkpointing import REGISTRY as GLOBAL_REGISTRY
from smpart.runtime.placement.activation_checkpointing import (
    CheckpointedForward,
    CheckpointRegistry,
    apply,
    checkpointed_names,
    is_checkpointed,
    remove,
    set_activation_checkpointing,
)


def with_dropout(model: nn.Module, modules: list[nn.Module], p: float = 0.2) -> nn.Module:
    """Dropout on the outputs of ``modules`` (the zoo models have none): inside a checkpointed
    block, so the recomputation must draw the same masks."""
    for module in modules:
        module.register_forward_hook(lambda _m, _a, out: F.dropout(out, p, training=True))
    return model


def gradients(example, seed: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    model = example.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = example.loss(model(*example.args, **example.kwargs), example.target)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_gradients(example, names: list[str]) -> None:
    loss, expected = gradients(example)
    assert apply(example.model, names) == names
    try:
        again, got = gradients(example)
    finally:
        remove(example.model)
    assert again == loss
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-12, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------- gradients
def test_gpt_blocks_with_dropout_have_the_same_gradients():
    example = gpt2(dtype=torch.float64)
    blocks = list(example.model.transformer.h)
    with_dropout(example.model, [m for b in blocks for m in (b.attn, b.mlp)])
    names = checkpointed_names(example.model, ["transformer.h.*"], registry=None)
    assert names == [f"transformer.h.{i}" for i in range(len(blocks))]
    assert_same_gradients(example, names)


def test_dropout_would_differ_without_the_preserved_rng_state():
    """The check above is not vacuous: recomputing with fresh random numbers changes gradients."""
    example = gpt2(dtype=torch.float64, n_layer=2)
    with_dropout(example.model, [b.mlp for b in example.model.transformer.h], p=0.5)
    _, expected = gradients(example)
    registry = CheckpointRegistry()
    for block in example.model.transformer.h:
        registry.add(block, preserve_rng_state=False)
    apply(example.model, checkpointed_names(example.model, registry=registry), registry=registry)
    _, got = gradients(example)
    remove(example.model)
    assert not torch.allclose(got["transformer.h.0.attn.c_attn.weight"],
                              expected["transformer.h.0.attn.c_attn.weight"])


def test_tied_embedding_and_lm_head_checkpointed_with_the_blocks():
    example = gpt2(dtype=torch.float64)
    model = example.model
    assert model.lm_head.weight is model.transformer.wte.weight  # the zoo GPT ties them
    with_dropout(model, [b.mlp for b in model.transformer.h])
    names = checkpointed_names(model, ["transformer.wte", "lm_head", "transformer.h.*", "transformer.ln_f"])
    assert_same_gradients(example, names)


def test_a_layer_called_many_times_is_checkpointed_at_every_call():
    example = albert(dtype=torch.float64)
    with_dropout(example.model, [example.model.layer.attn])
    calls = []
    example.model.layer.attn.register_forward_hook(lambda *_: calls.append(1))
    _, expected = gradients(example)
    forward_calls, calls[:] = len(calls), []
    apply(example.model, ["layer"])
    _, got = gradients(example)
    remove(example.model)
    assert forward_calls == example.model.n_repeat
    assert len(calls) == 2 * example.model.n_repeat  # each call's forward ran again in the backward
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-12, atol=1e-12, msg=name)


def test_keyword_arguments_and_a_dict_output():
    """T5 takes ``decoder_input_ids`` by keyword and returns a dict; its decoder blocks take the
    encoder's output as a second argument."""
    example = t5(dtype=torch.float64)
    assert example.kwargs
    assert_same_gradients(example, checkpointed_names(example.model, ["decoder.block.*"]))
    assert_same_gradients(example, [""])  # the root: keyword inputs go through checkpoint too


def test_keyword_named_like_a_checkpoint_option_reaches_the_module():
    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x, *, debug=None, use_reentrant=None):
            return self.lin(x) * debug + use_reentrant

    model = Takes()
    x, a, b = torch.randn(2, 3), torch.randn(2, 3, requires_grad=True), torch.randn(2, 3)
    expected = model(x, debug=a, use_reentrant=b)
    apply(model, [""])
    got = model(x, debug=a, use_reentrant=b)
    torch.testing.assert_close(got, expected)
    (grad,) = torch.autograd.grad(got.sum(), a)
    torch.testing.assert_close(grad, model.lin(x))


# ---------------------------------------------------------------------------- installing
def test_apply_sets_an_instance_forward_and_remove_restores_it():
    model = gpt2().model
    block = model.transformer.h[0]
    signature = inspect.signature(block.forward)
    assert apply(model, ["transformer.h.0"]) == ["transformer.h.0"]
    assert isinstance(block.__dict__["forward"], CheckpointedForward) and is_checkpointed(block)
    assert inspect.signature(block.forward) == signature
    assert apply(model, ["transformer.h.0"]) == []  # already checkpointed
    assert remove(model) == 1
    assert "forward" not in block.__dict__ and not is_checkpointed(block)
    assert list(model.state_dict()) == list(gpt2().model.state_dict())  # names never changed


def test_a_forward_the_user_set_on_the_instance_survives():
    lin = nn.Linear(2, 2)
    own = lambda x: 2 * nn.Linear.forward(lin, x)  # noqa: E731
    lin.forward = own
    apply(lin, [""])
    x = torch.randn(1, 2)
    torch.testing.assert_close(lin(x), 2 * nn.Linear.forward(lin, x))
    remove(lin)
    assert lin.forward is own


def test_without_grad_the_forward_runs_plainly():
    example = gpt2()
    model = example.model
    expected = model(*example.args)
    apply(model, checkpointed_names(model, ["transformer.h.*"]))
    with torch.no_grad():
        out = model(*example.args)
    torch.testing.assert_close(out, expected.detach())
    remove(model)


def test_apply_unknown_module_is_a_config_error():
    with pytest.raises(ConfigError, match="has no module 'nope'"):
        apply(gpt2().model, ["nope"])


# ---------------------------------------------------------------------------- which modules
def test_patterns_resolve_to_outermost_modules():
    model = gpt2(n_layer=3).model
    names = checkpointed_names(model, ["transformer.h.*", "transformer.h.1.mlp", "lm_head"], registry=None)
    assert names == ["transformer.h.0", "transformer.h.1", "transformer.h.2", "lm_head"]
    assert checkpointed_names(model, ["transformer.h.?.attn"], registry=None) == [
        f"transformer.h.{i}.attn" for i in range(3)]
    assert checkpointed_names(model, [], registry=None) == []
    assert checkpointed_names(model, [""], registry=None) == [""]  # the root, by its exact name
    assert checkpointed_names(model, ["*"], registry=None) == ["transformer", "lm_head"]  # never the root


def test_a_pattern_that_matches_nothing_is_named():
    with pytest.raises(ConfigError, match=r"\['blocks\.\*'\] match no module of GPT"):
        checkpointed_names(gpt2().model, ["transformer.h.*", "blocks.*"])
    with pytest.raises(ConfigError, match="list of module names"):
        checkpointed_names(gpt2().model, [3])


def test_registered_modules_are_checkpointed_and_weakly_held():
    model = gpt2(n_layer=2).model
    set_activation_checkpointing(model.transformer.h[1])
    try:
        assert checkpointed_names(model) == ["transformer.h.1"]
        assert checkpointed_names(model, ["transformer.h.0"]) == ["transformer.h.0", "transformer.h.1"]
    finally:
        GLOBAL_REGISTRY.discard(model.transformer.h[1])
    registry = CheckpointRegistry()
    registry.add(nn.Linear(1, 1))
    gc.collect()
    assert len(registry) == 0  # nothing kept the module alive
    with pytest.raises(ConfigError, match="takes an nn.Module"):
        set_activation_checkpointing("transformer.h.0")


def test_a_module_under_two_names_is_checkpointed_once():
    example = t5()
    names = checkpointed_names(example.model, ["shared", "encoder.embed_tokens"], registry=None)
    assert names == ["shared"]
