"""The process transport: pipeline messages between ranks, on torch.distributed.

`ProcessTransport` moves the runtime's messages (small dataclasses with tensors inside) from one
rank to another. The trick is to send every message as one transfer where it can::

    message ──pickle, reducer_override pulls tensors out──► header + [t0, t1, ...]
         frame: header + the CPU tensors that fit, on header_group (gloo)   tag FRAME (+ TAIL)
         the other tensors: flat uint8 views, one send each, on the data group    tag TENSOR
    receiver: frame (posted ahead) ─► tail ─► one recv per other tensor ─► rebuild ─► message

The header is small plain bytes (the object graph plus each tensor's shape and dtype, see
`smpart.runtime.wire.frames`), so it always goes over gloo, and with it the message's CPU tensors up
to ``wire.INLINE_BUDGET`` bytes: on gloo a pipeline message is then one transfer into a buffer
the receiver posted before it was sent. Bigger tensors never get pickled or copied and go over
the data group, gloo on CPU or NCCL on GPU (with gloo, CUDA tensors travel and arrive on the
CPU; with NCCL nothing but tiny CPU tensors rides in the frame). Shapes may differ from one
message to the next: the receiver allocates from the header every time.

Threads, and why order holds. `send` pickles on the caller's thread (so an unpicklable message
fails there, at once) and posts the message's parts there too, under one lock, as non-blocking
``isend`` calls: the frame, the tail, each tensor. Gloo matches the sends and receives of one tag
between two ranks in the order they were posted, so posting a message's parts back to back
under the lock keeps the messages of each (sender, receiver) pair in the order `send` was
called, and no thread hand-off stands between `send` and the wire. A completion thread waits for
each posted message (keeping its buffers alive until then) and counts it as sent. A receiver
thread per peer receives from that peer only (frame, tail, tensors, next frame, ...), so the
messages of each pair arrive in the order they were sent; messages from different peers
interleave. It hands each message to ``deliver`` (default: this transport's inbox, read by
`receive`) on its own thread. A message to one's own rank is delivered by reference, unpickled.

Why one receiver thread per peer and not one thread receiving from any source: on gloo (torch
2.13) a pending any-source receive is woken only by a message. A peer's death does not fail it,
nor does ``ProcessGroup.abort``/``shutdown``/``destroy_process_group``, and a wait with a
timeout that expires closes every connection of the group (gloo "signals" the timeout to all
pairs). A receive from one named peer, in contrast, fails within milliseconds when that peer's
process dies (its sockets close), and can be released on purpose (see *close*).

Lost peers are detected two ways. (1) Connections: a peer whose process ends (SIGKILL,
``os._exit``, an uncaught exception) closes its sockets, and the receive from it (or a send to
it) fails at once. (2) Heartbeats, for a peer that hangs or whose machine vanishes without
closing anything: a watchdog thread increments this rank's key in the c10d ``store`` every
``heartbeat_s`` and reads its peers' keys; a peer whose counter has not moved for
``lost_after_s`` (on the local clock, so clocks need not agree) is lost. A peer that closed its
transport writes ``closed`` there and is no longer watched. Then the rank goes into `lost`,
`receive` raises `PeerLost` on this and every later call, and `send` to it raises too.

Close, collective: every rank calls `close`. The completion thread waits for what was posted,
then a goodbye frame goes to every peer not lost; each receiver thread ends on its peer's goodbye or on its
peer's death. When threads are still blocked at the deadline (a peer that hangs, or does not
close), the transport releases them by letting a 1 ms receive time out on each gloo group it
uses: gloo then closes all that group's connections and every pending wait on them fails. That
group is unusable afterwards, so give the transport groups of its own. Close it before
``dist.destroy_process_group()``. Every thread is a daemon, so a process whose main thread dies
does not wait for them, and at interpreter exit a transport nobody closed is aborted (`abort`:
released, no goodbyes), since gloo waits still blocked when the groups are torn down make the
process abort (``terminate called without an active exception``) or linger.

Gloo waits have timeouts that are not harmless: an expired wait closes the group. A receive of
a next message waits without a limit (30 days), because an idle peer is normal; a send, or the
rest of a message once its frame arrived, waits at most ``timeout_s``. A gloo send completes
only once the receiver has posted the matching receive (the receiver thread posts the next
frame's receive as soon as it is idle, a tensor's once the frame has arrived), so each tensor
adds half a round trip (the receiver posts all of a message's tensor receives at once), and a
peer that hangs stalls the completion thread, and so the count of sent messages, until
``timeout_s`` passes or `close` releases it (the heartbeat has called it lost by then).

NCCL (untested here: no GPU on the machine it was written on). When the data group is NCCL,
tensors go to the CUDA device that was current when the transport was made before sending, and
are received onto it; each transfer is polled until it completed on the GPU (bounded by
``timeout_s``, stopped by `close`), so a delivered message is complete. NCCL send and recv
issued concurrently from two threads on one communicator can deadlock; the remedy is one group
per ordered pair: pass ``data_groups={(src, dst): group}`` (for example from `pair_groups`) and
each direction of each pair uses its own communicator, so the sends of ``src`` (posted under
one lock) and the receiver thread of ``dst`` are its only users.

`ProcessTransport` is one class of 490 lines (the file 690): its sender, receiver threads,
completion thread and heartbeat share one peer table and one shutdown, which a split would
spread over files that each need the others.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import queue
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from smpart.errors import PeerLost, SmpartError
from smpart.runtime.wire import frames as wire

TAG_FRAME = 0x736D0001
TAG_TAIL = 0x736D0002
TAG_TENSOR = 0x736D0003
TAG_RELEASE = 0x736D00FF  # never sent: a receive on it that times out releases a group's waits

_IDLE_WAIT = datetime.timedelta(days=30)  # the wait for a next message: no limit, in effect
_RELEASE_WAIT = datetime.timedelta(milliseconds=1)
_GRACE_S = 5.0  # how long close waits for threads once their waits were released
_NCCL_POLL_S = 50e-6

_STORE_FAILURES = 3  # consecutive store errors after which heartbeats stop (its host is gone)

_generations = itertools.count()  # one per transport made in this process: heartbeat keys
_open_transports: weakref.WeakSet[ProcessTransport] = weakref.WeakSet()


class _Wake:
    """Put in the inbox when a peer is lost, so a blocked `receive` notices."""


class _Undeliverable:
    """Put in the inbox instead of a message that arrived but could not be unpickled."""

    def __init__(self, peer: int, error: BaseException) -> None:
        self.peer = peer
        self.error = error


_WAKE = _Wake()
_CLOSE = object()


def pair_groups(ranks_or_pairs: Iterable[Any], backend: str = "nccl") -> dict[tuple[int, int], Any]:
    """One process group per ordered pair, for ``data_groups``: every pair of the given ranks, or
    the given ``(src, dst)`` pairs. The result holds the pairs that include this rank. Collective:
    every rank of the default group calls it with the same arguments (``dist.new_group`` is)."""
    items = list(ranks_or_pairs)
    if all(isinstance(item, int) for item in items):
        ranks = sorted(items)
        items = [(src, dst) for src in ranks for dst in ranks if src != dst]
    me = dist.get_rank()
    groups = {}
    for src, dst in items:
        group = dist.new_group([src, dst], backend=backend)
        if me in (src, dst):
            groups[(src, dst)] = group
    return groups


def _is_nccl(group: Any) -> bool:
    return str(dist.get_backend(group)).lower() == "nccl"


def _brief(err: BaseException) -> str:
    """The first sentence of an error, without gloo's source location prefix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0]


