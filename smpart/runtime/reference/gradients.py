"""Backward segments: stage-local ``autograd.backward`` calls driven by gradient messages.

`backpropagate` runs one segment for a batch of `Gradients` messages of one micro-batch: each
names a call whose kept tensors (the outputs a callee returned, or the arguments a caller sent)
receive the message's gradients. Gradients for the same tensor are summed first and every
tensor goes into a single ``autograd.backward`` call, so a graph shared by several of them (a
residual whose branches live on different stages) is traversed once per batch. Graphs are
retained: a later message of the same micro-batch may need the same graph again (correct by
linearity; the graphs go when the micro-batch is released).

**Holding, so that each part of the graph is traversed once.** Messages of one micro-batch that
arrive apart would each walk the graph upstream of their tensors: when a block is split between
stages, the residual stream crosses back and forth, its gradient comes back in pieces, and every
piece re-ran the whole backward before it (GPT-2 small cut inside a block ran blocks 0-3 three
times). So a stage learns, from the last step, how many gradient messages each of its kept
calls gets (`Holding.expected`). While a kept tensor still waits for one, the graph upstream of
it (``blocked``) is not entered: the segment runs ``autograd.backward`` with ``inputs`` limited
to what lies before that part (the parameters, the `_Arrive` nodes that post gradients, and the
blocked nodes at its edge, whose incoming gradients a pre-hook keeps in ``pending`` instead of
passing on). When the last expected message is in, the kept gradients go in with it, as
``GradientEdge`` roots, and the blocked part runs once with everything. A guess that is wrong
costs time, never correctness: a message that was not expected runs its own segment (as
without holding), and one that never comes is caught when the micro-batch's credit is all home
while a stage still holds gradients: the driver sends it a flush (`Gradients` with ``flush``),
which releases them. Leaves never block (accumulating into ``.grad`` twice is how autograd
handles a tied weight too). Tensor parallelism runs call by call and does not hold.

While a segment runs, the `_Arrive` nodes it reaches post gradient messages into an `Outbox`;
when it ends, `dispatch` sends them with their share of the segment's credit (see `messages`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from fractions import Fraction
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from smpart.runtime.reference.boundary import _Arrive, walk
from smpart.runtime.wire.messages import Address, Credit, Gradients

#: call_id -> (module name, kept tensors indexed like the call's tensors; None: no grad needed)
CallRecords = dict[Any, tuple[str, list[torch.Tensor | None]]]
Send = Callable[[Address, object], None]


class Outbox:
    """Gradient messages posted during a backward segment: ``(address, call_id, to_outputs)`` and
    ``{tensor index: gradient}``. Its `post` is what `_Arrive` nodes call (on whatever thread
    autograd runs them), so it is given to `boundary.arrive` at forward time."""

    __slots__ = ("posts",)

    def __init__(self) -> None:
        self.posts: list[tuple[tuple[Address, Any, bool], dict[int, torch.Tensor]]] = []

    def post(self, target: tuple[Address, Any, bool], grads: dict[int, torch.Tensor]) -> None:
        self.posts.append((target, grads))

    def take(self) -> list:
        posts, self.posts = self.posts, []
        return posts


def dispatch(send: Send, posts: list, credit: Fraction, step: int, microbatch: int, home: Address,
             sender: int = -1, counts: dict | None = None) -> None:
    """Send a segment's posts, one message per endpoint, each with an equal share of ``credit``;
    none: the credit goes home. ``counts`` numbers the messages per endpoint for their `origin`."""
    if not posts:
        if credit:
            send(home, Credit(step, microbatch, credit))
        return
    by_address: dict[Address, list] = {}
    for (address, call_id, to_outputs), grads in posts:
        by_address.setdefault(address, []).append((call_id, to_outputs, grads))
    share = credit / len(by_address)
    counts = {} if counts is None else counts
    for address, parts in by_address.items():
        n = counts.get(address, 0)
        counts[address] = n + 1
        send(address, Gradients(step, microbatch, parts, share, (sender, n)))


def grad_mask(kept: list | None, forwarded: dict) -> tuple[int, ...]:
    """Indices of a departing value's tensors that require grad: kept ones and forwarded ones."""
    kept_indices = [] if kept is None else [i for i, t in enumerate(kept) if t is not None]
    return tuple(sorted({*kept_indices, *forwarded}))


