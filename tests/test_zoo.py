"""The model zoo: every model trains on its example batch and has the structure tests rely on."""

from __future__ import annotations

import pytest
import torch

from examples import models
from examples.models import ZOO


def _call_counts(model: torch.nn.Module, args, kwargs) -> dict[str, int]:
    """How often each module (by its first name) runs in one forward pass."""
    counts = dict.fromkeys((name for name, _ in model.named_modules()), 0)
    names = {id(m): name for name, m in model.named_modules()}

    def count(module, _inputs):
        counts[names[id(module)]] += 1

    handles = [m.register_forward_pre_hook(count) for m in model.modules()]
    try:
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return counts


@pytest.mark.parametrize("name", sorted(ZOO))
def test_forward_backward_gives_finite_loss_and_gradients(name):
    ex = ZOO[name](dtype=torch.float64)
    loss = ex.loss(ex.model(*ex.args, **ex.kwargs), ex.target)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    grads = [p.grad for p in ex.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert all(p.dtype == torch.float64 for p in ex.model.parameters())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_factories_are_deterministic_and_batches_fresh(name):
    a, b = ZOO[name](seed=0), ZOO[name](seed=0)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    args, kwargs, target = a.batch(3, seed=1)
    assert args[0].shape[0] == 3 and target.shape[0] == 3
    again, _, _ = a.batch(3, seed=1)
    other, _, _ = a.batch(3, seed=2)
    assert torch.equal(args[0], again[0]) and not torch.equal(args[0], other[0])
    out = a.model(*args, **kwargs)
    assert torch.isfinite(a.loss(out, target))


def test_gpt2_lm_head_is_tied_to_the_input_embedding():
    model = models.gpt2().model
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(model.transformer.h) >= 8 and "transformer.h.7.mlp" in dict(model.named_modules())


def test_t5_shares_one_embedding_module_and_takes_kwargs():
    ex = models.t5()
    model = ex.model
    assert model.encoder.embed_tokens is model.shared is model.decoder.embed_tokens
    assert "decoder_input_ids" in ex.kwargs
    out = model(*ex.args, **ex.kwargs)
    assert isinstance(out, dict) and out["logits"].shape[:2] == ex.target.shape
    tied = models.t5(tie_lm_head=True).model
    assert tied.lm_head.weight is tied.shared.weight


def test_moe_router_leaves_some_experts_without_tokens():
    ex = models.moe()
    counts = _call_counts(ex.model, ex.args, ex.kwargs)
    experts = {n: c for n, c in counts.items() if ".experts." in n and n.count(".") == 5}
    assert experts, "expected modules named transformer.h.i.mlp.experts.j"
    uncalled = [n for n, c in experts.items() if c == 0]
    assert uncalled and len(uncalled) < len(experts)


def test_albert_calls_its_single_layer_n_times():
    ex = models.albert(n_repeat=5)
    counts = _call_counts(ex.model, ex.args, ex.kwargs)
    assert counts["layer"] == 5 and counts["layer.attn"] == 5


def test_resnet_layers_grow_with_depth():
    model = models.resnet().model
    sizes = [sum(p.numel() for p in stage.parameters()) for stage in model.layers]
    assert sizes == sorted(sizes) and sizes[-1] > 10 * sizes[0]
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())


def test_transgan_wide_layers_then_narrow_layers():
    model = models.transgan().model
    wide = [sum(p.numel() for p in b.parameters()) for b in model.wide_blocks]
    narrow = [sum(p.numel() for p in b.parameters()) for b in model.narrow_blocks]
    assert len(wide) == len(narrow) == 12 and min(wide) > 100 * max(narrow)


def test_transgan_upsampling_trades_width_for_tokens():
    """Pixel shuffle on the token grid: one 1×1 token of 4 channels becomes a 2×2 grid of 1-channel
    tokens, in row-major order, holding the same numbers."""
    upsample = models.PixelShuffleTokens(side=1, factor=2)
    tokens = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    assert upsample(tokens).tolist() == [[[1.0], [2.0], [3.0], [4.0]]]
    ex = models.transgan()
    shapes = []
    for block in (ex.model.wide_blocks[0], ex.model.narrow_blocks[0]):
        block.register_forward_pre_hook(lambda module, args: shapes.append(args[0].shape))
    ex.model(*ex.args)
    (batch, tokens, width), narrow_shape = shapes[0], shapes[1]
    assert narrow_shape == (batch, tokens * (width // 4), 4)  # 16× the tokens, 1/16 the width


def test_transgan_at_paper_size_narrow_blocks_cost_like_wide_ones():
    """At the AMP paper's shape (1024 wide on 9×9, 16 wide on 72×72) a narrow block has ~1/4000 of
    a wide block's weights but its attention over 5184 tokens makes its FLOPs comparable."""
    from torch.utils.flop_counter import FlopCounterMode

    model = models.transgan(wide=1024, narrow=16, bottom_width=9, wide_heads=16, device="meta").model
    wide_in = torch.zeros(1, 81, 1024, device="meta")
    narrow_in = model.upsample(wide_in)
    assert tuple(narrow_in.shape) == (1, 81 * 64, 16)

    def flops(block, x):
        with FlopCounterMode(display=False) as counter:
            block(x)
        return counter.get_total_flops()

    ratio = flops(model.narrow_blocks[0], narrow_in) / flops(model.wide_blocks[0], wide_in)
    assert 0.5 < ratio < 2
