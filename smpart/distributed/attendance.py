"""Waits on a step's collectives that end within ``timeout_s`` and name the ranks that did not come.

A collective that one rank never joins (its process hangs in its backward, or its machine
vanishes without closing its sockets) leaves the others waiting until the process group's own
timeout (30 minutes on gloo), which then says only "timed out", or a peer's closed socket says
"connection reset" with an address. So a rank marks where it is in the c10d store (the one
``torch.distributed`` rendezvoused through, as the transport's heartbeats) before each of a
step's collectives: one key per rank, overwritten, holding an ordinal that grows as the step
goes (the same on every rank of a group at the same collective) and what it is. A wait bounded
by ``timeout_s`` (`Attendance.wait`) that expires or fails reads the group's other keys and
raises an `SmpartError` naming each rank whose ordinal is behind, with where it was last seen.

A gloo wait that expires closes the group's connections: the group is unusable afterwards, so
the step fails on every rank that uses it, and the job goes on after ``smpart.shutdown()`` and
``smpart.init(...)`` (new groups), or restarts from a checkpoint.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Iterable
from typing import Any

from smpart.errors import SmpartError
from smpart.runtime.wire.processes import _default_store

_generations = itertools.count()  # per Attendance with a store made in this process (one per init)


class Attendance:
    """This rank's mark in the store, and bounded waits that read the others' marks."""

    def __init__(self, rank: int, describe_rank: Any = None, store: Any = None) -> None:
        """``store``: the c10d store (default: the default group's); False: none, the waits are
        bounded but name nobody."""
        self.rank = rank
        self.store = _default_store() if store is None else (store or None)
        # every rank makes one per init, in the same order: the same keys everywhere
        self._prefix = f"smpart/attendance/{next(_generations)}/" if self.store is not None else ""
        #: The last collective this rank said it reached: (ordinal, where).
        self.last: tuple[int, str] = (-1, "the start of this init")
        #: rank -> how to name it in an error ("rank 3 (data-parallel replica 1)").
        self._describe_rank = describe_rank or (lambda r: f"rank {r}")

    def arrive(self, ordinal: int, where: str) -> None:
        """Say this rank reached collective ``ordinal`` (described as ``where``)."""
        self.last = (ordinal, where)
        if self.store is not None:
            self.store.set(self._prefix + str(self.rank), f"{ordinal} {where}")

    def wait(self, work: Any, timeout_s: float, ordinal: int, where: str, ranks: Iterable[int]) -> None:
        """Wait for ``work`` (an async collective over ``ranks``, started after `arrive`) at most
        ``timeout_s``; raise an `SmpartError` naming the ranks that never reached it."""
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:  # an expired wait, or a peer's closed connection
            raise self.error(ordinal, where, ranks, timeout_s, err) from None

    def error(self, ordinal: int, where: str, ranks: Iterable[int], timeout_s: float,
              cause: BaseException) -> SmpartError:
        absent = self.absent(ordinal, ranks)
        if absent:
            named = "; ".join(f"{self._describe_rank(r)}, last seen {seen}" for r, seen in absent)
            who = f"{named}: it failed or hangs there"
        else:
            who = "every rank of the group had reached it (a connection failed, or collectives did not pair)"
        return SmpartError(f"rank {self.rank} waited for {where} and it did not complete within "
                           f"{timeout_s} s: {who}. The step fails here, and these ranks' process group is "
                           "unusable from now on: call smpart.shutdown() and smpart.init(...) again on every "
                           f"rank, or restart the job from a checkpoint ({type(cause).__name__}: "
                           f"{str(cause).splitlines()[0] if str(cause) else ''})")

    def absent(self, ordinal: int, ranks: Iterable[int]) -> list[tuple[int, str]]:
        """The ranks among ``ranks`` whose mark is behind ``ordinal``, with their marks."""
        others = [r for r in ranks if r != self.rank]
        if self.store is None or not others:
            return []
        behind = []
        for rank in others:
            seen = self._mark(rank)
            if seen is None:
                behind.append((rank, "nowhere: it reached no collective of this init"))
            elif seen[0] < ordinal:
                behind.append((rank, f"at {seen[1]}"))
        return behind

    def _mark(self, rank: int) -> tuple[int, str] | None:
        key = self._prefix + str(rank)
        try:
            if not self.store.check([key]):
                return None
            ordinal, _, where = self.store.get(key).decode().partition(" ")
            return int(ordinal), where
        except Exception:  # noqa: BLE001 - the store is gone too: no verdict
            return None
