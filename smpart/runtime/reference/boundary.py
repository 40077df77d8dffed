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

Carried state: a key/value cache (Hugging Face's ``DynamicCache``, passed by default to every
decoder layer) is not a pytree of tensors but an object the layers of several stages update in
turn. It crosses *without* autograd: its tensors are neither numbered nor rebuilt behind the
`_Arrive` node, so no gradient message ever comes back for them. That is the unsplit semantics
where it matters: a layer writes its own keys and values into the cache and reads them back in
the same call, so its gradient flows inside one stage; no layer differentiates through another
layer's entries, and training never differentiates through the cache across steps. Rebuilding the
cache instead would give each stage a copy, and the caller would never see the other stages' updates.

On threads a carried object crosses by reference: every stage mutates the one object in turn. A
process cannot share it, so the runtime copies it in and out: `pack_state` pickles the object with
its tensors taken out and detached (a `StateSnapshot`, whose tensors travel like any other message
tensor), `unpack_state` rebuilds it on the receiving device, and the callee sends its copy back
with the answer (`carried_leaves` of the call's arguments, packed), from which `merge_state`
updates the caller's object in place. "In turn" is the runtime's rule in both cases: a call that
carries an object is not started while another call carrying the same object is unanswered (its
copy merged back), so the stages update it in the unsplit model's order. The cost on processes is
that every crossing moves the whole cache, the entries of the stages it does not concern included,
both ways: for training, where the cache is thrown away, ``use_cache=False`` avoids it.

Which objects are carried: instances of `register_carried_state` types (Hugging Face's
``transformers.cache_utils.Cache`` and its subclasses are registered by name, so transformers
need not be imported), and any other opaque object (not a tensor, not a pytree container, not an
``nn.Module``, which lives where the partition put it) holding tensors none of which requires
grad. An unregistered object holding a tensor that requires grad, crossing with grad enabled, is
the one thing `check_sendable` refuses: carrying it would silently cut a gradient the unsplit model
computes, so the user must say which it is (a pytree container, or state).
"""

from __future__ import annotations

import io
import numbers
import pickle
from collections.abc import Callable, Iterator, Sequence
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
#: Values that hold no tensor and cross as they are (`handles` adds its references).
_SCALARS = {bool, int, float, complex, str, bytes, torch.dtype, torch.device}
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


def is_plain(kind: type) -> bool:
    """Whether values of type ``kind`` are leaves that hold no tensor (numbers, strings, dtypes)."""
    return kind in _SCALARS


def walk(value: Any, visit: Callable[[torch.Tensor], Any], what: Callable[[], str] | None = None,
         grad_enabled: bool = True) -> Any:
    """``value`` rebuilt with ``visit(tensor)`` in place of each tensor, tensors in a fixed order.

    Plain tuples, lists and dicts take a fast path (torch's generic pytree flatten costs ~15 µs,
    a noticeable share of a cross-stage call); any other container goes through pytree. Opaque
    leaves, carried state included, are returned as they are (their tensors are not visited).
    With ``what``, an opaque leaf that cannot cross raises `SmpartError` (see `check_sendable`).
    """
    kind = type(value)
    if kind in _TENSOR_TYPES:
        return visit(value)
    if kind is tuple:
        return tuple([walk(v, visit, what, grad_enabled) for v in value])
    if kind is list:
        return [walk(v, visit, what, grad_enabled) for v in value]
    if kind is dict:
        return {k: walk(v, visit, what, grad_enabled) for k, v in value.items()}
    if value is None or kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):  # a tensor subclass (slower check, hence last)
        return visit(value)
    if _is_carried_type(kind):  # before pytree: a cache type may also be registered there (export)
        return value
    leaves, spec = pytree.tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:  # not a container: an opaque leaf
        if what is not None:
            check_sendable(value, what, grad_enabled)
        return value
    return pytree.tree_unflatten([walk(leaf, visit, what, grad_enabled) for leaf in leaves], spec)


class Departure(NamedTuple):
    """What the sender of a value keeps: ``kept[i]`` is tensor ``i`` if a gradient message may
    come back for it (None otherwise; ``kept`` is None when none may), and ``forwarded`` the
    routes of the tensors passed on unchanged."""

    kept: list[torch.Tensor | None] | None
    forwarded: dict[int, Route]


def depart(value: Any, grad_enabled: bool, what: Callable[[], str]) -> Departure:
    """Check ``value`` can cross, and sort its tensors into kept and forwarded ones."""
    tensors = _flat_tensors(value) or _walk_tensors(value, what, grad_enabled)
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


def _walk_tensors(value: Any, what: Callable[[], str] | None = None,
                  grad_enabled: bool = True) -> list[torch.Tensor]:
    """The tensors of ``value`` in `walk` order."""
    tensors: list[torch.Tensor] = []
    walk(value, tensors.append, what, grad_enabled)
    return tensors


def _detached(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    out = tensor.detach()
    if device is not None and out.device != device:
        out = out.to(device)
    return out


# ==================================================================== carried state
def check_sendable(leaf: Any, what: Callable[[], str], grad_enabled: bool = True) -> None:
    """Raise `SmpartError` for an opaque value that cannot cross stages.

    Opaque values cross as they are, or as carried state when they hold tensors (see the module
    docstring). The one refused is an object of an unregistered type that holds a tensor which
    requires grad, crossing with grad enabled: as state its gradient would be silently lost, and
    smpart cannot tell whether the model differentiates through it.
    """
    if not grad_enabled or _is_carried_type(type(leaf)):
        return
    if any(t.requires_grad for t in _tensors_within(leaf)):
        kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
        raise SmpartError(
            f"{what()} contains a {kind} that holds tensors requiring grad, which smpart cannot carry "
            "across pipeline stages without knowing whether gradients flow through it. If they do, "
            f"register {kind} with torch.utils._pytree.register_pytree_node (its tensors then cross "
            "like any other, gradients included); if it is state the layers update and nobody "
            "differentiates through (a cache), register it with "
            f"smpart.runtime.reference.boundary.register_carried_state({type(leaf).__qualname__})."
        )


#: ``(module, qualified name)`` of classes whose instances and subclasses' instances are carried
#: state, named so that their library need not be imported: Hugging Face's key/value caches.
_CARRIED_CLASS_NAMES: set[tuple[str, str]] = {("transformers.cache_utils", "Cache")}
_carried_kinds: dict[type, bool] = {}  # answers of `_is_carried_type`, per type


def register_carried_state(cls: type) -> type:
    """Declare ``cls`` (and its subclasses) carried state: it crosses stages by reference on threads
    and by copy-in/copy-out on processes, never with gradients. Usable as a class decorator."""
    if not isinstance(cls, type) or issubclass(cls, torch.Tensor | torch.nn.Module):
        raise SmpartError(f"register_carried_state takes a class that is neither a tensor nor a module, "
                          f"got {cls!r}")
    _CARRIED_CLASS_NAMES.add((cls.__module__, cls.__qualname__))
    _carried_kinds.clear()
    return cls


def _is_carried_type(kind: type) -> bool:
    found = _carried_kinds.get(kind)
    if found is None:
        found = _carried_kinds[kind] = any((c.__module__, c.__qualname__) in _CARRIED_CLASS_NAMES
                                           for c in kind.__mro__)
    return found


def is_carried_state(value: Any) -> bool:
    """Whether ``value`` crosses stages as carried state: an instance of a registered type, or an
    opaque object (not a tensor, pytree container or module) that holds tensors."""
    kind = type(value)
    if _is_carried_type(kind):
        return True
    if kind in _TENSOR_TYPES or kind in _SCALARS or value is None or isinstance(value, torch.Tensor):
        return False
    leaves, _ = pytree.tree_flatten(value)
    return len(leaves) == 1 and leaves[0] is value and _holds_tensors(value)


def carried_leaves(value: Any) -> list[Any]:
    """The carried-state objects in ``value``, in `walk` order (the same on both sides of a message):
    a callee copies these back out with its answer, and the caller merges them into its own."""
    found: list[Any] = []
    pytree.tree_map(lambda leaf: found.append(leaf) if is_carried_state(leaf) else None, value,
                    is_leaf=_is_carried_leaf)
    return found


def pack_carried(value: Any) -> Any:
    """``value`` with each carried-state object replaced by its `pack_state` snapshot."""
    return pytree.tree_map(lambda leaf: pack_state(leaf) if is_carried_state(leaf) else leaf, value,
                           is_leaf=_is_carried_leaf)


def unpack_carried(value: Any, device: torch.device | str | None) -> Any:
    """``value`` with each `StateSnapshot` replaced by the object it copies (`unpack_state`)."""
    return pytree.tree_map(lambda leaf: unpack_state(leaf, device) if type(leaf) is StateSnapshot else leaf,
                           value, is_leaf=lambda v: type(v) is StateSnapshot or _is_carried_leaf(v))


def _is_carried_leaf(value: Any) -> bool:
    return _is_carried_type(type(value))


class StateSnapshot:
    """A carried-state object copied for another process: ``payload`` is the object pickled with its
    tensors taken out, ``tensors`` those tensors, detached, in the order the payload names them.

    It is a pytree node whose children are ``tensors``, so a transport that sends message tensors
    apart from a pickled header (NCCL, gloo) moves these with the others.
    """

    __slots__ = ("payload", "tensors")

    def __init__(self, payload: bytes, tensors: list[torch.Tensor]) -> None:
        self.payload = payload
        self.tensors = tensors

    def __reduce__(self):
        return StateSnapshot, (self.payload, self.tensors)

    def __repr__(self) -> str:
        return f"StateSnapshot({len(self.payload)} bytes, {len(self.tensors)} tensors)"


pytree.register_pytree_node(
    StateSnapshot, lambda s: (list(s.tensors), s.payload), lambda tensors, payload: StateSnapshot(payload,
                                                                                                  list(tensors)),
    serialized_type_name="smpart.runtime.reference.boundary.StateSnapshot",
)


class _StatePickler(pickle.Pickler):
    """Pickles an object with its tensors taken out (detached, each once however often it appears)."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, torch.Tensor):
            found = self.index.get(id(obj))
            if found is None:
                found = self.index[id(obj)] = len(self.tensors)
                self.tensors.append(obj.detach())
            return found
        if isinstance(obj, torch.nn.Module):
            raise SmpartError(f"the state object refers to a module ({type(obj).__qualname__}), which lives "
                              "on its own stage and cannot be copied to another process with the state")
        return None


class _StateUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: Sequence[torch.Tensor], device: torch.device | str | None):
        super().__init__(file)
        self.tensors = tensors
        self.device = device
        self.loaded: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: int) -> torch.Tensor:
        tensor = self.loaded.get(pid)
        if tensor is None:
            tensor = self.tensors[pid].detach()
            if self.device is not None:
                tensor = tensor.to(self.device)
            self.loaded[pid] = tensor
        return tensor


