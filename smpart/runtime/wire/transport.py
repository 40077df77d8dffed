"""The transport: the one seam between the runtime and how its messages travel.

A `Transport` moves messages to addresses ``(place, endpoint)`` (see `messages`) and counts the
tensor bytes that cross between places. Servers, drivers and the coordinator never touch a
queue, a socket or a process group.

- `ThreadTransport`: every place is in this process; one FIFO queue per address, messages
  passed by reference (the receiver detaches and moves tensors itself). Bytes are counted as
  they would cross between processes, so the thread runtime reports the same figures.
- `smpart.runtime.wire.routed.RoutedTransport`: one place per rank, messages between ranks over
  ``torch.distributed``; local addresses behave as here.

An address is either *received* (`receive` reads its queue: a driver, a coordinator, a rank's
main thread) or *served* (`serve`: a stage server's `Endpoint`, whose handler takes each message).

A served endpoint's handler runs on its own thread (a stage server's dispatcher): the
transport's thread that delivers a message only queues it, so no handler ever runs on a
sender's thread, and handlers take their messages one at a time, in arrival order.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from smpart.runtime.reference.handles import HandleRef
from smpart.runtime.wire.messages import Address, Batch, Gradients, Request, Response


class Endpoint:
    """A served address: a handler that takes its messages one at a time, in the order they arrive.

    ``deliver`` is called by the transport on whatever thread a message arrives on and queues it;
    the endpoint's own thread calls `serve_one` in a loop. Messages that arrive before a handler is
    attached wait in the queue.
    """

    def __init__(self, handler: Callable[[Any], None] | None) -> None:
        self.handler = handler
        self._queue: deque = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)

    def deliver(self, message: Any) -> None:
        with self._lock:
            self._queue.append(message)
            self._ready.notify()

    def serve_one(self, timeout: float) -> bool:
        """Handle the next queued message (waiting up to ``timeout`` s for one); whether one was."""
        with self._lock:
            if not self._ready.wait_for(lambda: bool(self._queue) and self.handler is not None, timeout):
                return False
            message = self._queue.popleft()
        self.handler(message)
        return True


class Transport(ABC):
    """Delivers messages between addresses; ``bytes_sent[(src, dst)]`` counts tensor bytes
    sent from place ``src`` to a different place ``dst``."""

    def __init__(self) -> None:
        self.bytes_sent: dict[tuple[int, int], int] = defaultdict(int)
        self.endpoints: dict[Address, Endpoint] = {}

    def serve(self, address: Address, handler: Callable[[Any], None]) -> Endpoint:
        """Make local ``address`` served: ``handler`` takes its messages (see `Endpoint`), those
        that arrived before too if the address was made ready for it (`expect`)."""
        endpoint = self.expect(address)
        endpoint.handler = handler
        return endpoint

    def expect(self, address: Address) -> Endpoint:
        """Queue the messages for local ``address`` until it is served."""
        endpoint = self.endpoints.get(address)
        if endpoint is None:
            endpoint = self.endpoints[address] = Endpoint(None)
        return endpoint

    def unserve(self, address: Address) -> None:
        """Stop serving ``address``; later messages to it are dropped."""
        self.endpoints.pop(address, None)

    @abstractmethod
    def open(self, address: Address) -> None:
        """Start accepting messages for local ``address`` (idempotent)."""

    @abstractmethod
    def close(self, address: Address) -> None:
        """Stop accepting messages for ``address``; later messages to it are dropped."""

    @abstractmethod
    def send(self, src: int, address: Address, message: Any) -> None:
        """Deliver ``message`` from place ``src`` to ``address`` (dropped if it is closed)."""

    def send_all(self, src: int, addresses: list[Address], message: Any) -> None:
        """`send` one ``message`` to each of ``addresses`` (between processes it is pickled once)."""
        for address in addresses:
            self.send(src, address, message)

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
    """Bytes of the tensors a message carries (arguments, outputs, gradients, small handles' data)."""
    if type(message) is Request:
        return _tensor_bytes((message.args, message.kwargs))
    if type(message) is Response:
        return _tensor_bytes(message.output)
    if type(message) is Gradients:
        return sum(_tensor_bytes(grads) for _, _, grads in message.parts)
    if type(message) is Batch:
        return sum(payload_bytes(m) for m in message.messages)
    return 0


def _tensor_bytes(value: Any) -> int:
    # Every message on threads is counted: plain containers are walked here, anything else
    # (a registered pytree node such as a model output) through pytree.
    kind = type(value)
    if kind is tuple or kind is list:
        return sum(_tensor_bytes(v) for v in value)
    if kind is dict:
        return sum(_tensor_bytes(v) for v in value.values())
    if kind is HandleRef:
        value = value.data
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if value is None or kind in (int, float, bool, str):
        return 0
    leaves = pytree.tree_leaves(value)
    return 0 if len(leaves) == 1 and leaves[0] is value else sum(_tensor_bytes(leaf) for leaf in leaves)


class ThreadTransport(Transport):
    """Threads of one process: one unbounded FIFO queue per received address."""

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
        endpoint = self.endpoints.get(address)
        inbox = self._queues.get(address) if endpoint is None else None
        if endpoint is None and inbox is None:
            return
        if address[0] != src:
            size = payload_bytes(message)
            if size:
                self.bytes_sent[(src, address[0])] += size
        if endpoint is not None:
            endpoint.deliver(message)
        else:
            inbox.put(message)

    def receive(self, address: Address, timeout: float) -> Any | None:
        inbox = self._queues.get(address)
        if inbox is None:
            raise KeyError(f"no open address {address!r}")
        try:
            return inbox.get(timeout=timeout) if timeout > 0 else inbox.get_nowait()
        except queue.Empty:
            return None
