"""`OneThread`: every stage's program on the caller's thread, switching where a stage waits.

On threads the stages share one interpreter, so their Python runs one stage at a time however
many threads there are. A thread per stage adds to the work itself the price of handing the GIL
over at every transfer (a wake-up through the OS scheduler) and of two cores taking turns on the
same Python objects.

Here each stage's loop is a greenlet of one thread, and a transfer is an entry in the receiving
stage's mailbox: a stage that waits for a transfer not yet made switches to the next stage that
can go on; the one it waited for goes back in line when the transfer is made. A stage runs until
it waits, so the order is set by the programs and their transfers, never by timing.

What one thread gives up is host-side parallelism between stages, and that is worth more than the
hand-overs wherever a stage does work outside the GIL: torch dispatches an operation, launches a
CUDA kernel, computes on the CPU and runs the autograd engine's backward without it, so a thread
per stage overlaps one stage's launches or compute with another's Python. On an H200, GPT-2 small
in 4 stages on one GPU took 1.17-1.31 x the unsplit step with a thread per stage and 1.59-1.78 x
on one thread; CPU stages computing on one thread compute one after the other. So a thread per
stage is the default, and ``Config.stage_threads="one"`` is for steps whose host work is all
Python (a host-bound model of many small layers), where it spends 28-39 % less CPU.

A stage that stops takes torch's thread-local state with it (`executor.Suspension`). Every stage
waiting with nothing in flight cannot happen with a program that passed its dry run
(`actions.Program.check`); if it does, every stage fails at once, naming what each waited for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from greenlet import getcurrent, greenlet

from smpart.runtime.program.executor import Aborted, Suspension, ThreadWire, describe_key


class OneThread:
    """Runs jobs (each a stage's whole program) as greenlets of the calling thread; the stages'
    `ThreadWire` sends to `arrived` and receives through `receive`."""

    def __init__(self, wire: ThreadWire) -> None:
        self.wire = wire
        self.ready: deque[greenlet] = deque()
        #: (receiving stage, transfer key) -> the greenlet waiting for it, and the sending stage.
        self.waiting: dict[tuple[int, tuple], tuple[greenlet, int]] = {}
        self.hub: Any = None
        self.base: Any = None
        wire.one_thread = self

    def run(self, jobs: list[Callable[[], None]]) -> None:
        """Run every job to its end (a job reports its own failure: none raises here)."""
        own = Suspension()  # the caller's state, back on the thread after the last job
        self.base = own.ambient
        self.hub = getcurrent()
        self.ready.extend(greenlet(job, parent=self.hub) for job in jobs)
        try:
            while self.ready or self.waiting:
                if not self.ready:
                    self._deadlocked()
                    continue
                self.ready.popleft().switch()
        finally:
            own.resume()
            self.wire.one_thread = self.hub = None  # no cycle left behind with the wire

    def receive(self, me: int, key: tuple, src: int) -> tuple[torch.Tensor | None, bool]:
        """Stage ``me``'s receive: other stages run until ``src`` has made the transfer."""
        wire = self.wire
        box = wire.boxes[me]
        while key not in box:
            if wire.abort is not None:
                raise wire.abort
            self.waiting[(me, key)] = (getcurrent(), src)
            suspension = Suspension()
            suspension.leave(self.base)
            try:
                self.hub.switch()
            finally:
                suspension.resume()
        return box.pop(key)

    def arrived(self, to: int, keys: list[tuple]) -> None:
        for key in keys:
            waiting = self.waiting.pop((to, key), None)
            if waiting is not None:
                self.ready.append(waiting[0])

    def wake_all(self) -> None:
        """Every waiting stage goes on (to find the step aborted)."""
        self.ready.extend(g for g, _ in self.waiting.values())
        self.waiting.clear()

    def _deadlocked(self) -> None:
        waits = "; ".join(f"stage {me} for {describe_key(key)} from stage {src}"
                          for (me, key), (_, src) in self.waiting.items())
        self.wire.fail(Aborted(f"every stage waits for a transfer no stage will make: {waits}"))