def pack_state(leaf: Any) -> StateSnapshot:
    """A picklable snapshot of the carried-state object ``leaf``, for a process that cannot share it.

    Its tensors are detached, not copied (sending copies them); tensors appearing several times are
    taken once and come back as one. The object must pickle once its tensors are out: one holding,
    say, a CUDA stream (an offloading cache) or a module raises `SmpartError`.
    """
    buffer, tensors = io.BytesIO(), []
    try:
        _StatePickler(buffer, tensors).dump(leaf)
    except SmpartError:
        raise
    except Exception as err:
        kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
        raise SmpartError(
            f"cannot copy a {kind} to another pipeline stage's process: {type(err).__name__}: {err}. "
            "State crossing processes is pickled with its tensors taken out; keep it to tensors and plain "
            "Python values (for a Hugging Face cache: no offloading), or pass use_cache=False."
        ) from err
    return StateSnapshot(buffer.getvalue(), tensors)


def unpack_state(snapshot: StateSnapshot, device: torch.device | str | None) -> Any:
    """The object `pack_state` copied, rebuilt with its tensors on ``device`` (None: where they are).

    Its tensors do not require grad: carried state crosses without autograd."""
    return _StateUnpickler(io.BytesIO(snapshot.payload), snapshot.tensors, device).load()


