"""``smp.nn``: SMP's layers where smpart or torch has the same thing.

- `DistributedLinear`, `DistributedEmbedding`: smpart's tensor-parallel layers (global sizes, as
  SMP's: ``DistributedLinear(in_features, out_features)``).
- `FusedLayerNorm`: SMP's stand-in for apex's fused layer norm is ``torch.nn.LayerNorm``.
- `FlashAttentionLayer`: attention over a packed ``qkv``, by ``scaled_dot_product_attention``
  (flash attention on GPUs that have it).

SMP's own fused transformer blocks (``DistributedTransformer``, ``DistributedTransformerLayer``,
``DistributedAttentionLayer``, ``DistributedTransformerOutputLayer``,
``DistributedTransformerLMHead``) have no smpart equivalent: the names raise an `SmpartError`
saying to write the block in plain torch (SMP's documentation gives its reference
implementation), which smpart's tensor parallelism then splits like any other model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smpart.errors import SmpartError
from smpart.tensor_parallel.layers import DistributedEmbedding, DistributedLinear


class FusedLayerNorm(nn.LayerNorm):
    """apex's ``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``: torch's LayerNorm."""


class FlashAttentionLayer(nn.Module):
    """SMP's ``FlashAttentionLayer``: ``forward(qkv, attn_mask=None, causal=False)`` with ``qkv`` of shape
    ``(batch, seq, 3, heads, head_size)``, returning ``(batch, heads, seq, head_size)``.

    The scale is ``scale`` when given, else ``1/sqrt(attention_head_size)`` (with
    ``scale_attention_scores``) times ``1/(layer_idx + 1)`` (with ``scale_attn_by_layer_idx``).
    ``attn_mask``, when given, is added to the scores (SMP took an ALiBi bias there).
    """

    def __init__(self, attention_dropout_prob: float = 0.1, attention_head_size: int | None = None,
                 scale_attention_scores: bool = True, scale_attn_by_layer_idx: bool = False,
                 layer_idx: int | None = None, scale: float | None = None,
                 triton_flash_attention: bool = False, use_alibi: bool = False) -> None:
        super().__init__()
        if scale is None:
            scale = 1.0
            if scale_attention_scores:
                if attention_head_size is None:
                    raise SmpartError("FlashAttentionLayer: scale_attention_scores needs attention_head_size")
                scale /= math.sqrt(attention_head_size)
            if scale_attn_by_layer_idx:
                if layer_idx is None:
                    raise SmpartError("FlashAttentionLayer: scale_attn_by_layer_idx needs layer_idx")
                scale /= layer_idx + 1
        self.scale = scale
        self.dropout = attention_dropout_prob

    def forward(self, qkv: torch.Tensor, attn_mask: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (batch, heads, seq, head_size)
        if attn_mask is not None and causal:
            seq = q.shape[-2]
            attn_mask = attn_mask.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1),
                                              float("-inf"))
            causal = False
        dropout = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                              dropout_p=dropout, scale=self.scale)


_NO_EQUIVALENT = ("DistributedTransformer", "DistributedTransformerLayer", "DistributedAttentionLayer",
                  "DistributedTransformerOutputLayer", "DistributedTransformerLMHead")


def __getattr__(name: str) -> Any:
    if name in _NO_EQUIVALENT:
        raise SmpartError(f"smp.nn.{name} was SMP's own fused transformer block, which smpart does not have: "
                          "write the block in plain torch (nn.Linear query/key/value/dense, LayerNorm, GELU; "
                          "SMP's documentation gives its reference implementation) and smpart's tensor "
                          "parallelism splits it like any other model")
    raise AttributeError(f"module 'smp.nn' has no attribute {name!r}")


__all__ = ["DistributedEmbedding", "DistributedLinear", "FlashAttentionLayer", "FusedLayerNorm"]
