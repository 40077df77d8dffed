"""`StateExchange`: the full state dict under processes, asked of the ranks that hold its parts.

Under ``torchrun`` each rank holds only its own stage's parameters (and their optimizer state), so
`DistributedModel.state_dict` and `DistributedOptimizer.state_dict` need the other stages' parts.
A collective would make every rank call them, and the most common line of a training script,
``if smpart.rank() == 0: torch.save(model.state_dict(), path)``, would hang. So the exchange is
one-sided: the rank asking sends a `StateRequest` to the main address of every other stage's rank
of its replica, and each answers with a `StateReply` of its part.

The trick is *where* a rank answers: only where its parameters hold still, so that every part
belongs to the same moment of training.
- Waiting for its next step to begin (`ProcessRuntime._follow`, and the driver's rank before it
  begins one): the previous step and its optimizer step are over, the next has not begun. A
  request that comes once the step has begun here is kept, and answered at the next such place.
- Inside its own ``state_dict()`` (every rank asking).
- At ``smpart.shutdown()``, which waits for its peers to leave too: the first rank saving after
  the last step, while the others' scripts ended.

Only the driver's rank can end such a place for the others: a step begins when it says so. So
before it begins one, it waits until every rank it answered since the last step says it is done
asking (`StateDone`, sent as that rank enters the step function), answering meanwhile. Every rank
calling ``model.state_dict()`` then ``optimizer.state_dict()`` cannot leave one behind, waiting
for the driver's rank to answer from inside the next step. The answer is a copy, so a tensor
still crossing when training goes on here is not the next one.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from smpart.errors import SmpartError
from smpart.runtime.reference.workers import POLL_S
from smpart.runtime.wire.messages import MAIN, StateDone, StateReply, StateRequest


class StateExchange:
    """One rank's side of the exchange: asking (`gather`) and answering (`answer`, `answer_waiting`).

    ``deferred`` collects the other messages a wait here takes from the main address, for the step
    function's wait (`ProcessRuntime._follow`); ``part_of(kind, target)`` is this rank's part."""

    def __init__(self, rank: int, transport: Any, timeout_s: float, deferred: list[Any],
                 part_of: Callable[[str, int], dict[Any, Any]]) -> None:
        self.rank = rank
        self.transport = transport
        self.timeout_s = timeout_s
        self.deferred = deferred
        self.part_of = part_of
        self._requests = itertools.count()
        self._kept: list[StateRequest] = []  # requests that came while this rank's step ran
        self._asked_by: set[int] = set()  # ranks answered since this rank last began a step
        self._gathered = False  # whether this rank asked since its last step
        self._done: dict[int, int] = {}  # rank -> the step its `StateDone` was for

    # ================================================================ asking
    def gather(self, places: list[int], kind: str, target: int, own: dict[Any, Any]) -> list[dict[Any, Any]]:
        """The parts held at ``places`` (this rank's is ``own``), in that order, tensors on the CPU:
        ``kind`` "model" or "optimizer", of the one numbered ``target``."""
        request = next(self._requests)
        others = set(places) - {self.rank}
        self._raise_if_gone(others)
        self._gathered = True
        for peer in sorted(others):
            self.transport.send(self.rank, (peer, MAIN), StateRequest(self.rank, request, kind, target))
        parts = {self.rank: _on_cpu(own)}
        deadline = time.monotonic() + self.timeout_s
        self.answer_kept()
        while missing := others - parts.keys():
            message = self.take(POLL_S)
            if isinstance(message, StateReply) and message.request == request:  # not a stale one
                if message.error is not None:
                    raise message.error
                parts[message.rank] = _on_cpu(message.part)
            self._raise_if_gone(missing)
            if time.monotonic() > deadline:
                raise SmpartError(f"rank(s) {sorted(missing)} did not send their part of the state dict "
                                  f"within {self.timeout_s} s. A rank answers in the step function, "
                                  "state_dict() or smpart.shutdown(): does every rank reach one?")
        return [parts[place] for place in places]

    def done_asking(self, driver: int, step: int) -> None:
        """Entering ``step``'s step function: tell the driver's rank, if this rank asked since the last."""
        if self._gathered:
            self._gathered = False
            self.transport.send(self.rank, (driver, MAIN), StateDone(self.rank, step))

    def take(self, timeout: float) -> Any | None:
        """The next message on the main address (None after ``timeout``), handled: a request is
        answered, a `StateDone` noted, the step's messages kept for its wait; a reply is the caller's."""
        message = self.transport.receive((self.rank, MAIN), timeout)
        if isinstance(message, StateRequest):
            self.answer(message)
        elif isinstance(message, StateDone):
            self._done[message.rank] = message.step
        elif message is not None and not isinstance(message, StateReply):
            self.deferred.append(message)  # a `PlaceModel` or `StepResult`: the step's wait takes it
        return message

    def _raise_if_gone(self, peers: set[int]) -> None:
        """`PeerLost` if one of ``peers`` was lost; an `SmpartError` if one shut smpart down."""
        self.transport.check()
        gone = sorted(peers & self.transport.inner.unreachable())
        if gone:
            raise SmpartError(f"rank(s) {gone} shut smpart down before sending their part of the state dict "
                              "(only they hold their stages' weights): call state_dict() before "
                              "smpart.shutdown() on every rank")

    # ================================================================ answering
    def keep(self, message: StateRequest) -> None:
        """A request that came while this rank's step ran: answered once it is over."""
        self._kept.append(message)

    def answer_kept(self) -> None:
        while self._kept:
            self.answer(self._kept.pop(0))

    def answer_waiting(self) -> None:
        """Answer the kept requests and those waiting on the main address."""
        self.answer_kept()
        while self.take(0) is not None:
            pass

    def answer(self, message: StateRequest) -> None:
        self._asked_by.add(message.rank)
        reply = StateReply(self.rank, message.request)
        try:
            reply.part = _copied(self.part_of(message.kind, message.target))
        except SmpartError as err:
            reply.error = err
        with contextlib.suppress(SmpartError):  # the asking rank is gone: nobody waits for the answer
            self.transport.send(self.rank, (message.rank, MAIN), reply)

    def before_step(self, step: int) -> None:
        """The driver's rank, about to begin ``step``: answer what waits, then wait (answering) until
        every rank it answered since its last step is done asking."""
        deadline = time.monotonic() + self.timeout_s
        self.answer_waiting()
        while pending := sorted(r for r in self._asked_by if self._done.get(r) != step):
            self.take(POLL_S)
            self._raise_if_gone(set(pending))
            if time.monotonic() > deadline:
                raise SmpartError(f"rank(s) {pending} asked this rank for its state and did not enter step "
                                  f"{step} within {self.timeout_s} s: every rank must call the step function")
        self._asked_by.clear()


def _on_cpu(part: Any) -> Any:
    """``part`` with its tensors on the CPU (under NCCL a bigger tensor arrives on the GPU)."""
    return pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, part)


def _copied(part: Any) -> Any:
    """``part`` with its tensors copied to the CPU: a big one travels without a copy of its own."""
    return pytree.tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t,
                           part)
