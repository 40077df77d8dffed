"""`LeaderFollowers`: a stage's threads take turns receiving; whoever receives work does it.

One thread at a time (the leader) holds the *turn*: it receives the stage's messages, admits
them (every message already queued at once, so baton tickets are taken in arrival order and the
best of them wins) and runs the work it admitted itself. A message costs one thread wake-up.

The leader keeps the turn while it works, as long as nobody else needs a receiver: a stage whose
modules never call another stage (most of them) runs everything on one thread, with no hand-off
per message. The turn passes to a follower (`step_aside`) only

- when the leader starts work while another thread of the stage is busy (a call waiting for
  another stage's answer must be woken when it comes, whatever this thread is doing), or
- when the leader is about to wait (for a remote answer, or for the baton): a waiting leader
  first keeps receiving (`serve`), so the answer it waits for usually reaches it directly, and
  steps aside only when it admits work it cannot run itself, which it hands to the follower.

A forward call that waits for another stage keeps its thread (its Python frame is on that
thread's stack), so the stage needs as many threads as it has calls waiting, plus one to
receive. A thread is started whenever the turn is passed on and no follower is free; threads
are reused afterwards, so in steady state none is created. `stop` joins them all.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

Task = Callable[[], None]


class StopServing(Exception):
    """Raised by ``admit`` for the message that ends the server."""


class LeaderFollowers:
    """``receive(timeout)`` gets the next message (None: none came); ``admit(messages)`` turns
    messages that arrived together into tasks."""

    def __init__(self, name: str, receive: Callable[[float], Any | None],
                 admit: Callable[[list[Any]], list[Task]], poll_s: float) -> None:
        self._name = name
        self._receive = receive
        self._admit = admit
        self._poll_s = poll_s
        self._turn = threading.Lock()  # held by the leader
        self._state = threading.Lock()  # guards the counters below
        self._leader: int | None = None
        self._idle = 0  # threads waiting for the turn
        self._busy = 0  # threads running a task
        self._handed_over: deque[Task] = deque()  # admitted by a leader that could not run them
        self._stopping = False
        self._threads: list[threading.Thread] = []
        with self._state:
            self._start_thread()

    def stop(self, timeout_s: float) -> list[str]:
        """Wait for every thread to end (after ``admit`` raised `StopServing`); return stragglers."""
        for thread in list(self._threads):
            thread.join(timeout_s)
        return [t.name for t in self._threads if t.is_alive()]

    # ================================================================ for the tasks
    def leading(self) -> bool:
        return self._leader == threading.get_ident()

    def step_aside(self) -> None:
        """Pass the turn to a follower if this thread holds it (before it blocks, or while others need
        a receiver)."""
        if self._leader != threading.get_ident():
            return
        with self._state:
            self._leader = None
            if self._idle == 0 and not self._stopping:
                self._start_thread()
        self._turn.release()

    def serve(self, timeout_s: float) -> bool:
        """Receive and admit for the stage while this thread waits for something; work admitted here
        is handed over to a follower. False if this thread does not hold the turn (it must sleep)."""
        if not self.leading():
            return False
        tasks = self._receive_tasks(timeout_s)
        if tasks or self._stopping:
            self._handed_over.extend(tasks)
            self.step_aside()
        return True

    # ================================================================ the threads
    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._serve_loop, name=f"{self._name}-{len(self._threads)}",
                                  daemon=True)
        self._threads.append(thread)
        self._idle += 1
        thread.start()

    def _serve_loop(self) -> None:
        me = threading.get_ident()
        while True:
            self._turn.acquire()
            with self._state:
                self._idle -= 1
                self._leader = me
            self._lead(me)
            if self._stopping:
                if self._leader == me:
                    self._leader = None
                    self._turn.release()
                return
            with self._state:
                self._idle += 1

    def _lead(self, me: int) -> None:
        """Receive and run tasks while this thread holds the turn."""
        while self._leader == me and not self._stopping:
            if self._handed_over:
                self._run(self._handed_over.popleft())
                continue
            tasks = self._receive_tasks(self._poll_s)
            if tasks:
                self._handed_over.extend(tasks[1:])
                self._run(tasks[0])

    def _receive_tasks(self, timeout_s: float) -> list[Task]:
        """Admit the next message to come and every other one already queued; the tasks they make."""
        message = self._receive(timeout_s)
        if message is None:
            return []
        messages = [message, *self._queued()]
        try:
            return self._admit(messages)
        except StopServing:
            self._stopping = True
            return []
        except Exception:  # a bug in a handler must not silence the stage
            _report(messages)
            return []

    def _queued(self) -> list[Any]:
        messages = []
        while (message := self._receive(0.0)) is not None:
            messages.append(message)
        return messages

    def _run(self, task: Task) -> None:
        with self._state:
            others_busy = self._busy > 0
            self._busy += 1
        if others_busy or self._handed_over:
            self.step_aside()  # someone must keep receiving for them
        try:
            task()
        except Exception:  # tasks report their own failures; this is a last resort
            _report(task)
        finally:
            with self._state:
                self._busy -= 1


def _report(what: Any) -> None:
    warnings.warn(f"smpart: unexpected error while serving {what!r}:\n{traceback.format_exc()}",
                  RuntimeWarning, stacklevel=2)
