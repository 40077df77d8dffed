"""Every rank runs the step body: the glue, with placeholders for what other ranks hold.

Under a step program the step body, and the forward of every module the partition split across
ranks (a root calling its blocks, a block whose attention sits on another stage), run on *every*
rank of the pipeline, as the rest of a ``torchrun`` script does. Only the code between module
calls runs that way (the *glue*); a module the partition placed whole on one rank (a *whole*
module) runs only there, and on every other rank its call returns at once, with placeholders for
its outputs (`placeholder`), shaped as the recording step saw them (`templates`).

What makes it work is that every rank follows the same glue in the same order, and so takes the
same decisions from the same rules, without asking anyone:

- every tensor the glue sees has a set of ranks that hold it (``avail``): the step's inputs (every
  rank on threads; the first rank on processes), a parameter's stage, a whole module's rank, and
  for the glue's own results the ranks holding all their inputs (computed there for real; elsewhere
  a placeholder, whose shape a meta-device run tells);
- when a whole module is called with a tensor its rank does not hold, or the glue needs a value in
  Python (``if mask.any():``, ``.item()``), that is a *transfer*: the lowest rank holding it sends it,
  the rank needing it receives it, every other rank only notes that one more rank holds it.
  Transfers are numbered in the order the glue makes them (``k``), so sender and receiver agree
  on what each one is, and a rank sends a value to another rank at most once per micro-batch;
- a placeholder made by glue from tensors held apart (``loss = f(logits, labels)``) is evaluated
  where it is needed, on the rank holding most of its inputs' bytes: the loss of an LM is computed
  where the logits are, and only the labels travel.

The backward pass follows the same numbering. A rank keeps each tensor it sent that requires grad
(a *root*), and gives each one it received an autograd node that collects its gradient (a *leaf*).
The loss's owner runs its backward at ``model.backward(loss)``; every other root runs when its
gradient comes back. Roots run latest first, and a leaf's gradient goes back to its sender once
no root made after it is left (a tensor can only depend on what arrived before it was made), so
every gradient crosses once, whole, and each rank's graph is walked once per root.

A rank that meets something else than the recorded program (another module, a transfer the
others do not make) raises `Diverged` before it sends or waits: the step then runs on the
reference runtime (`guards`).

The file is long (950 lines) because `MicrobatchRun` is one state machine over one micro-batch's
body (avail sets, transfers, roots and leaves, the placeholder evaluation): split, its rules
would be read in pieces that only make sense together. Every glue operation and module call of
every rank runs through it, so its hot paths are written for the interpreter (one loop over the
operands, kinds of operation looked up once per function): `bench/host_overhead.py --bytecodes`
counts what they cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from smpart.errors import SmpartError
from smpart.runtime.ambient import ambient_key
from smpart.runtime.placement.place import changed_buffer
from smpart.runtime.program.placeholder import METADATA, LazyNode, Placeholder, holders, lowest, meta_of
from smpart.runtime.program.templates import UNPREDICTABLE, Diverged, OutputTemplate, call_key
from smpart.runtime.reference import boundary
from smpart.runtime.reference.calls import Frame, as_pipeline_error, running
from smpart.tensor_parallel import streams

_AT = "_smpart_at"  # a tensor this rank made inside a micro-batch: (avail, pos, run)
_T = torch.Tensor

#: Operations whose result Python needs: the value must be on every rank.
NEEDS = frozenset(
    {
        _T.__bool__,
        _T.item,
        _T.tolist,
        _T.__int__,
        _T.__float__,
        _T.__index__,
        _T.__complex__,
        _T.numpy,
        _T.__array__,
        _T.__format__,
        _T.__repr__,
        _T.__str__,
        _T.data_ptr,
        _T.__reduce_ex__,
        _T.__deepcopy__,
        torch.equal,
        torch.allclose,
        torch.is_nonzero,
        _T.__iter__,
        _T.__contains__,
        _T.untyped_storage,
    }
)
#: Operations that read no data of their tensor argument, only its shape and dtype.
SHAPE_ONLY = frozenset(
    {
        torch.zeros_like,
        torch.ones_like,
        torch.empty_like,
        torch.full_like,
        _T.new_zeros,
        _T.new_ones,
        _T.new_empty,
        _T.new_full,
    }
)


#: Operations that draw random numbers: one rank draws (the reference runtime's driver, or the
#: lowest rank holding the inputs), the others hold placeholders: a copy per rank would differ.
RANDOM = frozenset({
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.normal, torch.bernoulli, _T.bernoulli, torch.multinomial, _T.multinomial,
    torch.poisson, torch.dropout, torch.nn.functional.dropout, torch.nn.functional.dropout1d,
    torch.nn.functional.dropout2d, torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout,
    torch.nn.functional.feature_alpha_dropout,
})

_GRAD = _T.grad.__get__  # type: ignore[attr-defined]


class GlueMode(TorchFunctionMode):
    """Routes the glue's torch operations of the micro-batch running on this thread (``run``)."""

    def __init__(self) -> None:
        super().__init__()
        self.run: MicrobatchRun | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        run = self.run
        if func in METADATA or run is None:
            return func(*args, **kwargs)
        if func == _GRAD:
            run.reading_gradients()
            return func(*args, **kwargs)
        return run.operate(func, args, kwargs)


