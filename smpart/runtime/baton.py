"""`Baton`: a stage runs one piece of work at a time, and the schedule picks which.

A stage is one device: its forward calls and backward segments run one at a time, in the order
its `Schedule` prefers. Each piece of work takes a `Ticket` when it becomes runnable (a forward
request or a gradient message arrives, a waiting call gets its response) and waits until the
baton is granted to that ticket. Whoever holds the baton gives it back when the work ends or
when it waits on another stage, and the baton then goes to the best ready ticket.

Tickets are taken by the thread receiving the stage's messages, in arrival order, not by the
threads doing the work when they happen to wake up, so the order work runs in does not depend
on thread timing: micro-batches pass each stage in order, which keeps BatchNorm statistics
identical to an unsplit run. Messages that arrived together are admitted under `deferred`, so
the best of them wins, not the first. A stage has two batons: one for compute, one for the glue
code of calls resuming after another stage answered (`ExecutionServer.enter_compute`).
Work offered to a stage with a free, uncontested baton may skip the queue altogether: `try_take`
grants it at once, as admitting it would have (`ExecutionServer._take_inline`).

A ticket is signalled through a bare lock (created held, released once to wake its waiter):
tickets are taken for every message, and a lock costs a fraction of a `threading.Event`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator

POLL_S = 0.05


class Cancelled(BaseException):
    """The ticket's step was aborted while it waited (a BaseException: user code must not catch it)."""


class TimedOut(Exception):
    """The ticket waited longer than the step's timeout."""


class Ticket:
    """A claim on the baton by one piece of work of ``kind`` for ``microbatch``."""

    __slots__ = ("kind", "microbatch", "arrival", "granted", "cancelled", "payload", "_signal")

    def __init__(self, kind: str, microbatch: int) -> None:
        self.kind = kind
        self.microbatch = microbatch
        self.arrival = 0
        self.granted = False
        self.cancelled = False
        self.payload = None
        self._signal = threading.Lock()
        self._signal.acquire()

    def grant(self) -> None:
        self.granted = True
        self._wake()

    def cancel(self) -> None:
        self.cancelled = True
        self._wake()

    def block(self, timeout_s: float) -> None:
        """Sleep until granted or cancelled, at most ``timeout_s``."""
        if not (self.granted or self.cancelled) and self._signal.acquire(timeout=timeout_s):
            self._signal.release()  # stay signalled: later checks must not block

    def _wake(self) -> None:
        try:  # noqa: SIM105 - contextlib.suppress costs more than the release, on every message
            self._signal.release()
        except RuntimeError:  # already woken (granted, then cancelled)
            pass


#: ``serve(timeout_s)``: do the stage's receiving while a ticket waits; False if this thread cannot.
Serve = Callable[[float], bool]


class Baton:
    """The right to run on one stage, granted to the best ready `Ticket`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: Ticket | None = None
        self._waiting: list[Ticket] = []
        self._arrival = itertools.count()
        self._last_kind: str | None = None
        self._deferred = False
        self._rank: Callable[[str, int, str | None], tuple] = lambda kind, mb, last: (mb,)
        self._ready: Callable[[str], bool] = lambda kind: True

    def set_schedule(self, rank: Callable[[str, int, str | None], tuple],
                     ready: Callable[[str], bool]) -> None:
        """``rank(kind, microbatch, last kind granted)`` orders ready tickets; ``ready(kind)`` filters."""
        with self._lock:
            self._rank, self._ready, self._last_kind = rank, ready, None

    def ticket(self, kind: str, microbatch: int) -> Ticket:
        """A new ticket, not yet waiting (`enqueue` it when its work becomes runnable)."""
        return Ticket(kind, microbatch)

    def enqueue(self, ticket: Ticket) -> Ticket:
        """Make ``ticket`` runnable; it is granted the baton when it is the best ready one."""
        with self._lock:
            ticket.arrival = next(self._arrival)
            self._waiting.append(ticket)
            self._grant()
        return ticket

    def take(self, kind: str, microbatch: int) -> Ticket:
        return self.enqueue(self.ticket(kind, microbatch))

    def try_take(self, kind: str, microbatch: int) -> Ticket | None:
        """A ticket already holding the baton, or None unless the baton is free, nobody waits for it
        and the schedule lets ``kind`` run (then no choice is being bypassed)."""
        with self._lock:
            if self._holder is not None or self._waiting or self._deferred or not self._ready(kind):
                return None
            ticket = Ticket(kind, microbatch)
            ticket.arrival = next(self._arrival)
            self._holder = ticket
            self._last_kind = kind
            ticket.grant()
            return ticket

    def idle(self) -> bool:
        """Nobody holds the baton or waits for it (a hint: it may change at any moment)."""
        return self._holder is None and not self._waiting

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Grant nothing until the block ends (tickets enqueued in it compete with each other)."""
        with self._lock:
            self._deferred = True
        try:
            yield
        finally:
            with self._lock:
                self._deferred = False
                self._grant()

    def wait(self, ticket: Ticket, timeout_s: float, what: Callable[[], str],
             serve: Serve | None = None) -> None:
        """Block until ``ticket`` holds the baton; raise `Cancelled` or `TimedOut` instead.

        While it waits, the thread may do the stage's receiving (``serve``) instead of sleeping.
        """
        deadline = time.monotonic() + timeout_s
        while not ticket.granted:
            if ticket.cancelled:
                raise Cancelled()
            if time.monotonic() > deadline:
                with self._lock:
                    if self._holder is not ticket:
                        self._waiting.remove(ticket)
                        raise TimedOut(what())
                return  # granted just now
            if serve is None or not serve(POLL_S):
                ticket.block(POLL_S)
        if ticket.cancelled:
            self.release(ticket)
            raise Cancelled()

    def release(self, ticket: Ticket) -> None:
        """Give the baton back (a no-op unless ``ticket`` holds it)."""
        with self._lock:
            if self._holder is ticket:
                self._holder = None
                self._grant()

    def reconsider(self) -> None:
        """Readiness may have changed (a forward pass finished): grant if possible."""
        with self._lock:
            self._grant()

    def cancel_all(self) -> None:
        """Wake every waiting ticket with `Cancelled` (the step was aborted)."""
        with self._lock:
            for ticket in self._waiting:
                ticket.cancel()
            self._waiting.clear()

    def _grant(self) -> None:
        if self._holder is not None or not self._waiting or self._deferred:
            return
        waiting = self._waiting
        if len(waiting) == 1:  # the common case: no choice to make
            best = waiting[0] if self._ready(waiting[0].kind) else None
        else:
            ready = [t for t in waiting if self._ready(t.kind)]
            best = min(ready, key=lambda t: (*self._rank(t.kind, t.microbatch, self._last_kind), t.arrival),
                       default=None)
        if best is None:
            return
        waiting.remove(best)
        self._holder = best
        self._last_kind = best.kind
        best.grant()
