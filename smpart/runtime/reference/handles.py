"""Handles: an output stays on the stage that made it until a stage computes with it.

A root module on stage 0 that calls the blocks of stage 1 one by one (``for block in self.h``)
would otherwise bounce every activation 0 -> 1 -> 0 -> 1: each block's output travels back to the
caller, which sends it straight out again as the next block's argument. With handles, a stage
answering another stage's call *holds* the tensors of its output (per micro-batch, keyed by the
call and the tensor's number) and answers with a `HandleRef` for each: plain, picklable data (the
owner's address, the key, shape, dtype, whether it requires grad, where its gradient goes).

On the receiving side a reference becomes:

- on its owner (the caller passed it back, as the root passes block ``i``'s output to block
  ``i + 1``): the held tensor itself, so consecutive calls on the owner chain in one autograd
  graph and nothing crosses;
- anywhere else: a `Handle`, a tensor subclass with the reference's shape, dtype and device and
  no data. ``.shape``, ``.size()``, ``.dim()``, ``len()``, ``.dtype``, ``.device``,
  ``.requires_grad`` are answered from it; the first other torch operation that touches it
  *materialises* it: the endpoint of the current thread sends a `Fetch` to the owner, whose
  dispatcher answers at once (no turn needed: the tensor exists) with a `Response`, and the data
  arrives exactly as a call's output does (`boundary.arrive`: a detached tensor behind an `_Arrive`
  node that posts its gradient to the owner, which kept it for the backward as before).

A handle passed on in a call's arguments or output travels as its reference again, so a third
stage fetches from the owner directly, never through the caller; one materialised and since
modified in place travels as its (modified) data, so correctness never depends on the owner's
copy. A driver (the user's step body) asks for data, not handles, and materialises the handles
of foreign owners in its answers at once: the loss is computed from real tensors.

A small output (at most `SMALL_BYTES`) is held all the same, but its reference also carries its
data: materialising it then needs no fetch. Its bytes cross once, whether used or not; a round
trip to the owner would cost far more than they do (a loss, a routing index, a tiny activation).

Nothing waits for a handle's gradient: the end of a backward pass is detected by credit
(`messages`), and an output consumed on its owner, or never used, sends no message at all. The
owner drops what it holds when the micro-batch is released.

A handle can also be an input of the graph itself: ``Function.apply`` (a custom autograd
function, a tensor-parallel layer's collective) takes its tensors as they are, so autograd sends
that input's gradient to the handle, not through its data's `_Arrive` node. A hook on the handle
posts that gradient to the owner too (`_posting`).

`Config.output_handles` (default on; ``SMPART_HANDLES=0`` turns the default off) switches the whole
mechanism: off, every output crosses as data, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from smpart.errors import SmpartError
from smpart.runtime.reference import boundary
from smpart.runtime.reference.boundary import GradPost, Route
from smpart.runtime.reference.calls import current_frame

#: An output tensor of at most this many bytes travels with its handle (see the module docstring).
SMALL_BYTES = 1024


class HandleRef:
    """Names tensor ``index`` of the output of call ``call_id``, held by ``owner`` (an address)
    for ``microbatch`` of ``step``; ``route`` is where a fetched copy posts its gradient; ``data``:
    the tensor's data (detached) when it is small, else None."""

    __slots__ = ("owner", "step", "microbatch", "call_id", "index", "shape", "dtype", "requires_grad",
                 "route", "data")

    def __init__(self, owner: Any, step: int, microbatch: int, call_id: Any, index: int, shape: tuple,
                 dtype: torch.dtype, requires_grad: bool, route: Route,
                 data: torch.Tensor | None = None) -> None:
        self.owner = owner
        self.step = step
        self.microbatch = microbatch
        self.call_id = call_id
        self.index = index
        self.shape = shape
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.route = route
        self.data = data

    def without_data(self) -> HandleRef:
        """This reference without a small tensor's data (going back to its owner, which holds it)."""
        if self.data is None:
            return self
        return HandleRef(self.owner, self.step, self.microbatch, self.call_id, self.index, self.shape,
                         self.dtype, self.requires_grad, self.route, None)

    @property
    def key(self) -> tuple[Any, int]:
        return (self.call_id, self.index)

    def __reduce__(self) -> tuple:
        return (HandleRef, (self.owner, self.step, self.microbatch, self.call_id, self.index, self.shape,
                            self.dtype, self.requires_grad, self.route, self.data))

    def __repr__(self) -> str:
        return (f"HandleRef(owner={self.owner}, mb={self.microbatch}, call={self.call_id}, "
                f"index={self.index}, shape={list(self.shape)}, {self.dtype})")


