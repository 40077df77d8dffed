"""A step program is data: each rank's list of actions, built from what a recorded step did.

The recording (a step run in the discovery order, every micro-batch's body then every backward)
tells, for each rank, what its glue did in one micro-batch: the tensors it sent and received
(numbered transfers), where it computed, where the loss's backward ran, and the rounds of its
other backward work. From that, for every micro-batch alike:

- a rank's forward is one action ``F3``, unless a tensor comes back to it from a rank it sent to
  (GPT-2 with its head tied to the embedding: the embedding on rank 0, the blocks on rank 1, the
  head on rank 0 again): then it is cut there, ``F3.0`` and ``F3.1``, so that the rank embeds
  the next micro-batch while the blocks run, as a rank holding two virtual stages would;
- the loss's backward runs inside the body, right after the forward action that computes the
  loss (shown as its own action, ``B3``, marked inline); every other round of backward work is a
  ``B`` action, cut where a gradient comes back from a rank this one sent gradients to;
- the schedule orders the actions: a list-scheduling simulation on unit costs, ``gpipe``
  preferring forwards, ``1f1b`` preferring backwards once a rank holds as many micro-batches as
  it needs to stay busy (on a chain of stages, exactly torch's ``Schedule1F1B`` lists).

`Program.check` replays the lists against their dependencies, as torch's ``_simulate`` does, and
refuses a program in which some rank would wait forever. `Program.show` prints ranks x time.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from smpart.errors import SmpartError


@dataclass(frozen=True)
class Action:
    """One piece of one micro-batch's work on one rank.

    ``kind``: ``"F"`` (forward), ``"B"`` (backward) or ``"REDUCE_GRAD"`` (the data-parallel
    average, once the rank's gradients are final); ``part`` numbers the pieces of a micro-batch's
    forward or backward when the program cut it; ``inline``: the loss's backward, which runs inside
    the forward before it; ``rounds``: for a ``B``, which rounds of backward work (first, end).
    """

    kind: str
    microbatch: int = -1
    part: int | None = None
    inline: bool = False
    rounds: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.kind not in ("F", "B"):
            return self.kind
        return f"{self.kind}{self.microbatch}" + ("" if self.part is None else f".{self.part}")


@dataclass
class RankShape:
    """What one rank did in one micro-batch of the recorded step."""

    #: ("send", k, to), ("recv", k, src), ("compute",), ("loss",), ("loss_sent", ((k, to), ...)): the
    #: gradients the loss's backward sent, ("end_sent", ...): those sent as the body ended.
    forward: list[tuple]
    #: Backward rounds: ((received (k, from), ...), (sent (k, to), ...)); the first entry has no
    #: roots: the gradients sent before any round (leaves no root reaches).
    backward: list[tuple]


@dataclass
class Program:
    """Every rank's actions for one kind of step (one signature of the step's inputs)."""

    schedule: str
    microbatches: int
    size: int
    actions: list[list[Action]]
    #: Per rank: the transfers at which a micro-batch's forward stops (the start of ``F.1``, ...).
    suspend_at: list[frozenset[int]]
    #: Per rank: the glue's events in one micro-batch, which every micro-batch must repeat.
    events: list[list[tuple]]
    #: Per rank and action name: (receives before it, sends during it), for the printed lists.
    comm: list[dict[str, tuple[bool, bool]]] = field(default_factory=list)
    #: Per rank and action name: its start in the simulation (unit costs), for `show`.
    slots: list[dict[str, float]] = field(default_factory=list)
    data_parallel: bool = False
    #: Per rank: after how many of its events a micro-batch's body has nothing left to do there
    #: (None: it runs to the end), see `stop_points`.
    stops: list[int | None] = field(default_factory=list)

    @cached_property
    def labels(self) -> list[list[str]]:
        """Each rank's actions by name, in order (what a timeline's ``started`` lists), named once
        per program rather than at every step."""
        return [[str(a) for a in actions] for actions in self.actions]

    @cached_property
    def loss_labels(self) -> list[dict[int, str]]:
        """Per rank: micro-batch -> the name of its loss's backward (an inline ``B``) there."""
        return [{a.microbatch: str(a) for a in actions if a.inline} for actions in self.actions]

    def lines(self) -> list[str]:
        """Each rank's list with its sends and receives: ``rank 1: RECV_F0 F0 SEND_F0 ...``."""
        out = []
        for rank, actions in enumerate(self.actions):
            words = []
            for action in actions:
                recv, send = self.comm[rank].get(str(action), (False, False)) if self.comm else (False, False)
                tag = f"{action.microbatch}" if action.kind in ("F", "B") else ""
                if recv:
                    words.append(f"RECV_{action.kind}{tag}")
                words.append(str(action))
                if send:
                    words.append(f"SEND_{action.kind}{tag}")
            out.append(f"rank {rank}: " + " ".join(words))
        return out

    def describe(self) -> str:
        return "\n".join(self.lines())

    def marked(self, rank: int, index: int) -> str:
        """Rank ``rank``'s list with action ``index`` in brackets (the one that failed)."""
        words = [f"[{a}]" if i == index else str(a) for i, a in enumerate(self.actions[rank])]
        return f"rank {rank}'s step program ({self.schedule}), the failed action in brackets: " + " ".join(
            words
        )

    def show(self, console: Any = None, marked: tuple[int, int] | None = None) -> None:
        """A rich table: one row per rank, its actions in time order (the simulation's), the
        action ``marked`` ((rank, index)) highlighted."""
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"step program: {self.schedule}, {self.size} ranks x {self.microbatches} micro-batches",
            show_lines=False,
        )
        table.add_column("rank", justify="right")
        width = max(len(a) for a in self.actions) if self.actions else 0
        for t in range(width):
            table.add_column(str(t), justify="center")
        for rank, actions in enumerate(self.actions):
            cells = []
            for i, action in enumerate(actions):
                style = (
                    "bold red reverse"
                    if marked == (rank, i)
                    else ("cyan" if action.kind == "F" else "magenta" if action.kind == "B" else "yellow")
                )
                cells.append(f"[{style}]{action}[/]")
            table.add_row(str(rank), *cells, *[""] * (width - len(cells)))
        (console or Console()).print(table)

    def __str__(self) -> str:
        return self.describe()

    # ================================================================ checks
    def check(self, deps: dict[tuple[int, str], set[tuple[int, str]]]) -> None:
        """Refuse lists in which a rank would wait forever: run every rank's list in order, an
        action starting once all it depends on is done (``deps``: (rank, action) -> (rank, action))."""
        done: set[tuple[int, str]] = set()
        cursor = [0] * self.size
        progress = True
        while progress:
            progress = False
            for rank in range(self.size):
                while cursor[rank] < len(self.actions[rank]):
                    name = (rank, str(self.actions[rank][cursor[rank]]))
                    if not deps.get(name, set()) <= done:
                        break
                    done.add(name)
                    cursor[rank] += 1
                    progress = True
        stuck = [
            (rank, str(self.actions[rank][cursor[rank]]))
            for rank in range(self.size)
            if cursor[rank] < len(self.actions[rank])
        ]
        if stuck:
            waits = "; ".join(
                f"rank {r} at {a} waits for "
                f"{sorted(f'rank {x} {y}' for x, y in deps.get((r, a), set()) - done)}"
                for r, a in stuck
            )
            raise SmpartError(f"the {self.schedule} program would deadlock: {waits}")


