"""`LeaderFollowers`: a stage's threads take turns receiving; whoever receives work does it.

One thread at a time (the leader) waits on the stage's inbox. When a message arrives, the leader
*admits* it while still holding the turn (so baton tickets are taken in arrival order), passes
the turn to a follower, and runs the work itself: a message costs one thread wake-up, not two
(no hand-off from a dispatcher to a worker).

A forward call that waits for another stage keeps its thread (its Python frame is on that
thread's stack), so the stage needs as many threads as it has calls waiting, plus one to receive.
Whenever the last free thread takes work, a new one is started; threads are reused afterwards,
so in steady state none is created. `stop` joins them all.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any

Task = Callable[[], None]


class StopServing(Exception):
    """Raised by ``admit`` for the message that ends the server."""


class LeaderFollowers:
    def __init__(self, name: str, receive: Callable[[], Any | None],
                 admit: Callable[[Any], Task | None]) -> None:
        self._name = name
        self._receive = receive
        self._admit = admit
        self._turn = threading.Lock()  # held by the leader while it waits for a message
        self._count = threading.Lock()
        self._free = 0  # threads not running a task (the leader and the followers)
        self._stopping = False
        self._threads: list[threading.Thread] = []
        with self._count:
            self._start_thread()

    def stop(self, timeout_s: float) -> list[str]:
        """Wait for every thread to end (after ``admit`` raised `StopServing`); return stragglers."""
        for thread in list(self._threads):
            thread.join(timeout_s)
        return [t.name for t in self._threads if t.is_alive()]

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._serve, name=f"{self._name}-{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        self._free += 1
        thread.start()

    def _serve(self) -> None:
        while True:
            with self._turn:
                if self._stopping:
                    return
                message = self._receive()
                if message is None:
                    continue
                try:
                    task = self._admit(message)
                except StopServing:
                    self._stopping = True
                    return
                except Exception:  # a bug in a handler must not silence the stage
                    _report(message)
                    continue
                if task is not None:
                    with self._count:
                        self._free -= 1
                        if self._free == 0:
                            self._start_thread()  # someone must keep receiving
            if task is not None:
                try:
                    task()
                except Exception:  # tasks report their own failures; this is a last resort
                    _report(task)
                finally:
                    with self._count:
                        self._free += 1


def _report(what: Any) -> None:
    warnings.warn(f"smpart: unexpected error while serving {what!r}:\n{traceback.format_exc()}",
                  RuntimeWarning, stacklevel=2)
