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
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
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


class _Arrive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post: GradPost, routes: list[Route], needs_grad: list[bool],  # type: ignore[override]
                anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.post, ctx.routes = post, routes
        ctx.set_materialize_grads(False)
        outputs = tuple(t.detach() for t in tensors)
        if not all(needs_grad):
            ctx.mark_non_differentiable(*(o for o, need in zip(outputs, needs_grad, strict=True) if not need))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        messages: dict[tuple[Any, int, bool], dict[int, torch.Tensor]] = {}
        for route, grad in zip(ctx.routes, grads, strict=True):
            if grad is None:
                continue
            found = messages.setdefault((route.address, route.call_id, route.to_outputs), {})
            found[route.index] = found[route.index] + grad if route.index in found else grad
        for target, grads_by_index in messages.items():
            ctx.post(target, grads_by_index)
        return (None, None, None, None) + (None,) * len(grads)


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
    tensors: list[torch.Tensor] = []
    walk(value, tensors.append, what)
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
    """
    needs_grad: list[bool] = []
    fresh: list[torch.Tensor] = []

    def detach(tensor: torch.Tensor) -> torch.Tensor:
        needs_grad.append(tensor.requires_grad)
        fresh.append(_detached(tensor, device))
        return fresh[-1]

    detached = walk(value, detach)
    if route is None or not any(needs_grad):
        return detached
    routes = [route(i) for i in range(len(fresh))]
    anchor = torch.empty(0, requires_grad=True)
    arrived = _Arrive.apply(post, routes, needs_grad, anchor, *fresh)
    if detached is fresh[0]:  # the value is one tensor (the common case): no rebuild
        result = arrived[0]
    else:
        rest = iter(arrived)
        result = walk(detached, lambda _: next(rest))
    for tensor, each, needed in zip(arrived, routes, needs_grad, strict=True):
        if needed:
            tensor.__dict__[_ROUTE_ATTR] = (each, tensor._version)
    return result


def route_back(address: Any, call_id: int, to_outputs: bool,
               forwarded: dict[int, Route]) -> Callable[[int], Route]:
    """Route of tensor ``i`` of a message: the forwarded one, else back to ``address``."""
    return lambda i: forwarded.get(i) or Route(address, call_id, i, to_outputs)


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
