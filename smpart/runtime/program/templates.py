"""What a whole module's call returns, recorded by the reference step, replayed as placeholders.

A rank that does not hold a whole module still runs the glue that calls it, so the call must
return something right away: what the same call returned in the recording step, a *template*
(the output's structure, each tensor's shape, dtype and whether it requires grad, and its plain
values). The key is the call's *signature*: the module, and the shapes and dtypes of its tensor
arguments with their plain values, so a step on a batch of another shape finds no template and
records one (`guards`).

`Recorder` watches the reference step: every call of a whole module made from the glue (the
body, or a module the partition split) is a *boundary call*; the rank running it records its
template. A call whose micro-batches disagree (a shape that depends on the data) is marked
unpredictable, and a program never predicts its output.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from smpart.errors import SmpartError
from smpart.runtime.ambient import ambient_key
from smpart.runtime.program.placeholder import Placeholder
from smpart.runtime.reference import boundary

#: A template of a call whose output changed between micro-batches: never replayed.
UNPREDICTABLE = "unpredictable"


class Diverged(SmpartError):
    """This rank's glue did something else than the recorded program (or than the others);
    ``rerecord``: a reference step recording anew may give it a program (a call not seen yet)."""

    def __init__(self, why: str, rerecord: bool = False) -> None:
        super().__init__(why)
        self.rerecord = rerecord

    def __reduce__(self) -> tuple:
        return (Diverged, (str(self), self.rerecord))


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool
    stride: tuple


class Opaque:
    """An output leaf a template cannot rebuild (an object that is neither a tensor nor plain)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.kind == self.kind

    def __hash__(self) -> int:
        return hash(self.kind)


class OutputTemplate:
    """A recorded output: its pytree structure and, per leaf, a `TensorMeta` or its plain value."""

    def __init__(self, spec: Any, leaves: list[Any]) -> None:
        self.spec = spec
        self.leaves = leaves
        self.opaque = next((leaf.kind for leaf in leaves if isinstance(leaf, Opaque)), None)
        self.single = len(leaves) == 1 and spec.is_leaf()
        self.tensor_positions = [i for i, m in enumerate(leaves) if type(m) is TensorMeta]

    @classmethod
    def of(cls, output: Any) -> OutputTemplate:
        leaves, spec = pytree.tree_flatten(output)
        return cls(spec, [_leaf_template(leaf) for leaf in leaves])

    def placeholders(self, avail: int, pos: int, run: Any, device: torch.device, node: Any = None,
                     own: Any = None) -> Any:
        """The outputs as placeholders held by ``avail`` (made at transfer count ``pos``, the outputs
        of lazy ``node`` if given); ``own``: a value of the same structure whose leaves stand in for
        those a template cannot rebuild (a rank's own step arguments)."""
        fill = None
        if own is not None:  # this rank's own value of the same structure fills the opaque leaves
            fill, spec = pytree.tree_flatten(own)
            if spec != self.spec:
                raise Diverged("this rank's step arguments are not structured as the first stage's rank's")
        elif self.opaque is not None:
            raise Diverged(
                f"a module's output holds a {self.opaque}, which a step program cannot stand in "
                "for on the ranks that do not hold the module"
            )
        leaves = []
        for i, m in enumerate(self.leaves):
            if type(m) is Opaque and fill is not None:
                m = fill[i]
            elif type(m) is TensorMeta:
                index = len(node.outputs) if node is not None else 0
                m = Placeholder(m.shape, m.dtype, device, m.requires_grad, avail, pos, run, m.stride, node,
                                index)
                if node is not None:
                    node.outputs.append(m)
            leaves.append(m)
        if self.single:  # one tensor, the most common output: no pytree to rebuild
            return leaves[0]
        return pytree.tree_unflatten(leaves, self.spec)

    def refill(self, kept: list[Placeholder], avail: int, pos: int, run: Any, node: Any = None) -> Any:
        """The outputs again, as the placeholders ``kept`` from `placeholders` on an earlier step,
        their state that of a new one: making a tensor subclass costs ~5 us, resetting it ~1."""
        for m in kept:
            m._avail, m._pos, m._run, m._value = avail, pos, run, None
            if node is not None:
                m._node, m._index = node, len(node.outputs)
                node.outputs.append(m)
            else:
                m._node, m._index = None, 0
        if self.single:
            return kept[0]
        leaves = list(self.leaves)
        for i, m in zip(self.tensor_positions, kept, strict=True):
            leaves[i] = m
        return pytree.tree_unflatten(leaves, self.spec)

    def matches(self, output: Any) -> bool:
        if self.single and isinstance(output, torch.Tensor):
            m = self.leaves[0]
            return (type(m) is TensorMeta and tuple(output.shape) == m.shape and output.dtype == m.dtype
                    and output.requires_grad == m.requires_grad)
        leaves, spec = pytree.tree_flatten(output)
        return spec == self.spec and [_leaf_template(leaf) for leaf in leaves] == self.leaves

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutputTemplate) and other.spec == self.spec and other.leaves == self.leaves

    def __hash__(self) -> int:
        return hash(tuple(map(repr, self.leaves)))

    def __reduce__(self) -> tuple:
        return (_rebuild, (spec_state(self.spec), self.leaves))