# ==================================================================== building
def build(
    schedule: str,
    shapes: list[RankShape],
    events: list[list[tuple]],
    microbatches: int,
    active_microbatches: int | None = None,
    data_parallel: bool = False,
    finishers: frozenset[int] = frozenset(),
) -> Program:
    """The program for ``schedule`` from each rank's recorded shape of one micro-batch;
    ``finishers``: the ranks that hold a tensor of the body's result (they run the body to its end;
    none: the last rank does)."""
    graph = _Graph(shapes)
    pieces = graph.pieces()
    deps_one = graph.piece_deps(pieces)
    size = len(shapes)
    nodes: dict[tuple[int, str], Action] = {}
    deps: dict[tuple[int, str], set[tuple[int, str]]] = {}
    per_rank: list[list[Action]] = []
    for rank in range(size):
        mine = []
        for mb in range(microbatches):
            for piece in pieces[rank]:
                action = piece.action(mb)
                nodes[(rank, str(action))] = action
                mine.append(action)
        per_rank.append(mine)
    for mb in range(microbatches):
        for (rank, key), needs in deps_one.items():
            name = (rank, str(_piece_by_key(pieces[rank], key).action(mb)))
            deps[name] = {(r, str(_piece_by_key(pieces[r], k).action(mb))) for r, k in needs}
    caps = graph.caps(pieces, active_microbatches)
    order, slots = _simulate(schedule, per_rank, deps, caps, pieces)
    suspend_at = [
        frozenset(
            p.first_recv for p in pieces[r] if p.kind == "F" and p.index > 0 and p.first_recv is not None
        )
        for r in range(size)
    ]
    comm = [
        {str(p.action(mb)): (p.receives, p.sends) for p in pieces[r] for mb in range(microbatches)}
        for r in range(size)
    ]
    actions = [list(o) for o in order]
    if data_parallel:
        for rank_actions in actions:
            rank_actions.append(Action("REDUCE_GRAD"))
    program = Program(schedule, microbatches, size, actions, suspend_at, events, comm, slots, data_parallel,
                      stop_points(events, finishers or {size - 1}))
    program.check(deps)
    return program


