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
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from smpart.runtime.boundary import GradPost
from smpart.runtime.messages import Address, BackwardRequest, GradientMessage, GradResponse

#: call_id -> (module name, kept tensors indexed like the call's tensors; None: no grad needed)
CallRecords = dict[int, tuple[str, list[torch.Tensor | None]]]


def backpropagate(batches: list[tuple[CallRecords, list[GradientMessage]]]) -> None:
    """One backward segment: each batch's messages (gradient index -> tensor) land on the tensors
    its records kept; all of them go through a single ``autograd.backward`` call."""
    targets: dict[int, list] = {}
    for records, message in ((r, m) for r, ms in batches for m in ms):
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
        torch.autograd.backward(list(tensors), list(grads), retain_graph=True)


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


def gradient_poster(send: Callable[[Address, object], None], pending: PendingGradients, step: int,
                    microbatch: int) -> GradPost:
    """What `_Arrive` nodes of ``microbatch`` call: count the message in flight, then send it."""

    def post(target: tuple[Address, int, bool], grads: dict[int, torch.Tensor]) -> None:
        address, call_id, to_outputs = target
        pending.add(microbatch)
        kind = BackwardRequest if to_outputs else GradResponse
        send(address, kind(step, microbatch, call_id, grads))

    return post
