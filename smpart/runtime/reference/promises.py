"""Promised calls: a stage calling another stage's module goes on without waiting for the answer.

With handles (`handles`), the answer to a call between stages is only references: the shape,
dtype and gradient flag of each output, which the callee keeps. A root module on stage 0 that
calls the blocks of stage 1 one by one (``for block in self.h``) still waited for each answer
before making the next call, so stage 1 sat idle for a round trip between its blocks, and under
1F1B that round trip was on the pipeline's critical path once per block and micro-batch.

The trick: the answer of a call is predictable. A module called with arguments of the same
structure, shapes, dtypes and gradient flags (and the same non-tensor arguments and grad and
autocast state) returns outputs of the same structure, shapes and dtypes: micro-batches, and
steps, are the same computation on different data. So once a caller has seen one answer, it keeps it as a
*template* (`template_of`) under the call's `signature`, and the next call with that signature
is *promised*: the caller makes the references itself (`promise`: the callee as owner, a fresh
call id, ``promised=True``), sends the `Request` with the signature it promised, and goes on. The
callee runs the call in its turn as usual, checks its outputs against the promise, holds them, and
sends a bare confirmation (or the error) instead of the answer.

Fewer messages: a frame's promised requests to one stage wait until it next does anything else
(computes, fetches, calls another stage, settles) and go as one `Batch`, and the callee confirms
them with one message when the last is done. A confirmation brings the data of outputs like
those a driver on the caller's rank fetched before (the loss is computed from the last stage's
output): the driver then needs no fetch. A stage computing with an output fetches it at once.

What keeps the semantics of a waited-for call:

- **Nothing escapes unconfirmed.** The job that made promised calls waits for all of their
  confirmations before it answers its own caller (`StageServer._settle`), giving up the stage's
  turn meanwhile. A micro-batch's forward pass is therefore over only once every call of it ran,
  and an error in a promised call reaches the caller's frame, as a `PipelineError` naming where
  it happened, when it settles (or earlier, at the first use of one of the call's outputs).
- **Outputs that do not exist yet are waited for**, never missed: a `Fetch` of a promised
  reference, or a request that passes one back to its owner, can overtake the promised request
  itself (it comes from another rank). The owner keeps such a fetch until the call produced its
  outputs, and a request waits for them before it takes its turn. A stage that receives a
  promised reference held elsewhere fetches it before taking its turn too, so it never waits for
  another stage while holding its own turn.
- **A broken promise fails loudly.** A module whose output shape depends on its data, not on its
  input shapes, makes the callee raise `UnpredictableOutput`; the step fails with it, and the
  caller never promises that module again.
- Only calls whose template holds nothing but references to large tensors (more than
  `handles.SMALL_BYTES`) owned by the callee, and ``None``, are promised: a small output, or a
  Python value, is likely to be looked at (a routing index, a flag), and a Python value cannot
  be predicted. A small output's data comes with its answer; promised, it would cost a fetch,
  and on a chain through several stages (the sleep-kernel pipeline of `bench/`) that made more
  messages than it saved waiting. Calls carrying state (a key/value cache) are never promised.

Templates outlive the step: a promise does not depend on what can change between steps. They
are learned from one step and used from the next (a step that fails teaches nothing): whether a
call is promised never depends on which answer of the step came first, so the tensor-parallel
ranks of a stage, which must give their turns back alike, always decide alike. A
promised output requires grad whenever it may (`promise`), so freezing or unfreezing parameters
breaks nothing; casting the model changes the arguments' dtypes, hence the signatures.
`Config.promised_calls` (default on; ``SMPART_PROMISES=0`` turns the default off) switches the
mechanism; it needs `Config.output_handles`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

from smpart.errors import PipelineError
from smpart.runtime.reference import handles
from smpart.runtime.reference.boundary import Route, walk
from smpart.runtime.reference.handles import HandleRef

_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, type(None))


class UnpredictableOutput(PipelineError):
    """A promised call's outputs differ from the outputs of an earlier call with the same signature."""


#: Templates a stage keeps (calls with that many signatures, such as every sequence length of a
#: long run, forget the oldest).
MAX_TEMPLATES = 4096


class Templates(OrderedDict):
    """Templates by call signature, the oldest forgotten past `MAX_TEMPLATES`."""

    def __setitem__(self, key: Hashable, value: Template | None) -> None:
        super().__setitem__(key, value)
        if len(self) > MAX_TEMPLATES:
            self.popitem(last=False)


class Template:
    """What a caller learned from one answer: the output with its references, and their signature."""

    __slots__ = ("output", "expected")

    def __init__(self, output: Any, expected: Hashable) -> None:
        self.output = output
        self.expected = expected


