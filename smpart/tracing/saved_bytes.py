"""`SavedBytesCounter`: the activation memory training really keeps, read off autograd itself.

Between a micro-batch's forward and its backward, what stays alive is not every module's output
(most are freed once the next operation has read them) nor every operation's output, but the
tensors autograd *saves* for the backward pass: a linear layer's input, a softmax's output, a
dropout's mask. ``torch.autograd.graph.saved_tensors_hooks`` calls a "pack" hook for each of them
as the forward runs, so a grad-enabled forward (on meta, nothing allocated) sees exactly what
the real backward will need. The counter attributes each saved tensor to the innermost module
running at that moment (the recorder's stack), which makes ``saved_bytes`` a *self* cost like
FLOPs.

**Counting rule.** Saved tensors alias a lot: one input saved by three projections, ``q`` and
``k`` both views of one fused ``qkv`` buffer, a transposed weight. Memory is held per *storage*,
so each distinct storage is counted once, with its full size (a view keeps its whole buffer
alive), by the first module that saves it. Storage identity is the ``untyped_storage()`` object
(PyTorch keeps one Python object per storage, on meta too, where every data pointer is 0); the
counter holds each one until the pass ends, so an identity can never be reused. Parameters and
buffers are never activations (they are already in the parameter and buffer bytes): their
storages are excluded up front. The model's example inputs count their own bytes, not their
storage's: a micro-batch is a slice of a batch its caller holds anyway (and a meta copy of an
input is compact, so meta and real traces agree). Inside a ``torch.utils.checkpoint`` region
checkpoint's own hooks (or no-grad) take over, so only what checkpoint itself keeps (the
region's inputs) is counted: exactly what training with recomputation holds.

The model's final outputs are counted too (by the module that produced them, unless already
saved): the loss computed from them keeps them, or a tensor their size, until backward.

`SavedBytesCounter.kept_bytes` sizes a module call's inputs by the same rules (each storage once,
parameters never, example inputs by their own bytes): what checkpointing that module would keep
instead of its saved tensors. ``torch.utils.checkpoint`` saves its positional inputs for backward
(this counter sees them) and smpart's `CheckpointedForward` passes keyword inputs positionally, so
a model traced with checkpointing installed is counted exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch


class SavedBytesCounter:
    """Counts, per module index, the bytes of the distinct storages autograd saves for backward.

    ``running_module`` returns the index of the innermost running module (None outside any);
    ``weights`` are the parameters and buffers the forward runs with (never counted),
    ``inputs`` the model's example inputs (counted by their own bytes). Use as a context
    manager around a grad-enabled forward; read `by_module` after.
    """

    def __init__(self, running_module: Callable[[], int | None], weights: Iterable[torch.Tensor] = (),
                 inputs: Iterable[torch.Tensor] = (), fallback_module: int = 0) -> None:
        self.by_module: dict[int, int] = defaultdict(int)
        self._running = running_module
        self._fallback = fallback_module
        self._seen: dict[int, Any] = {}  # id(storage) -> storage, held so no id is reused
        self._input_bytes: dict[int, tuple[Any, int]] = {}  # id(storage) -> (storage, inputs' bytes)
        for t in inputs:
            storage, _ = _storage_and_size(t)
            held, size = self._input_bytes.get(id(storage), (storage, 0))
            self._input_bytes[id(storage)] = (held, size + t.numel() * t.element_size())
        for w in weights:
            self._remember(w)
        self._weights = set(self._seen)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> SavedBytesCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._input_bytes.clear()
        self._weights.clear()
        self._seen.clear()  # release the storages (and, on a real device, their memory)

    def count(self, tensor: torch.Tensor, module: int | None) -> None:
        """Charge ``tensor``'s storage to ``module`` unless that storage was already counted."""
        key, size = self._remember(tensor)
        if key is not None:
            owner = module if module is not None else self._fallback
            self.by_module[owner] += size

    def kept_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the distinct storages of one call's input ``tensors`` (parameters excluded)."""
        held: dict[int, tuple[Any, int]] = {}  # holds each storage object while its id is in use
        for t in tensors:
            holder, size = _storage_and_size(t)
            key = id(holder)
            if key not in self._weights and key not in held:
                held[key] = (holder, self._input_bytes[key][1] if key in self._input_bytes else size)
        return sum(size for _, size in held.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.count(tensor, self._running())
        # Saved as is (no copy), but detached: an op that saves its own output (tanh, softmax)
        # would otherwise hold, through this hook, the tensor whose graph holds the hook: a cycle
        # through autograd's C++ that no garbage collection breaks, keeping this counter, the
        # recorder and so the traced model alive for ever.
        return tensor.detach()

    def _remember(self, tensor: torch.Tensor) -> tuple[int | None, int]:
        """Mark ``tensor``'s storage seen; returns (its key, its bytes), or (None, 0) if seen before."""
        holder, size = _storage_and_size(tensor)
        key = id(holder)
        if key in self._seen:
            return None, 0
        self._seen[key] = holder
        if key in self._input_bytes:
            size = self._input_bytes[key][1]
        return key, size


def _storage_and_size(tensor: torch.Tensor) -> tuple[Any, int]:
    """The object that identifies ``tensor``'s memory, and that memory's size in bytes.

    Its untyped storage where it has one; a tensor without a plain storage (sparse, some
    subclasses) stands for itself, sized by its elements.
    """
    try:
        storage = tensor.untyped_storage()
        return storage, storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return tensor, tensor.numel() * tensor.element_size()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