@atexit.register
def _abort_open_transports() -> None:
    """At interpreter exit, end the threads of transports nobody closed (the main thread raised):
    gloo waits still blocked when the process groups are torn down make it abort or linger."""
    for transport in list(_open_transports):
        transport.abort()


def _undeliverable_error(peer: int, error: BaseException) -> SmpartError:
    err = SmpartError(f"a message from rank {peer} arrived but could not be unpickled here ({error}); "
                      "are both ranks running the same code?")
    err.__cause__ = error
    return err


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def release_group(group: Any, peers: Iterable[int], lost: Collection[int] = ()) -> None:
    """Make every pending wait on gloo ``group`` fail: a receive nobody will answer, from one of
    ``peers``, with a 1 ms timeout, makes gloo close all of that group's connections."""
    members = set(dist.get_process_group_ranks(group))
    # A live peer first: a receive from a dead one fails at once and times nothing out.
    for peer in sorted((r for r in peers if r in members), key=lambda r: r in lost):
        try:
            buffer = torch.empty(1, dtype=torch.uint8)
            work = group.recv([buffer], dist.get_group_rank(group, peer), TAG_RELEASE)
            work.wait(timeout=_RELEASE_WAIT)
        except Exception as err:
            if "timed out" in str(err).lower():
                return  # the expected timeout: it closed the group's connections
            continue  # that peer's connection is closed already: try another
        return