def _rebuild(spec: Any, leaves: list[Any]) -> OutputTemplate:
    return OutputTemplate(spec_from_state(spec), leaves)


_LEAF = pytree.treespec_leaf() if hasattr(pytree, "treespec_leaf") else pytree.LeafSpec()


def spec_state(spec: pytree.TreeSpec) -> Any:
    """A pytree spec as plain nested tuples ``(type, context, children)``, a leaf as None, for
    pickling: torch's own serialised form (``treespec_dumps``) refuses a namedtuple that was not
    registered by name and costs ~4x as much, and an unpickled spec object warns on every use
    (torch's deprecated ``LeafSpec`` check). The node types travel by reference, as pickle does."""
    if spec.is_leaf():
        return None
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return (spec.type, spec.context, [spec_state(child) for child in children])


def spec_from_state(state: Any) -> pytree.TreeSpec:
    if state is None:
        return _LEAF
    kind, context, children = state
    return pytree.TreeSpec(kind, context, [spec_from_state(child) for child in children])


def _leaf_template(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return TensorMeta(tuple(leaf.shape), leaf.dtype, leaf.requires_grad, tuple(leaf.stride()))
    if leaf is None or boundary.is_plain(type(leaf)):
        return leaf
    return Opaque(type(leaf).__qualname__)


def call_key(model: int, name: str, args: tuple, kwargs: dict) -> tuple:
    """What a call's template is kept under: the module, its arguments' signature, and the grad
    mode and autocast it runs under (an output requires grad, or comes out in bfloat16, by them)."""
    return (model, name, _arguments(args, kwargs), ambient_key())


def _arguments(args: tuple, kwargs: dict) -> tuple:
    """``signature((args, kwargs))``, without its two recursive calls when there are no keywords:
    every module call of a step program asks, on the rank running it and on the others."""
    if kwargs:
        return signature((args, kwargs))
    return ("tuple", _sequence(args), _NO_KEYWORDS)


_NO_KEYWORDS = ("dict",)


_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def _sequence(value: tuple | list) -> tuple:
    """`signature` of a tuple or list: its tensors and placeholders read in this loop."""
    out: list[Any] = [type(value).__name__]
    for v in value:
        kind = type(v)
        if kind is Placeholder:
            out.append(v._sig)
        elif kind in _PLAIN_TENSORS:
            out.append(("T", tuple(v.shape), v.dtype, v.requires_grad))
        else:
            out.append(signature(v))
    return tuple(out)


def signature(value: Any) -> tuple:
    """A call's arguments as a hashable key: tensors by shape, dtype and requires_grad, plain values
    as they are, any other object by its type. A sequence's tensors and placeholders are read in
    its loop: every call of a step program asks, mostly of a few tensors."""
    kind = type(value)
    if kind is tuple or kind is list:
        return _sequence(value)
    if kind is dict:
        return ("dict", *[(k, signature(v)) for k, v in value.items()])
    if kind is Placeholder:
        return value._sig
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.requires_grad)
    if value is None or boundary.is_plain(kind):
        return (kind.__name__, value) if kind is not torch.device else ("device", value.type)
    if kind is slice:
        return ("slice", value.start, value.stop, value.step)
    leaves, spec = pytree.tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        return ("obj", kind.__qualname__)
    return (kind.__qualname__, *[signature(leaf) for leaf in leaves])


