"""Crossing a stage boundary: tensors leave one autograd graph and start a fresh one.

A value sent to another stage (a call's arguments, its outputs) is flattened with torch's pytree
(lists, tuples, dicts, named tuples and registered containers such as Hugging Face
``ModelOutput``). Its tensors are numbered in flatten order, and both sides use those numbers.

The receiver rebuilds every tensor as a *detached* tensor on its own device and puts a single
`_Arrive` autograd node in front of all of them. That node's backward is the whole trick: when
autograd on the receiving stage reaches it, it does not block or wait for anyone, it posts the
gradients as messages along each tensor's `Route`. Normally the route leads back to the sender,
which kept the tensors it sent (`depart`) and runs ``torch.autograd.backward(kept, grads)`` on its
own graph when the message arrives. A backward pass is therefore a chain of stage-local segments
driven by messages; by linearity their sum is the gradient of the unsplit model, even when a
segment runs more than once with partial gradients.

Forwarding: a stage that passes a received tensor on *unchanged* (a root module handing one
stage's output to the next stage) would only relay its gradient. So the tensor remembers its
route, the sender puts that route in the message instead of keeping the tensor, and the gradient
goes straight to where the tensor came from, never waiting for the relaying stage to be free.

Why a custom ``autograd.Function`` and not a hook on a detached leaf (cheaper by ~4 µs per
crossing on CPU): a leaf that requires grad cannot be modified in place, and modules do that to
their inputs (``nn.ReLU(inplace=True)``); an `_Arrive` output is an ordinary non-leaf tensor. The
node is kept lean instead: one shared anchor input, the sender's tensors carried on the `Arrival`
rather than as inputs, ``Function.apply``'s functorch preamble skipped, and a tensor or a tuple
of tensors (most values) handled without walking them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from smpart.errors import SmpartError


class Route(NamedTuple):
    """Where the gradient of a crossing tensor goes: tensor ``index`` of call ``call_id``, kept at
    ``address`` as one of the call's outputs (``to_outputs``) or of its arguments."""

    address: Any
    call_id: int
    index: int
    to_outputs: bool


#: ``post((address, call_id, to_outputs), {index: grad})`` sends one gradient message.
GradPost = Callable[[tuple[Any, int, bool], dict[int, torch.Tensor]], None]

#: Leaf values that cross as they are (no tensors inside).
PLAIN_TYPES = (type(None), bool, numbers.Number, str, bytes, torch.dtype, torch.device, torch.Size,
               slice, type(Ellipsis), torch.memory_format, torch.layout)
_SCALARS = frozenset({bool, int, float, complex, str, bytes, torch.dtype, torch.device})
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_ROUTE_ATTR = "_smpart_route"