def stop_points(events: list[list[tuple]], finishers: frozenset[int] | set[int]) -> list[int | None]:
    """Per rank, the number of its events after which a micro-batch's body has nothing left to do
    on it (None: it runs the body to its end).

    Every rank runs the whole glue only to follow the others' transfers; once a rank has made the
    last call, transfer, read or backward it takes part in, the rest of the body would only make
    placeholders for other ranks' work. It stops there (`glue.BodyDone`), which on threads, where
    every stage shares one interpreter, removes most of the glue of the first stages. The
    ``finishers`` (the ranks holding the body's result) run to the end: the result's structure and
    plain values come from them."""
    stops: list[int | None] = []
    for rank, rank_events in enumerate(events):
        last = -1
        for i, event in enumerate(rank_events):
            if _takes_part(rank, event, rank in finishers):
                last = i
        stops.append(None if last >= len(rank_events) - 1 else last + 1)
    return stops


def _takes_part(rank: int, event: tuple, finishes: bool) -> bool:
    kind = event[0]
    if kind == "call" or kind == "backward":
        return event[-1] == rank
    if kind == "x":
        return rank in (event[2], event[3])
    if kind == "end":
        return finishes
    return True  # a value read in Python: every rank takes part


@dataclass
class _Piece:
    """One action's worth of one rank's micro-batch (the same for every micro-batch)."""

    kind: str  # "F", "L" (the loss's backward, inline), "B"
    index: int  # F: chunk, B: group (within the rank)
    part: int | None = None
    first_recv: int | None = None
    rounds: tuple[int, int] | None = None
    receives: bool = False
    sends: bool = False
    key: tuple = ()

    def action(self, mb: int) -> Action:
        if self.kind == "F":
            return Action("F", mb, self.part)
        return Action("B", mb, self.part, inline=self.kind == "L", rounds=self.rounds)


def _piece_by_key(pieces: list[_Piece], key: tuple) -> _Piece:
    return next(p for p in pieces if p.key == key)


