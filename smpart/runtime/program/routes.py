"""Direct transfers: a replayed program step's tensors as their bytes alone, no frame, no thread.

Under ``torchrun`` a program step's transfers are the process transport's messages (`Transfers`):
pickled behind a header, received by the transport's thread for that peer, handed to the rank's.
That is ~3x the latency of ``dist.send``/``dist.recv``, and 1F1B pays a transfer's latency on
its critical path. But once a program has run, what each pair of ranks exchanges in a step is
known: which transfers, in which order, each tensor's shape and dtype. So a program's runs go:

1. *Noting* (its first run): the transfers go framed, and both ends of each pair note what
   crossed (`Notes`): the sender what it sent, the receiver what arrived, in the order it arrived
   (the transport keeps each pair's order). Each rank's report carries digests of its notes; the
   first stage's rank compares the two ends of every pair (`agree`).
2. *Direct* (the runs after one whose notes agreed, `BeginProgram.direct`): `DirectWire` sends
   each message (what one `Transfers` held: most often an activation, with the labels beside it)
   with one ``isend`` of its bytes on `DirectChannel`, tagged with its place in the pair's list,
   into a buffer the receiver allocated from its notes and posted `AHEAD` messages ahead; the
   receiver waits for it on its own thread: torch's way. The tag makes each message match its
   own receive whatever the order they are posted in.
3. *Guards*: the sender checks each message against its notes before posting it (the same keys
   in the same place, shapes, dtypes, requires-grad); anything else is a divergence, and the step
   runs on the reference runtime, as any divergence does. A receive not noted is one too.
4. *Settling*: every message carries one more byte, 0, or why its sender gave the step up
   (`FAILED`, `DIVERGED`). A rank that gives up (its error, a divergence, another rank's abort)
   still completes its part of the route: what it had left to send goes with that byte set and
   no data, what it had left to receive it receives. So a receiver never takes a sender's give-up
   for data, and no transfer outlives its step: the next step's tags meet a quiet channel.

A small message's tensors are copied into one buffer, each at a 16-byte offset (any dtype views
its bytes in place), the byte at the end: one transfer. A big one sends each tensor as it is,
with a tag of its own, then the byte alone (no copy). CPU tensors on gloo only: where a step's
transfers include anything else (a CUDA tensor), its notes say so and it stays framed; under
NCCL no channel is made.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from smpart.errors import SmpartError
from smpart.runtime.program.executor import Aborted, ProcessWire, describe_key
from smpart.runtime.program.messages import ProgramAbort, Transfers
from smpart.runtime.program.templates import Diverged
from smpart.runtime.wire import frames

#: An entry of a route: ``(key, shape or None for a None tensor, dtype, requires grad)``; a
#: message is a tuple of entries (what one `Transfers` carried).
Entry = tuple
Message = tuple

#: The byte behind each message: its data is good, or its sender gave the step up (why).
GOOD, FAILED, DIVERGED = 0, 1, 2
_FLAG = {flag: torch.tensor([flag], dtype=torch.uint8) for flag in (GOOD, FAILED, DIVERGED)}
#: Up to this many bytes a message's tensors are copied into one buffer, with the flag byte, and
#: travel as one transfer; a bigger message sends each tensor as it is, then the flag.
COPY_LIMIT = 1 << 18
_ALIGN = 16  # each tensor's offset in a message: any dtype can view its bytes in place
_PADDING = torch.zeros(_ALIGN, dtype=torch.uint8)
#: How many messages ahead of the one it waits for a rank posts its receives from a peer.
AHEAD = 2
_TAG_BASE = 0x20000000
_MAX_ITEMS = 1 << 10  # tag = base + message << 10 + item: a message's parts have tags of their own


def entry_of(key: tuple, tensor: torch.Tensor | None, needs: bool) -> Entry | None:
    """``tensor``'s entry, or None where it cannot go direct (not a dense CPU tensor)."""
    if tensor is None:
        return (key, None, None, bool(needs))
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        return None
    return (key, tuple(tensor.shape), tensor.dtype, bool(needs))


