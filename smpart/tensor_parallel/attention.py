"""Attention adapters: where an attention class keeps its q/k/v and output projections and its
head counts, and how to make it compute on ``heads / degree`` local heads once they are split.

Known here: the zoo's self- and cross-attention, GPT-2, OPT, BERT, Llama (and Qwen2, Mixtral,
Mistral, which share its layout); an attention a Hugging Face published plan splits
(`PublishedAttention`); and one whose heads `smpart.tensor_parallel.heads` found and proved
(`FoundHeads`). `register_attention_adapter` teaches the planner another class.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

from torch import nn

from smpart.tensor_parallel.localize import HeadSplit


@dataclass(frozen=True)


class AttentionLayout:
    """Where an attention module keeps its projections, and its head counts.

    ``columns``: ``(path relative to the attention module, fused parts)`` of each q/k/v
    projection; ``row``: the output projection's path.
    """

    columns: tuple[tuple[str, int], ...]
    row: str
    q_heads: int
    kv_heads: int


class AttentionAdapter:
    """Knows one attention class: where its projections are, its heads, and how to localise it.

    ``layout`` returns an `AttentionLayout`, or a string saying why this instance cannot be
    split. ``localize(module, degree)`` makes the module compute with ``heads / degree`` local
    heads once its projections are split, returning ``{attribute: (old, new)}``.
    """

    name = "attention"

    def matches(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def layout(self, module: nn.Module) -> AttentionLayout | str:
        raise NotImplementedError

    def localize(self, module: nn.Module, degree: int) -> dict[str, tuple[Any, Any]]:
        return {}


def _divide_attributes(module: nn.Module, names: tuple[str, ...], degree: int) -> dict[str, tuple[Any, Any]]:
    changed = {}
    for attr in names:
        target, _, leaf = attr.rpartition(".")
        owner = module.get_submodule(target) if target else module
        old = getattr(owner, leaf)
        setattr(owner, leaf, old // degree)
        changed[attr] = (old, old // degree)
    return changed


def _is_class(module: nn.Module, names: tuple[str, ...], package: str) -> bool:
    cls = type(module)
    return cls.__name__ in names and cls.__module__.startswith(package)


class _ZooSelfAttention(AttentionAdapter):
    """``examples.models.SelfAttention``: fused ``c_attn``, ``c_proj``, ``n_head``.

    Its forward splits the fused output by the *input* width, which a local shard no longer
    has, so the localised module gets a forward that splits by thirds instead.
    """

    name = "zoo SelfAttention"

    def matches(self, module):
        return type(module).__qualname__ == "SelfAttention" and type(module).__module__ == "examples.models"

    def layout(self, module):
        return AttentionLayout((("c_attn", 3),), "c_proj", module.n_head, module.n_head)

    def localize(self, module, degree):
        changed = _divide_attributes(module, ("n_head",), degree)
        attend = sys.modules[type(module).__module__].attend

        def forward(self, x):
            q, k, v = self.c_attn(x).chunk(3, dim=-1)
            return self.c_proj(attend(q, k, v, self.n_head, self.causal))

        module.forward = types.MethodType(forward, module)
        changed["forward"] = ("split by the input width", "split by thirds")
        return changed


class _ZooCrossAttention(AttentionAdapter):
    """``examples.models.CrossAttention``: ``q``, fused ``kv``, ``o``, ``n_head``."""

    name = "zoo CrossAttention"

    def matches(self, module):
        return type(module).__qualname__ == "CrossAttention" and type(module).__module__ == "examples.models"

    def layout(self, module):
        return AttentionLayout((("q", 1), ("kv", 2)), "o", module.n_head, module.n_head)

    def localize(self, module, degree):
        changed = _divide_attributes(module, ("n_head",), degree)
        attend = sys.modules[type(module).__module__].attend

        def forward(self, x, memory):
            k, v = self.kv(memory).chunk(2, dim=-1)
            return self.o(attend(self.q(x), k, v, self.n_head, causal=False))

        module.forward = types.MethodType(forward, module)
        changed["forward"] = ("split by the input width", "split by halves")
        return changed


class _GPT2Attention(AttentionAdapter):
    """Hugging Face GPT-2: fused Conv1D ``c_attn``; ``split_size``, ``num_heads``, ``embed_dim``."""

    name = "transformers GPT2Attention"

    def matches(self, module):
        return _is_class(module, ("GPT2Attention",), "transformers")

    def layout(self, module):
        if module.is_cross_attention:
            return "cross-attention (q_attn plus a fused k/v c_attn) is not supported"
        return AttentionLayout((("c_attn", 3),), "c_proj", module.num_heads, module.num_heads)

    def localize(self, module, degree):
        return _divide_attributes(module, ("num_heads", "embed_dim", "split_size"), degree)


class _OPTAttention(AttentionAdapter):
    """Hugging Face OPT: q/k/v/out_proj; its views use ``num_heads``."""

    name = "transformers OPTAttention"

    def matches(self, module):
        return _is_class(module, ("OPTAttention",), "transformers")

    def layout(self, module):
        return AttentionLayout((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), "out_proj",
                               module.num_heads, module.num_heads)

    def localize(self, module, degree):
        return _divide_attributes(module, ("num_heads", "embed_dim"), degree)


class _BertAttention(AttentionAdapter):
    """Hugging Face BERT-like: ``self.query/key/value``, output projection ``output.dense``."""

    name = "transformers BertAttention"

    def matches(self, module):
        inner = getattr(module, "self", None)
        output = getattr(module, "output", None)
        return (type(module).__module__.startswith("transformers") and isinstance(inner, nn.Module)
                and all(isinstance(getattr(inner, p, None), nn.Linear) for p in ("query", "key", "value"))
                and hasattr(inner, "num_attention_heads") and hasattr(inner, "all_head_size")
                and isinstance(getattr(output, "dense", None), nn.Linear))

    def layout(self, module):
        heads = module.self.num_attention_heads
        return AttentionLayout((("self.query", 1), ("self.key", 1), ("self.value", 1)), "output.dense",
                               heads, heads)

    def localize(self, module, degree):
        return _divide_attributes(module, ("self.num_attention_heads", "self.all_head_size"), degree)


class _LlamaAttention(AttentionAdapter):
    """Hugging Face Llama-like attention (Llama, Qwen2, Mixtral, Mistral): views use ``-1`` and
    ``head_dim``, and ``num_key_value_groups`` (q heads per kv head) is unchanged by the split,
    so nothing needs adjusting; the heads are read from the projection sizes."""

    name = "transformers Llama-like attention"
    classes = ("LlamaAttention", "Qwen2Attention", "MixtralAttention", "MistralAttention")

    def matches(self, module):
        return _is_class(module, self.classes, "transformers")

    def layout(self, module):
        head_dim = module.head_dim
        return AttentionLayout((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), "o_proj",
                               module.q_proj.out_features // head_dim, module.k_proj.out_features // head_dim)


class PublishedAttention(AttentionAdapter):
    """An attention whose projections a Hugging Face published plan splits: the publisher's own
    tensor parallelism runs it unchanged on shards, so only the head counts are checked."""

    name = "published plan"

    def __init__(self, columns: tuple[str, ...], row: str) -> None:
        self.columns, self.row = columns, row

    def matches(self, module):
        return True

    def layout(self, module):
        config = getattr(module, "config", None)
        q = getattr(config, "num_attention_heads", None)
        if not isinstance(q, int):
            return "its published plan splits it, but no config.num_attention_heads gives its head count"
        kv = getattr(config, "num_key_value_heads", None) or q
        return AttentionLayout(tuple((c, 1) for c in self.columns), self.row, q, kv)


class FoundHeads(AttentionAdapter):
    """An attention no adapter knows, whose heads `heads.find_head_split` found and proved."""

    name = "heads found by smpart"

    def __init__(self, split: HeadSplit) -> None:
        self.split = split

    def matches(self, module):
        return True

    def layout(self, module):
        return AttentionLayout(self.split.columns, self.split.row, self.split.q_heads, self.split.kv_heads)


_ADAPTERS: list[AttentionAdapter] = [_ZooSelfAttention(), _ZooCrossAttention(), _GPT2Attention(),
                                     _OPTAttention(), _BertAttention(), _LlamaAttention()]


def register_attention_adapter(adapter: AttentionAdapter) -> None:
    """Teach the planner an attention class; adapters registered later are tried first."""
    _ADAPTERS.insert(0, adapter)


def attention_adapter(module: nn.Module) -> AttentionAdapter | None:
    return next((a for a in _ADAPTERS if a.matches(module)), None)


def adapter_named(name: str) -> AttentionAdapter | None:
    """The registered adapter a plan names (once its layers are swapped, an attention may no longer
    look as it did when the plan matched it: its ``nn.Linear`` projections are shards now)."""
    return next((a for a in _ADAPTERS if a.name == name), None)


_HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nhead", "num_key_value_heads")


def looks_like_attention(module: nn.Module) -> bool:
    """A class called *Attention*/*Attn*, or one with a head-count attribute."""
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name or any(
        isinstance(getattr(module, a, None), int) for a in _HEAD_ATTRIBUTES)