class _Graph:
    """One micro-batch of the recorded step: segments of each rank's forward (cut at receives) and
    its backward rounds, with the transfers between them."""

    def __init__(self, shapes: list[RankShape]) -> None:
        self.shapes = shapes
        self.size = len(shapes)
        self.segments: list[list[list[tuple]]] = []  # rank -> segment -> items
        for shape in shapes:
            segs: list[list[tuple]] = [[]]
            previous = None
            for item in shape.forward:
                if item[0] == "recv" and previous is not None and previous != "recv":
                    segs.append([])
                segs[-1].append(item)
                previous = item[0]
            self.segments.append(segs)
        self.rounds = [list(shape.backward[1:]) for shape in shapes]
        self.pre = [shape.backward[0][1] if shape.backward else () for shape in shapes]
        # where each transfer is sent and received (forward), and each gradient
        self.f_send: dict[int, tuple] = {}
        self.f_recv: dict[int, tuple] = {}
        self.g_send: dict[tuple[int, int], tuple] = {}  # (k, to) -> node
        self.g_recv: dict[tuple[int, int], tuple] = {}  # (k, rank) -> node
        for rank, segs in enumerate(self.segments):
            for i, seg in enumerate(segs):
                node = (rank, "F", i)
                for item in seg:
                    if item[0] == "send":
                        self.f_send[item[1]] = node
                    elif item[0] == "recv":
                        self.f_recv[item[1]] = node
                    elif item[0] in ("loss_sent", "end_sent"):
                        for k, to in item[1]:
                            self.g_send[(k, to)] = node
            for k, to in self.pre[rank]:
                self.g_send[(k, to)] = (rank, "B", -1)
            for j, (received, sent) in enumerate(self.rounds[rank]):
                node = (rank, "B", j)
                for k, _ in received:
                    self.g_recv[(k, rank)] = node
                for k, to in sent:
                    self.g_send[(k, to)] = node
        self.edges: dict[tuple, set[tuple]] = defaultdict(set)
        for k, node in self.f_send.items():
            if k in self.f_recv:
                self.edges[node].add(self.f_recv[k])
        for (k, to), node in self.g_send.items():
            target = self.g_recv.get((k, to))
            if target is not None:
                self.edges[node].add(target)

    def _order_edges(self, rank: int) -> list[tuple[tuple, tuple]]:
        nodes = [(rank, "F", i) for i in range(len(self.segments[rank]))]
        nodes += [(rank, "B", -1)] + [(rank, "B", j) for j in range(len(self.rounds[rank]))]
        return list(zip(nodes, nodes[1:], strict=False))

    def _reaches(self, sources: set[tuple], target: tuple, rank: int, stop: tuple) -> bool:
        """Whether ``target`` (on another rank) depends on ``sources`` (of ``rank``), not counting
        ``rank``'s own order past ``stop``."""
        order = {a: b for a, b in (e for r in range(self.size) for e in self._order_edges(r))}
        seen = set(sources)
        todo = deque(sources)
        while todo:
            node = todo.popleft()
            if node == target:
                return True
            nexts = set(self.edges.get(node, ()))
            after = order.get(node)
            if after is not None and not (node[0] == rank and (node == stop or _later(node, stop))):
                nexts.add(after)
            for nxt in nexts:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    def pieces(self) -> list[list[_Piece]]:
        out = []
        for rank in range(self.size):
            segs = self.segments[rank]
            starts = [0]
            for i in range(1, len(segs)):
                senders = {
                    self.f_send[item[1]] for item in segs[i] if item[0] == "recv" and item[1] in self.f_send
                }
                earlier = {(rank, "F", j) for j in range(i)}
                if any(self._reaches(earlier, s, rank, (rank, "F", i - 1)) for s in senders):
                    starts.append(i)
            pieces: list[_Piece] = []
            split = len(starts) > 1
            for n, first in enumerate(starts):
                last = starts[n + 1] if n + 1 < len(starts) else len(segs)
                items = [item for seg in segs[first:last] for item in seg]
                recv = next((item[1] for item in segs[first] if item[0] == "recv"), None) if n else None
                piece = _Piece(
                    "F",
                    n,
                    n if split else None,
                    recv,
                    receives=any(i[0] == "recv" for i in items),
                    sends=any(i[0] == "send" for i in items),
                    key=("F", n),
                )
                piece.segments = (first, last)  # type: ignore[attr-defined]
                pieces.append(piece)
                if any(item[0] == "loss" for item in items):
                    pieces.append(
                        _Piece(
                            "L",
                            0,
                            key=("L",),
                            sends=any(item[0] == "loss_sent" and item[1] for item in items),
                        )
                    )
            rounds = self.rounds[rank]
            groups = [0] if rounds else []
            for j in range(1, len(rounds)):
                senders = {self.g_send[(k, rank)] for k, _ in rounds[j][0] if (k, rank) in self.g_send}
                earlier = {(rank, "B", i) for i in range(-1, j)}
                if any(self._reaches(earlier, s, rank, (rank, "B", j - 1)) for s in senders):
                    groups.append(j)
            if not rounds and self.pre[rank]:
                groups = [0]
            b_count = len(groups) + (1 if any(p.kind == "L" for p in pieces) else 0)
            b_index = 0
            for p in pieces:
                if p.kind == "L":
                    p.part = b_index if b_count > 1 else None
                    b_index += 1
            for n, first in enumerate(groups):
                last = groups[n + 1] if n + 1 < len(groups) else max(len(rounds), 1)
                chosen = rounds[first:last]
                pieces.append(
                    _Piece(
                        "B",
                        n,
                        b_index if b_count > 1 else None,
                        rounds=(first, last) if rounds else (0, 0),
                        receives=any(r[0] for r in chosen),
                        sends=any(r[1] for r in chosen) or (n == 0 and bool(self.pre[rank])),
                        key=("B", n),
                    )
                )
                b_index += 1
            out.append(pieces)
        return out

    def piece_deps(self, pieces: list[list[_Piece]]) -> dict[tuple[int, tuple], set[tuple[int, tuple]]]:
        """(rank, piece key) -> the pieces it waits for, within one micro-batch."""
        owner: dict[tuple, tuple[int, tuple]] = {}
        for rank in range(self.size):
            for p in pieces[rank]:
                if p.kind == "F":
                    first, last = p.segments  # type: ignore[attr-defined]
                    for i in range(first, last):
                        owner[(rank, "F", i)] = (rank, p.key)
                elif p.kind == "B":
                    first, last = p.rounds or (0, 0)
                    for j in range(first, last):
                        owner[(rank, "B", j)] = (rank, p.key)
                    if p.index == 0:
                        owner[(rank, "B", -1)] = (rank, p.key)
        deps: dict[tuple[int, tuple], set[tuple[int, tuple]]] = defaultdict(set)
        for node, targets in self.edges.items():
            src = owner.get(node)
            if src is None:
                continue
            if self._is_loss_send(node) and any(p.kind == "L" for p in pieces[node[0]]):
                src = (node[0], ("L",))
            for target in targets:
                dst = owner.get(target)
                if dst is not None and dst != src:
                    deps[dst].add(src)
        for rank in range(self.size):
            keys = [p.key for p in pieces[rank]]
            for a, b in zip(keys, keys[1:], strict=False):
                deps[(rank, b)].add((rank, a))
        return deps

    def _is_loss_send(self, node: tuple) -> bool:
        rank, kind, i = node
        if kind != "F":
            return False
        return any(item[0] == "loss_sent" and item[1] for item in self.segments[rank][i])

    def caps(self, pieces: list[list[_Piece]], active: int | None) -> list[int]:
        """How many micro-batches each rank keeps in flight under 1F1B: the forward pieces from its
        first one to the loss, along the longest chain (the last stage of a chain: 1)."""
        deps = self.piece_deps(pieces)
        children: dict[tuple, set[tuple]] = defaultdict(set)
        for node, needs in deps.items():
            for need in needs:
                children[need].add(node)
        memo: dict[tuple, int] = {}

        def depth(node: tuple) -> int:
            if node in memo:
                return memo[node]
            memo[node] = 0
            rank, key = node
            own = 1 if key[0] == "F" else 0
            best = 0
            for child in children.get(node, ()):
                if child[1][0] in ("F", "L"):
                    best = max(best, depth(child))
            memo[node] = own + best
            return memo[node]

        caps = []
        for rank in range(self.size):
            first = next((p for p in pieces[rank] if p.kind == "F"), None)
            cap = max(1, depth((rank, first.key))) if first is not None else 1
            if active is not None:
                cap = min(cap, active)
            caps.append(cap)
        return caps


