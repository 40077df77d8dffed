"""`RoutedTransport`: the runtime's ``(place, endpoint)`` addresses over the rank-to-rank transport.

Under ``torchrun`` a place is a rank. The thread that receives a message from a peer
(`smpart.runtime.wire.processes.ProcessTransport`) puts it straight into the queue of its
endpoint; messages between endpoints of one rank
never leave it. A peer that shut smpart down says after how many steps (`Leaving`), and a wait
inside a later step fails at once, naming it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from smpart.errors import PeerLost, SmpartError
from smpart.runtime.wire.messages import MAIN, STAGE, Address, Leaving
from smpart.runtime.wire.processes import ProcessTransport
from smpart.runtime.wire.transport import Transport


class RoutedTransport(Transport):
    """``(place, endpoint)`` addresses over a rank-to-rank `ProcessTransport` (place = rank)."""

    def __init__(self, make_inner: Callable[[Callable[[Any], None]], ProcessTransport], rank: int) -> None:
        super().__init__()
        self.rank = rank
        self._queues: dict[Any, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self.open((rank, MAIN))
        self.expect((rank, STAGE))  # the stage server is made after: what arrives first waits for it
        #: The step this rank is in (numbered from 0), None between steps.
        self.step: int | None = None
        #: Peer -> the steps it took part in before it shut smpart down (`Leaving`).
        self.left: dict[int, int] = {}
        self.inner = make_inner(self._arrived)

    @property  # type: ignore[override]
    def bytes_sent(self) -> dict[tuple[int, int], int]:
        return self.inner.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: Any) -> None:  # the base class initialises it; the inner one counts
        pass

    def open(self, address: Address) -> None:
        with self._lock:
            self._queues.setdefault(address[1], queue.SimpleQueue())

    def close(self, address: Address) -> None:
        if address[1] not in (MAIN, STAGE):
            with self._lock:
                self._queues.pop(address[1], None)

    def local(self, place: int) -> bool:
        return place == self.rank

    def send(self, src: int, address: Address, message: Any) -> None:
        place, endpoint = address
        if place == self.rank:
            self._deliver(endpoint, message)
        else:
            self.inner.send(place, (endpoint, message))

    def send_all(self, src: int, addresses: list[Address], message: Any) -> None:
        by_endpoint: dict[Any, list[int]] = {}
        for place, endpoint in addresses:
            by_endpoint.setdefault(endpoint, []).append(place)
        for endpoint, places in by_endpoint.items():
            if self.rank in places:
                self._deliver(endpoint, message)
            self.inner.send_all([place for place in places if place != self.rank], (endpoint, message))

    def receive(self, address: Address, timeout: float) -> Any | None:
        inbox = self._queues.get(address[1])
        if inbox is None:
            raise KeyError(f"no open address {address!r}")
        try:
            return inbox.get(timeout=timeout) if timeout > 0 else inbox.get_nowait()
        except queue.Empty:
            self.check()
            return None

    def check(self) -> None:
        """Raise for a lost peer, and, inside a step, for a peer that shut smpart down before
        taking part in it (its script raised outside a step and ended through
        ``smpart.shutdown``, or it stopped calling the step function early): it said goodbye, so
        it is not lost to the transport, but a wait for it would last until its timeout."""
        self.inner.check()
        step = self.step
        if step is None:
            return
        for peer, steps in list(self.left.items()):
            if steps <= step:
                raise PeerLost(peer, f"it shut smpart down after {steps} step(s) (smpart.shutdown(), or the "
                                     f"end of its script), and this rank is in step {step + 1}", left=True)

    def shutdown(self) -> None:
        self.inner.close()

    def _deliver(self, endpoint: Any, message: Any) -> None:
        served = self.endpoints.get((self.rank, endpoint))
        if served is not None:
            served.deliver(message)
            return
        inbox = self._queues.get(endpoint)
        if inbox is not None:
            inbox.put(message)

    def _arrived(self, item: tuple[Any, Any]) -> None:
        """A message from another rank, on the inner transport's receiver thread for that rank."""
        endpoint, message = item
        if type(message) is Leaving:
            self.left[message.rank] = message.steps
            return
        self._deliver(endpoint, message)

    def say_leaving(self, steps: int) -> None:
        """Tell every peer this rank shuts down after ``steps`` steps (best effort: a peer may be
        gone or closing already)."""
        for peer in self.inner.peers:
            with contextlib.suppress(SmpartError):
                self.inner.send(peer, (MAIN, Leaving(self.rank, steps)))
