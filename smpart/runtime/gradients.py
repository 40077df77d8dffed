"""Backward segments: stage-local ``autograd.backward`` calls driven by gradient messages.

`backpropagate` runs one segment for a batch of `Gradients` messages of one micro-batch: each
names a call whose kept tensors (the outputs a callee returned, or the arguments a caller sent)
receive the message's gradients. Gradients for the same tensor are summed first and every
tensor goes into a single ``autograd.backward`` call, so a graph shared by several of them (a
residual whose branches live on different stages) is traversed once per batch. Graphs are
retained: a later message of the same micro-batch may need the same graph again (correct by
linearity; the graphs go when the micro-batch is released).

While a segment runs, the `_Arrive` nodes it reaches post gradient messages into an `Outbox`;
when it ends, `dispatch` sends them with their share of the segment's credit (see `messages`).
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch

from smpart.runtime.boundary import walk
from smpart.runtime.messages import Address, Credit, Gradients

#: call_id -> (module name, kept tensors indexed like the call's tensors; None: no grad needed)
CallRecords = dict[Any, tuple[str, list[torch.Tensor | None]]]
Send = Callable[[Address, object], None]


class Outbox:
    """Gradient messages posted during a backward segment: ``(address, call_id, to_outputs)`` and
    ``{tensor index: gradient}``. Its `post` is what `_Arrive` nodes call (on whatever thread
    autograd runs them), so it is given to `boundary.arrive` at forward time."""

    __slots__ = ("posts",)

    def __init__(self) -> None:
        self.posts: list[tuple[tuple[Address, Any, bool], dict[int, torch.Tensor]]] = []

    def post(self, target: tuple[Address, Any, bool], grads: dict[int, torch.Tensor]) -> None:
        self.posts.append((target, grads))

    def take(self) -> list:
        posts, self.posts = self.posts, []
        return posts


def dispatch(send: Send, posts: list, credit: Fraction, step: int, microbatch: int, home: Address,
             sender: int = -1, counts: dict | None = None) -> None:
    """Send a segment's posts, one message per endpoint, each with an equal share of ``credit``;
    none: the credit goes home. ``counts`` numbers the messages per endpoint for their `origin`."""
    if not posts:
        if credit:
            send(home, Credit(step, microbatch, credit))
        return
    by_address: dict[Address, list] = {}
    for (address, call_id, to_outputs), grads in posts:
        by_address.setdefault(address, []).append((call_id, to_outputs, grads))
    share = credit / len(by_address)
    counts = {} if counts is None else counts
    for address, parts in by_address.items():
        n = counts.get(address, 0)
        counts[address] = n + 1
        send(address, Gradients(step, microbatch, parts, share, (sender, n)))


def grad_mask(kept: list | None, forwarded: dict) -> tuple[int, ...]:
    """Indices of a departing value's tensors that require grad: kept ones and forwarded ones."""
    kept_indices = [] if kept is None else [i for i, t in enumerate(kept) if t is not None]
    return tuple(sorted({*kept_indices, *forwarded}))


def restore_requires_grad(value: Any, mask: tuple[int, ...]) -> None:
    """Tensors that crossed a process boundary arrive as leaves that do not require grad: mark
    those the sender's did (on threads they are the sender's own tensors and already do)."""
    if not mask:
        return
    wanted = set(mask)
    index = 0

    def visit(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal index
        if index in wanted and not tensor.requires_grad and tensor.is_floating_point() | tensor.is_complex():
            tensor.requires_grad_(True)
        index += 1
        return tensor

    walk(value, visit)


def backpropagate(served: CallRecords, sent: CallRecords, messages: list[Gradients],
                  call_by_call: bool = False) -> None:
    """One backward segment: every message's gradients land on the tensors its call kept (the
    outputs this endpoint ``served``, or the arguments it ``sent``), in one ``backward`` call.

    ``call_by_call`` (tensor parallelism): one ``backward`` call per module call instead, in the
    messages' order. Autograd runs the nodes that are ready at once by their creation number, a
    per-thread counter, and the calls of one stage ran on different worker threads: one backward
    over several calls' graphs could order their collectives differently on each tensor-parallel
    rank. A call's own graph was built on one thread, so its order is the same everywhere."""
    groups: dict[Any, dict[int, list]] = {}
    for call_id, to_outputs, grads_by_index in (part for message in messages for part in message.parts):
        records = served if to_outputs else sent
        if call_id not in records:
            continue
        _, kept = records[call_id]
        targets = groups.setdefault((call_id, to_outputs) if call_by_call else None, {})
        for index, grad in grads_by_index.items():
            tensor = kept[index]
            if tensor is None:
                continue
            grad = grad.to(tensor.device)
            entry = targets.get(id(tensor))
            if entry is None:
                targets[id(tensor)] = [tensor, grad]
            else:
                entry[1] = entry[1] + grad
    for targets in groups.values():
        if targets:
            tensors, grads = zip(*targets.values(), strict=True)
            torch.autograd.backward(list(tensors), list(grads), retain_graph=True)


def module_of(served: CallRecords, sent: CallRecords, messages: list[Gradients]) -> str | None:
    """The module whose call a failing segment worked for (to name it in the error)."""
    for call_id, to_outputs, _ in (part for message in messages for part in message.parts):
        records = served if to_outputs else sent
        if call_id in records:
            return records[call_id][0]
    return None