boundary._SCALARS.add(HandleRef)  # walked past like a number: it holds no tensor

_T = torch.Tensor
#: Questions a handle answers from its metadata, without fetching its data.
_METADATA = frozenset({
    _T.shape.__get__, _T.size, _T.dim, _T.ndimension, _T.ndim.__get__, _T.dtype.__get__,  # type: ignore[attr-defined]
    _T.device.__get__, _T.__len__, _T.requires_grad.__get__, _T.numel, _T.nelement,  # type: ignore[attr-defined]
    _T.element_size, _T.is_floating_point, _T.is_complex, _T.__hash__, _T.layout.__get__,  # type: ignore[attr-defined]
    _T.is_cuda.__get__, _T.is_sparse.__get__, _T.is_quantized.__get__, _T.is_meta.__get__,  # type: ignore[attr-defined]
})


class Handle(torch.Tensor):
    """A tensor held by another stage: metadata here, data fetched at the first operation on it."""

    _ref: HandleRef
    _value: torch.Tensor | None
    _seen: int | None
    _used: bool
    _lock: threading.Lock

    @staticmethod
    def __new__(cls, ref: HandleRef, device: torch.device | str, post: GradPost | None = None) -> Handle:
        handle = torch.Tensor._make_wrapper_subclass(cls, ref.shape, dtype=ref.dtype, device=device,
                                                     requires_grad=ref.requires_grad)
        handle._ref = ref
        handle._value = None
        handle._seen = 0
        handle._used = False
        handle._lock = threading.Lock()
        if ref.requires_grad and post is not None:
            with torch._C.DisableTorchFunctionSubclass():  # not a use of the data: no fetch
                handle.register_hook(_posting(ref.route, post))
        return handle

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is _T.__repr__ and type(args[0]) is Handle and args[0]._value is None:
            return f"Handle({args[0]._ref!r})"
        args, kwargs = materialise_all((args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only by code that skips ``__torch_function__``: use the data all the same.
        args, kwargs = materialise_all((args, kwargs or {}))
        return func(*args, **kwargs)

    def value(self) -> torch.Tensor:
        """The data (fetched from the owner the first time)."""
        if not self._used:
            with self._lock:
                if not self._used:
                    frame = current_frame()
                    if frame is None:
                        raise SmpartError(
                            f"a tensor held by stage {self._ref.owner} (micro-batch {self._ref.microbatch}) "
                            "was used outside the step that made it; keep tensors a step returns, not "
                            "ones stored away inside modules")
                    value = frame.endpoint.fetch(frame, self._ref)
                    self._seen = _version(value)
                    self._value = value
                    self._used = True
        return self._value  # type: ignore[return-value]

    def departing(self, materialised_as_data: bool, to: Any = None) -> Any:
        """What crosses when this handle is sent on (to address ``to``): its reference, or the data
        it was materialised to if that was modified in place since (or, ``materialised_as_data``, if
        it is here at all). A small tensor's data does not go back to its owner."""
        value = self._value
        version = None if value is None else _version(value)
        if value is not None and (materialised_as_data or version is None or version != self._seen):
            return value
        return self._ref.without_data() if self._ref.owner == to else self._ref


def _posting(route: Route, post: GradPost) -> Callable[[torch.Tensor], None]:
    """The hook of a handle that is itself an input of the graph: ``Function.apply`` (a custom
    autograd function, a tensor-parallel layer's collective) takes its inputs as they are, without
    ``__torch_function__``, so autograd sends that input's gradient to the handle, not through the
    `_Arrive` node of its fetched data. The hook posts it to the owner like that node would (a
    handle used both ways posts twice, and the owner adds the two up)."""
    target = (route.address, route.call_id, route.to_outputs)

    def hook(grad: torch.Tensor) -> None:
        post(target, {route.index: grad})

    return hook


def materialise_all(value: Any) -> Any:
    """``value`` with every `Handle` in it replaced by its data (every torch operation on a handle
    comes here: plain tuples, lists and dicts are walked directly, the rest by pytree)."""
    kind = type(value)
    if kind is Handle:
        return value.value()
    if kind is tuple or kind is list:
        return kind(materialise_all(v) for v in value)
    if kind is dict:
        return {k: materialise_all(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor | int | float | str | type(None)):
        return value
    return pytree.tree_map(lambda v: v.value() if type(v) is Handle else v, value)


def departing(value: Any, materialised_as_data: bool = False, to: Any = None) -> tuple[Any, bool]:
    """``value`` as it crosses: every `Handle` replaced by what `Handle.departing` says, and
    whether any reference is left in it (the receiver then resolves them)."""
    found = False

    def visit(tensor: torch.Tensor) -> Any:
        nonlocal found
        if type(tensor) is not Handle:
            return tensor
        out = tensor.departing(materialised_as_data, to)
        found = found or type(out) is HandleRef
        return out

    out = boundary.walk(value, visit)
    return out, found


def hold(value: Any, owner: Any, step: int, microbatch: int, call_id: Any, held: dict,
         needs_grad: tuple[int, ...], forwarded: dict[int, Route]) -> Any:
    """``value`` (an output about to cross) with each tensor put in ``held`` and replaced by its
    reference; tensors are numbered as `boundary.depart` numbers them."""
    wanted = set(needs_grad)
    index = 0

    def visit(tensor: torch.Tensor) -> HandleRef:
        nonlocal index
        i = index
        index += 1
        held[(call_id, i)] = tensor
        route = forwarded.get(i) or Route(owner, call_id, i, True)
        small = tensor.numel() * tensor.element_size() <= SMALL_BYTES
        return HandleRef(owner, step, microbatch, call_id, i, tuple(tensor.shape), tensor.dtype, i in wanted,
                         route, tensor.detach() if small else None)

    return boundary.walk(value, visit)


def resolve(value: Any, here: Callable[[HandleRef], Any], elsewhere: Callable[[HandleRef], Any],
            owner: Any) -> Any:
    """``value`` with each reference replaced: ``here(ref)`` for those ``owner`` holds, else
    ``elsewhere(ref)``."""
    def swap(v: Any) -> Any:
        return (here(v) if v.owner == owner else elsewhere(v)) if type(v) is HandleRef else v

    return _map_leaves(value, swap)


def _map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to every leaf: plain tuples, lists and dicts walked directly
    (pytree's generic flatten is slow), other containers through pytree."""
    kind = type(value)
    if kind is tuple:
        return tuple([_map_leaves(v, fn) for v in value])
    if kind is list:
        return [_map_leaves(v, fn) for v in value]
    if kind is dict:
        return {k: _map_leaves(v, fn) for k, v in value.items()}
    if kind is HandleRef or value is None or isinstance(value, torch.Tensor) or boundary.is_plain(kind):
        return fn(value)
    return pytree.tree_map(fn, value)


def arrive_fetched(tensor: torch.Tensor, ref: HandleRef, device: torch.device | None,
                   post: GradPost) -> torch.Tensor:
    """A fetched (or locally held) tensor as it arrives: detached behind an `_Arrive` node posting
    its gradient along ``ref.route``, as a call's output arrives (``ref`` not requiring grad: only
    detached)."""
    if not ref.requires_grad:
        return boundary.arrive(tensor, device, None, post)
    if not tensor.requires_grad:  # it crossed a process boundary (tensors arrive as leaves)
        tensor = tensor.detach().requires_grad_(True)
    with torch.enable_grad():  # as when the call that made it ran, whatever the mode here now
        return boundary.arrive(tensor, device, lambda _: ref.route, post)


def describe_missing(ref: HandleRef, stage: int) -> str:
    return (f"stage {stage} no longer holds output {ref.index} of call {ref.call_id} (micro-batch "
            f"{ref.microbatch}, step {ref.step}): a tensor was used after its micro-batch was released")


def _version(tensor: torch.Tensor) -> int | None:
    """``tensor``'s count of in-place changes; None for an inference tensor (made under
    ``torch.inference_mode``), which keeps none: it counts as changed, so its data travels."""
    return None if tensor.is_inference() else tensor._version
