"""Hugging Face models as users have them, through the public API, against the unsplit model.

Each model is built from a tiny random config with its defaults, so the decoders pass a key/value
cache (``use_cache=True``) from layer to layer across stages. The reference is a deep copy of the
same model run unsplit on the same micro-batches: the step's loss is the mean of the micro-batch
losses and gradients are averaged. Training mode sets dropout to 0 (the only change to a default
besides T5's decoder_start_token_id, which every released T5 config sets): stage threads draw
random numbers in another order than the unsplit model, so masks would differ.

Tolerances are relative to each gradient's largest entry: the RMS and layer norms of Llama, Qwen2,
Mixtral and T5 compute in float32 even in a float64 model, so a sum of the same terms in another
order (a gradient summed across a stage boundary) can move a float32 rounding by one step.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import smpart

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, MICROBATCHES = 64, 8, 4, 2
TINY = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 64,
        "vocab_size": VOCAB, "max_position_embeddings": 32}


@dataclass
class Case:
    """A model class and its config, and how to feed it: ``inputs(seed)`` is ``(x, labels)``, called
    ``model(x, labels=labels)`` (``key`` names ``x`` in a dict batch)."""

    config_class: str
    model_class: str
    config: dict
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    key: str = "input_ids"
    dtype: torch.dtype = torch.float64
    tol: float = 1e-6

    def make(self, dropout: bool) -> nn.Module:
        config = getattr(transformers, self.config_class)(**self.config)
        if not dropout:  # every probability the config names (HF models read them in forward too)
            for field, value in config.to_dict().items():
                if ("drop" in field or field.endswith("pdrop")) and isinstance(value, float):
                    setattr(config, field, 0.0)
        return getattr(transformers, self.model_class)(config)


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return ids, ids


def _seq2seq(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, _ = _tokens(seed)
    return ids, ids.flip(-1)


def _images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, 8, 8, generator=generator), torch.randint(5, (BATCH,), generator=generator)


CASES: dict[str, Case] = {
    "gpt2": Case("GPT2Config", "GPT2LMHeadModel",
                 {"n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB, "n_positions": 32}, _tokens),
    "llama": Case("LlamaConfig", "LlamaForCausalLM", {**TINY, "num_key_value_heads": 2}, _tokens),  # grouped
    "qwen2": Case("Qwen2Config", "Qwen2ForCausalLM", {**TINY, "num_key_value_heads": 2}, _tokens),
    # torch's grouped matmul (the experts) refuses float64
    "mixtral": Case("MixtralConfig", "MixtralForCausalLM", {**TINY, "num_key_value_heads": 2,
                                                            "num_local_experts": 4, "num_experts_per_tok": 2},
                    _tokens, dtype=torch.float32, tol=1e-4),
    "opt": Case("OPTConfig", "OPTForCausalLM", {**TINY, "ffn_dim": 64, "word_embed_proj_dim": 32}, _tokens),
    "bert": Case("BertConfig", "BertForMaskedLM", TINY, _tokens),
    "t5": Case("T5Config", "T5ForConditionalGeneration",
               {"vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
                "num_decoder_layers": 2, "num_heads": 4,
                "decoder_start_token_id": 0},  # as every released T5 config sets it
               _seq2seq),
    "vit": Case("ViTConfig", "ViTForImageClassification", {**TINY, "image_size": 8, "patch_size": 4,
                                                           "num_labels": 5}, _images, key="pixel_values"),
    "albert": Case("AlbertConfig", "AlbertForMaskedLM", {**TINY, "embedding_size": 16}, _tokens),
}


@smpart.step
def train_step(model, x, labels):
    loss = model(x, labels=labels).loss
    model.backward(loss)
    return loss


@smpart.step
def dict_step(model, batch):
    loss = model(**batch).loss
    model.backward(loss)
    return loss


# ==================================================================== helpers
def build(name: str, train: bool) -> tuple[Case, nn.Module, nn.Module]:
    """The case, its model (dropout 0 in training) and an unsplit deep copy."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.make(dropout=not train).to(case.dtype)
    model.train(train)
    return case, model, copy.deepcopy(model)


def start(model: nn.Module, stages: int) -> smpart.DistributedModel:
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, timeout_s=60)
    return smpart.DistributedModel(model)


