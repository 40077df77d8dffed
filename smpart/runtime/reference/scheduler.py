"""`StageScheduler`: a stage runs one piece of work at a time, in its schedule's order.

A stage is one device: its module calls and backward segments hold the stage's *turn* one at a
time. Each piece of work asks for the turn with a `Claim` naming its action (``F3``, ``B1``)
and waits. When the turn is free it goes to the best *eligible* claim:

- an action is eligible once every action before it in the stage's list has *started* or can
  no longer happen: its micro-batch's forward (or backward) is over everywhere without having
  come here, or its forward never came here (then no gradient will). So actions start exactly in
  list order, whatever the timing.
- a new forward call that is this micro-batch's k-th on the stage also waits for the previous
  micro-batch's k-th call to have started (or its forward to be over), so every module sees the
  micro-batches in order, as in the unsplit model (BatchNorm's running statistics depend on it).

Among eligible claims, a call resuming after another stage answered it goes first (it usually
passes one stage's answer on to the next), then the claim of the earliest action, then the
earliest to arrive. Whoever holds the turn gives it back when its work ends or when it waits
for another stage.

Tensor parallelism: the ranks holding shards of one stage run collectives inside its modules,
so they must give the turn to the same work in the same order, and the rule above depends on
arrival timing. One of them (the *leader*) decides by the rule and announces every grant; the
others (*followers*) do not decide: they grant the waiting claim whose `key` the leader
announced next (`follow`). A key names the work the same way in every tensor-parallel column:
``("F", mb, k)`` the k-th forward call of a micro-batch here, ``("R", mb, k)`` its k-th
resumption, ``("B", mb)`` a backward segment (whose gradient messages the grant's payload names).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

from smpart.runtime.schedule import BACKWARD, FORWARD, Action

NEW = 0
RESUME = 1
SEGMENT = 2


class Cancelled(BaseException):
    """The step was aborted while this work waited (a BaseException: user code must not catch it)."""


class TimedOut(Exception):
    """A claim waited longer than the step's timeout."""


class Claim:
    """A request for the stage's turn by one piece of work."""

    __slots__ = ("action", "kind", "seq", "key", "payload", "arrival", "granted", "cancelled", "_event")

    def __init__(self, action: Action, kind: int, seq: int = 0) -> None:
        self.action = action
        self.kind = kind
        # NEW claims: which forward call of this micro-batch on this stage (0, 1, ...); RESUME
        # claims: which resumption of this micro-batch here.
        self.seq = seq
        mb = action.microbatch
        self.key: tuple = ("F", mb, seq) if kind == NEW else ("R", mb, seq) if kind == RESUME else ("B", mb)
        self.payload: tuple = ()  # a follower's grant: what the leader's segment consumed
        self.arrival = 0
        self.granted = False
        self.cancelled = False
        self._event: threading.Event | None = None  # made only if the claim has to wait

    def _wake(self) -> None:  # with the scheduler's lock held
        if self._event is not None:
            self._event.set()


