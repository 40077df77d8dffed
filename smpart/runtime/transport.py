"""The transport: the one seam between the runtime and how its messages travel.

A `Transport` moves messages to addresses ``(place, endpoint)`` (see `messages`) and counts the
tensor bytes that cross between places. Servers, drivers and the coordinator never touch a
queue, a socket or a process group.

- `ThreadTransport`: every place is in this process; one FIFO queue per address, messages
  passed by reference (the receiver detaches and moves tensors itself). Bytes are counted as
  they would cross between processes, so the thread runtime reports the same figures.
- `smpart.distributed.routing.RoutedTransport`: one place per rank, messages between ranks over
  ``torch.distributed``; local addresses behave as here.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

import torch
import torch.utils._pytree as pytree

from smpart.runtime.messages import Address, Gradients, Request, Response


class Transport(ABC):
    """Delivers messages between addresses; ``bytes_sent[(src, dst)]`` counts tensor bytes
    sent from place ``src`` to a different place ``dst``."""

    def __init__(self) -> None:
        self.bytes_sent: dict[tuple[int, int], int] = defaultdict(int)

    @abstractmethod
    def open(self, address: Address) -> None:
        """Start accepting messages for local ``address`` (idempotent)."""

    @abstractmethod
    def close(self, address: Address) -> None:
        """Stop accepting messages for ``address``; later messages to it are dropped."""

    @abstractmethod
    def send(self, src: int, address: Address, message: Any) -> None:
        """Deliver ``message`` from place ``src`` to ``address`` (dropped if it is closed)."""

    @abstractmethod
    def receive(self, address: Address, timeout: float) -> Any | None:
        """The next message for local ``address``, or None after ``timeout`` seconds."""

    def local(self, place: int) -> bool:
        """Whether ``place`` lives in this process."""
        return True

    def check(self) -> None:  # noqa: B027 - optional
        """Raise if the transport has failed (a lost peer); a no-op by default."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Release what the transport holds (threads, connections)."""


def payload_bytes(message: Any) -> int:
    """Bytes of the tensors a message carries (arguments, outputs, gradients)."""
    if type(message) is Request:
        value = (message.args, message.kwargs)
    elif type(message) is Response:
        value = message.output
    elif type(message) is Gradients:
        value = [grads for _, _, grads in message.parts]
    else:
        return 0
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


class ThreadTransport(Transport):
    """Threads of one process: one unbounded FIFO queue per address."""

    def __init__(self) -> None:
        super().__init__()
        self._queues: dict[Address, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def open(self, address: Address) -> None:
        with self._lock:
            self._queues.setdefault(address, queue.SimpleQueue())

    def close(self, address: Address) -> None:
        with self._lock:
            self._queues.pop(address, None)

    def send(self, src: int, address: Address, message: Any) -> None:
        inbox = self._queues.get(address)
        if inbox is None:
            return
        if address[0] != src:
            size = payload_bytes(message)
            if size:
                self.bytes_sent[(src, address[0])] += size
        inbox.put(message)

    def receive(self, address: Address, timeout: float) -> Any | None:
        inbox = self._queues.get(address)
        if inbox is None:
            raise KeyError(f"no open address {address!r}")
        try:
            return inbox.get(timeout=timeout) if timeout > 0 else inbox.get_nowait()
        except queue.Empty:
            return None
