"""`DirectChannel`: tensors between ranks as their bytes alone, on a gloo group of their own.

The process transport (`smpart.runtime.wire.processes`) frames each message: a pickled header,
a receiver thread per peer, a hand-over to the rank's thread. A replayed step program knows in
advance what each pair of ranks exchanges (`smpart.runtime.program.routes`), so its tensors can
travel the way ``torch.distributed.pipelining`` sends them: one ``isend`` of the bytes into a
buffer the receiver allocated and posted ahead, waited for on the rank's own thread. This is the
channel for that: posting and waiting, nothing else; what the bytes mean is the caller's.

Why a group of its own: a gloo wait that times out closes every connection of its group. A
transfer that waited ``timeout_s`` (a hang) then breaks this channel only: the transport's
messages go on, and so do later steps, framed (`broken`). A peer that hangs silently is found by
the transport's heartbeats; the channel then releases a wait in progress the same way (a 1 ms
receive that times out), so the rank's thread does not wait out ``timeout_s`` for it.

CPU tensors only: gloo moves host memory, and the transport's NCCL path is another design.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from smpart.errors import PeerLost, SmpartError
from smpart.runtime.wire.processes import ProcessTransport, release_group


class DirectChannel:
    """Raw sends and receives on ``group`` (gloo, every rank), waited on the caller's thread."""

    def __init__(self, group: Any, rank: int, timeout_s: float, transport: ProcessTransport) -> None:
        self.group = group
        self.rank = rank
        self.transport = transport
        self.timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._in_group: dict[int, int] = {}
        #: Why the channel can no longer be used (a wait timed out, or was released), or None.
        self.broken: str | None = None
        self._waiting = 0
        transport.on_lost(self._peer_lost)

    @property
    def usable(self) -> bool:
        return self.broken is None and self.group is not None

    def send(self, place: int, data: torch.Tensor, tag: int) -> Any:
        """Post ``data`` (flat uint8) to rank ``place``; returns the work to `wait` for."""
        return self.group.send([data], self._rank_in(place), tag)

    def receive(self, place: int, buffer: torch.Tensor, tag: int) -> Any:
        """Post a receive from rank ``place`` into ``buffer`` (flat uint8, the sent size)."""
        return self.group.recv([buffer], self._rank_in(place), tag)

    def wait(self, work: Any, place: int, what: str) -> None:
        """Wait for a posted transfer with rank ``place``; ``what`` names it in the error."""
        self._waiting += 1
        try:
            work.wait(timeout=self._timeout)
        except Exception as err:
            self.transport.check()  # a lost peer: `PeerLost`, naming it and why
            if "timed out" in str(err).lower():
                self.broken = f"a transfer waited more than {self.timeout_s} s"
                raise SmpartError(f"rank {self.rank} waited more than {self.timeout_s} s for {what} "
                                  f"with rank {place} (a hang?)") from err
            self.broken = f"a transfer with rank {place} failed: {err}"
            raise PeerLost(place, f"the transfer of {what} failed: {err}") from err
        finally:
            self._waiting -= 1

    def close(self) -> None:
        self.group = None
        self.broken = "closed"

    def _rank_in(self, place: int) -> int:
        rank = self._in_group.get(place)
        if rank is None:
            rank = self._in_group[place] = dist.get_group_rank(self.group, place)
        return rank

    def _peer_lost(self, peer: int) -> None:
        """On the transport's thread that found ``peer`` lost: release a wait in progress."""
        group = self.group
        if self._waiting and group is not None:
            self.broken = f"rank {peer} was lost"
            release_group(group, [p for p in dist.get_process_group_ranks(group) if p != self.rank], {peer})
