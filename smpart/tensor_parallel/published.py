"""A Hugging Face model's own tensor-parallel plan (``config.base_model_tp_plan``, the model's
``_tp_plan``), read as patterns over module names and mapped onto smpart's split styles.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from smpart.tensor_parallel.decisions import NONE
from smpart.tensor_parallel.layers import COLUMN, ROW, VOCAB

#: Hugging Face style -> (smpart style, gather the output / the input is parallel).
PUBLISHED_STYLES = {
    "colwise": (COLUMN, False), "rowwise": (ROW, True), "colwise_gather_output": (COLUMN, True),
    "colwise_rep": (COLUMN, True), "embedding_rowwise": (VOCAB, False), "replicate": (NONE, False),
}


def published_plan(model: nn.Module) -> dict[str, str]:
    """The Hugging Face plan the model carries, keys relative to ``model`` (``*``: any one name)."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, dict):
        prefix = getattr(model, "base_model_prefix", "")
        on_base = prefix and isinstance(getattr(model, prefix, None), nn.Module)
        plan.update({(f"{prefix}.{k}" if on_base else k): v for k, v in base.items()})
    for own in (getattr(type(model), "_tp_plan", None), getattr(model, "_tp_plan", None)):
        if isinstance(own, dict):  # the class's, then the instance's (merged by transformers)
            plan.update(own)
    return plan


def pattern_matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(map(fnmatch.fnmatchcase, names, parts))
