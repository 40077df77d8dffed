"""Carried state (a Hugging Face cache the layers of several stages update in turn) between processes.

On threads a carried object crosses by reference: every stage mutates the one object. Between
processes it cannot, so a call copies in and copies out (see `boundary`'s docstring for why no
gradient flows through such state):

- the caller packs each carried object of the arguments (`boundary.pack_carried`);
- the callee unpacks its copies, runs the module (which mutates them), and answers with a
  snapshot of each (`Response.carried`); an output that *is* one of those objects (a model
  returning the cache it was given) goes back as a `CarriedRef` to it, any other carried object in
  the output is packed;
- the caller merges every snapshot into its own object in place (`boundary.merge_state`) and
  puts its own objects where the output refers to them.

Within a micro-batch, calls are sequential, so two copies of one object are never live at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from smpart.runtime.reference import boundary


class CarriedRef:
    """In an answer: "the ``index``-th carried object of the call's arguments"."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple:
        return (CarriedRef, (self.index,))


def _is_leaf(value: Any) -> bool:
    return boundary.is_carried_state(value) or type(value) is CarriedRef


def pack_call(value: Any) -> tuple[Any, list[Any]]:
    """The arguments as they cross (carried objects packed), and the caller's own carried objects."""
    originals = boundary.carried_leaves(value)
    return (boundary.pack_carried(value) if originals else value), originals


def unpack_call(value: Any, device: torch.device | None) -> Any:
    return boundary.unpack_carried(value, device)


def pack_answer(arguments: Any, output: Any) -> tuple[Any, list[Any]]:
    """The callee's output as it crosses back, and snapshots of the argument objects it mutated."""
    mutated = boundary.carried_leaves(arguments)
    if not mutated and not boundary.carried_leaves(output):
        return output, []
    index = {id(obj): i for i, obj in enumerate(mutated)}

    def swap(leaf: Any) -> Any:
        if id(leaf) in index:
            return CarriedRef(index[id(leaf)])
        return boundary.pack_state(leaf) if boundary.is_carried_state(leaf) else leaf

    return pytree.tree_map(swap, output, is_leaf=_is_leaf), [boundary.pack_state(obj) for obj in mutated]


def unpack_answer(output: Any, snapshots: list[Any], originals: list[Any],
                  device: torch.device | None) -> Any:
    """Merge the callee's snapshots into the caller's objects; the output with references resolved."""
    for original, snapshot in zip(originals, snapshots, strict=True):
        boundary.merge_state(original, boundary.unpack_state(snapshot, device))
    if not snapshots and not any(type(leaf) is CarriedRef for leaf in pytree.tree_leaves(output)):
        return boundary.unpack_carried(output, device)
    output = pytree.tree_map(lambda leaf: originals[leaf.index] if type(leaf) is CarriedRef else leaf, output,
                             is_leaf=_is_leaf)
    return boundary.unpack_carried(output, device)
