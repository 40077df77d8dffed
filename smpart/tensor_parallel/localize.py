"""A rank's share of an attention's heads: `HeadSplit` (how one attention module splits by heads,
as `smpart.tensor_parallel.heads` proved it) and `localize` (make the module compute on its
``heads / degree`` local heads once its projections are split).

A forward that reads its width from its input is handed a narrow view of the local width while
its projections get the whole input (`_LocalWidthForward`); parameters kept whole but used on
the local heads only read through `copy_to_tp`, which sums their gradient (`_SummedGradients`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn


@dataclass(frozen=True)
class HeadSplit:
    """How to split one attention module by heads, proven at ``degree``.

    ``columns``: ``(child name, fused parts)`` of the q/k/v projections; ``row``: the output
    projection. ``attributes``: its integer attributes divided by the degree. ``local_width``:
    the width of the input its forward is handed its share of (None: it gets the whole input).
    """

    columns: tuple[tuple[str, int], ...]
    row: str
    q_heads: int
    kv_heads: int
    head_dim: int
    attributes: tuple[str, ...] = ()
    local_width: int | None = None
    #: Parameters kept whole but used on the local heads only (per-head q/k norms): each rank's
    #: gradient is its heads' part, summed over the tensor-parallel group.
    summed: tuple[str, ...] = ()


# ==================================================================== localising
class _LocalWidthForward:
    """The module's forward, handed a narrow view of each input of ``width`` features (the local
    width) while its ``columns`` projections receive the whole input: a forward that reads its
    width from its input (``B, T, C = x.size()``) then reshapes its local heads back with the
    local width. The views stand for the inputs only by identity, for the length of one call."""

    def __init__(self, module: nn.Module, columns: Iterable[str], width: int, degree: int) -> None:
        self.original = self.__wrapped__ = module.forward  # inspect.signature sees the module's own
        self.width, self.local = width, width // degree
        self.whole: dict[int, Tensor] = {}
        for path in columns:
            module.get_submodule(path).register_forward_pre_hook(self._whole_input)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        views: list[Tensor] = []

        def share(value: Any) -> Any:
            if isinstance(value, Tensor) and value.ndim and value.shape[-1] == self.width:
                view = value.narrow(-1, 0, self.local)
                self.whole[id(view)] = value
                views.append(view)
                return view
            return value

        try:
            return self.original(*map(share, args), **{k: share(v) for k, v in kwargs.items()})
        finally:
            for view in views:
                self.whole.pop(id(view), None)

    def _whole_input(self, _module: nn.Module, args: tuple) -> tuple | None:
        if args and isinstance(args[0], Tensor) and id(args[0]) in self.whole:
            return (self.whole[id(args[0])], *args[1:])
        return None


class _SummedGradients:
    """The module's forward, with each of ``names`` (parameters used on the local heads only) read
    through `copy_to_tp` for the length of the call: the same values, and a gradient summed over
    the tensor-parallel group in the backward, as a column-parallel layer's input gets. Parameters
    stay the objects optimizers hold; only the module's view of them changes during its call."""

    def __init__(self, module: nn.Module, names: Iterable[str], group: Any) -> None:
        self.original = self.__wrapped__ = module.forward
        self.module, self.group = module, group
        self.names = [name.rpartition(".") for name in names]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from smpart.tensor_parallel.collectives import copy_to_tp

        held = []
        for path, _, attr in self.names:
            owner = self.module.get_submodule(path) if path else self.module
            param = owner._parameters[attr]
            held.append((owner, attr, param))
            owner._parameters[attr] = copy_to_tp(param, self.group)
        try:
            return self.original(*args, **kwargs)
        finally:
            for owner, attr, param in held:
                owner._parameters[attr] = param


def localize(module: nn.Module, split: HeadSplit, degree: int,
             group: Any = None) -> dict[str, tuple[Any, Any]]:
    """Make ``module`` (its projections already split) compute with ``1/degree`` of its heads;
    returns ``{attribute: (old, new)}``. ``group``: the tensor-parallel group the gradients of
    `HeadSplit.summed` are summed over (None: they are not, as in the proof's emulation)."""
    changed = {}
    for attr in split.attributes:
        old = getattr(module, attr)
        setattr(module, attr, old // degree)
        changed[attr] = (old, old // degree)
    if split.local_width is not None:
        module.forward = _LocalWidthForward(module, (c for c, _ in split.columns), split.local_width, degree)
        changed["forward"] = (f"input width {split.local_width}", f"its share, {split.local_width // degree}")
    if split.summed and group is not None:
        module.forward = _SummedGradients(module, split.summed, group)
        changed["gradients"] = ("", f"{', '.join(split.summed)} summed over the group")
    return changed
