"""The transport: the one seam between execution servers and how their messages travel.

A `Transport` moves messages to addresses and nothing else: ``send(address, message)`` and
``receive(address, timeout)``. The servers, drivers and schedules above it never touch a queue,
a socket or a process group, so a `torch.distributed` transport (one process per stage, tensors
sent with ``send``/``recv``, the rest pickled) is an addition beside `ThreadTransport`, not a
second runtime.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from typing import Any

from smpart.runtime.messages import Address


class Transport(ABC):
    """Delivers messages between addresses (stages, drivers, step coordinators)."""

    @abstractmethod
    def open(self, address: Address) -> None:
        """Start accepting messages for ``address`` (idempotent)."""

    @abstractmethod
    def close(self, address: Address) -> None:
        """Stop accepting messages for ``address``; later messages to it are dropped."""

    @abstractmethod
    def send(self, address: Address, message: Any) -> None:
        """Deliver ``message`` to ``address``; dropped silently if the address is closed."""

    @abstractmethod
    def receive(self, address: Address, timeout: float) -> Any | None:
        """The next message for ``address``, or None after ``timeout`` seconds (0: do not wait)."""

    def idle(self, address: Address) -> bool:
        """True if no message is waiting for ``address`` (False when the transport cannot tell)."""
        return False


class ThreadTransport(Transport):
    """Threads of one process: one unbounded FIFO queue per address, messages passed by reference.

    Tensors are not copied here; the receiving side detaches (and moves) them itself.
    """

    def __init__(self) -> None:
        self._queues: dict[Address, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def open(self, address: Address) -> None:
        with self._lock:
            self._queues.setdefault(address, queue.SimpleQueue())

    def close(self, address: Address) -> None:
        with self._lock:
            self._queues.pop(address, None)

    def send(self, address: Address, message: Any) -> None:
        inbox = self._queues.get(address)
        if inbox is not None:
            inbox.put(message)

    def idle(self, address: Address) -> bool:
        inbox = self._queues.get(address)
        return inbox is not None and inbox.empty()

    def receive(self, address: Address, timeout: float) -> Any | None:
        inbox = self._queues.get(address)
        if inbox is None:
            raise KeyError(f"no open address {address!r}")
        if timeout <= 0:  # a poll: one reader per address, so empty() cannot go stale
            return None if inbox.empty() else inbox.get_nowait()
        try:
            return inbox.get(timeout=timeout)
        except queue.Empty:
            return None
