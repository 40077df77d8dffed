"""The tensor-parallel plan as data: a `Decision` per Linear / Conv1D / Embedding, the attention
modules whose heads are split, and the warnings; and which modules a split can replace exactly.

`smpart.tensor_parallel.planner` fills a `TensorParallelPlan`; the swap-in (`swap`) and the
pricing (`pricing`) read one. It prints as a table and turns into JSON-able data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from smpart.tensor_parallel.layers import COLUMN, DIM, ROW, VOCAB, _is_conv1d
from smpart.tensor_parallel.localize import HeadSplit

NONE = "none"
SPLIT_STYLES = (COLUMN, ROW, VOCAB, DIM)


class TensorParallelWarning(UserWarning):
    """A module that could have been split stays whole (the message says which and why)."""


# ==================================================================== decisions
@dataclass


class Decision:
    """How one Linear / Conv1D / Embedding module is split (``style`` ``"none"``: kept whole)."""

    style: str
    reason: str
    #: "published" (the model's own plan), "attention", "mlp", "embedding", "lm_head", "marked", "none".
    source: str = NONE
    gather_output: bool = False
    input_is_parallel: bool = True
    fused: int = 1
    #: The unit split together with this module (an attention or MLP module's name), if any.
    unit: str | None = None
    #: Own parameter elements, and how many of them are sharded (a row-parallel bias is not).
    params: int = 0
    split_params: int = 0
    #: Every name the module object is registered under (the first is the canonical one).
    names: tuple[str, ...] = ()

    @property
    def split(self) -> bool:
        return self.style != NONE


@dataclass


class AttentionSplit:
    """An attention module whose heads are split: ``q_heads``/``kv_heads`` are global counts."""

    name: str
    adapter: str
    q_heads: int
    kv_heads: int
    degree: int
    projections: tuple[str, ...]
    #: For an attention no adapter knows: how smpart found and localises its heads (`heads`).
    heads: HeadSplit | None = None


@dataclass


class TensorParallelPlan:
    """Per module decisions for one model and degree; print it for a table."""

    degree: int
    model_class: str
    decisions: dict[str, Decision] = field(default_factory=dict)
    attention: dict[str, AttentionSplit] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> Decision:
        return self.decisions[name]

    def __contains__(self, name: str) -> bool:
        return name in self.decisions

    def style_of(self, name: str) -> str:
        return self.decisions[name].style

    def styles(self) -> dict[str, str]:
        """``{module name: style}`` of the modules that are split."""
        return {name: d.style for name, d in self.decisions.items() if d.split}

    def split_modules(self) -> list[str]:
        return [name for name, d in self.decisions.items() if d.split]

    def split_param_fraction(self) -> float:
        """Share of the planned modules' parameters that get sharded."""
        total = sum(d.params for d in self.decisions.values())
        return sum(d.split_params for d in self.decisions.values()) / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "degree": self.degree,
            "model_class": self.model_class,
            "decisions": {name: {"style": d.style, "reason": d.reason, "source": d.source,
                                 "gather_output": d.gather_output, "input_is_parallel": d.input_is_parallel,
                                 "fused": d.fused, "unit": d.unit} for name, d in self.decisions.items()},
            "attention": {name: {"adapter": a.adapter, "q_heads": a.q_heads, "kv_heads": a.kv_heads,
                                 **({"divided": list(a.heads.attributes), "local_width": a.heads.local_width}
                                    if a.heads is not None else {})}
                          for name, a in self.attention.items()},
            "warnings": list(self.warnings),
        }

    def __str__(self) -> str:
        split = self.split_modules()
        lines = [f"TensorParallelPlan({self.model_class}, degree {self.degree}): {len(split)} of "
                 f"{len(self.decisions)} modules split, {self.split_param_fraction():.0%} of their "
                 "parameters"]
        width = max((len(n) for n in self.decisions), default=0)
        for name, d in self.decisions.items():
            style = d.style + (f" x{d.fused}" if d.fused > 1 else "")
            style += " +gather" if d.gather_output else ""
            style += " +scatter" if d.style == ROW and not d.input_is_parallel else ""
            lines.append(f"  {name:<{width}}  {style:<16} {d.reason}")
        for name, a in self.attention.items():
            lines.append(f"  attention {name}: {a.q_heads} q / {a.kv_heads} kv heads -> "
                         f"{a.q_heads // a.degree} / {a.kv_heads // a.degree} per rank ({a.adapter})")
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)


# ==================================================================== what can be split


def module_kind(module: nn.Module) -> str | None:
    """"linear", "embedding" or None, for the modules the swap can replace exactly."""
    if _is_conv1d(module):
        return "linear"
    if isinstance(module, nn.Linear):
        return "linear" if type(module).forward is nn.Linear.forward else "custom"
    if isinstance(module, nn.Embedding):
        return "embedding" if type(module).forward is nn.Embedding.forward else "custom"
    return None


def own_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def out_features(module: nn.Module) -> int:
    return module.nf if _is_conv1d(module) else module.out_features


def in_features(module: nn.Module) -> int:
    return module.nx if _is_conv1d(module) else module.in_features
