"""Backward segments: stage-local ``autograd.backward`` calls driven by gradient messages.

`backpropagate` runs one segment for a batch of gradient messages of one micro-batch: each
message names a call (``call_id``) whose kept tensors (the outputs a callee returned, or the
arguments a caller sent) receive the message's gradients. Gradients for the same tensor are
summed first, and all tensors go into a single ``autograd.backward`` call, so a graph shared by
several of them (a residual whose branches live on different stages) is traversed once per batch
rather than once per message. Graphs are always retained: a later message of the same
micro-batch may need the same graph again (correct by linearity; the graphs are dropped when
the micro-batch completes).

`PendingGradients` counts gradient messages in flight per micro-batch: +1 before a message is
posted, -1 after it has been processed. A micro-batch's backward is complete when its forward
is done and the count is zero.

Messages a segment posts are held back until the segment's bookkeeping is done (`held_posts`,
used when nothing else runs on the stage): the stage they wake then runs alone instead of
fighting this thread for the GIL during its tail. The boundary node is almost always the last
node of a segment's graph, so holding delays nothing else. At the flush, a stage's server may
run a held message itself when its stage is idle (`ExecutionServer.deliver`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from smpart.runtime.boundary import GradPost
from smpart.runtime.messages import Address, BackwardRequest, GradientMessage, GradResponse

#: call_id -> (module name, kept tensors indexed like the call's tensors; None: no grad needed)
CallRecords = dict[int, tuple[str, list[torch.Tensor | None]]]


def backpropagate(messages: list[tuple[CallRecords, GradientMessage]]) -> None:
    """One backward segment: each message's gradients (tensor index -> gradient) land on the tensors
    its records kept; all of them go through a single ``autograd.backward`` call."""
    targets: dict[int, list] = {}
    for records, message in messages:
        _, kept = records[message.call_id]
        for index, grad in message.grads.items():
            tensor = kept[index]
            if tensor is None:
                continue
            grad = grad.to(tensor.device)
            entry = targets.get(id(tensor))
            if entry is None:
                targets[id(tensor)] = [tensor, grad]
            else:
                entry[1] = entry[1] + grad
    if targets:
        tensors, grads = zip(*targets.values(), strict=True)
        run_backward(tensors, grads)


def run_backward(tensors: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]) -> None:
    """``torch.autograd.backward(tensors, grads, retain_graph=True)`` without its argument checks.

    Each gradient was computed by autograd for a tensor of the same shape and dtype and moved to
    its device, so ``torch.autograd``'s validation of them (a third of a small segment's cost on
    CPU, ~10 µs) is skipped by entering the engine the way ``torch.autograd.backward`` does.
    """
    if _engine_run is None:  # another torch version: the public route
        torch.autograd.backward(list(tensors), list(grads), retain_graph=True)
        return
    _engine_run(tensors, grads, True, False, (), True, True)  # retain, no create_graph, all leaves


_engine_run = getattr(torch.autograd.graph, "_engine_run_backward", None)


def module_of(records: CallRecords, messages: list[GradientMessage]) -> str | None:
    for message in messages:
        if message.call_id in records:
            return records[message.call_id][0]
    return None


class PendingGradients:
    """Gradient messages in flight per micro-batch (shared by the threads of one process)."""

    def __init__(self, microbatches: int) -> None:
        self._counts = [0] * microbatches
        self._lock = threading.Lock()

    def add(self, microbatch: int) -> None:
        with self._lock:
            self._counts[microbatch] += 1

    def done(self, microbatch: int) -> bool:
        """Count one message processed; True when none is left in flight."""
        with self._lock:
            self._counts[microbatch] -= 1
            return self._counts[microbatch] == 0

    def count(self, microbatch: int) -> int:
        with self._lock:
            return self._counts[microbatch]


_outbox = threading.local()


class HeldPosts:
    """Gradient messages posted by backward segments run in this thread, sent at `flush`."""

    __slots__ = ("messages", "_previous")

    def __init__(self) -> None:
        self.messages: list[tuple[Address, Any, Callable[[Address, object], None]]] = []
        self._previous = getattr(_outbox, "held", None)
        _outbox.held = self

    def flush(self) -> None:
        """Stop holding (nested holds: back to the outer one) and send what was held."""
        _outbox.held = self._previous
        for address, message, send in self.messages:
            send(address, message)
        self.messages.clear()


def held_posts() -> HeldPosts:
    """Hold the gradient messages this thread posts until ``.flush()`` (call it in a ``finally``)."""
    return HeldPosts()


def gradient_poster(send: Callable[[Address, object], None], pending: PendingGradients, step: int,
                    microbatch: int, deliver: Callable[[Address, object], None] | None = None) -> GradPost:
    """What `_Arrive` nodes of ``microbatch`` call: count the message in flight, then send it (or
    hold it, see `held_posts`; a device's autograd thread on CUDA sends at once). A held message
    is passed to ``deliver`` at the flush (default: ``send``), outside any autograd call."""
    deliver = deliver or send

    def post(target: tuple[Address, int, bool], grads: dict[int, torch.Tensor]) -> None:
        address, call_id, to_outputs = target
        pending.add(microbatch)
        message = (BackwardRequest if to_outputs else GradResponse)(step, microbatch, call_id, grads)
        held = getattr(_outbox, "held", None)
        if held is None:
            send(address, message)
        else:
            held.messages.append((address, message, deliver))

    return post