def reference_losses(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unsplit model on the same micro-batches: loss per micro-batch, gradients averaged."""
    losses = []
    for xs, ys in zip(x.chunk(MICROBATCHES), labels.chunk(MICROBATCHES), strict=True):
        loss = model(xs, labels=ys).loss
        (loss / MICROBATCHES).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Off by at most ``tol`` times ``expected``'s largest entry, or by 1e-12 times ``tol`` where all are
    ~0 (an attention key bias's gradient is 0 in exact arithmetic, ~1e-20 in either model)."""
    scale = max(expected.abs().max().item(), 1e-12)
    error = (actual.detach().cpu() - expected.detach()).abs().max().item()
    assert error <= tol * scale, f"{what}: off by {error:.3g} (largest entry {scale:.3g})"


def assert_same_grads(model: smpart.DistributedModel, reference: nn.Module, tol: float) -> None:
    pairs = list(zip(model.named_parameters(), reference.named_parameters(), strict=True))
    assert [n for (n, _), _ in pairs] == [n for _, (n, _) in pairs]
    for (name, p), (_, q) in pairs:
        if q.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        assert p.grad is not None, f"{name} got no gradient"
        assert_close_to(p.grad, q.grad, tol, f"gradient of {name}")


def used_stages(model: smpart.DistributedModel) -> int:
    return len(set(smpart.partition_of(model).module_stages().values()))


# ==================================================================== losses and gradients
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_eval_loss_and_every_gradient_match_unsplit(name, stages):
    case, model, reference = build(name, train=False)
    dm = start(model, stages)
    x, labels = case.inputs(0)
    out = train_step(dm, x, labels)
    expected = reference_losses(reference, x, labels)
    assert_close_to(out.stack(), expected, case.tol, "loss")
    assert_same_grads(dm, reference, case.tol)
    assert used_stages(dm) > 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_two_training_steps_leave_every_parameter_as_unsplit(name, stages):
    case, model, reference = build(name, train=True)
    dm = start(model, stages)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x, labels = case.inputs(step)
        out = train_step(dm, x, labels)
        assert_close_to(out.stack(), reference_losses(reference, x, labels), case.tol, f"loss of step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name_, p), (_, q) in zip(dm.named_parameters(), reference.named_parameters(), strict=True):
        assert_close_to(p, q, case.tol, f"{name_} after 2 steps")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["llama", "t5", "vit"])
def test_a_dict_batch_unpacked_into_the_model(name):
    case, model, reference = build(name, train=False)
    dm = start(model, 2)
    x, labels = case.inputs(0)
    out = dict_step(dm, {case.key: x, "labels": labels})
    assert_close_to(out.stack(), reference_losses(reference, x, labels), case.tol, "loss")
    assert_same_grads(dm, reference, case.tol)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "opt", "t5"])
def test_the_cache_every_stage_wrote_to_comes_back_whole(name):
    """The cache crosses as carried state: one object that the layers of all four stages fill in turn."""
    case, model, reference = build(name, train=False)
    dm = start(model, 4)

    @smpart.step
    def forward(model, x, labels):
        with torch.no_grad():
            return model(x, labels=labels).past_key_values

    x, labels = case.inputs(0)
    caches = forward(dm, x, labels).outputs
    with torch.no_grad():
        expected = [reference(xs, labels=ys).past_key_values
                    for xs, ys in zip(x.chunk(MICROBATCHES), labels.chunk(MICROBATCHES), strict=True)]
    assert len({id(c) for c in caches}) == MICROBATCHES and type(caches[0]) is type(expected[0])
    for cache, want in zip(caches, expected, strict=True):
        mine, theirs = cache_tensors(cache), cache_tensors(want)
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs, strict=True):
            assert_close_to(a, b, case.tol, "a cached key or value")


def cache_tensors(cache) -> list[torch.Tensor]:
    """Keys and values of every layer (of both halves of an encoder-decoder cache)."""
    halves = [cache]
    if hasattr(cache, "cross_attention_cache"):
        halves = [cache.self_attention_cache, cache.cross_attention_cache]
    return [t for half in halves for layer in half.layers for t in (layer.keys, layer.values)]


# ==================================================================== generation
@pytest.mark.timeout(60, method="thread")  # a hang must not outlive the test, even one stuck in a wait
@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_generate_works_forward_only_or_says_it_is_not_supported(name):
    """``generate()`` loops over forwards that grow a cache; inside a step and outside one."""
    case, model, reference = build(name, train=False)
    dm = start(model, 2)
    x, labels = case.inputs(0)
    train_step(dm, x, labels)  # placed across stages now
    dm.zero_grad()
    prompt = x[:, :4]
    expected = reference.generate(prompt, max_new_tokens=3, do_sample=False)

    @smpart.step
    def generate(model, prompt):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=3, do_sample=False)

    for run in (lambda: generate(dm, prompt).concat(),
                lambda: dm.generate(prompt, max_new_tokens=3, do_sample=False)):
        try:
            produced = run()
        except smpart.SmpartError as err:
            assert "generate" in str(err)
        else:
            assert torch.equal(produced.cpu(), expected)
        assert all(p.grad is None for p in dm.parameters())


