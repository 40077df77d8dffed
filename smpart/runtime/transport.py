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

    def admitted(self, address: Address, count: int) -> None:  # noqa: B027 - optional, no-op by default
        """The receiver of ``address`` has taken ``count`` received messages into account (its
        server has admitted them: taken their baton tickets). Only `idle` cares."""

    def idle(self, address: Address) -> bool:
        """True if every message sent to ``address`` has been admitted (`admitted`), so none is in
        its inbox or in its receiver's hands; False when the transport cannot tell."""
        return False


class ThreadTransport(Transport):
    """Threads of one process: one unbounded FIFO queue per address, messages passed by reference.

    Tensors are not copied here; the receiving side detaches (and moves) them itself.

    `idle` counts messages from the moment they are sent until the receiver reports them admitted,
    not just those still queued: a message the receiving thread has just taken off the queue, but
    not yet ticketed, must not make its stage look idle (see `ExecutionServer.run_inline`).
    """

    def __init__(self) -> None:
        self._queues: dict[Address, queue.SimpleQueue] = {}
        self._unadmitted: dict[Address, int] = {}
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()

    def open(self, address: Address) -> None:
        with self._lock:
            self._queues.setdefault(address, queue.SimpleQueue())

    def close(self, address: Address) -> None:
        with self._lock:
            self._queues.pop(address, None)
            self._unadmitted.pop(address, None)

    def send(self, address: Address, message: Any) -> None:
        inbox = self._queues.get(address)
        if inbox is not None:
            with self._count_lock:  # counted before it can be received: `idle` never misses it
                self._unadmitted[address] = self._unadmitted.get(address, 0) + 1
            inbox.put(message)

    def admitted(self, address: Address, count: int) -> None:
        with self._count_lock:
            self._unadmitted[address] = self._unadmitted.get(address, 0) - count

    def idle(self, address: Address) -> bool:
        return address in self._queues and self._unadmitted.get(address, 0) == 0

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