def restore_requires_grad(value: Any, mask: tuple[int, ...]) -> None:
    """Tensors that crossed a process boundary arrive as leaves that do not require grad: mark
    those the sender's did (on threads they are the sender's own tensors and already do)."""
    if not mask:
        return
    wanted = set(mask)
    index = 0

    def visit(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal index
        if index in wanted and not tensor.requires_grad and tensor.is_floating_point() | tensor.is_complex():
            tensor.requires_grad_(True)
        index += 1
        return tensor

    walk(value, visit)


class Holding:
    """What a stage holds back of one micro-batch's backward (see the module docstring).

    The blocked part of the graph is kept up to date message by message rather than found again
    for every segment: each kept call that still expects a message contributes the nodes upstream
    of its tensors once, counted in ``blocking``, and takes them back when its last message is in.
    A call that receives many messages of its own (a root calling another stage's module 200
    times in a loop) then costs each segment the part it touches, not the whole graph."""

    __slots__ = ("expected", "received", "pending", "flushing", "reported", "outstanding", "blocking",
                 "_records_seen")

    def __init__(self, expected: Callable[[Any, bool], int]) -> None:
        #: ``expected(call_id, to_outputs)``: gradient messages the kept call should get (0: none
        #: expected, or not known).
        self.expected = expected
        self.received: dict[tuple[Any, bool], int] = {}
        #: Blocked autograd nodes -> {output index: the gradient that reached it meanwhile}.
        self.pending: dict[Any, dict[int, torch.Tensor]] = {}
        self.flushing = False  # the driver said nothing more will come: hold nothing back
        self.reported = False  # the driver was told this stage holds gradients
        #: Kept calls still expecting a message -> the nodes upstream of their tensors.
        self.outstanding: dict[tuple[Any, bool], set] = {}
        #: Node -> how many outstanding calls have it upstream: the blocked part of the graph.
        self.blocking: dict[Any, int] = {}
        self._records_seen = (0, 0)

    def count(self, messages: list[Gradients]) -> None:
        for message in messages:
            self.flushing = self.flushing or message.flush
            for key in {(call_id, to_outputs) for call_id, to_outputs, _ in message.parts}:
                self.received[key] = self.received.get(key, 0) + 1
                if key in self.outstanding and self.received[key] >= self.expected(*key):
                    self._unblock(key)
        if self.flushing:
            self.outstanding.clear()
            self.blocking.clear()

    def blocked(self, served: CallRecords, sent: CallRecords) -> dict[Any, int]:
        """The autograd nodes upstream of kept tensors whose calls still expect a gradient
        message (a mapping, for membership tests)."""
        if self.flushing:
            return self.blocking
        sizes = (len(served), len(sent))
        if sizes != self._records_seen:  # calls kept since the last look: the new ones may block
            self._records_seen = sizes
            for records, to_outputs in ((served, True), (sent, False)):
                for call_id, (_, kept) in records.items():
                    key = (call_id, to_outputs)
                    if key not in self.outstanding and self.received.get(key, 0) < self.expected(*key):
                        self._block(key, kept)
        return self.blocking

    def _block(self, key: tuple[Any, bool], kept: list) -> None:
        nodes = _upstream(get_gradient_edge(t).node for t in kept if t is not None)
        self.outstanding[key] = nodes
        for node in nodes:
            self.blocking[node] = self.blocking.get(node, 0) + 1

    def _unblock(self, key: tuple[Any, bool]) -> None:
        for node in self.outstanding.pop(key):
            left = self.blocking[node] - 1
            if left:
                self.blocking[node] = left
            else:
                del self.blocking[node]

    def keep(self, node: Any, index: int, grad: torch.Tensor) -> None:
        grads = self.pending.setdefault(node, {})
        grads[index] = grads[index] + grad if index in grads else grad

    def capture(self, node: Any) -> Callable[[tuple], tuple]:
        """A pre-hook for blocked ``node``: keep what reaches it, pass nothing on."""

        def hook(grad_outputs: tuple) -> tuple:
            for index, grad in enumerate(grad_outputs):
                if grad is not None:
                    self.keep(node, index, grad)
            return tuple(None for _ in grad_outputs)

        return hook

    def take(self, nodes: Any = None) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """The kept gradients of ``nodes`` (default: all) as roots, no longer kept."""
        roots, grads = [], []
        for node in list(self.pending) if nodes is None else nodes:
            for index, grad in self.pending.pop(node).items():
                roots.append(GradientEdge(node, index))
                grads.append(grad)
        return roots, grads


def backpropagate(served: CallRecords, sent: CallRecords, messages: list[Gradients],
                  call_by_call: bool = False, holding: Holding | None = None) -> None:
    """One backward segment: every message's gradients land on the tensors its call kept (the
    outputs this endpoint ``served``, or the arguments it ``sent``), in one ``backward`` call.

    ``call_by_call`` (tensor parallelism): one ``backward`` call per module call instead, in the
    messages' order. Autograd runs the nodes that are ready at once by their creation number, a
    per-thread counter, and the calls of one stage ran on different worker threads: one backward
    over several calls' graphs could order their collectives differently on each tensor-parallel
    rank. A call's own graph was built on one thread, so its order is the same everywhere."""
    groups: dict[Any, dict[int, list]] = {}
    for call_id, to_outputs, grads_by_index in (part for message in messages for part in message.parts):
        records = served if to_outputs else sent
        if call_id not in records:
            continue
        _, kept = records[call_id]
        targets = groups.setdefault((call_id, to_outputs) if call_by_call else None, {})
        for index, grad in grads_by_index.items():
            tensor = kept[index]
            if tensor is None:
                continue
            grad = grad.to(tensor.device)
            entry = targets.get(id(tensor))
            if entry is None:
                targets[id(tensor)] = [tensor, grad]
            else:
                entry[1] = entry[1] + grad
    if holding is not None and not call_by_call and edges_supported():
        holding.count(messages)
        targets = groups.get(None, {})
        _held_backward(holding, [t for t, _ in targets.values()], [g for _, g in targets.values()],
                       holding.blocked(served, sent))
        return
    for targets in groups.values():
        if targets:
            tensors, grads = zip(*targets.values(), strict=True)
            torch.autograd.backward(list(tensors), list(grads), retain_graph=True)


def _held_backward(holding: Holding, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                   blocked: Collection) -> None:
    """Back-propagate ``grads`` into ``tensors`` except into the ``blocked`` part of the graph
    (upstream of kept tensors that still wait for a message), whose gradients stay in
    ``holding`` until nothing is blocked any more."""
    if not blocked:  # everything is in: one pass over what is left, kept gradients included
        roots, kept = holding.take()
        if tensors or roots:
            torch.autograd.backward([*tensors, *roots], [*grads, *kept], retain_graph=True)
        return
    active: list[Any] = []
    active_grads: list[torch.Tensor] = []
    for tensor, grad in zip(tensors, grads, strict=True):
        edge = get_gradient_edge(tensor)
        if edge.node in blocked:
            holding.keep(edge.node, edge.output_nr, grad)
        else:
            active.append(tensor)
            active_grads.append(grad)
    roots, kept = holding.take([node for node in holding.pending if node not in blocked])
    active, active_grads = [*active, *roots], [*active_grads, *kept]
    if not active:
        return
    params, sinks, frontier = _ready_part(active, blocked)
    if not frontier:  # nothing blocked lies in reach: the plain backward runs exactly the ready part
        torch.autograd.backward(active, active_grads, retain_graph=True)
        return
    inputs = [*params, *(GradientEdge(node, 0) for node in (*sinks, *frontier))]
    hooks = [node.register_prehook(holding.capture(node)) for node in frontier]
    try:
        torch.autograd.backward(active, active_grads, inputs=inputs, retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()


@functools.cache
def _leaf_type() -> type:
    """The type of the nodes that accumulate into parameters (``AccumulateGrad``; torch does not
    export it)."""
    leaf = torch.empty(1, requires_grad=True)
    return type((leaf * 1).grad_fn.next_functions[0][0])


def _upstream(nodes: Any) -> set:
    """``nodes`` and every autograd node before them, leaves (parameters) excepted."""
    # These walks run for every kept call and segment: plain loops, the node types compared by
    # identity (a per-node cost of ~1 µs, half the generator-and-name-compare version's).
    leaf = _leaf_type()
    seen: set = set()
    stack = [n for n in nodes if n is not None and type(n) is not leaf]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for upstream, _ in node.next_functions:
            if upstream is not None and type(upstream) is not leaf and upstream not in seen:
                stack.append(upstream)
    return seen


def _ready_part(roots: list[Any], blocked: Collection) -> tuple[list[torch.Tensor], list[Any], list[Any]]:
    """What a held segment may run into from ``roots`` without entering ``blocked``: the leaves it
    accumulates into, the `_Arrive` nodes it reaches (they post gradients), and the blocked nodes
    at its edge (the pre-hooks keep what reaches them)."""
    leaf, arrive = _leaf_type(), _Arrive._backward_cls
    params: list[torch.Tensor] = []
    sinks: list[Any] = []
    frontier: list[Any] = []
    seen: set = set()
    stack = [r.node if isinstance(r, GradientEdge) else get_gradient_edge(r).node for r in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kind = type(node)
        if node in blocked:
            frontier.append(node)
        elif kind is leaf:
            params.append(node.variable)
        elif kind is arrive:
            sinks.append(node)
        else:
            for upstream, _ in node.next_functions:
                if upstream is not None and upstream not in seen:
                    stack.append(upstream)
    return params, sinks, frontier


@functools.cache
def edges_supported() -> bool:
    """Whether this torch runs ``autograd.backward`` from and into ``GradientEdge``s (holding
    needs it; older versions back-propagate every message at once, as before)."""
    try:
        x = torch.ones(1, requires_grad=True)
        y = x * 2
        torch.autograd.backward([get_gradient_edge(y)], [torch.ones(1)], inputs=[x])
        return x.grad is not None
    except (TypeError, RuntimeError, AttributeError):
        return False


def module_of(served: CallRecords, sent: CallRecords, messages: list[Gradients]) -> str | None:
    """The module whose call a failing segment worked for (to name it in the error)."""
    for call_id, to_outputs, _ in (part for message in messages for part in message.parts):
        records = served if to_outputs else sent
        if call_id in records:
            return records[call_id][0]
    return None