def merge_state(original: Any, returned: Any) -> Any:
    """Update the caller's ``original`` in place from ``returned``, the callee's copy of it, and
    return it: the copy-out half of crossing processes (`unpack_state` the callee's snapshot first).

    Objects, lists and dicts of the same type are merged recursively, so everything that refers to
    ``original`` or to a part of it (a cache's layers) sees the update; tensors and other values
    are replaced by the returned ones (never written in place: a tensor the caller saved for its
    backward must keep its version).
    """
    if type(original) is not type(returned):
        raise SmpartError(f"cannot merge a {type(returned).__qualname__} into a {type(original).__qualname__}"
                          ": the state that came back is not a copy of the one sent")
    return _merge(original, returned, set())


def _merge(original: Any, returned: Any, seen: set[int]) -> Any:
    if type(original) is not type(returned) or isinstance(returned, _REPLACED_TYPES):
        return returned
    if id(returned) in seen:  # a cycle, or a part shared by two owners: merged once already
        return original
    seen.add(id(returned))
    if type(returned) is list:  # by position: a cache's layers grow as stages add theirs
        original[:] = [_merge(o, r, seen) for o, r in zip(original, returned, strict=False)] + \
            returned[len(original):]
        return original
    if type(returned) is dict:
        merged = {k: _merge(original[k], v, seen) if k in original else v for k, v in returned.items()}
        original.clear()
        original.update(merged)
        return original
    attrs, new_attrs = getattr(original, "__dict__", None), getattr(returned, "__dict__", None)
    if type(attrs) is not dict or type(new_attrs) is not dict or _slots(type(returned)):
        return returned  # no plain attribute dict to update in place: take the copy
    merged = {k: _merge(attrs[k], v, seen) if k in attrs else v for k, v in new_attrs.items()}
    attrs.clear()
    attrs.update(merged)
    return original


#: Values `merge_state` replaces rather than updates, and that `_tensors_within` does not look into.
_REPLACED_TYPES = (torch.Tensor, torch.nn.Module, *PLAIN_TYPES)
_OPAQUE_TYPES = (torch.nn.Module, *PLAIN_TYPES)


def _slots(kind: type) -> bool:
    return any("__slots__" in vars(c) and c.__slots__ for c in kind.__mro__[:-1])


def _holds_tensors(obj: Any) -> bool:
    return next(_tensors_within(obj), None) is not None


def _tensors_within(obj: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """The tensors an opaque object holds, looking ``depth`` levels into containers and attributes."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or isinstance(obj, _OPAQUE_TYPES) or callable(obj) and not hasattr(obj, "__dict__"):
        return  # modules are shared by reference and live where the partition put them
    if isinstance(obj, dict):
        children: Any = obj.values()
    elif isinstance(obj, list | tuple | set | frozenset):
        children = obj
    else:
        children = (getattr(obj, "__dict__", None) or {}).values()
    for child in children:
        yield from _tensors_within(child, depth - 1)
