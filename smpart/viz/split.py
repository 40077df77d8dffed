"""What tensor parallelism splits in a partition, and what each split means, for both views.

A partition knows its tensor-parallel split only from ``partition.meta["tensor_parallel"]``
(``{"degree": 2, "split": {node name: style}}``), which a plan's partition and the runtime's
partition under tensor parallelism carry. The tree's own ``tp_split`` records are what *would*
be split at each degree; without the meta the degree is unknown, so the views show no split.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smpart.partitioning.result import Partition

#: What each style does to a module's weight on ``d`` ranks (``{d}`` is filled in).
_MEANINGS = {
    "column": "split {d} ways by columns: each rank holds 1/{d} of the weight and computes 1/{d} of "
              "the output features",
    "row": "split {d} ways by rows: each rank holds 1/{d} of the weight, takes 1/{d} of the input "
           "features, and the {d} partial outputs are summed (all-reduce)",
    "vocab": "split {d} ways by vocabulary: each rank holds the embeddings of 1/{d} of the tokens, "
             "and the {d} lookups are summed (all-reduce)",
    "dim": "split {d} ways by embedding dimension: each rank holds 1/{d} of every embedding vector, "
           "and the {d} pieces are gathered",
    "heads": "attention on local heads: each rank computes 1/{d} of the attention heads",
}


@dataclass(frozen=True)
class TensorSplit:
    """The tensor-parallel degree and ``{node name: style}`` of the nodes it splits."""

    degree: int
    styles: dict[str, str]

    def style_counts(self) -> Counter[str]:
        """How many split nodes use each single style (a ``column+vocab`` node counts for both)."""
        return Counter(part for style in self.styles.values() for part in style.split("+"))

    def summary(self) -> str:
        """``tensor parallel ×2: 42 modules split (column 16, row 16, heads 8, vocab 2)``."""
        counts = ", ".join(f"{style} {n}" for style, n in self.style_counts().most_common())
        return (f"tensor parallel ×{self.degree}: {len(self.styles)} module"
                f"{'' if len(self.styles) == 1 else 's'} split" + (f" ({counts})" if counts else ""))


def tensor_split(partition: Partition) -> TensorSplit | None:
    """The split ``partition.meta`` records, keyed by the partition tree's node names; None without one.

    Names are resolved through the tree, so a module name (``lm_head`` of a tied pair) counts
    for its node; names the tree does not know are dropped, not guessed at.
    """
    info = partition.meta.get("tensor_parallel")
    if not isinstance(info, dict):
        return None
    try:
        degree = int(info.get("degree") or 0)
    except (TypeError, ValueError):
        return None
    if degree < 2:
        return None
    styles: dict[str, set[str]] = {}
    for name, style in (info.get("split") or {}).items():
        try:
            node = partition.tree.node(name)
        except KeyError:
            continue
        parts = {p for p in str(style).split("+") if p}
        if parts:
            styles.setdefault(node.name, set()).update(parts)
    return TensorSplit(degree, {name: "+".join(sorted(parts)) for name, parts in styles.items()})


def describe(style: str, degree: int) -> str:
    """What ``style`` means on ``degree`` ranks, in one sentence (a joined style: one clause each)."""
    parts = [p for p in style.split("+") if p]
    words = [_MEANINGS.get(p, f"split {degree} ways ({p})").format(d=degree) for p in parts]
    if len(words) == 1:
        return words[0]
    return "one node of several modules: " + "; ".join(f"{p}: {w}" for p, w in zip(parts, words, strict=True))