#: (model id, module name) -> rank, for the modules placed whole, of every model placed in this
#: process (`note_placed`).
WHOLE: dict[tuple[int, str], int] = {}


def note_placed(whole: dict[tuple[int, str], int]) -> None:
    WHOLE.update(whole)


def forget(model_id: int) -> None:
    for key in [key for key in WHOLE if key[0] == model_id]:
        del WHOLE[key]


class Recorder:
    """The templates of the boundary calls a reference step makes on this rank (every stage, on
    threads). A module placed whole that turns out to call a module of another stage (one it
    holds in a plain attribute, outside its subtree) is not whole after all: ``crossing`` demotes
    it (its calls then run as glue, and the calls it makes are the boundary calls)."""

    def __init__(self) -> None:
        self.templates: dict[tuple, Any] = {}
        #: (model, module) -> micro-batch -> the signatures of its calls, in order.
        self.calls: dict[tuple[int, str], dict[int, list]] = {}
        self._inside = threading.local()  # the boundary call running on this thread: its key
        self._lock = threading.Lock()

    def enter(self, model: int, name: str) -> bool:
        """A module starts running on this thread; True if it is a boundary call to record (a whole
        module, not inside another): then `leave` must follow."""
        if getattr(self._inside, "key", None) is not None or (model, name) not in WHOLE:
            return False
        self._inside.key = (model, name)
        return True

    def leave(self) -> None:
        self._inside.key = None

    def crossing(self) -> None:
        """The module running on this thread calls another stage: the whole module it runs inside
        is not whole."""
        key = getattr(self._inside, "key", None)
        if key is not None:
            WHOLE.pop(key, None)
            with self._lock:
                self.templates[("demoted", *key)] = DEMOTED

    def record(
        self, model: int, name: str, args: tuple, kwargs: dict, output: Any, microbatch: int = 0
    ) -> None:
        key = call_key(model, name, args, kwargs)
        template = OutputTemplate.of(output)
        with self._lock:
            self.calls.setdefault((model, name), {}).setdefault(microbatch, []).append(key[2])
            known = self.templates.get(key)
            if known is None:
                self.templates[key] = template
            elif known != UNPREDICTABLE and known != template:
                self.templates[key] = UNPREDICTABLE

    def recorded(self) -> dict[tuple, Any]:
        """The templates, with a ``("varies", model, name)`` entry for each module whose calls'
        shapes differed between micro-batches (their inputs depend on the data)."""
        out = dict(self.templates)
        for (model, name), by_microbatch in self.calls.items():
            if len({tuple(sigs) for sigs in by_microbatch.values()}) > 1:
                out[("varies", model, name)] = VARIES
        return out


#: The value of a ``("demoted", model id, name)`` entry in a recorder's templates.
DEMOTED = "demoted"
#: The value of a ``("varies", model id, name)`` entry.
VARIES = "varies"


#: The recorder of the reference step running now, if it records (`start_recording`); a module
#: call reads it at every call, so it is a plain module attribute.
recorder: Recorder | None = None


def recording() -> Recorder | None:
    """The recorder of the reference step running now, if it records."""
    return recorder


def start_recording(active: Recorder | None) -> None:
    global recorder
    recorder = active