class ProcessTransport:
    """Messages between the ranks of a torch.distributed job; see the module docstring.

    ``rank``/``world_size`` are global; ``place`` in `send` and `receive` is a global rank.
    ``header_group`` must be a gloo group; ``data_group`` (default: the header group) carries
    the tensors, ``data_groups`` (optional) one group per ordered pair ``(src, dst)``, which wins
    over ``data_group``. ``peers`` restricts the ranks this one exchanges messages with (default:
    all others): one receiver thread and one heartbeat watch per peer. ``store`` (default: the
    default group's store; None there: no heartbeats) holds the heartbeats, one every
    ``heartbeat_s`` (0: none); a peer silent for ``lost_after_s`` is lost, one never heard from
    after ``max(timeout_s, lost_after_s)``. ``timeout_s`` bounds a send and the rest of a message
    once its first frame arrived. Heartbeat keys are numbered by transport: make transports in
    the same order on every rank. ``deliver`` (default: the inbox `receive` reads) is called with
    each message from another rank, on that peer's receiver thread; with one given, `check`
    raises what `receive` would (a lost peer, a message that could not be unpickled).

    ``bytes_sent[(src, dst)]`` counts tensor payload bytes sent, ``messages_sent`` the messages
    sent to other ranks (not those delivered to this rank, nor goodbyes), once fully sent.
    Tensors are sent after `send` returns: do not modify them in place until the message is
    received.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        header_group: Any,
        data_group: Any = None,
        *,
        timeout_s: float = 300.0,
        heartbeat_s: float = 1.0,
        lost_after_s: float = 15.0,
        store: Any = None,
        data_groups: Mapping[tuple[int, int], Any] | None = None,
        peers: Iterable[int] | None = None,
        deliver: Callable[[Any], None] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise SmpartError(f"rank {rank} is not in a world of {world_size} ranks")
        self.rank = rank
        self.world_size = world_size
        self.bytes_sent: dict[tuple[int, int], int] = {}
        self.messages_sent = 0
        self.lost: set[int] = set()
        self._lost_order: list[int] = []  # as detected: `receive` names the first, the likely cause
        self._why_lost: dict[int, str] = {}
        self._gone: set[int] = set()  # peers whose goodbye arrived: they closed
        self._header_group = header_group
        self._data_group = header_group if data_group is None else data_group
        self._data_groups = {pair: g for pair, g in (data_groups or {}).items() if rank in pair}
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._lost_after_s = lost_after_s
        self._peers = self._peer_list(peers)
        self._peer_set = frozenset(self._peers)
        groups = [header_group, self._data_group, *self._data_groups.values()]
        self._nccl = {id(g) for g in groups if _is_nccl(g)}
        self._group_ranks: dict[tuple[int, int], int] = {}  # (group, global rank) -> rank in the group
        if id(header_group) in self._nccl:
            raise SmpartError(
                "the header group must be a gloo group (headers are CPU bytes); NCCL goes in data_group(s)"
            )
        self._device = torch.device("cuda", torch.cuda.current_device()) if self._nccl else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliver = self._inbox.put if deliver is None else deliver
        self._undeliverable: SmpartError | None = None
        self._posted: queue.SimpleQueue = queue.SimpleQueue()  # messages whose sends await completion
        self._post_lock = threading.Lock()  # a message's parts are posted back to back (order)
        self._lock = threading.Lock()
        self._lost_watchers: list[Callable[[int], None]] = []
        self._stop = threading.Event()
        self._closing = False
        self._closed = False
        self._released = False
        self._close_deadline = float("inf")
        self._threads: list[threading.Thread] = []
        self._watchdog: threading.Thread | None = None
        self._start(self._complete_loop, f"smpart-send-{rank}")
        for peer in self._peers:
            self._start(self._receive_loop, f"smpart-receive-{rank}<{peer}", peer)
        store = _default_store() if store is None else store
        if store is not None and heartbeat_s > 0:
            self._watchdog = self._start(self._watch, f"smpart-watchdog-{rank}", store, next(_generations))
        _open_transports.add(self)

    # -- the interface --------------------------------------------------------------------------

    def send(self, place: int, message: Any) -> None:
        """Send ``message`` to rank ``place`` without waiting for it to arrive (own rank: delivered
        at once, by reference)."""
        self._check_open()
        if place == self.rank:
            self._deliver(message)
            return
        self._check_peer(place)
        self._send_packed(place, self._pack(message, place))

    def send_all(self, places: list[int], message: Any) -> None:
        """`send` ``message`` to each of ``places``, pickled once (per inline budget): what a rank
        tells every other rank of its pipeline at a step's start and end. A place that cannot be
        reached does not keep the message from the others; the first such error is raised after."""
        self._check_open()
        packed: dict[int, wire.Packed] = {}
        failed: SmpartError | None = None
        for place in places:
            if place == self.rank:
                self._deliver(message)
                continue
            try:
                self._check_peer(place)
                budget = self._inline_budget(place)
                if budget not in packed:
                    packed[budget] = self._pack(message, place)
                self._send_packed(place, packed[budget])
            except SmpartError as err:
                failed = failed or err
        if failed is not None:
            raise failed

    def _pack(self, message: Any, place: int) -> wire.Packed:
        try:
            return wire.pack(message, self._inline_budget(place))
        except SmpartError:
            raise
        except Exception as err:
            raise SmpartError(
                f"cannot send a {type(message).__name__} to rank {place}: it does not pickle ({err}). "
                "Messages between processes must be picklable: plain data, dataclasses, tensors"
            ) from err

    def _send_packed(self, place: int, packed: wire.Packed) -> None:
        with self._post_lock:
            self._check_open()
            self._check_peer(place)
            if self._released:
                raise SmpartError(f"the transport of rank {self.rank} was released: nothing more can be sent")
            try:
                posted = self._post(place, packed)
            except Exception as err:
                self._lose(place, f"sending to it failed: {_brief(err)}")
                raise PeerLost(place, self._why_lost.get(place, "")) from err
        self._posted.put((place, posted, packed.tensor_bytes))

    @property
    def peers(self) -> list[int]:
        """The ranks this one exchanges messages with."""
        return list(self._peers)

    def check(self) -> None:
        """Raise `PeerLost` for the first peer lost, or the error of a message that arrived but could
        not be unpickled (with ``deliver`` given; `receive` raises these itself)."""
        self._raise_if_lost()
        if self._undeliverable is not None:
            raise self._undeliverable

    def receive(self, place: int, timeout: float) -> Any | None:
        """The next message for this rank, or None after ``timeout`` seconds (0: do not wait)."""
        if place != self.rank:
            raise SmpartError(f"rank {self.rank} can only receive its own messages, not rank {place}'s")
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_lost()
            remaining = min(deadline - time.monotonic(), threading.TIMEOUT_MAX)
            try:
                item = self._inbox.get(timeout=remaining) if remaining > 0 else self._inbox.get(block=False)
            except queue.Empty:
                return None
            if isinstance(item, _Wake):
                continue
            if isinstance(item, _Undeliverable):
                raise _undeliverable_error(item.peer, item.error)
            return item

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, say goodbye to every peer, and end every thread (collective).

        Waits up to ``timeout_s`` for the peers' goodbyes; threads still blocked then are released
        by closing the transport's gloo groups (see the module docstring). Idempotent.
        """
        if self._closed:
            return
        self._closing = True
        self._close_deadline = time.monotonic() + timeout_s
        self._posted.put(_CLOSE)
        workers = [t for t in self._threads if t is not self._watchdog]
        self._join(workers, self._close_deadline)
        if any(t.is_alive() for t in workers):
            with contextlib.suppress(Exception):  # the groups may be gone already
                self._release_waits()
            self._join(workers, time.monotonic() + _GRACE_S)
        self._stop.set()
        self._join(self._threads, time.monotonic() + _GRACE_S + self._heartbeat_s)
        self._closed = True
        self._forget_groups()
        _open_transports.discard(self)
        left = [t.name for t in self._threads if t.is_alive()]
        if left:
            warnings.warn(f"ProcessTransport.close left threads running: {left}", stacklevel=2)

    def abort(self) -> None:
        """End every thread now, without goodbyes (the peers will see this rank as lost). Runs at
        interpreter exit for a transport that was not closed."""
        if self._closed:
            return
        self._closing = True
        with contextlib.suppress(Exception):  # the groups may be gone already
            self._release_waits()
        self._posted.put(_CLOSE)
        self._stop.set()
        self._join(self._threads, time.monotonic() + _GRACE_S)
        self._closed = True
        self._forget_groups()
        _open_transports.discard(self)

    def _forget_groups(self) -> None:
        """Drop the groups once closed: whoever destroys them frees them (and their threads) now,
        not when the cycle collector gets to this transport."""
        self._header_group = self._data_group = None
        self._data_groups = {}

    # -- checks ---------------------------------------------------------------------------------

    def _peer_list(self, peers: Iterable[int] | None) -> list[int]:
        chosen = range(self.world_size) if peers is None else peers
        listed = sorted(set(chosen) - {self.rank})
        if any(not 0 <= p < self.world_size for p in listed):
            raise SmpartError(f"peers {listed} are not all ranks of a world of {self.world_size}")
        return listed

    def _check_open(self) -> None:
        if self._closing:
            raise SmpartError(f"the transport of rank {self.rank} is closed: nothing more can be sent")

    def _check_peer(self, place: int) -> None:
        if place not in self._peer_set:
            raise SmpartError(
                f"rank {self.rank} cannot send to rank {place}: not one of its peers {self._peers}"
            )
        if place in self.lost:
            raise PeerLost(place, self._why_lost.get(place, ""))
        if place in self._gone:
            raise SmpartError(f"rank {place} has closed its transport: it receives nothing more")

    def unreachable(self) -> set[int]:
        """Peers that said goodbye (closed their transport) or were lost: nothing sent reaches them."""
        with self._lock:
            return self.lost | self._gone

    def _raise_if_lost(self) -> None:
        if self._lost_order:
            rank = self._lost_order[0]
            raise PeerLost(rank, self._why_lost[rank])

    def _lose(self, peer: int, why: str) -> None:
        with self._lock:
            if peer in self.lost or peer in self._gone or self._released:
                return
            self._why_lost[peer] = why
            self._lost_order.append(peer)
            self.lost.add(peer)
        self._inbox.put(_WAKE)
        for watcher in list(self._lost_watchers):
            watcher(peer)

    def on_lost(self, watcher: Callable[[int], None]) -> None:
        """Call ``watcher(peer)`` when a peer is lost (on the thread that found it): a wait outside
        the transport's threads (`smpart.runtime.wire.direct`) learns of it there."""
        self._lost_watchers.append(watcher)

    # -- threads --------------------------------------------------------------------------------

    def _start(self, target: Any, name: str, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    @staticmethod
    def _join(threads: list[threading.Thread], deadline: float) -> None:
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _pair_group(self, src: int, dst: int) -> Any:
        return self._data_groups.get((src, dst), self._data_group)

    def _isend(self, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> Any:
        """``dist.isend`` without its Python checks (~10–25 µs a call, twice per message): the
        group's own ``send``, to the peer's rank in that group (looked up once)."""
        return group.send([tensor], self._rank_in(group, peer), tag)

    def _irecv(self, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> Any:
        """``dist.irecv`` from ``peer`` the same way."""
        return group.recv([tensor], self._rank_in(group, peer), tag)

    def _rank_in(self, group: Any, peer: int) -> int:
        key = (id(group), peer)
        rank = self._group_ranks.get(key)
        if rank is None:
            rank = self._group_ranks[key] = dist.get_group_rank(group, peer)
        return rank

    def _wait(self, work: Any, group: Any, timeout: datetime.timedelta | None = None) -> None:
        timeout = self._timeout if timeout is None else timeout
        if id(group) in self._nccl:
            self._wait_nccl(work, timeout.total_seconds())
        else:
            work.wait(timeout=timeout)

    def _wait_nccl(self, work: Any, timeout_s: float) -> None:
        """Poll an NCCL send/recv until it completed on the GPU (so the message is whole), at most
        ``timeout_s`` and not past `close`: a host wait on a transfer a dead peer never joins would
        not return."""
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if self._released or time.monotonic() > deadline:
                raise SmpartError(f"an NCCL transfer did not complete within {timeout_s:.0f} s")
            time.sleep(_NCCL_POLL_S)
        work.wait()

    # -- sending --------------------------------------------------------------------------------

    def _inline_budget(self, place: int) -> int:
        """How many tensor bytes may ride in a message's frame to ``place``: none with NCCL, whose
        tensors should travel on the GPU (small CPU ones still go inline, see `wire.SMALL_BYTES`)."""
        return 0 if id(self._pair_group(self.rank, place)) in self._nccl else wire.INLINE_BUDGET

    def _post(self, place: int, packed: wire.Packed) -> list[tuple]:
        """Post every part of a message to ``place`` (the caller holds ``_post_lock``): for each part
        its work, group and buffer (kept alive until the work completes)."""
        header_group = self._header_group
        posted = [(self._isend(packed.frame, place, header_group, TAG_FRAME), header_group,
                   packed.frame)]
        if packed.tail is not None:
            posted.append((self._isend(packed.tail, place, header_group, TAG_TAIL), header_group,
                           packed.tail))
        group = self._pair_group(self.rank, place)
        nccl = id(group) in self._nccl
        with torch.cuda.device(self._device) if nccl else contextlib.nullcontext():
            for tensor in packed.tensors:
                data = wire.to_wire(tensor, self._device if nccl else torch.device("cpu"))
                if data.numel():
                    posted.append((self._isend(data, place, group, TAG_TENSOR), group, data))
        return posted

    def _complete_loop(self) -> None:
        """Wait, in posting order, for each posted message to be sent; at close, say goodbye."""
        if self._device is not None:
            torch.cuda.set_device(self._device)
        while True:
            item = self._posted.get()
            if item is _CLOSE:
                break
            place, posted, size = item
            try:
                for work, group, _buffer in posted:
                    self._wait(work, group)
            except Exception as err:
                self._lose(place, f"sending to it failed: {_brief(err)}")
                continue
            with self._lock:
                key = (self.rank, place)
                self.bytes_sent[key] = self.bytes_sent.get(key, 0) + size
                self.messages_sent += 1
        self._say_goodbye()

    def _say_goodbye(self) -> None:
        """A goodbye frame to every peer not lost, sent together, each waited for until close's
        deadline (a send that then times out closes the header group: close releases it anyway)."""
        pending = []
        for peer in self._peers:
            if peer in self.lost or self._released:
                continue
            frame = wire.goodbye()
            try:
                with self._post_lock:
                    work = self._isend(frame, peer, self._header_group, TAG_FRAME)
                pending.append((peer, frame, work))
            except Exception as err:
                self._lose(peer, f"saying goodbye to it failed: {_brief(err)}")
        for peer, _frame, work in pending:
            remaining = max(0.001, self._close_deadline - time.monotonic())
            try:
                self._wait(work, self._header_group, datetime.timedelta(seconds=remaining))
            except Exception as err:
                self._lose(peer, f"saying goodbye to it failed: {_brief(err)}")

    # -- receiving ------------------------------------------------------------------------------

    def _receive_loop(self, peer: int) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        frame = torch.empty(wire.FRAME_BYTES, dtype=torch.uint8)  # reused: what it brings is copied out
        try:
            while True:
                incoming = self._receive_frame(peer, frame)
                if incoming is None:
                    with self._lock:
                        self._gone.add(peer)
                    return
                tensors = self._receive_tensors(peer, incoming.specs)
                try:
                    message = wire.rebuild(incoming, tensors)
                except Exception as err:
                    self._on_undeliverable(peer, err)
                    continue
                self._deliver(message)
        except Exception as err:
            self._lose(peer, f"receiving from it failed: {_brief(err)}")

    def _on_undeliverable(self, peer: int, err: BaseException) -> None:
        if self._deliver == self._inbox.put:
            self._inbox.put(_Undeliverable(peer, err))
        elif self._undeliverable is None:
            self._undeliverable = _undeliverable_error(peer, err)

    def _receive_frame(self, peer: int, frame: torch.Tensor) -> wire.Incoming | None:
        """The next message's frame from ``peer`` (and its tail), opened; None if it said goodbye."""
        work = self._irecv(frame, peer, self._header_group, TAG_FRAME)
        self._wait(work, self._header_group, _IDLE_WAIT)
        header_length, length = wire.frame_lengths(frame)
        if header_length == wire.GOODBYE:
            return None
        tail = None
        if wire.tail_size(length):
            tail = torch.empty(wire.tail_size(length), dtype=torch.uint8)
            self._wait(self._irecv(tail, peer, self._header_group, TAG_TAIL), self._header_group)
        return wire.open_frame(frame, tail)

    def _receive_tensors(self, peer: int, specs: list[wire.TensorSpec]) -> list[torch.Tensor]:
        """A message's tensors that did not come in its frame: every receive posted at once, then
        waited for in order."""
        group = self._pair_group(peer, self.rank)
        device = self._device if id(group) in self._nccl else None
        buffers = [wire.empty_for(spec, device) for spec in specs]
        works = [self._irecv(b, peer, group, TAG_TENSOR) for b in buffers if b.numel()]
        for work in works:
            self._wait(work, group)
        return [wire.from_wire(buffer, spec) for buffer, spec in zip(buffers, specs, strict=True)]

    # -- closing and heartbeats -----------------------------------------------------------------

    def _release_waits(self) -> None:
        """Make every pending wait on the transport's gloo groups fail: a receive nobody will
        answer, with a 1 ms timeout, makes gloo close all of that group's connections."""
        with self._lock:
            self._released = True
        groups = {id(g): g for g in [self._header_group, self._data_group, *self._data_groups.values()]}
        for group in groups.values():
            if id(group) not in self._nccl:
                self._release_group(group)

    def _release_group(self, group: Any) -> None:
        release_group(group, self._peers, self.lost)

    def _watch(self, store: Any, generation: int) -> None:
        """Heartbeat this rank and mark peers whose heartbeat stopped as lost, until close."""
        key = f"smpart/transport/{generation}/heartbeat/"
        started = time.monotonic()
        seen: dict[int, tuple[bytes, float]] = {}  # peer -> (last value, local time it changed)
        watched = set(self._peers)
        failures = 0
        for beat in itertools.count(1):
            now = time.monotonic()
            try:
                store.set(f"{key}{self.rank}", str(beat))
                for peer in sorted(watched - self.lost - self._gone):
                    value = store.get(f"{key}{peer}") if store.check([f"{key}{peer}"]) else None
                    if value == b"closed":
                        watched.discard(peer)
                    elif value is not None and seen.get(peer, (None, 0.0))[0] != value:
                        seen[peer] = (value, now)
                    else:
                        self._judge(peer, seen.get(peer), started, now)
                failures = 0
            except Exception:  # the store is unreachable: no verdict from heartbeats this time
                failures += 1
                if failures >= _STORE_FAILURES:
                    return  # its host is gone (rank 0, or the agent); connection errors still tell
            if self._stop.wait(self._heartbeat_s):
                break
        with contextlib.suppress(Exception):
            store.set(f"{key}{self.rank}", "closed")

    def _judge(self, peer: int, seen: tuple[bytes, float] | None, started: float, now: float) -> None:
        if seen is None:  # never heard from: the peer may still be starting up
            if now - started > max(self._timeout_s, self._lost_after_s):
                self._lose(peer, f"no heartbeat from it in {now - started:.0f} s")
        elif now - seen[1] > self._lost_after_s:
            self._lose(peer, f"its heartbeat stopped {now - seen[1]:.0f} s ago")
