"""`CallRecorder`: module hooks that watch one forward pass and write down what every module did.

Each module gets a forward pre-hook and a forward hook. The pre-hook pushes a frame on a stack
of running modules, the hook pops it, so at any moment the stack says which module's code is
running (and, when a forward raises, which module failed). Three tricks keep it cheap and exact:

- **Self costs by subtraction.** A frame remembers the running FLOP total (from torch's
  ``FlopCounterMode``) and clock at entry; at exit the difference is the call's *inclusive*
  cost, which is added to the caller frame's children total. Self cost = inclusive − children.
- **Data flow by tensor identity.** Every tensor a module returns is registered as produced by
  it (the innermost module wins: a container that returns its last child's output produced
  nothing new). A module's input tensor then comes from: the example inputs (``INPUT``); the
  caller, when the caller received that very tensor and hands it down; the module that returned
  it; or else the caller's own code, which computed it between child calls.
- **Tensors kept alive.** Registered tensors are held until the recorder is dropped, so their
  ``id`` cannot be reused by a new tensor during the pass.

Modules are identified by their index in the list handed to the recorder; turning indices into
tree nodes is `smpart.tracing.grouping`'s job.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from smpart.tracing.call_inputs import describe_call

#: Module index used as the source of the model's own example inputs.
INPUT_INDEX = -1


@dataclass
class CallStats:
    """What one module did during the pass (costs are self costs, summed over calls)."""

    calls: int = 0
    #: Index of the module's first call among all first calls (0 is the root), None if never called.
    first_call: int | None = None
    #: The name the module was called under first (the one whose parent was the caller).
    called_as: str | None = None
    flops: float = 0.0
    #: Bytes written by the module's own operations (see `smpart.tracing.op_bytes`).
    op_bytes: int = 0
    activation_bytes: int = 0
    #: Bytes of the storages autograd saved for backward in its own code (`smpart.tracing.saved_bytes`).
    saved_bytes: int = 0
    #: Bytes it would keep if checkpointed: the distinct storages it was called with, summed over
    #: calls, plus model outputs it returned (None: not counted).
    checkpoint_bytes: int | None = None
    seconds: float = 0.0
    #: Its first call's arguments, described (`smpart.tracing.call_inputs.describe_call`).
    call_inputs: dict[str, Any] | None = None


class _Frame:
    __slots__ = ("index", "flops_at_entry", "child_flops", "bytes_at_entry", "child_bytes", "time_at_entry",
                 "child_seconds", "inputs")

    def __init__(self, index: int, flops: float, written: int, now: float, inputs: set[int]) -> None:
        self.index = index
        self.flops_at_entry = flops
        self.child_flops = 0.0
        self.bytes_at_entry = written
        self.child_bytes = 0
        self.time_at_entry = now
        self.child_seconds = 0.0
        self.inputs = inputs


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The distinct tensors inside a nested structure (tuples, lists, dicts, dataclass outputs)."""
    seen: dict[int, torch.Tensor] = {}
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CallRecorder:
    """Hooks on ``modules`` that fill one `CallStats` per module and the data-flow edges.

    ``names[i]`` lists every qualified name of ``modules[i]``. ``total_flops`` returns the running
    FLOP count (or 0), ``total_bytes`` the running count of bytes operations wrote (or 0),
    ``clock`` the current time in seconds (synchronising the device first
    when it must). ``example_inputs`` are the tensors the model itself was called with.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        names: list[list[str]],
        example_inputs: Iterable[torch.Tensor] = (),
        total_flops: Callable[[], float] = lambda: 0.0,
        total_bytes: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.modules = modules
        self.names = names
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.stats = [CallStats() for _ in modules]
        #: (source module index or INPUT_INDEX, destination module index) -> bytes, over all calls.
        self.edges: dict[tuple[int, int], int] = defaultdict(int)
        self.stack: list[_Frame] = []
        self._example_inputs = {id(t) for t in example_inputs}
        self._produced_by: dict[int, tuple[torch.Tensor, int]] = {}
        self._total_flops = total_flops
        self._total_bytes = total_bytes
        self._clock = clock
        self._first_calls = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        #: When set, ``kept_bytes(inputs)`` sizes each call's inputs (`CallStats.checkpoint_bytes`).
        self.kept_bytes: Callable[[list[torch.Tensor]], int] | None = None

    # ------------------------------------------------------------ installing
    def __enter__(self) -> CallRecorder:
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._produced_by.clear()

    def running_module(self) -> int | None:
        """Index of the innermost module whose forward is running (after a failure: the culprit)."""
        return self.stack[-1].index if self.stack else None

    def producer_of(self, t: torch.Tensor) -> int | None:
        """Index of the innermost module that returned ``t`` during the pass (None if none did)."""
        produced = self._produced_by.get(id(t))
        return produced[1] if produced is not None else None

    def name_of(self, index: int) -> str:
        return self.stats[index].called_as or self.names[index][0]

    # ------------------------------------------------------------ hooks
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        i = self.index[id(module)]
        caller = self.stack[-1] if self.stack else None
        stats = self.stats[i]
        if stats.calls == 0:
            stats.first_call = self._first_calls
            self._first_calls += 1
            stats.called_as = self._name_seen_from(i, caller)
            stats.call_inputs = describe_call(args, kwargs)
        stats.calls += 1
        inputs = tensors_in((args, kwargs))
        if self.kept_bytes is not None:
            stats.checkpoint_bytes = (stats.checkpoint_bytes or 0) + self.kept_bytes(inputs)
        for t in inputs:
            source = self._source_of(t, caller)
            if source != i:
                self.edges[source, i] += nbytes(t)
        self.stack.append(_Frame(i, self._total_flops(), self._total_bytes(), self._clock(),
                                 {id(t) for t in inputs}))

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        i = self.index[id(module)]
        frame = self.stack.pop()
        while frame.index != i and self.stack:  # a child raised and its caller caught the error
            frame = self.stack.pop()
        flops = self._total_flops() - frame.flops_at_entry
        written = self._total_bytes() - frame.bytes_at_entry
        seconds = self._clock() - frame.time_at_entry
        stats = self.stats[i]
        stats.flops += flops - frame.child_flops
        stats.op_bytes += written - frame.child_bytes
        stats.seconds += seconds - frame.child_seconds
        if self.stack:
            self.stack[-1].child_flops += flops
            self.stack[-1].child_bytes += written
            self.stack[-1].child_seconds += seconds
        for t in tensors_in(output):
            if id(t) not in self._produced_by:
                self._produced_by[id(t)] = (t, i)
                stats.activation_bytes += nbytes(t)

    # ------------------------------------------------------------ attribution
    def _source_of(self, t: torch.Tensor, caller: _Frame | None) -> int:
        if id(t) in self._example_inputs:
            return INPUT_INDEX
        if caller is not None and id(t) in caller.inputs:
            return caller.index
        produced = self._produced_by.get(id(t))
        if produced is not None:
            return produced[1]
        return caller.index if caller is not None else INPUT_INDEX

    def _name_seen_from(self, i: int, caller: _Frame | None) -> str:
        """Of a module's names, the one whose parent is the calling module (T5's ``shared``
        embedding is first called as ``encoder.embed_tokens``)."""
        names = self.names[i]
        if len(names) > 1 and caller is not None:
            caller_names = set(self.names[caller.index])
            for name in names:
                if name.rpartition(".")[0] in caller_names:
                    return name
        return names[0]