class Notes:
    """What crossed this rank's pairs in one framed run of a program: messages, in order."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.to: dict[int, list[Message]] = {}
        self.came: dict[int, list[Message]] = {}
        self.direct_ok = True

    def sent(self, to: int, items: list[tuple]) -> None:
        self.to.setdefault(to, []).append(self._message(items))

    def arrived(self, src: int, items: list[tuple]) -> None:
        self.came.setdefault(src, []).append(self._message(items))

    def _message(self, items: list[tuple]) -> Message:
        entries = tuple(entry_of(key, tensor, needs) for key, tensor, needs in items)
        if None in entries or len(entries) >= _MAX_ITEMS:
            self.direct_ok = False
        return entries

    def digests(self) -> dict[tuple[int, int], tuple[str, str]] | None:
        """``{(src, dst): (side, digest)}`` for each pair this rank is an end of (None: not direct)."""
        if not self.direct_ok:
            return None
        out = {(self.me, to): ("sent", _digest(messages)) for to, messages in self.to.items()}
        out.update({(src, self.me): ("came", _digest(messages)) for src, messages in self.came.items()})
        return out

    def route(self) -> Route | None:
        return Route(self.to, self.came) if self.direct_ok else None


def _digest(messages: list[Message]) -> str:
    return hashlib.blake2b(repr(messages).encode(), digest_size=16).hexdigest()


def agree(digests: list[dict | None]) -> bool:
    """Whether every pair's two ends noted the same messages (every rank's `Notes.digests`)."""
    if any(d is None for d in digests):
        return False
    ends: dict[tuple[int, int], dict[str, str]] = {}
    for theirs in digests:
        for pair, (side, digest) in theirs.items():
            ends.setdefault(pair, {})[side] = digest
    return all(sides.get("sent") == sides.get("came") is not None for sides in ends.values())


class Route:
    """A program's messages with this rank's peers: to each, what it sends; from each, what it
    receives, in order (a message's place in its list is its tag)."""

    def __init__(self, to: dict[int, list[Message]], came: dict[int, list[Message]]) -> None:
        self.to = to
        self.came = came
        self.where = {entry[0]: (src, n, j) for src, messages in came.items()
                      for n, message in enumerate(messages) for j, entry in enumerate(message)}
        #: Each message's `Layout`, made once: a program's route serves every step it runs.
        self.to_layouts = {peer: [_layout(m) for m in messages] for peer, messages in to.items()}
        self.came_layouts = {peer: [_layout(m) for m in messages] for peer, messages in came.items()}


#: A message's buffer: each tensor's offset (None: a None), its bytes, and the bytes before the flag.
Layout = tuple[list[int | None], list[int], int]


def _layout(message: Message) -> Layout:
    """Each tensor's offset in the message's buffer (None: a None), its bytes, and the bytes
    before the flag."""
    offsets: list[int | None] = []
    sizes: list[int] = []
    end = 0
    for entry in message:
        if entry[1] is None:
            offsets.append(None)
            sizes.append(0)
            continue
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        sizes.append(_nbytes(entry))
        end = start + sizes[-1]
    return offsets, sizes, end


class _Posted:
    """The receives posted for one message: their works, its tensors (views of the buffers the
    bytes land in), and the flag byte."""

    __slots__ = ("works", "tensors", "flag", "left")

    def __init__(self, works: list, tensors: list[torch.Tensor | None], flag: torch.Tensor) -> None:
        self.works = works
        self.tensors = tensors
        self.flag = flag
        self.left = len(tensors)  # not yet taken: the message is let go of once all are


class DirectWire(ProcessWire):
    """A program step's transfers as `DirectChannel` sends along ``route`` (see the module docstring)."""

    def __init__(self, *args: Any, route: Route, channel: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.route = route
        self.channel = channel
        self.next_send: dict[int, int] = {}
        self.next_post: dict[int, int] = {}
        self.posted: dict[tuple[int, int], _Posted] = {}
        self.taken: set[tuple] = set()
        self.in_flight: list[tuple[int, list, tuple]] = []
        #: Each peer's process rank, asked once (every message asks).
        self.places = {peer: self.place_of(peer) for peer in (*route.to, *route.came)}

    # ---------------------------------------------------------------- sending
    def send(self, to: int, items: list[tuple]) -> None:
        messages = self.route.to.get(to, [])
        n = self.next_send.get(to, 0)
        message = tuple(entry_of(key, tensor, needs) for key, tensor, needs in items)
        if n >= len(messages) or messages[n] != message:
            noted = ", ".join(_described(e, e[0]) for e in messages[n]) if n < len(messages) else "nothing"
            sending = ", ".join(_described(e, item[0]) for e, item in zip(message, items, strict=True))
            raise Diverged(f"rank {self.rank} would send {sending} to pipeline rank {to} where its program "
                           f"sent {noted}")
        self._post_send(to, n, [tensor for _, tensor, _ in items], GOOD)
        self.next_send[to] = n + 1
        self.messages[to] = self.messages.get(to, 0) + 1
        size = sum(t.numel() * t.element_size() for _, t, _ in items if t is not None)
        self.sent_bytes[to] = self.sent_bytes.get(to, 0) + size

    def _post_send(self, to: int, n: int, tensors: list[torch.Tensor | None] | None, flag: int) -> None:
        """Post message ``n`` to ``to``: ``tensors``, or (None) the message's size in no data."""
        message = self.route.to[to][n]
        offsets, sizes, end = self.route.to_layouts[to][n]
        place, tag = self.places[to], _TAG_BASE + (n << 10)
        if tensors is None:  # giving up: what the message weighs, and the flag says why
            tensors = [None if e[1] is None else torch.empty(size, dtype=torch.uint8)
                       for e, size in zip(message, sizes, strict=True)]
        data = [None if t is None else frames.to_wire(t) for t in tensors]
        if end < COPY_LIMIT:
            whole = torch.cat(_packed(data, offsets, flag))
            works, kept = [self.channel.send(place, whole, tag)], (whole,)
        else:  # each tensor as it is (an empty one sends nothing), then the flag
            sent = [j for j, d in enumerate(data) if d is not None and d.numel()]
            works = [self.channel.send(place, data[j], tag + j) for j in sent]
            works.append(self.channel.send(place, _FLAG[flag], tag + len(message)))
            kept = tuple(data[j] for j in sent)
        self.in_flight.append((place, works, kept))

    # ---------------------------------------------------------------- receiving
    def receive(self, key: tuple, src: int) -> tuple[torch.Tensor | None, bool]:
        self._check_inbox()
        at = self.route.where.get(key)
        if at is None or at[0] != src or key in self.taken:
            raise Diverged(f"rank {self.rank} waits for {describe_key(key)} from pipeline rank {src}, "
                           "which its program did not receive")
        self.taken.add(key)
        _, n, j = at
        self._post_through(src, n + AHEAD)
        posted = self.posted[(src, n)]
        if posted.works:
            self._wait(posted, src, key)
        posted.left -= 1
        if not posted.left:
            del self.posted[(src, n)]
        return posted.tensors[j], self.route.came[src][n][j][3]

    def _post_through(self, src: int, last: int) -> None:
        messages = self.route.came.get(src, [])
        n = self.next_post.get(src, 0)
        if n > min(last, len(messages) - 1):
            return
        place, layouts = self.places[src], self.route.came_layouts[src]
        while n <= min(last, len(messages) - 1):
            self.posted[(src, n)] = self._post_receive(place, messages[n], layouts[n], _TAG_BASE + (n << 10))
            n += 1
        self.next_post[src] = n

    def _post_receive(self, place: int, message: Message, layout: Layout, tag: int) -> _Posted:
        offsets, sizes, end = layout
        if end < COPY_LIMIT:
            buffer = torch.empty(end + 1, dtype=torch.uint8)
            works = [self.channel.receive(place, buffer, tag)]
            views = [None if at is None else buffer[at: at + size] for at, size in zip(offsets, sizes,
                                                                                       strict=True)]
            flag = buffer[end:]
        else:
            views = [None if at is None else torch.empty(size, dtype=torch.uint8)
                     for at, size in zip(offsets, sizes, strict=True)]
            flag = torch.empty(1, dtype=torch.uint8)
            works = [self.channel.receive(place, v, tag + j) for j, v in enumerate(views)
                     if v is not None and v.numel()]
            works.append(self.channel.receive(place, flag, tag + len(message)))
        tensors = [None if v is None else frames.from_wire(v, e[1:3])
                   for e, v in zip(message, views, strict=True)]
        return _Posted(works, tensors, flag)

    def _wait(self, posted: _Posted, src: int, key: tuple) -> None:
        place = self.places[src]
        for work in posted.works:
            self.channel.wait(work, place, f"{describe_key(key)} from pipeline rank {src}")
        posted.works = []
        flag = int(posted.flag[0])
        if flag != GOOD:
            raise Aborted(f"pipeline rank {src} (rank {place}) gave up the step", diverged=flag == DIVERGED)

    def _check_inbox(self) -> None:
        """A rank that gave up says so here first (its messages say it too, in their flag byte)."""
        while (message := self.inbox(0.0)) is not None:
            if isinstance(message, ProgramAbort) and message.step == self.step:
                raise Aborted(message.why, message.diverged)
            if isinstance(message, Transfers) and message.step == self.step:
                raise SmpartError(f"rank {self.rank} got a framed transfer in a step its program runs direct")

    # ---------------------------------------------------------------- the step's end
    def settle(self, error: BaseException | None) -> None:
        """Complete this rank's part of the route (see *Settling*): send what is left, flagged,
        receive what is left; wait for everything. A clean run that left a send unmade diverged;
        one that receives a give-up learns of another rank's failure here."""
        flag = GOOD if error is None else DIVERGED if _diverged(error) else FAILED
        unsent = [(to, n) for to, messages in self.route.to.items()
                  for n in range(self.next_send.get(to, 0), len(messages))]
        for to, n in unsent:
            self._post_send(to, n, None, flag or DIVERGED)
            self.next_send[to] = n + 1
        for src, messages in self.route.came.items():
            self._post_through(src, len(messages) - 1)
        problem: BaseException | None = None
        if unsent and error is None:
            problem = Diverged(f"rank {self.rank} ended its part of the step with {len(unsent)} message(s) "
                               "of its program unsent")
        for (src, n), posted in sorted(self.posted.items()):
            if posted.works:
                try:
                    self._wait(posted, src, self.route.came[src][n][0][0])
                except Aborted as err:
                    problem = problem or err
        self.posted.clear()
        for place, works, _ in self.in_flight:
            for work in works:
                self.channel.wait(work, place, "a transfer it sent")
        self.in_flight.clear()
        if problem is not None and error is None:
            raise problem


def _packed(data: list[torch.Tensor | None], offsets: list[int | None], flag: int) -> list[torch.Tensor]:
    """A small message's pieces: each tensor's bytes at its offset (`_layout`), then the flag."""
    pieces, at = [], 0
    for bytes_, start in zip(data, offsets, strict=True):
        if bytes_ is not None:
            pieces += [_PADDING[: start - at], bytes_]
            at = start + bytes_.numel()
    return [*pieces, _FLAG[flag]]


def _diverged(error: BaseException) -> bool:
    return isinstance(error, Diverged) or (isinstance(error, Aborted) and error.diverged)


def _nbytes(entry: Entry) -> int:
    return frames.nbytes(entry[1:3])


def _described(entry: Entry | None, key: tuple) -> str:
    if entry is None:
        return f"{describe_key(key)} (not a dense CPU tensor)"
    shape = "None" if entry[1] is None else f"{list(entry[1])} {entry[2]}"
    return f"{describe_key(key)} ({shape})"