def _later(node: tuple, stop: tuple) -> bool:
    """Whether ``node`` comes after ``stop`` in their rank's order (F segments, then B rounds)."""
    kind_rank = {"F": 0, "B": 1}
    return (kind_rank[node[1]], node[2]) > (kind_rank[stop[1]], stop[2])


def _simulate(
    schedule: str, per_rank: list[list[Action]], deps: dict, caps: list[int], pieces: list[list[_Piece]]
) -> tuple[list[list[Action]], list[dict[str, float]]]:
    """Order each rank's actions by a list-scheduling simulation on unit costs (F 1, B 2)."""
    size = len(per_rank)
    remaining = [list(actions) for actions in per_rank]
    done_at: dict[tuple[int, str], float] = {}
    order: list[list[Action]] = [[] for _ in range(size)]
    slots: list[dict[str, float]] = [{} for _ in range(size)]
    free_at = [0.0] * size
    inflight: list[set[int]] = [set() for _ in range(size)]
    last_b = [{p.key for p in pieces[r] if p.kind in ("B", "L")} for r in range(size)]
    last_b_key = [next((p for p in reversed(pieces[r]) if p.kind in ("B", "L")), None) for r in range(size)]
    time = 0.0
    total = sum(len(r) for r in remaining)
    guard = 0
    while sum(len(o) for o in order) < total:
        guard += 1
        if guard > 100 * total + 1000:
            raise SmpartError("building the step program did not converge (a bug)")
        progressed = False
        for rank in range(size):
            if free_at[rank] > time or not remaining[rank]:
                continue
            choice = _choose(schedule, rank, remaining[rank], deps, done_at, time, caps[rank], inflight[rank])
            if choice is None:
                continue
            remaining[rank].remove(choice)
            cost = 1.0 if choice.kind == "F" else (0.0 if choice.inline else 2.0)
            # an inline loss backward follows its forward at once
            name = (rank, str(choice))
            slots[rank][str(choice)] = time
            order[rank].append(choice)
            end = time + cost
            if choice.kind == "F":
                inflight[rank].add(choice.microbatch)
                nxt = next(
                    (
                        a
                        for a in remaining[rank]
                        if a.inline
                        and a.microbatch == choice.microbatch
                        and deps.get((rank, str(a)), set()) <= set(done_at) | {name}
                    ),
                    None,
                )
                done_at[name] = end
                if nxt is not None:
                    remaining[rank].remove(nxt)
                    slots[rank][str(nxt)] = end
                    order[rank].append(nxt)
                    end += 2.0
                    done_at[(rank, str(nxt))] = end
                    _finish_b(rank, nxt, inflight, last_b_key)
            else:
                done_at[name] = end
                _finish_b(rank, choice, inflight, last_b_key)
            free_at[rank] = end
            progressed = True
        del last_b
        last_b = None  # noqa: F841 - kept simple
        if not progressed:
            future = [t for t in free_at if t > time] + [t for t in done_at.values() if t > time]
            if not future:
                stuck = {r: [str(a) for a in remaining[r][:2]] for r in range(size) if remaining[r]}
                raise SmpartError(f"the step program cannot be ordered: ranks wait for each other ({stuck})")
            time = min(future)
    return order, slots


def _finish_b(rank: int, action: Action, inflight: list[set[int]], last_b_key: list) -> None:
    last = last_b_key[rank]
    if last is not None and last.action(action.microbatch) == action:
        inflight[rank].discard(action.microbatch)


def _choose(
    schedule: str,
    rank: int,
    remaining: list[Action],
    deps: dict,
    done_at: dict,
    time: float,
    cap: int,
    inflight: set[int],
) -> Action | None:
    def ready(action: Action) -> bool:
        return all(done_at.get(d, float("inf")) <= time for d in deps.get((rank, str(action)), ()))

    forwards = [a for a in remaining if a.kind == "F" and ready(a)]
    backwards = [a for a in remaining if a.kind == "B" and not a.inline and ready(a)]
    key = lambda a: (a.microbatch, a.part or 0)  # noqa: E731
    if schedule == "gpipe":
        if forwards:
            return min(forwards, key=key)
        return min(backwards, key=key) if backwards else None
    if backwards:
        return min(backwards, key=key)
    if forwards:
        candidate = min(forwards, key=key)
        if candidate.microbatch in inflight or len(inflight) < cap:
            return candidate
    return None
