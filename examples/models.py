"""The model zoo: small, readable versions of the model families smpart must split.

Every factory returns an `Example`: the model, one example batch, and how to compute a training
loss, so tests, benchmarks and the command line (``smpart partition examples.models:gpt2``) can
use any model the same way. Each family stresses one thing a partitioner or a pipeline runtime
can get wrong:

- ``gpt2``: a decoder whose LM head is *tied* to the input embedding (one parameter, two modules).
- ``t5``: an encoder–decoder whose ``shared`` embedding is the same module object under three
  names, taking ``decoder_input_ids`` as a keyword and returning a dict.
- ``moe``: mixture-of-experts layers whose top-k router leaves some experts without tokens, so
  plain Python control flow skips them (``if tokens.numel(): expert(...)``).
- ``resnet``: a Wide-ResNet-like CNN with BatchNorm whose layers get wider with depth.
- ``transgan``: 12 wide transformer layers, a pixel-shuffle upsampling, then 12 very narrow ones
  over 64× the tokens (the AMP paper's heterogeneous TransGAN, 1024 then 16 wide at full size):
  weights, compute and activation memory peak in different layers.
- ``albert``: ONE transformer layer called N times (parameter sharing across depth).

Sizes are keyword arguments with small defaults (the tests run these many times on CPU);
``dtype=torch.float64`` makes gradient comparisons exact enough. ``gpt3_175b`` is built on the
meta device (no memory), ``gpt2_small`` is GPT-2-small sized. Initialisation is deterministic
for a given ``seed`` and never disturbs the global RNG; dropout defaults to 0 so a split model
computes exactly what the unsplit one does.

Why one file of ~650 lines: the zoo is one import (``examples.models:NAME`` on the command line),
and smpart's tensor-parallel adapters know its attention classes by their module,
``examples.models``; each family is a section of a few dozen lines.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Batch = tuple[tuple, dict, Tensor]


# ==================================================================== the Example contract
@dataclass
class Example:
    """A model with an example batch and its training loss."""

    model: nn.Module
    args: tuple
    kwargs: dict
    target: Tensor | None
    #: ``loss_fn(output, target) -> scalar``; default: cross-entropy for integer targets, else MSE.
    loss_fn: Callable[[Any, Tensor], Tensor] | None = field(default=None, repr=False)
    #: ``make_batch(batch_size, seed) -> (args, kwargs, target)``.
    make_batch: Callable[[int, int], Batch] | None = field(default=None, repr=False)

    def loss(self, output: Any, target: Tensor) -> Tensor:
        """Scalar training loss of ``output`` (the model's return value) against ``target``."""
        if self.loss_fn is not None:
            return self.loss_fn(output, target)
        return default_loss(output, target)

    def batch(self, batch_size: int, seed: int = 0) -> Batch:
        """A fresh ``(args, kwargs, target)`` batch of ``batch_size`` samples, fixed by ``seed``."""
        if self.make_batch is None:
            raise NotImplementedError("this Example was built without a make_batch function")
        return self.make_batch(batch_size, seed)


def default_loss(output: Any, target: Tensor) -> Tensor:
    """Cross-entropy over the last axis for integer targets, mean squared error otherwise."""
    if isinstance(output, dict):
        output = output["logits"]
    if target.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(output.flatten(0, -2), target.flatten())
    return F.mse_loss(output, target)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's CPU RNG seeded, restoring the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _finish(model: nn.Module, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """Move a freshly built model to its dtype and device (meta models are built there directly)."""
    return model.to(dtype=dtype, device=device)


def _example(model: nn.Module, make_batch: Callable[[int, int], Batch], batch_size: int, loss_fn=None):
    args, kwargs, target = make_batch(batch_size, 0)
    return Example(model, args, kwargs, target, loss_fn=loss_fn, make_batch=make_batch)


# ==================================================================== transformer parts
class SelfAttention(nn.Module):
    """Multi-head attention written out (so FlopCounterMode sees every matmul); causal or not."""

    def __init__(self, n_embd: int, n_head: int, causal: bool = True, bias: bool = True):
        super().__init__()
        assert n_embd % n_head == 0, f"n_embd={n_embd} must be divisible by n_head={n_head}"
        self.n_head = n_head
        self.causal = causal
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.c_attn(x).split(x.size(-1), dim=-1)
        return self.c_proj(attend(q, k, v, self.n_head, self.causal))


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention: queries from ``x``, keys and values from ``memory``."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.q = nn.Linear(n_embd, n_embd, bias=False)
        self.kv = nn.Linear(n_embd, 2 * n_embd, bias=False)
        self.o = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        k, v = self.kv(memory).split(x.size(-1), dim=-1)
        return self.o(attend(self.q(x), k, v, self.n_head, causal=False))


def attend(q: Tensor, k: Tensor, v: Tensor, n_head: int, causal: bool) -> Tensor:
    """Scaled dot-product attention over ``n_head`` heads; (B, T, C) in, (B, T, C) out."""
    B, T, C = q.shape
    S = k.size(1)
    q, k, v = (t.view(B, -1, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // n_head)
    if causal:
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    y = scores.softmax(dim=-1) @ v
    return y.transpose(1, 2).reshape(B, T, C)


class MLP(nn.Module):
    def __init__(self, n_embd: int, hidden: int | None = None, bias: bool = True):
        super().__init__()
        hidden = hidden or 4 * n_embd
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class MoE(nn.Module):
    """Top-k mixture of experts: each token goes to its ``top_k`` best-scoring experts.

    The loop over experts is ordinary Python: an expert that receives no token is not called at
    all, which is exactly the data-dependent control flow a graph-capturing splitter cannot
    follow and a hook-based tracer must survive (it also fails on the meta device, where the
    router's choice is unknown).
    """

    def __init__(self, n_embd: int, n_experts: int, top_k: int, hidden: int | None = None):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(n_embd, hidden) for _ in range(n_experts))

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.size(-1))
        weights, chosen = self.router(tokens).softmax(dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(chosen == e)
            if token_idx.numel():
                gate = weights[token_idx, slot].unsqueeze(-1)
                out = out.index_add(0, token_idx, gate * expert(tokens[token_idx]))
        return out.view_as(x)


class Block(nn.Module):
    """Pre-norm transformer block; the MLP becomes a mixture of experts when ``n_experts > 0``."""

    def __init__(self, n_embd: int, n_head: int, causal: bool = True, n_experts: int = 0, top_k: int = 2):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, causal)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MoE(n_embd, n_experts, top_k) if n_experts else MLP(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# ==================================================================== GPT-2 / GPT-3 / MoE
@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 8
    n_head: int = 4
    n_embd: int = 32
    n_experts: int = 0
    top_k: int = 2


class GPT(nn.Module):
    """A nanoGPT-style decoder; ``lm_head.weight`` *is* ``transformer.wte.weight``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        c = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(c.vocab_size, c.n_embd),
                wpe=nn.Embedding(c.block_size, c.n_embd),
                h=nn.ModuleList(
                    Block(c.n_embd, c.n_head, True, c.n_experts, c.top_k) for _ in range(c.n_layer)
                ),
                ln_f=nn.LayerNorm(c.n_embd),
            )
        )
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.apply(_init_transformer_weights)

    def forward(self, idx: Tensor) -> Tensor:
        seq_len = idx.size(1)
        if seq_len > self.config.block_size:
            raise ValueError(f"sequence of {seq_len} tokens exceeds block_size={self.config.block_size}")
        pos = torch.arange(seq_len, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _init_transformer_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


def _token_batches(vocab: int, seq: int, device) -> Callable[[int, int], Batch]:
    """Random token ids and next-token targets, ``(B, seq)`` each."""

    def make_batch(batch_size: int, seed: int) -> Batch:
        tokens = torch.randint(vocab, (batch_size, seq + 1), generator=_generator(seed)).to(device)
        return (tokens[:, :-1],), {}, tokens[:, 1:]

    return make_batch


def _gpt_example(config: GPTConfig, batch_size: int, seed: int, dtype, device) -> Example:
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            model = GPT(config)
    else:
        with seeded(seed):
            model = GPT(config)
    model = _finish(model, dtype, device)
    return _example(model, _token_batches(config.vocab_size, config.block_size, device), batch_size)


def gpt2(
    *,
    vocab_size: int = 64,
    seq_len: int = 16,
    n_layer: int = 8,
    n_head: int = 4,
    n_embd: int = 32,
    batch_size: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Example:
    """A small GPT-2-like decoder with tied embeddings (8 layers, width 32, vocab 64, 16 tokens)."""
    config = GPTConfig(vocab_size, seq_len, n_layer, n_head, n_embd)
    return _gpt_example(config, batch_size, seed, dtype, device)


def gpt2_small(
    *,
    vocab_size: int = 50257,
    seq_len: int = 1024,
    batch_size: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **sizes: int,
) -> Example:
    """GPT-2 small: 12 layers, width 768, 12 heads, vocab 50257, 1024 tokens (124M parameters).

    ``device="meta"`` builds it without memory (for tracing); a smaller ``vocab_size`` and
    ``seq_len`` suit character-level training.
    """
    sizes = {"n_layer": 12, "n_head": 12, "n_embd": 768, **sizes}
    config = GPTConfig(vocab_size, seq_len, **sizes)
    return _gpt_example(config, batch_size, seed, dtype, device)


def gpt3_175b(
    *,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "meta",
    **sizes: int,
) -> Example:
    """GPT-3 175B's shape (96 layers, width 12288, 96 heads, vocab 50257, 2048 tokens), on meta.

    Built under ``torch.device("meta")``: no weight is ever allocated, the inputs live on meta too.
    """
    shape = {"vocab_size": 50257, "block_size": 2048, "n_layer": 96, "n_head": 96, "n_embd": 12288, **sizes}
    return _gpt_example(GPTConfig(**shape), batch_size, 0, dtype, device)


def moe(
    *,
    vocab_size: int = 64,
    seq_len: int = 8,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 32,
    n_experts: int = 8,
    top_k: int = 1,
    batch_size: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Example:
    """A GPT-like decoder with top-k mixture-of-experts MLPs (``transformer.h.i.mlp.experts.j``).

    With 16 tokens per batch and 8 experts per layer, top-1 routing leaves some experts of the
    example batch without any token: those experts are never called.
    """
    config = GPTConfig(vocab_size, seq_len, n_layer, n_head, n_embd, n_experts=n_experts, top_k=top_k)
    return _gpt_example(config, batch_size, seed, dtype, device)


# ==================================================================== T5
class T5Block(nn.Module):
    """Encoder block (self-attention, MLP) or decoder block (+ cross-attention to the encoder)."""

    def __init__(self, n_embd: int, n_head: int, is_decoder: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, causal=is_decoder, bias=False)
        if is_decoder:
            self.ln_cross = nn.LayerNorm(n_embd)
            self.cross_attn = CrossAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, bias=False)

    def forward(self, x: Tensor, memory: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        if memory is not None:
            x = x + self.cross_attn(self.ln_cross(x), memory)
        return x + self.mlp(self.ln_2(x))


class T5Stack(nn.Module):
    """The encoder or the decoder; ``embed_tokens`` is the model's ``shared`` embedding itself."""

    def __init__(self, embed_tokens: nn.Embedding, n_layer: int, n_head: int, is_decoder: bool):
        super().__init__()
        n_embd = embed_tokens.embedding_dim
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList(T5Block(n_embd, n_head, is_decoder) for _ in range(n_layer))
        self.final_layer_norm = nn.LayerNorm(n_embd)

    def forward(self, input_ids: Tensor, memory: Tensor | None = None) -> Tensor:
        x = self.embed_tokens(input_ids)
        for block in self.block:
            x = block(x, memory)
        return self.final_layer_norm(x)


class T5(nn.Module):
    """A T5-like encoder–decoder. One ``shared`` embedding module serves encoder and decoder
    (registered as ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens``); with
    ``tie_lm_head`` the output projection reuses its weight too.

    ``forward(input_ids, decoder_input_ids=...)`` returns ``{"logits", "encoder_last_hidden_state"}``.
    """

    def __init__(self, vocab_size: int, n_embd: int, n_head: int, n_layer: int, n_decoder_layer: int,
                 tie_lm_head: bool = False):
        super().__init__()
        self.shared = nn.Embedding(vocab_size, n_embd)
        self.encoder = T5Stack(self.shared, n_layer, n_head, is_decoder=False)
        self.decoder = T5Stack(self.shared, n_decoder_layer, n_head, is_decoder=True)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(_init_transformer_weights)
        if tie_lm_head:
            self.lm_head.weight = self.shared.weight

    def forward(self, input_ids: Tensor, decoder_input_ids: Tensor) -> dict[str, Tensor]:
        memory = self.encoder(input_ids)
        hidden = self.decoder(decoder_input_ids, memory)
        return {"logits": self.lm_head(hidden), "encoder_last_hidden_state": memory}


def t5(
    *,
    vocab_size: int = 64,
    src_len: int = 12,
    tgt_len: int = 8,
    n_layer: int = 4,
    n_decoder_layer: int | None = None,
    n_head: int = 4,
    n_embd: int = 32,
    tie_lm_head: bool = False,
    batch_size: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Example:
    """A small T5-like encoder–decoder; the decoder input comes as keyword ``decoder_input_ids``."""
    with seeded(seed):
        model = T5(vocab_size, n_embd, n_head, n_layer, n_decoder_layer or n_layer, tie_lm_head)
    model = _finish(model, dtype, device)

    def make_batch(batch_size: int, seed: int) -> Batch:
        g = _generator(seed)
        source = torch.randint(vocab_size, (batch_size, src_len), generator=g).to(device)
        target = torch.randint(vocab_size, (batch_size, tgt_len + 1), generator=g).to(device)
        return (source,), {"decoder_input_ids": target[:, :-1]}, target[:, 1:]

    return _example(model, make_batch, batch_size)


# ==================================================================== ResNet
class BasicBlock(nn.Module):
    """Two 3×3 convolutions with BatchNorm and a shortcut (a 1×1 projection when shapes change)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """A Wide-ResNet-like CNN: a stem, stages ``layer1..layerN`` that double the width and halve
    the resolution, then global pooling and a classifier. Later blocks hold far more weights."""

    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, num_classes: int, in_ch: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_ch, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]))
        stages, ch = [], widths[0]
        for i, width in enumerate(widths):
            blocks = [BasicBlock(ch if b == 0 else width, width, 2 if (b == 0 and i > 0) else 1)
                      for b in range(blocks_per_stage)]
            stages.append(nn.Sequential(*blocks))
            ch = width
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layers(F.relu(self.stem(x)))
        return self.fc(x.mean(dim=(2, 3)))


def resnet(
    *,
    widths: tuple[int, ...] = (8, 16, 32, 64),
    blocks_per_stage: int = 2,
    image_size: int = 16,
    num_classes: int = 10,
    batch_size: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Example:
    """A small Wide-ResNet-like classifier on 16×16 images; widths 8→64 over four stages."""
    with seeded(seed):
        model = ResNet(tuple(widths), blocks_per_stage, num_classes)
    model = _finish(model, dtype, device)

    def make_batch(batch_size: int, seed: int) -> Batch:
        g = _generator(seed)
        images = torch.randn(batch_size, 3, image_size, image_size, generator=g, dtype=dtype).to(device)
        labels = torch.randint(num_classes, (batch_size,), generator=g).to(device)
        return (images,), {}, labels

    return _example(model, make_batch, batch_size)


# ==================================================================== TransGAN
class PixelShuffleTokens(nn.Module):
    """TransGAN's upsampling: tokens of a ``side × side`` grid, ``C`` wide, become a grid ``factor``
    times finer with ``C / factor²`` channels (``nn.PixelShuffle`` on the token grid). The same
    numbers, ``factor²`` times as many tokens: a block after it attends over far more positions."""

    def __init__(self, side: int, factor: int):
        super().__init__()
        self.side, self.factor = side, factor

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        grid = x.transpose(1, 2).reshape(B, C, self.side, self.side)
        finer = F.pixel_shuffle(grid, self.factor)  # (B, C / factor², side·factor, side·factor)
        return finer.flatten(2).transpose(1, 2)


class TransGAN(nn.Module):
    """A TransGAN-like generator: noise → a ``bottom_width``² grid of tokens → ``n_wide`` blocks of
    width ``wide`` → pixel-shuffle upsampling → ``n_narrow`` blocks of width ``narrow`` over
    ``wide / narrow`` times as many tokens → RGB pixels.

    The AMP paper's example of heterogeneous layers (1024 wide on a 9 × 9 grid, then 16 wide on
    72 × 72): the narrow blocks hold almost no weights yet their attention over 64× the tokens
    costs as much compute as a wide block, and far more activation memory, so neither a uniform
    split nor a parameter-balanced split is right.
    """

    def __init__(self, latent_dim: int, bottom_width: int, wide: int, narrow: int, n_wide: int, n_narrow: int,
                 wide_heads: int, narrow_heads: int, channels: int = 3):
        super().__init__()
        factor = math.isqrt(wide // narrow)
        if wide % narrow or factor * factor != wide // narrow:
            raise ValueError(f"wide / narrow must be a square (pixel shuffle), got {wide} / {narrow}")
        self.n_tokens, self.wide = bottom_width * bottom_width, wide
        self.image_size = bottom_width * factor
        self.embed = nn.Linear(latent_dim, self.n_tokens * wide)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.n_tokens, wide))
        self.wide_blocks = nn.ModuleList(Block(wide, wide_heads, causal=False) for _ in range(n_wide))
        self.upsample = PixelShuffleTokens(bottom_width, factor)
        self.narrow_blocks = nn.ModuleList(Block(narrow, narrow_heads, causal=False) for _ in range(n_narrow))
        self.to_pixels = nn.Linear(narrow, channels)
        self.apply(_init_transformer_weights)

    def forward(self, z: Tensor) -> Tensor:
        x = self.embed(z).view(-1, self.n_tokens, self.wide) + self.pos_embed
        for block in self.wide_blocks:
            x = block(x)
        x = self.upsample(x)
        for block in self.narrow_blocks:
            x = block(x)
        side = self.image_size
        return self.to_pixels(x).transpose(1, 2).reshape(z.size(0), -1, side, side)


def transgan(
    *,
    latent_dim: int = 16,
    bottom_width: int = 2,
    wide: int = 64,
    narrow: int = 4,
    n_wide: int = 12,
    n_narrow: int = 12,
    wide_heads: int = 4,
    narrow_heads: int = 1,
    batch_size: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Example:
    """A TransGAN-like generator: 12 blocks 64 wide on a 2 × 2 grid of tokens, then 12 blocks 4
    wide on 8 × 8, making 8 × 8 RGB images (small, for tests). The AMP paper's shape, 16× narrower
    over 64× the tokens: ``wide=1024, narrow=16, bottom_width=9, wide_heads=16`` (72 × 72 images)."""
    with seeded(seed):
        model = TransGAN(latent_dim, bottom_width, wide, narrow, n_wide, n_narrow, wide_heads, narrow_heads)
    model = _finish(model, dtype, device)
    image_size = model.image_size

    def make_batch(batch_size: int, seed: int) -> Batch:
        g = _generator(seed)
        z = torch.randn(batch_size, latent_dim, generator=g, dtype=dtype).to(device)
        images = torch.randn(batch_size, 3, image_size, image_size, generator=g, dtype=dtype).to(device)
        return (z,), {}, images

    return _example(model, make_batch, batch_size)


# ==================================================================== ALBERT
class Albert(nn.Module):
    """An ALBERT-like encoder: factorised embeddings and ONE ``layer`` applied ``n_repeat`` times."""

    def __init__(self, vocab_size: int, seq_len: int, embedding_size: int, n_embd: int, n_head: int,
                 n_repeat: int):
        super().__init__()
        self.n_repeat = n_repeat
        self.word_embeddings = nn.Embedding(vocab_size, embedding_size)
        self.position_embeddings = nn.Embedding(seq_len, embedding_size)
        self.embedding_projection = nn.Linear(embedding_size, n_embd)
        self.layer = Block(n_embd, n_head, causal=False)
        self.head = nn.Linear(n_embd, vocab_size)
        self.apply(_init_transformer_weights)

    def forward(self, input_ids: Tensor) -> Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.embedding_projection(self.word_embeddings(input_ids) + self.position_embeddings(pos))
        for _ in range(self.n_repeat):
            x = self.layer(x)
        return self.head(x)


def albert(
    *,
    vocab_size: int = 64,
    seq_len: int = 16,
    embedding_size: int = 16,
    n_embd: int = 32,
    n_head: int = 4,
    n_repeat: int = 6,
    batch_size: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Example:
    """A small ALBERT-like masked-LM-shaped model whose single ``layer`` runs 6 times."""
    with seeded(seed):
        model = Albert(vocab_size, seq_len, embedding_size, n_embd, n_head, n_repeat)
    model = _finish(model, dtype, device)

    def make_batch(batch_size: int, seed: int) -> Batch:
        g = _generator(seed)
        tokens = torch.randint(vocab_size, (batch_size, seq_len), generator=g).to(device)
        labels = torch.randint(vocab_size, (batch_size, seq_len), generator=g).to(device)
        return (tokens,), {}, labels

    return _example(model, make_batch, batch_size)


#: The six test models, by name.
ZOO: dict[str, Callable[..., Example]] = {
    "gpt2": gpt2,
    "t5": t5,
    "moe": moe,
    "resnet": resnet,
    "transgan": transgan,
    "albert": albert,
}