class StageScheduler:
    """The turn of one stage during one step, granted by the rule above."""

    def __init__(self, actions: list[Action], follower: bool = False) -> None:
        self.actions = actions
        self.follower = follower
        self._announced: deque[tuple[tuple, tuple]] = deque()  # a follower's grants still to make
        self.position = {action: i for i, action in enumerate(actions)}
        self._lock = threading.Lock()
        self._holder: Claim | None = None
        self._waiting: list[Claim] = []
        self._arrivals = 0
        self._frontier = 0  # first action neither started nor passed over
        self._started: set[Action] = set()
        self._over: set[Action] = set()  # actions that can no longer happen here
        self._calls_started: dict[int, int] = defaultdict(int)  # micro-batch -> NEW claims granted
        self._forward_over: set[int] = set()
        self.started_order: list[Action] = []
        self.aborted = False

    # ================================================================ events
    def forward_over(self, microbatch: int) -> None:
        """The forward pass of ``microbatch`` is over everywhere. If it never came here, neither
        will its backward: gradients only go to stages that kept tensors in the forward. Passing
        both over at once matters: under 1F1B a later stage may wait for this backward before it
        runs the forward of a micro-batch that this stage waits for."""
        with self._lock:
            self._forward_over.add(microbatch)
            self._over.add(Action(FORWARD, microbatch))
            if Action(FORWARD, microbatch) not in self._started:
                self._over.add(Action(BACKWARD, microbatch))
            self._grant()

    def microbatch_over(self, microbatch: int) -> None:
        """``microbatch`` is complete: its backward (if any) is over everywhere."""
        with self._lock:
            self._forward_over.add(microbatch)
            self._over.update((Action(FORWARD, microbatch), Action(BACKWARD, microbatch)))
            self._grant()

    def follow(self, key: tuple, payload: tuple = ()) -> None:
        """A follower: the leader granted the turn to ``key``; grant it here in the same order."""
        with self._lock:
            self._announced.append((key, payload))
            self._grant()

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            for claim in self._waiting:
                claim.cancelled = True
                claim._wake()
            self._waiting.clear()

    # ================================================================ the turn
    def acquire(self, claim: Claim, timeout_s: float, what: Callable[[], str],
                check: Callable[[], None] | None = None) -> None:
        """Block until ``claim`` holds the turn; raise `Cancelled` or `TimedOut` instead."""
        with self._lock:
            if self.aborted:
                raise Cancelled()
            self._arrivals += 1
            claim.arrival = self._arrivals
            self._waiting.append(claim)
            self._grant()
            if not claim.granted:
                claim._event = threading.Event()
        deadline = time.monotonic() + timeout_s
        while not claim.granted:
            if claim.cancelled:
                raise Cancelled()
            if check is not None:
                check()
            if time.monotonic() > deadline:
                with self._lock:
                    if not claim.granted:
                        self._waiting.remove(claim)
                        raise TimedOut(what())
                break
            claim._event.wait(0.05)  # type: ignore[union-attr]
        if claim.cancelled:
            self.release(claim)
            raise Cancelled()

    def release(self, claim: Claim) -> None:
        """Give the turn back (a no-op unless ``claim`` holds it)."""
        with self._lock:
            if self._holder is claim:
                self._holder = None
                self._grant()

    # ================================================================ the rule
    def _grant(self) -> None:
        if self._holder is not None or not self._waiting or self.aborted:
            return
        best = self._announced_claim() if self.follower else self._best_claim()
        if best is None:
            return
        self._waiting.remove(best)
        self._holder = best
        if best.kind == NEW:
            self._calls_started[best.action.microbatch] += 1
        if best.action not in self._started and best.action in self.position:
            self._started.add(best.action)
            self.started_order.append(best.action)
            self._advance_frontier()
        best.granted = True
        best._wake()

    def _best_claim(self) -> Claim | None:
        self._advance_frontier()
        eligible = [c for c in self._waiting if self._eligible(c)]
        if not eligible:
            return None
        return min(eligible, key=lambda c: (c.kind != RESUME, self.position.get(c.action, 0), c.arrival))

    def _announced_claim(self) -> Claim | None:
        if not self._announced:
            return None
        key, payload = self._announced[0]
        claim = next((c for c in self._waiting if c.key == key), None)
        if claim is not None:
            self._announced.popleft()
            claim.payload = payload
        return claim

    def _advance_frontier(self) -> None:
        actions = self.actions
        while self._frontier < len(actions) and (actions[self._frontier] in self._started
                                                 or actions[self._frontier] in self._over):
            self._frontier += 1

    def _eligible(self, claim: Claim) -> bool:
        position = self.position.get(claim.action)
        if position is None or position > self._frontier:
            return position is None  # work outside the schedule (none today) is never held
        if claim.kind != NEW:
            return True
        previous = claim.action.microbatch - 1
        return (previous < 0 or previous in self._forward_over
                or self._calls_started[previous] > claim.seq)
