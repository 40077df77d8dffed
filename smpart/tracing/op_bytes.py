"""`OpBytesCounter`: how many bytes the operations of a forward pass write.

FLOPs alone mispredict layers of low arithmetic intensity: attention with a head of 16 channels
over thousands of tokens does few FLOPs per byte of its token × token score matrices, and runs at
the speed of memory, not of the tensor cores. Those matrices are no module's output (they live
inside ``forward`` code), so the module hooks never see them. This dispatch mode sees every
operation, like ``FlopCounterMode``: it adds up the bytes of each operation's fresh outputs
(views and in-place results alias an input and write nothing new), which the recorder turns into
per-module self counts exactly as it does FLOPs. Works on the meta device (only shapes matter).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class OpBytesCounter(TorchDispatchMode):
    """Counts the bytes written by the outputs of every operation run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def get_total_bytes(self) -> int:
        return self.total

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _aliases_input(func):
            self.total += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                              if isinstance(t, torch.Tensor))
        return out


def _aliases_input(func: Any) -> bool:
    """A view (``transpose``, ``view``) or in-place op (``add_``) returns memory it was given."""
    return any(ret.alias_info is not None for ret in func._schema.returns)
