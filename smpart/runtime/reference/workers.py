"""The threads a stage's work runs on, and what they share: jobs, waits for answers, the debug log.

`WorkerPool` starts a thread whenever every one is busy (a call waiting for another stage keeps its
thread: its Python frames live on that stack) and reuses idle ones, so a steady state starts none.
`run_job` runs a job, warning of anything that escapes it. A `Waiter` is a call
waiting for its `Response`, every ``POLL_S`` checking the transport for lost peers.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from smpart.runtime.ambient import compute_thread
from smpart.runtime.reference.scheduler import Cancelled, TimedOut
from smpart.runtime.wire.messages import Response

POLL_S = 0.05
log = logging.getLogger("smpart.runtime")
_call_counter = itertools.count()


def new_call_id(place: int) -> tuple[int, int]:
    """Call ids are unique per job: the caller's place and a per-process counter."""
    return (place, next(_call_counter))


def debugging() -> bool:
    """Whether ``SMPART_DEBUG`` is set (read when a stage server is made: at ``smpart.init``)."""
    return os.environ.get("SMPART_DEBUG", "") not in ("", "0")


def debug(what: str, *args: Any) -> None:
    log.warning("[rank %s %s] " + what, os.environ.get("RANK", "-"), threading.current_thread().name, *args)


class Waiter:
    """A call waiting for its `Response`."""

    __slots__ = ("event", "response", "cancelled")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.response: Response | None = None
        self.cancelled = False

    def deliver(self, response: Response | None) -> None:
        self.response = response
        self.event.set()

    def cancel(self) -> None:
        self.cancelled = True
        self.event.set()

    def wait(self, timeout_s: float, what: Callable[[], str], check: Callable[[], None]) -> Response:
        deadline = time.monotonic() + timeout_s
        while not self.event.wait(POLL_S):
            check()
            if time.monotonic() > deadline:
                raise TimedOut(what())
        if self.cancelled:
            raise Cancelled()
        assert self.response is not None
        return self.response


def run_job(job: Callable[[], Any]) -> None:
    """Run ``job``. Jobs report their own failures, so anything escaping one is only warned of."""
    try:
        job()
    except BaseException:  # noqa: BLE001 - a last resort: the thread goes on with its next job
        warnings.warn(f"smpart: unexpected error in {threading.current_thread().name}:\n"
                      f"{traceback.format_exc()}", RuntimeWarning, stacklevel=1)


class WorkerPool:
    """Threads that run jobs; a new one starts whenever every thread is busy (a waiting call keeps
    its thread), and idle ones are reused, so a steady state starts none."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
            else:
                thread = compute_thread(self._loop, f"{self._name}-{len(self.threads)}")
                self.threads.append(thread)
                thread.start()
            self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            run_job(job)
            with self._lock:
                self._idle += 1

    def stop(self, timeout_s: float) -> list[str]:
        for _ in self.threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]