class Arrival:
    """One value arriving with gradients to send back: what its `_Arrive` node needs.

    ``tensors`` are the sender's own tensors, read once by the node's forward (which detaches
    them onto ``device``) and then dropped; ``routes[i]`` is where the gradient of tensor ``i``
    goes; ``constant`` lists those that did not require grad on the sending side (they arrive
    non-differentiable).
    """

    __slots__ = ("post", "routes", "constant", "tensors", "device")

    def __init__(self, post: GradPost, routes: list[Route], needs_grad: list[bool],
                 tensors: Sequence[torch.Tensor], device: torch.device | None) -> None:
        self.post = post
        self.routes = routes
        self.constant = [i for i, need in enumerate(needs_grad) if not need]
        self.tensors = tensors
        self.device = device

    def send(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Post the gradients, one message per (address, call, side), summing repeated indices."""
        if len(grads) == 1:  # one tensor crossed (the common case)
            if grads[0] is not None:
                address, call_id, index, to_outputs = self.routes[0]
                self.post((address, call_id, to_outputs), {index: grads[0]})
            return
        messages: dict[tuple[Any, int, bool], dict[int, torch.Tensor]] = {}
        for route, grad in zip(self.routes, grads, strict=True):
            if grad is None:
                continue
            found = messages.setdefault((route.address, route.call_id, route.to_outputs), {})
            found[route.index] = found[route.index] + grad if route.index in found else grad
        for target, grads_by_index in messages.items():
            self.post(target, grads_by_index)


class _Arrive(torch.autograd.Function):
    """The sender's tensors, detached onto this stage's device, behind one node whose backward
    posts messages.

    The sender's tensors travel on the `Arrival`, not as inputs: an input would link this graph to
    the sender's, and an input returned as-is would come out as a view. The only input is the
    shared `_ANCHOR`, which makes autograd record the node.
    """

    @staticmethod
    def forward(ctx, arrival: Arrival, anchor: torch.Tensor):  # type: ignore[override]
        ctx.arrival = arrival
        ctx.set_materialize_grads(False)
        outputs = tuple([_detached(t, arrival.device) for t in arrival.tensors])
        arrival.tensors = None  # the sender keeps what it needs; this node must not
        if arrival.constant:
            ctx.mark_non_differentiable(*[outputs[i] for i in arrival.constant])
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        ctx.arrival.send(grads)
        return None, None


#: The one input of every `_Arrive` node, requiring grad (a node is recorded only if an input
#: does). It never receives a gradient (the backward returns None for it), so all nodes share it.
_ANCHOR = torch.empty(0, requires_grad=True)
#: ``_Arrive.apply`` without ``Function.apply``'s Python preamble (~1.5 µs per crossing), which
#: only serves functorch transforms: with one active, `_apply` takes the public route.
_c_apply = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
_apply_unchecked = _c_apply.__get__(None, _Arrive) if _c_apply is not None else _Arrive.apply


def _apply(arrival: Arrival) -> tuple[torch.Tensor, ...]:
    if torch._C._are_functorch_transforms_active():
        return _Arrive.apply(arrival, _ANCHOR)
    return _apply_unchecked(arrival, _ANCHOR)


def walk(value: Any, visit: Callable[[torch.Tensor], Any], what: Callable[[], str] | None = None) -> Any:
    """``value`` rebuilt with ``visit(tensor)`` in place of each tensor, tensors in a fixed order.

    Plain tuples, lists and dicts take a fast path (torch's generic pytree flatten costs ~15 µs,
    a noticeable share of a cross-stage call); any other container goes through pytree. With
    ``what``, an opaque leaf that holds tensors raises `SmpartError` (it cannot cross stages).
    """
    kind = type(value)
    if kind in _TENSOR_TYPES:
        return visit(value)
    if kind is tuple:
        return tuple([walk(v, visit, what) for v in value])
    if kind is list:
        return [walk(v, visit, what) for v in value]
    if kind is dict:
        return {k: walk(v, visit, what) for k, v in value.items()}
    if value is None or kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):  # a tensor subclass (slower check, hence last)
        return visit(value)
    leaves, spec = pytree.tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:  # not a container: an opaque leaf
        if what is not None:
            check_sendable(value, what)
        return value
    return pytree.tree_unflatten([walk(leaf, visit, what) for leaf in leaves], spec)


class Departure(NamedTuple):
    """What the sender of a value keeps: ``kept[i]`` is tensor ``i`` if a gradient message may
    come back for it (None otherwise; ``kept`` is None when none may), and ``forwarded`` the
    routes of the tensors passed on unchanged."""

    kept: list[torch.Tensor | None] | None
    forwarded: dict[int, Route]


def depart(value: Any, grad_enabled: bool, what: Callable[[], str]) -> Departure:
    """Check ``value`` can cross, and sort its tensors into kept and forwarded ones."""
    tensors = _flat_tensors(value) or _walk_tensors(value, what)
    kept: list[torch.Tensor | None] = []
    forwarded: dict[int, Route] = {}
    for i, tensor in enumerate(tensors):
        needs = grad_enabled and tensor.requires_grad
        tag = tensor.__dict__.get(_ROUTE_ATTR) if needs else None
        if tag is not None and tag[1] == tensor._version:  # unchanged since it arrived
            forwarded[i] = tag[0]
            needs = False
        kept.append(tensor if needs else None)
    return Departure(kept if any(t is not None for t in kept) else None, forwarded)


def arrive(value: Any, device: torch.device | None, route: Callable[[int], Route] | None,
           post: GradPost) -> Any:
    """``value`` rebuilt on ``device`` with detached tensors behind one `_Arrive` node.

    Tensors that required grad on the sending side require grad here; the gradient of tensor
    ``i`` is posted along ``route(i)``. With ``route`` None (grad disabled) they are only detached.
    A tensor or a tuple of tensors (most values) is rebuilt without walking it.
    """
    flat = _flat_tensors(value)
    tensors = flat or _walk_tensors(value)
    needs_grad = [tensor.requires_grad for tensor in tensors]
    if route is None or not any(needs_grad):
        arrived: Any = [_detached(tensor, device) for tensor in tensors]
    else:
        routes = [route(i) for i in range(len(tensors))]
        arrived = _apply(Arrival(post, routes, needs_grad, tensors, device))
        for tensor, each, needed in zip(arrived, routes, needs_grad, strict=True):
            if needed:
                tensor.__dict__[_ROUTE_ATTR] = (each, tensor._version)
    if flat is None:
        rest = iter(arrived)
        return walk(value, lambda _: next(rest))
    return arrived[0] if flat is not value else tuple(arrived)


def depart_call(args: tuple, kwargs: dict, grad_enabled: bool, what: Callable[[], str]) -> Departure:
    """`depart` for a call's ``(args, kwargs)``; `arrive_call` is its other end."""
    return depart((args, kwargs) if kwargs else args, grad_enabled, what)


def arrive_call(args: tuple, kwargs: dict, device: torch.device | None, route: Callable[[int], Route] | None,
                post: GradPost) -> tuple[tuple, dict]:
    """`arrive` for a call's ``(args, kwargs)``. Without keyword arguments only ``args`` crosses the
    boundary (one level less to walk; the tensors are numbered the same either way)."""
    if kwargs:
        return arrive((args, kwargs), device, route, post)
    return arrive(args, device, route, post), {}


def route_back(address: Any, call_id: int, to_outputs: bool,
               forwarded: dict[int, Route]) -> Callable[[int], Route]:
    """Route of tensor ``i`` of a message: the forwarded one, else back to ``address``."""
    return lambda i: forwarded.get(i) or Route(address, call_id, i, to_outputs)


def _flat_tensors(value: Any) -> Sequence[torch.Tensor] | None:
    """``[value]`` for a tensor, ``value`` for a non-empty tuple of tensors, else None (walk it)."""
    kind = type(value)
    if kind in _TENSOR_TYPES:
        return [value]
    if kind is tuple and value and all(type(v) in _TENSOR_TYPES for v in value):
        return value
    return None


def _walk_tensors(value: Any, what: Callable[[], str] | None = None) -> list[torch.Tensor]:
    """The tensors of ``value`` in `walk` order."""
    tensors: list[torch.Tensor] = []
    walk(value, tensors.append, what)
    return tensors


def _detached(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    out = tensor.detach()
    if device is not None and out.device != device:
        out = out.to(device)
    return out


def check_sendable(leaf: Any, what: Callable[[], str]) -> None:
    """Raise `SmpartError` for an opaque value that hides tensors (they cannot cross stages)."""
    if _holds_tensors(leaf):
        raise SmpartError(
            f"{what()} contains a {type(leaf).__module__}.{type(leaf).__qualname__} that holds tensors; "
            "smpart carries tensors across pipeline stages only as tensors or inside lists, tuples, dicts "
            "and pytree-registered containers. Return plain tensors (for Hugging Face models also pass "
            "use_cache=False), or register the type with torch.utils._pytree.register_pytree_node."
        )


def _holds_tensors(obj: Any, depth: int = 3) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth == 0 or isinstance(obj, PLAIN_TYPES) or callable(obj) and not hasattr(obj, "__dict__"):
        return False
    if isinstance(obj, dict):
        return any(_holds_tensors(v, depth - 1) for v in obj.values())
    if isinstance(obj, list | tuple | set):
        return any(_holds_tensors(v, depth - 1) for v in obj)
    if isinstance(obj, torch.nn.Module):
        return False  # modules are shared by reference and live where the partition put them
    attrs = getattr(obj, "__dict__", None)
    return bool(attrs) and any(_holds_tensors(v, depth - 1) for v in attrs.values())