class BodyDone(BaseException):  # noqa: N818 - not an error: a body ending early, as GreenletExit
    """Raised at the glue's next event once a rank has done all it takes part in of a micro-batch
    (`actions.stop_points`): the rest of the body runs only on the ranks that still have work in it.
    A BaseException, so that a body's ``except Exception`` does not take it for its own."""


class Root:
    """A tensor this rank sent that requires grad: its gradient comes back as transfer ``k``'s."""

    __slots__ = ("pos", "tensor", "k", "to")

    def __init__(self, pos: int, tensor: torch.Tensor, k: int, to: int) -> None:
        self.pos, self.tensor, self.k, self.to = pos, tensor, k, to


class Leaf:
    """A tensor this rank received that requires grad: its gradient, summed, goes back to ``src``."""

    __slots__ = ("src", "grad", "sent")

    def __init__(self, src: int) -> None:
        self.src = src
        self.grad: torch.Tensor | None = None
        self.sent = False

    def add(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad


class MicrobatchRun:
    """One micro-batch of one step on one rank: the glue's bookkeeping, its transfers, its roots
    and leaves. It is the endpoint of the `Frame` the body runs under (``frame.glue``)."""

    def __init__(self, rank: Any, microbatch: int, step: int, expected: list | None,
                 stop: int | None = None) -> None:
        self.rank = rank  # the `executor.RankRun` of this rank
        self.me = rank.me
        self.stage = rank.stage
        self.microbatch = microbatch
        self.step = step
        self.count = 0  # transfers made so far in this micro-batch
        self.sites = 0  # places in the glue that made placeholders so far (`_placeholders`)
        self.roots: list[Root] = []
        self.leaves: dict[int, Leaf] = {}
        self.outbox: dict[int, list] = {}
        self.expected = expected
        self.stop = stop  # after this many events the body has nothing left to do on this rank
        self.stopped = False
        self.events: list[tuple] = []
        self.cursor = 0
        self.structure: list[tuple] = []  # what this rank did: recv / send / compute / loss, in order
        self.loss_done = False
        self.results: Any = None
        self.provided: dict[int, torch.Tensor] = {}
        self.result_spec: Any = None
        self.frame = Frame(self, step, microbatch, claim=True, glue=True)
        self.inline = Frame(self, step, microbatch, claim=True)

    # ================================================================ where a tensor is
    def avail(self, t: torch.Tensor) -> int:
        if type(t) is Placeholder:
            return t._avail
        at = t.__dict__.get(_AT)
        if at is not None and at[2] is self:
            return at[0]
        return self.rank.owners.get(id(t), self.rank.everyone)

    def pos(self, t: torch.Tensor) -> int:
        """Where in the micro-batch's transfers the tensor came to be here: made after which
        transfers (a received one: the transfer that brought it)."""
        if type(t) is Placeholder:
            if t._value is None:
                return t._pos
            t = t._value
        at = t.__dict__.get(_AT)
        return at[1] if at is not None and at[2] is self else 0

    def mark(self, value: Any, avail: int) -> None:
        """Note that the tensors in ``value`` (made here) are held by ``avail``."""
        at = (avail, self.count, self)
        if type(value) is torch.Tensor:  # most outputs: no walk
            value.__dict__[_AT] = at
            return
        for t in _tensors(value):
            if type(t) is not Placeholder:
                t.__dict__[_AT] = at

    def _widen(self, t: torch.Tensor, avail: int) -> None:
        if type(t) is Placeholder:
            t._avail = avail
        else:
            at = t.__dict__.get(_AT)
            if at is not None and at[2] is self:  # only what this rank made: inputs may be shared
                t.__dict__[_AT] = (avail, at[1], self)

    def real(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is Placeholder:
            if t._value is None:
                raise Diverged(
                    f"rank {self.me} lacks a tensor it was to hold (micro-batch {self.microbatch})"
                )
            return t._value
        return t

    # ================================================================ events
    def event(self, what: tuple) -> None:
        """Record what the glue does (discovery), or check it against the program."""
        if self.expected is None:
            self.events.append(what)
            return
        i = self.cursor
        if i == self.stop:
            self.stopped = True
            raise BodyDone
        if i >= len(self.expected) or self.expected[i] != what:
            want = self.expected[i] if i < len(self.expected) else "the end of the micro-batch"
            raise Diverged(
                f"micro-batch {self.microbatch} on rank {self.me} did {_say(what)} where the program "
                f"recorded {_say(want)}"
            )
        self.cursor = i + 1

    def reading_gradients(self) -> None:
        """The body reads a ``.grad``: after ``model.backward``, the other ranks' backward may still
        be running (a step program runs them in its own order): such a step runs on the reference
        runtime."""
        if self.loss_done:
            raise Diverged("the step body reads gradients after model.backward, before the step ends")

    # ================================================================ torch operations in the glue
    def operate(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """One torch operation of the glue. What happens depends only on what every rank knows
        alike (the operation, which ranks hold its inputs), so every rank makes the same transfers."""
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind_of(func)
        tensors = _operands(args, kwargs)
        if kind == _RANDOM:
            return self._random(func, args, kwargs, tensors)
        if not tensors:
            return func(*args, **kwargs)
        rank = self.rank
        everyone = rank.everyone
        mask = everyone
        swap = False
        for t in tensors:  # `avail`, inlined: every glue operation asks it of every operand
            if type(t) is Placeholder:
                mask &= t._avail
                swap = True
            else:
                at = t.__dict__.get(_AT)
                mask &= at[0] if at is not None and at[2] is self else rank.owners.get(id(t), everyone)
        if mask == everyone:  # every rank holds every input, and computes it
            return func(*args, **kwargs) if not swap else self._here(func, args, kwargs)
        if kind == _NEEDS or (kwargs and "out" in kwargs) or (kind == _DATA and _data_dependent(func, args)):
            for t in tensors:  # Python, or the shape of the result, needs the values: every rank gets them
                self.need_everywhere(t)
            return self._here(func, args, kwargs)
        if kind == _SHAPE_ONLY:
            return func(*_swap_placeholders(args, _stand_in), **_swap_placeholders(kwargs, _stand_in))
        if kind == _IN_PLACE:
            return self._in_place(func, args, kwargs, tensors, mask)
        if mask >> self.me & 1:
            out = self._here(func, args, kwargs) if swap else func(*args, **kwargs)
            self.mark(out, mask)
            return out
        return self._lazy(func, args, kwargs, mask)

    def _random(self, func: Any, args: tuple, kwargs: dict, tensors: list) -> Any:
        """A random draw: by one rank, the lowest holding its inputs (others: a placeholder)."""
        mask = self.rank.everyone
        for t in tensors:
            mask &= self.avail(t)
        if mask == 0:
            return self._lazy(func, args, kwargs, 0)
        drawer = 1 << lowest(mask)
        if drawer >> self.me & 1:
            out = self._here(func, args, kwargs)
            self.mark(out, drawer)
            return out
        return self._lazy(func, args, kwargs, drawer)

    def _here(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` computed here, on the data of every placeholder in its arguments."""
        return func(*_swap_placeholders(args, self.real), **_swap_placeholders(kwargs, self.real))

    def _lazy(self, func: Any, args: tuple, kwargs: dict, mask: int) -> Any:
        """A placeholder for ``func``'s result: computed for real by the ranks in ``mask``, else
        evaluated where it is needed; its shape from a run on the meta device."""
        cache = self.rank.meta_cache
        key = _meta_key(func, args, kwargs)
        template = cache.get(key) if key is not None else None
        if template is None:  # a meta-device run is slow (torch's Python decompositions): once per kind
            template = OutputTemplate.of(self._meta(func, args, kwargs))
            if key is not None:
                cache[key] = template
        return self._placeholders(template, mask, LazyNode(func, args, kwargs))

    def _placeholders(self, template: OutputTemplate, avail: int, node: LazyNode | None = None) -> Any:
        """``template``'s outputs as placeholders, those of the same place in the glue on the last
        step when they were made from the same template (every step of a program makes them alike)."""
        site = (self.microbatch, self.sites)
        self.sites += 1
        kept = self.rank.kept_placeholders.get(site)
        if kept is not None and kept[0] is template:
            if template.single:  # one output, the most common: `refill`, inlined
                m = kept[1][0]
                m._avail, m._pos, m._run, m._value = avail, self.count, self, None
                if node is None:
                    m._node, m._index = None, 0
                else:
                    m._node, m._index = node, len(node.outputs)
                    node.outputs.append(m)
                return m
            return template.refill(kept[1], avail, self.count, self, node)
        out = template.placeholders(avail, self.count, self, self.rank.device, node)
        made = [out] if template.single else [t for t in pytree.tree_leaves(out) if type(t) is Placeholder]
        self.rank.kept_placeholders[site] = (template, made)
        return out

    def _meta(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _MOVES:  # a placeholder moved to a device: only its dtype may change
            args, kwargs = _on_meta(args), {k: "meta" if k == "device" else v for k, v in kwargs.items()}
            if func is not _T.to:
                return meta_of(args[0])
        try:
            return func(*_swap_placeholders(args, meta_of), **_swap_placeholders(kwargs, meta_of))
        except Exception as err:
            raise Diverged(
                f"{getattr(func, '__name__', func)} on tensors held by other ranks could not be "
                f"followed on the meta device ({type(err).__name__}: {err})"
            ) from err

    def _in_place(self, func: Any, args: tuple, kwargs: dict, tensors: list, mask: int) -> Any:
        """An in-place operation: every rank holding the tensor it changes computes it (operands sent
        where they lack), the others' placeholder stands for the changed tensor from then on."""
        target = args[0]
        holding = self.avail(target)
        if holding == 0:  # a lazy value changed lazily: the new node reads the old one
            self._meta(func, args, kwargs)
            old = Placeholder(
                target.shape,
                target.dtype,
                target.device,
                target.requires_grad,
                0,
                target._pos,
                self,
                target.stride(),
                target._node,
                target._index,
            )
            if target._node is not None:
                target._node.outputs[target._index] = old
            node = LazyNode(func, (old, *args[1:]), kwargs)
            node.outputs.append(target)
            target._node, target._index, target._pos = node, 0, self.count
            return target
        for t in holders(holding & ~mask):
            for operand in tensors[1:]:
                self.make_available(t, operand)
        if holding >> self.me & 1:
            return self._here(func, args, kwargs)
        self._meta(func, args, kwargs)
        target._pos = self.count
        return target

    # ================================================================ transfers
    def make_available(self, t: int, u: torch.Tensor) -> torch.Tensor | None:
        """Make tensor ``u`` held by rank ``t`` (every rank calls this alike); returns the data on ``t``."""
        a = self.avail(u)
        if a >> t & 1:
            return self.real(u) if t == self.me else None
        if a == 0:
            return self._evaluate(u, t)
        src = lowest(a)
        k = self.count
        self.count = k + 1
        self.event(("x", k, src, t))
        if self.me == src:
            value = self.real(u)
            needs = torch.is_grad_enabled() and value.requires_grad
            self.outbox.setdefault(t, []).append((k, value, needs))
            self.structure.append(("send", k, t))
            if needs:
                self.roots.append(Root(self.pos(u), value, k, t))
        self._widen(u, a | 1 << t)
        if t != self.me:
            return None
        value = self.receive(k, src)
        self.mark(value, a | 1 << t)  # made here by transfer k: roots sending it on run before k is final
        if type(u) is Placeholder:
            u._value = value
        return value

    def need_everywhere(self, u: torch.Tensor) -> None:
        """Python needs ``u``'s value (``if u:``, ``u.item()``): every rank gets it."""
        if self.avail(u) == self.rank.everyone:
            return
        self.event(("need",))
        if self.avail(u) == 0:
            self._evaluate(u, self._evaluation_rank(u._node))
        for t in range(self.rank.size):
            self.make_available(t, u)
        self.flush_sends()

    def _evaluate(self, u: Placeholder, t: int) -> torch.Tensor | None:
        """Compute the lazy ``u`` on rank ``t``: its inputs go there first."""
        node = u._node
        if node is None:
            raise Diverged(
                f"rank {self.me}: a tensor held by no rank was needed (micro-batch {self.microbatch})"
            )
        for v in _tensors((node.args, node.kwargs)):
            self.make_available(t, v)
        for out in node.outputs:
            out._avail |= 1 << t
        if t != self.me:
            return None
        if node.result is None:
            node.result = node.func(
                *_swap_placeholders(node.args, self.real), **_swap_placeholders(node.kwargs, self.real)
            )
            leaves = [x for x in pytree.tree_leaves(node.result) if isinstance(x, torch.Tensor)]
            for out, value in zip(node.outputs, leaves, strict=False):
                if tuple(value.shape) != tuple(out.shape) or value.dtype != out.dtype:
                    raise Diverged(
                        f"an operation of the glue gave {tuple(value.shape)} {value.dtype} on rank "
                        f"{self.me}, where its placeholder said {tuple(out.shape)} {out.dtype}"
                    )
                out._value = value
                self.mark(value, out._avail)
        return u._value

    def _evaluation_rank(self, node: LazyNode | None) -> int:
        """Where to compute a lazy result: the rank holding most of its inputs' bytes."""
        weights = [0] * self.rank.size
        for v in _tensors((node.args, node.kwargs)) if node is not None else ():
            size = v.numel() * v.element_size()
            for r in holders(self.avail(v)):
                weights[r] += size
        return max(range(len(weights)), key=lambda r: (weights[r], -r))

    def receive(self, k: int, src: int) -> torch.Tensor:
        self.flush_sends()
        self.structure.append(("recv", k, src))
        self.rank.before_receive(self, k)
        tensor, needs = self.rank.wire.receive(("F", self.microbatch, k), src)
        tensor = tensor.to(self.rank.device) if tensor.device != self.rank.device else tensor
        if not needs:
            return tensor.detach()
        leaf = self.leaves[k] = Leaf(src)
        if not tensor.requires_grad:
            tensor = tensor.detach().requires_grad_(True)
        with torch.enable_grad():
            return boundary.arrive(
                tensor,
                None,
                lambda _: boundary.Route(src, k, 0, False),
                lambda _target, grads: leaf.add(grads[0]),
            )

    def flush_sends(self) -> None:
        """Send what the transfers so far left for other ranks, one message per rank. Called where
        this rank would otherwise keep a peer waiting: before it waits itself (a receive, the loss's
        backward, a suspension), before its own modules' work, at the end of the body; what the glue
        makes for a rank in between (an activation, then the labels its loss needs) travels together."""
        if not self.outbox:
            return
        outbox, self.outbox = self.outbox, {}
        for t, items in outbox.items():
            self.rank.wire.send(
                t, [(("F", self.microbatch, k), value.detach(), needs) for k, value, needs in items]
            )

    # ================================================================ module calls (the `Frame` endpoint)
    def glue_call(self, staged: Any, args: tuple, kwargs: dict) -> Any:
        """A module called from the glue: a split one runs its forward here as glue; a whole one
        runs on its rank, and returns placeholders on the others."""
        key = staged.key
        owner = self.rank.whole.get(key)
        if owner is None:
            buffers = self.rank.recomputed.get(key)
            if buffers is not None and (changed := changed_buffer(buffers)) is not None:
                raise Diverged(
                    f"module {staged.name!r}, which every rank computes for itself, changed its buffer "
                    f"{changed!r} since it was placed: the ranks' copies may differ"
                )
            return staged.run_here(self.frame, args, kwargs)
        modes = _pop_modes()  # what follows is smpart's own work, or the module's on this rank
        try:
            if owner != self.me:
                return self._called_elsewhere(staged, owner, args, kwargs)
            return self._called_here(staged, args, kwargs)
        finally:
            _push_modes(modes)

    def _called_elsewhere(self, staged: Any, owner: int, args: tuple, kwargs: dict) -> Any:
        if streams.live is not None:  # a split region ends where the call leaves this rank (`streams`)
            streams.leave()
        rank = self.rank
        self.event(("call", staged.name, owner))
        for t in _operands(args, kwargs):
            self.make_available(owner, t)
        key = call_key(staged.model, staged.name, args, kwargs)
        template = rank.templates.get(key)
        if type(template) is OutputTemplate:
            return self._placeholders(template, 1 << owner)
        if template == UNPREDICTABLE:
            raise Diverged(
                f"module {staged.name!r} returned outputs of other shapes in other micro-batches "
                "(shapes that depend on the data): the ranks that do not hold it cannot stand in for them"
            )
        if staged.key in rank.varies:
            raise Diverged(
                f"module {staged.name!r} is called with shapes that depend on the data (they "
                "differed between micro-batches: routing across stages by the data)"
            )
        raise Diverged(
            f"no recorded output for module {staged.name!r} called with "
            f"{_brief_signature(key[2])} (a new shape): recording it",
            rerecord=True,
        )

    def _called_here(self, staged: Any, args: tuple, kwargs: dict) -> Any:
        rank = self.rank
        self.event(("call", staged.name, self.me))
        leaves = _operands(args, kwargs)
        if leaves:
            me, device = self.me, rank.device
            swap = moved = False
            for t in leaves:
                self.make_available(me, t)
                if type(t) is Placeholder:
                    swap = True
                elif t.device != device:  # the body's own tensors (a batch on the CPU)
                    moved = True
            if swap:
                args, kwargs = _swap_placeholders((args, kwargs), self.real)
            if moved:
                args, kwargs = _moved_to((args, kwargs), device)
        self.flush_sends()  # the ranks waiting for what this one sent need not wait for its work too
        self.structure.append(("compute",))
        try:
            with running(self.inline):
                out = staged.run_here(self.inline, args, kwargs)
        except Diverged:
            raise
        except Exception as err:
            raise as_pipeline_error(err, self.stage, staged.name, self.microbatch,
                                    rank=rank.process_rank) from err
        if rank.checks_outputs:
            rank.check_output(staged, args, kwargs, out)
        self.mark(out, 1 << self.me)
        return out

    def call(self, frame: Frame, stage: int, model: int, module: str, args: tuple, kwargs: dict) -> Any:
        raise Diverged(f"module {module!r} was called outside the step's glue")

    # ================================================================ model.backward
    def backward(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """``model.backward(loss)``: the rank holding the loss runs its backward now."""
        with _no_glue_mode():
            self._backward(loss, grad)

    def _backward(self, loss: torch.Tensor, grad: torch.Tensor | None) -> None:
        if self.loss_done:
            raise SmpartError(
                "model.backward() was called twice for the same micro-batch; call it once per "
                "step body (combine losses first: model.backward(loss_a + loss_b))"
            )
        if not isinstance(loss, torch.Tensor):
            raise SmpartError(f"model.backward() needs a tensor loss, got {type(loss).__name__}")
        if not loss.requires_grad:
            raise SmpartError(
                "model.backward(loss): the loss does not require grad; was it computed from "
                "the model's output, outside torch.no_grad()?"
            )
        if grad is None and loss.numel() != 1:
            raise SmpartError(
                f"model.backward(loss) needs a scalar loss (got shape {tuple(loss.shape)}), "
                "or pass the gradient: model.backward(loss, grad)"
            )
        self.loss_done = True
        if self.avail(loss) == 0:
            self._evaluate(loss, self._evaluation_rank(loss._node))
        owner = lowest(self.avail(loss))
        self.event(("backward", owner))
        if grad is not None:
            self.make_available(owner, grad)
        self.flush_sends()
        if owner != self.me:
            return
        value = self.real(loss)
        grad = torch.ones_like(value) if grad is None else self.real(grad)
        self.structure.append(("loss",))
        self.rank.loss_round(self, value, grad * self.rank.grad_scale)

    # ================================================================ the body's result
    def let_go(self) -> None:
        """Drop what ties this run in cycles (its frames name it, its roots' tensors mark it)."""
        self.roots.clear()
        self.leaves.clear()
        self.outbox.clear()
        self.frame = self.inline = None  # type: ignore[assignment]

    def finish(self, result: Any) -> None:
        """The body returned ``result``: each of its tensors is kept by one rank holding it."""
        with _no_glue_mode():
            self._finish(result)

    def _finish(self, result: Any) -> None:
        leaves, spec = pytree.tree_flatten(result)
        constants: list[Any] = []
        tensors: set[int] = set()
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if self.avail(leaf) == 0:
                    self._evaluate(leaf, self._evaluation_rank(leaf._node))
                provider = lowest(self.avail(leaf))
                if provider == self.me:
                    self.provided[i] = self.real(leaf).detach()
                tensors.add(i)
                constants.append(None)
            elif boundary.is_plain(type(leaf)) or leaf is None:
                constants.append(leaf)
            else:
                raise Diverged(
                    f"the step returns a {type(leaf).__name__}, which a step program cannot gather "
                    "from the ranks (return tensors and numbers)"
                )
        self.flush_sends()
        self.event(("end", len(leaves)))
        self.result_spec = (spec, constants, tensors)


def release_placeholders(kept: dict) -> None:
    """After a step: the kept placeholders let go of what they stood for (a received activation and
    its autograd graph, a lazy operation's inputs), so nothing of the step outlives it."""
    for _, made in kept.values():
        for m in made:
            m._value = m._node = m._run = None


class Backward:
    """The rest of one micro-batch's backward on one rank: its roots, latest first."""

    def __init__(self, run: MicrobatchRun) -> None:
        self.run = run
        by_pos: dict[int, list[Root]] = {}
        for root in run.roots:
            by_pos.setdefault(root.pos, []).append(root)
        #: Rounds of roots, latest first: the roots of one round were made at one point of the glue.
        self.rounds = [by_pos[p] for p in sorted(by_pos, reverse=True)]

    def remaining_pos(self, after: int) -> int:
        """The position of the roots of round ``after`` (-1 when none is left)."""
        return self.rounds[after][0].pos if after < len(self.rounds) else -1


def send_final_leaves(run: MicrobatchRun, below: int, wire: Any) -> list[tuple]:
    """Send the gradients of the leaves that no root left can reach: those received at or after
    position ``below`` (every root made later has run). Returns what was sent: ``(k, to)``."""
    out: dict[int, list] = {}
    sent = []
    for k, leaf in run.leaves.items():
        if not leaf.sent and k >= below:
            leaf.sent = True
            grad = None if leaf.grad is None else leaf.grad.detach()
            out.setdefault(leaf.src, []).append((("B", run.microbatch, k), grad, False))
            sent.append((k, leaf.src))
            leaf.grad = None
    for t, items in out.items():
        wire.send(t, items)
    return sent


# ==================================================================== helpers
class _no_glue_mode:  # noqa: N801 - used like a function: ``with _no_glue_mode():``
    """Take the glue's torch-function mode off this thread inside the block (smpart's own code and
    the modules this rank runs do not go through it)."""

    __slots__ = ("modes",)

    def __enter__(self) -> None:
        self.modes = _pop_modes()

    def __exit__(self, *exc: object) -> None:
        _push_modes(self.modes)


def _pop_modes() -> tuple | list:
    """Take every torch-function mode off this thread (`_push_modes` puts them back)."""
    depth = torch._C._len_torch_function_stack()
    if depth == 1:  # the glue's mode alone: every module call of the glue comes here
        return (torch._C._pop_torch_function_stack(),)
    return [torch._C._pop_torch_function_stack() for _ in range(depth)]


def _push_modes(modes: tuple | list) -> None:
    for mode in reversed(modes):
        torch._C._push_on_torch_function_stack(mode)


_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
                     slice, type(Ellipsis), torch.memory_format, torch.layout})
_TENSOR_KINDS = frozenset({torch.Tensor, torch.nn.Parameter, Placeholder})


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (tuples, lists and dicts walked directly, other containers by pytree),
    in a fixed order. A loop, not a recursion: every glue operation pays for it."""
    found: list[torch.Tensor] = []
    todo = [value]
    while todo:
        v = todo.pop()
        kind = type(v)
        if kind in _TENSOR_KINDS:
            found.append(v)
        elif kind is tuple or kind is list:
            todo.extend(reversed(v))
        elif kind is dict:
            todo.extend(reversed(v.values()))
        elif kind in _LEAVES or (kind in _OPAQUE and len(pytree.SUPPORTED_NODES) == _OPAQUE_NODES[0]):
            continue
        elif isinstance(v, torch.Tensor):
            found.append(v)
        elif not boundary.is_plain(kind):
            leaves = pytree.tree_leaves(v)
            if len(leaves) != 1 or leaves[0] is not v:
                todo.extend(reversed(leaves))
            else:
                _note_opaque(kind)
    return found


#: Types pytree takes for leaves that are not tensors (a `DistributedModel` among a step's
#: arguments, an object of the user's): asked once per type, not at every call. pytree decides
#: by type; a type registered with it since makes the set stale (`_note_opaque` empties it).
_OPAQUE: set[type] = set()
_OPAQUE_NODES = [0]  # how many node types pytree knew when `_OPAQUE` was filled


def _note_opaque(kind: type) -> None:
    nodes = len(pytree.SUPPORTED_NODES)
    if nodes != _OPAQUE_NODES[0]:
        _OPAQUE.clear()
        _OPAQUE_NODES[0] = nodes
    _OPAQUE.add(kind)


def _operands(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments, as `_tensors` finds them; the common case (no
    containers, keywords of plain values) in one pass: every glue operation and module call asks."""
    found = []
    for a in args:
        kind = type(a)
        if kind in _TENSOR_KINDS:
            found.append(a)
        elif kind not in _LEAVES:
            return _tensors((args, kwargs))
    if kwargs:
        for a in kwargs.values():
            kind = type(a)
            if kind in _TENSOR_KINDS:
                found.append(a)
            elif kind not in _LEAVES:
                return _tensors((args, kwargs))
    return found


def _swap_placeholders(value: Any, swap: Callable[[torch.Tensor], Any], every: bool = False) -> Any:
    """``value`` with every placeholder replaced by ``swap(placeholder)`` (and, for ``meta_of``,
    every tensor: shape inference runs on the meta device). A plain recursive function, not a
    closure: a closure that calls itself is a reference cycle, freed only by the collector."""
    every = every or swap is meta_of
    kind = type(value)
    if kind is Placeholder or (every and isinstance(value, torch.Tensor)):
        return swap(value)
    if kind is tuple:
        return tuple([_swap_placeholders(x, swap, every) for x in value])
    if kind is list:
        return [_swap_placeholders(x, swap, every) for x in value]
    if kind is dict:
        return {key: _swap_placeholders(x, swap, every) for key, x in value.items()}
    if value is None or boundary.is_plain(kind) or isinstance(value, torch.Tensor) or kind is slice:
        return value
    return pytree.tree_map(
        lambda x: swap(x) if type(x) is Placeholder or (every and isinstance(x, torch.Tensor)) else x, value
    )


def _moved_to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor on another device moved to ``device``, differentiably: a module
    of this stage gets its arguments where its weights are, as the reference runtime's stage
    server gets them."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.device == device else t.to(device), value)


def _stand_in(p: Placeholder) -> torch.Tensor:
    """A tensor of ``p``'s shape and dtype here, for operations that read no data."""
    return torch.empty(p.shape, dtype=p.dtype, device=p.device)


_MOVES = frozenset({_T.to, _T.cpu, _T.cuda})


def _on_meta(args: tuple) -> tuple:
    """``.to(...)``'s arguments with every device made the meta device."""
    return tuple("meta" if isinstance(a, str | torch.device) else a for a in args)


_DATA_DEPENDENT = frozenset(
    {
        torch.nonzero,
        _T.nonzero,
        torch.masked_select,
        _T.masked_select,
        torch.unique,
        _T.unique,
        torch.unique_consecutive,
        _T.unique_consecutive,
        torch.argwhere,
        _T.argwhere,
        torch.bincount,
        _T.bincount,
        torch.nonzero_static,
        torch.repeat_interleave,
        _T.repeat_interleave,
    }
)


def _data_dependent(func: Any, args: tuple) -> bool:
    """Whether the shape of ``func``'s result depends on its inputs' values (nonzero, indexing by a
    boolean mask, ``torch.where(condition)``): no rank can stand in for it without the data."""
    if func in _DATA_DEPENDENT:
        return True
    if func is torch.where and len(args) == 1:
        return True
    if func is _T.__getitem__ and len(args) > 1:
        return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1]))
    return False


def _meta_key(func: Any, args: tuple, kwargs: dict) -> Any:
    """What decides an operation's output shapes: the function, its arguments' shapes, strides,
    dtypes and plain values, grad mode and autocast (None: not worth a key)."""
    try:
        key = (func, _shape_key(args), _shape_key(kwargs) if kwargs else (), ambient_key())
        hash(key)
    except (TypeError, _NoKey):
        return None
    return key


_NUMBERS = frozenset({int, float, bool, type(None)})


class _NoKey(Exception):
    pass


def _shape_key(value: Any) -> Any:
    kind = type(value)
    if kind is tuple or kind is list:
        out: list[Any] = [kind is list]
        for v in value:  # a flat tuple of tensors and numbers in this loop: every lazy operation asks
            k = type(v)
            if k is Placeholder:
                out.append((v._sig, v._stride))
            elif k in _TENSOR_KINDS:
                out.append((v.shape, v.stride(), v.dtype, v.requires_grad))
            elif k in _NUMBERS:
                out.append(v)
            else:
                out.append(_shape_key(v))
        return tuple(out)
    if kind is dict:
        return tuple((k, _shape_key(v)) for k, v in value.items())
    if kind is Placeholder:
        return (value._sig, value._stride)
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype, value.requires_grad)
    if value is None or boundary.is_plain(kind) or kind is slice:
        return value if kind is not slice else (value.start, value.stop, value.step)
    raise _NoKey


#: What `operate` does with an operation beyond computing it where its inputs are (`_kind_of`),
#: kept per function: every glue operation asks.
_PLAIN, _RANDOM, _NEEDS, _DATA, _SHAPE_ONLY, _IN_PLACE = range(6)
_KINDS: dict[Any, int] = {}


def _kind_of(func: Any) -> int:
    if func in RANDOM:
        return _RANDOM
    if func in NEEDS:
        return _NEEDS
    if func in _DATA_DEPENDENT or func is torch.where or func is _T.__getitem__:
        return _DATA  # `_data_dependent` looks at the arguments
    if func in SHAPE_ONLY:
        return _SHAPE_ONLY
    if _in_place(func):
        return _IN_PLACE
    return _PLAIN


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (
        name.endswith("_")
        and not name.endswith("__")
        or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
    )


def _say(what: Any) -> str:
    if not isinstance(what, tuple):
        return str(what)
    kind = what[0]
    if kind == "call":
        return f"a call of module {what[1]!r} (rank {what[2]})"
    if kind == "x":
        return f"transfer {what[1]} (rank {what[2]} -> {what[3]})"
    if kind == "need":
        return "a read of a tensor's value in Python"
    if kind == "backward":
        return "model.backward"
    if kind == "end":
        return "the end of the step body"
    return str(what)


def _brief_signature(sig: Any) -> str:
    text = repr(sig)
    return text if len(text) < 160 else text[:157] + "..."