@pytest.mark.timeout(60, method="thread")
def test_a_step_that_only_generates_says_the_model_ran_whole_until_a_call_splits_it():
    """A model is split at its first call inside a step; ``model.generate`` alone never calls the
    DistributedModel, so the first step says the model ran whole, and once a forward split it,
    generating runs split and says nothing."""
    case, model, reference = build("gpt2", train=False)
    dm = start(model, 2)
    prompt = case.inputs(0)[0][:, :4]

    @smpart.step
    def generate(model, prompt):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=3, do_sample=False)

    @smpart.step
    def forward(model, prompt):
        with torch.no_grad():
            return model(prompt).logits

    expected = reference.generate(prompt, max_new_tokens=3, do_sample=False)
    with pytest.warns(UserWarning, match="not split"):
        assert torch.equal(generate(dm, prompt).concat(), expected)
    forward(dm, prompt)
    assert used_stages(dm) == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not split.*")
        assert torch.equal(generate(dm, prompt).concat(), expected)


# ==================================================================== gradient checkpointing
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "reentrant", "when"), [("gpt2", True, "before"), ("llama", False, "after")])
def test_hf_gradient_checkpointing_recomputes_the_layers_each_stage_holds_whole(name, reentrant, when):
    """``gradient_checkpointing_enable()`` before the first step or between steps: a layer the
    partition cut recomputing in the backward would call the other stage from inside it (a hang);
    its checkpointing goes off, with a warning, and the layers held whole still recompute."""
    case, model, reference = build(name, train=True)
    dm = start(model, 2)
    enable = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    reference.gradient_checkpointing_enable(**enable)
    for step in range(2):
        if step == (0 if when == "before" else 1):
            model.gradient_checkpointing_enable(**enable)
        x, labels = case.inputs(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # whether a layer was cut depends on the partition
            out = train_step(dm, x, labels)
        assert_close_to(out.stack(), reference_losses(reference, x, labels), case.tol, f"loss of step {step}")
        assert_same_grads(dm, reference, case.tol)
        dm.zero_grad()
        reference.zero_grad()
    stages = smpart.partition_of(dm).module_stages()
    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, transformers.GradientCheckpointingLayer)]
    kept = {n: m.gradient_checkpointing for n, m in layers}
    whole = {n: len({s for other, s in stages.items() if other == n or other.startswith(n + ".")}) == 1
             for n, _ in layers}
    assert kept == whole and any(kept.values()), (kept, whole)


# ==================================================================== autocast
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["inside", "around"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_autocast_inside_the_step_or_around_its_call_reaches_every_stage(name, where):
    """``torch.autocast`` is thread-local: the modules on other stages must run under it too, and
    so must the step body, which runs on threads of its own, when autocast is around the call."""
    case, model, reference = build(name, train=False)
    model.float()
    reference.float()
    seen, expected_seen = record_output_dtypes(model), record_output_dtypes(reference)
    dm = start(model, 2)

    @smpart.step
    def autocast_step(model, x, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16) if where == "inside" else contextlib.nullcontext():
            loss = model(x, labels=labels).loss
        model.backward(loss)
        return loss

    x, labels = case.inputs(0)
    with torch.autocast("cpu", dtype=torch.bfloat16) if where == "around" else contextlib.nullcontext():
        out = autocast_step(dm, x, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = reference_losses(reference, x, labels)
    assert seen == expected_seen and torch.bfloat16 in set(expected_seen.values())
    assert_close_to(out.stack(), losses, 2e-2, "loss")
    assert_same_grads(dm, reference, 5e-2)


def record_output_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Name -> dtype of the first tensor each module returns, filled in by forward hooks."""
    seen: dict[str, torch.dtype] = {}

    def hook(name):
        def record(_module, _args, output):
            leaves = torch.utils._pytree.tree_leaves(output)
            first = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
            if first is not None:
                seen[name] = first.dtype
        return record

    for name, module in model.named_modules():
        module.register_forward_hook(hook(name))
    return seen