def signature(value: Any, grad_enabled: bool | None = None) -> Hashable | None:
    """What determines a call's output structure: ``value`` with every tensor (or handle, or
    reference) replaced by its shape, dtype and whether it requires grad, plain values kept; None
    if it holds anything else (an object whose effect cannot be told from its type).

    With ``grad_enabled`` given (an output's signature), a tensor's flag is whether it *may*
    require grad: grad enabled and a floating-point or complex dtype (see `promise`)."""
    kind = type(value)
    if kind is HandleRef or isinstance(value, torch.Tensor):
        flag = value.requires_grad if grad_enabled is None else grad_enabled and _differentiable(value.dtype)
        return ("T", tuple(value.shape), value.dtype, flag)
    if kind is tuple or kind is list:
        items = tuple(signature(v, grad_enabled) for v in value)
        return None if None in items else (kind.__name__, items)
    if kind is dict:
        items = tuple((k, signature(v, grad_enabled)) for k, v in value.items())
        return None if any(s is None for _, s in items) else ("dict", items)
    if value is None:
        return ("None",)
    if kind in _PLAIN:
        return ("V", kind.__name__, value)
    return None


def template_of(output: Any, callee: Any, grad_enabled: bool) -> Template | None:
    """The template an answer makes (``output`` as it came, with references), or None if calls
    like it must not be promised (see the module docstring)."""
    def promisable(value: Any) -> bool:
        kind = type(value)
        if kind is HandleRef:
            return value.owner == callee and value.data is None
        if kind is tuple or kind is list:
            return all(promisable(v) for v in value)
        if kind is dict:
            return all(promisable(v) for v in value.values())
        return value is None

    if not promisable(output) or not _has_refs(output):
        return None
    expected = signature(output, grad_enabled)
    return None if expected is None else Template(output, expected)


def promise(template: Template, callee: Any, step: int, microbatch: int, call_id: Any,
            grad_enabled: bool) -> Any:
    """The references a promised call answers with: the template's, for call ``call_id``.

    Each requires grad if it may (grad enabled, a floating-point dtype), whatever the template's
    did: a parameter frozen or unfrozen between steps changes that flag and nothing else. An output
    that turns out not to require grad only gets a gradient its owner ignores; promising "no
    gradient" for one that needs it would cut the backward pass."""
    def fresh(ref: Any) -> Any:
        if type(ref) is not HandleRef:
            return ref
        route = Route(callee, call_id, ref.index, True)
        return HandleRef(callee, step, microbatch, call_id, ref.index, ref.shape, ref.dtype,
                         grad_enabled and _differentiable(ref.dtype), route, None, promised=True)

    return handles._map_leaves(template.output, fresh)


def check(output: Any, grad_enabled: bool, expected: Hashable, module: str, stage: int, microbatch: int,
          rank: int | None) -> None:
    """Raise `UnpredictableOutput` unless ``output`` (a promised call's, about to be held) is what
    the caller promised."""
    actual = signature(output, grad_enabled) if not references(output) else ("another stage's tensor",)
    if actual != expected:
        raise UnpredictableOutput(
            f"module {module!r} on stage {stage} returned outputs {_describe(actual)} for micro-batch "
            f"{microbatch}, where an earlier call with arguments of the same shapes returned "
            f"{_describe(expected)}. The caller had gone on without waiting for the answer (a promised "
            "call): its output shapes depend on its data. This step fails; later steps wait for this "
            "module's answers. Config(promised_calls=False) (SMPART_PROMISES=0) turns promises off",
            stage=stage, module=module, microbatch=microbatch, rank=rank)


def keep_forwarded(output: Any, kept: list | None, forwarded: dict[int, Route]) -> list:
    """The callee of a promised call keeps the output tensors it passed on unchanged, whose
    gradients it would otherwise have routed past itself: the caller made every route lead here."""
    tensors: list[torch.Tensor] = []
    walk(output, lambda t: tensors.append(t) or t)
    kept = list(kept) if kept is not None else [None] * len(tensors)
    for index in forwarded:
        kept[index] = tensors[index]
    return kept


def references(value: Any) -> list[HandleRef]:
    """The references in a request's arguments."""
    found: list[HandleRef] = []

    def visit(v: Any) -> Any:
        if type(v) is HandleRef:
            found.append(v)
        return v

    handles._map_leaves(value, visit)
    return found


def waits_on(request: Any, address: Any) -> bool:
    """Whether ``request`` (a promised call) is passed promised outputs, all held at ``address``:
    it waits for earlier calls of that stage only (the scheduler reserves its place there)."""
    if not request.refs:
        return False
    owners = {ref.owner for ref in references((request.args, request.kwargs)) if ref.promised}
    return owners == {address}


def handles_in(value: Any) -> dict[int, handles.Handle]:
    """The handles a promised call's resolved output holds, by tensor index."""
    found: dict[int, handles.Handle] = {}

    def visit(v: Any) -> Any:
        if type(v) is handles.Handle:
            found[v._ref.index] = v
        return v

    handles._map_leaves(value, visit)
    return found


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _has_refs(value: Any) -> bool:
    return bool(references(value))


def _describe(sig: Any) -> str:
    """A signature as a short list of shapes."""
    shapes: list[str] = []

    def visit(s: Any) -> None:
        if isinstance(s, tuple) and s and s[0] == "T":
            shapes.append(f"{list(s[1])} {str(s[2]).removeprefix('torch.')}")
        elif isinstance(s, tuple) and s and s[0] in ("tuple", "list"):
            for item in s[1]:
                visit(item)
        elif isinstance(s, tuple) and s and s[0] == "dict":
            for _, item in s[1]:
                visit(item)

    visit(sig)
    return "[" + ", ".join(shapes) + "]" if shapes else repr(sig)
