"""`trace`: run a model once on an example batch and return its costed `ModuleTree`.

The pass runs on the **meta device** by default: every parameter and buffer is swapped, for the
duration of the pass, for a meta tensor of the same shape, so a model
of any size is traced without allocating or copying a single weight (a model already built on
meta runs as is). Shapes, FLOPs (``torch.utils.flop_counter.FlopCounterMode``) and activation
sizes are exact on meta; only values are missing. A model whose Python code looks at values (a
mixture-of-experts router asking which experts got tokens) fails there, and is then traced on
its own device with its own weights, used in place, and a warning says so.

The same pass runs with autograd on (when any parameter or input requires grad) and counts,
per module, the bytes autograd saves for backward (`smpart.tracing.saved_bytes`): the
activation memory a micro-batch really holds during training. No backward runs, so no ``.grad``
is ever written; the graph is dropped with the pass's output.

``measure_time=True`` on a real device adds a timed pass: each module's forward self time is
measured with the same hooks, and the measured backward of the whole model is shared out in
proportion (autograd runs backward as one graph, not module by module).

**Activation checkpointing.** Each call's inputs are sized too (``checkpoint_bytes``: what
checkpointing the module would keep, `with_activation_checkpointing`). A model traced with
checkpointing already installed (`smpart.runtime.placement.activation_checkpointing`, recognised by the
`RECOMPUTED_FORWARD` mark on a module's instance ``forward``) is counted as it trains: inside a
checkpointed module autograd saves nothing the counter sees, the module itself is charged its
inputs, and its subtree is marked ``recomputed``. Its measured backward includes the
recomputation, which is taken out again so that ``time_s`` means the same with or without it.

The hook bookkeeping lives in `smpart.tracing.recorder`, the turning of modules into nodes
(shared parameters, names, order) in `smpart.tracing.grouping`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from smpart.errors import ConfigError, TraceError
from smpart.tracing.grouping import ModuleInventory, build_edges, build_nodes
from smpart.tracing.op_bytes import OpBytesCounter
from smpart.tracing.recorder import CallRecorder, nbytes, tensors_in
from smpart.tracing.saved_bytes import SavedBytesCounter
from smpart.tracing.tree import (
    DEFAULT_FORWARD_SHARE,
    DEFAULT_PARAM_MEMORY_FACTOR,
    OUTPUTS,
    SAVED,
    ModuleTree,
    mark_recomputed,
)

META = torch.device("meta")
#: Attribute set (true) on a module's instance ``forward`` whose activations are recomputed in
#: the backward instead of kept (`smpart.runtime.placement.activation_checkpointing.CheckpointedForward`).
RECOMPUTED_FORWARD = "smpart_recomputed"

_tracing = threading.local()


def is_tracing() -> bool:
    """Whether this thread is inside `trace`: the model's forward runs on example inputs (on the
    meta device by default) only to be measured, as SMP's ``smp.is_tracing()`` tells a script."""
    return getattr(_tracing, "depth", 0) > 0


def trace(
    model: nn.Module,
    example_args: Any,
    example_kwargs: dict[str, Any] | None = None,
    device: str | torch.device | None = "meta",
    *,
    measure_time: bool = False,
    param_memory_factor: float = DEFAULT_PARAM_MEMORY_FACTOR,
) -> ModuleTree:
    """Trace ``model(*example_args, **example_kwargs)`` and return its costed module tree.

    ``example_args`` is a tuple of positional inputs (anything else is the single input).
    ``device``: ``"meta"`` (no weight allocated or copied), ``None`` for the model's own device,
    or a device to run on (weights are copied there if they live elsewhere). The model itself is
    left untouched: no gradients, no BatchNorm statistics updated.

    Raises `TraceError` naming the module that failed when the example inputs do not fit.
    """
    _tracing.depth = getattr(_tracing, "depth", 0) + 1
    try:
        return _trace(model, example_args, example_kwargs, device, measure_time, param_memory_factor)
    finally:
        _tracing.depth -= 1


def _trace(model: nn.Module, example_args: Any, example_kwargs: dict[str, Any] | None,
           device: str | torch.device | None, measure_time: bool, param_memory_factor: float) -> ModuleTree:
    args, kwargs = _check_arguments(model, example_args, example_kwargs, param_memory_factor)
    inventory = ModuleInventory.of(model)
    home = _home_device(model)
    target = _as_device(device) if device is not None else home
    recomputed = _recomputed_modules(inventory)
    forward_share = DEFAULT_FORWARD_SHARE
    try:
        recorder, ran_on = _record_flops(model, inventory, args, kwargs, target, home)
        seconds = None
        if measure_time and ran_on.type == "meta":
            warnings.warn(
                "measure_time needs a real device; the trace ran on meta, so compute is counted "
                "in FLOPs (pass device=None to time the model where it lives)",
                stacklevel=3,
            )
        elif measure_time:
            seconds, forward_share = _measure_seconds(model, inventory, args, kwargs, ran_on, home,
                                                      recomputed)
    except _ForwardFailed as failure:
        raise TraceError(failure.describe()) from failure.error
    root, node_name = build_nodes(inventory, recorder.stats, seconds)
    trainable = _trainable(model, args, kwargs)
    tree = ModuleTree(
        root=root,
        edges=build_edges(recorder.edges, node_name),
        param_memory_factor=param_memory_factor,
        compute_unit="time" if seconds is not None else "flops",
        input_bytes=sum(nbytes(t) for t in tensors_in((args, kwargs))),
        activation_memory=SAVED if trainable else OUTPUTS,
        forward_share=forward_share,
    )
    for node in tree.nodes():
        if node.checkpoint_bytes is None and trainable:  # never called: it would keep nothing
            node.checkpoint_bytes = 0
    _mark_checkpointed(tree, [node_name[i] for i in sorted(recomputed)])
    if seconds is not None:  # time_s holds the recomputation once, compute_of adds it again
        for node in tree.nodes():
            if node.recomputed and node.time_s:
                node.time_s /= 1 + forward_share
    return tree


# ==================================================================== the passes
class _ForwardFailed(Exception):
    """The model's forward raised inside ``module`` (its name) while tracing on ``device``."""

    def __init__(self, module: str | None, class_name: str, error: BaseException, device: torch.device):
        super().__init__(module)
        self.module, self.class_name, self.error, self.device = module, class_name, error, device

    def where(self) -> str:
        if self.module:
            return f"module {self.module!r} ({self.class_name})"
        return f"the root module ({self.class_name})"

    def describe(self) -> str:
        return (f"the model failed on the example inputs in {self.where()} on {self.device}: "
                f"{type(self.error).__name__}: {self.error}. Check that the example inputs are what "
                "this module expects (count, shapes, dtypes, devices).")


def _record_flops(model, inventory, args, kwargs, target, home) -> tuple[CallRecorder, torch.device]:
    """The FLOP-counting pass on ``target``; from meta, falls back to the model's own device."""
    try:
        return _forward(model, inventory, args, kwargs, target, home, count_flops=True, grad=True)[0], target
    except _ForwardFailed as failure:
        if target.type != "meta":
            raise
        if home.type == "meta":
            raise TraceError(
                f"{failure.describe()} The model's weights are on the meta device, so it cannot be "
                "traced anywhere else: if its forward looks at tensor values (data-dependent control "
                "flow), build it on a real device."
            ) from failure.error
        meta_failure = failure
    recorder = _forward(model, inventory, args, kwargs, home, home, count_flops=True, grad=True)[0]
    warnings.warn(
        f"{type(model).__name__} could not be traced on the meta device ({meta_failure.where()}: "
        f"{type(meta_failure.error).__name__}), probably because its forward looks at tensor values; "
        f"traced it on {home} with its own weights instead (nothing was copied)",
        stacklevel=4,
    )
    return recorder, home


def _forward(model, inventory, args, kwargs, device, home, *, count_flops=False, clock=time.perf_counter,
             grad=False) -> tuple[CallRecorder, Any, list[torch.Tensor]]:
    """One hooked forward on ``device``: the recorder, the output and the parameters that ran.

    ``count_flops``: the costing pass, which also counts op bytes and, grad enabled, saved bytes.
    """
    try:
        args, kwargs = _to_device((args, kwargs), device)
    except RuntimeError as err:
        raise TraceError(f"cannot move the example inputs to {device}: {err}") from err
    counter = FlopCounterMode(display=False) if count_flops else None
    written = OpBytesCounter() if count_flops else None
    recorder = CallRecorder(
        inventory.modules,
        inventory.names,
        example_inputs=tensors_in((args, kwargs)),
        total_flops=counter.get_total_flops if counter else _zero,
        total_bytes=written.get_total_bytes if written else _zero,
        clock=clock,
    )
    param_swap, buffer_swap = _substitutes(device, home)
    with _swapped_weights(inventory.modules, param_swap, buffer_swap):
        saved = (SavedBytesCounter(recorder.running_module, _weights_of(model), tensors_in((args, kwargs)))
                 if count_flops and grad else None)
        recorder.kept_bytes = saved.kept_bytes if saved is not None else None
        with recorder, counter or contextlib.nullcontext(), written or contextlib.nullcontext(), \
                saved or contextlib.nullcontext(), torch.set_grad_enabled(grad):
            try:
                output = model(*args, **kwargs)
            except Exception as err:
                culprit = recorder.running_module()
                name = recorder.name_of(culprit) if culprit is not None else None
                module = inventory.modules[culprit] if culprit is not None else model
                raise _ForwardFailed(name, type(module).__name__, err, device) from err
            if saved is not None:  # the loss will keep the outputs it is computed from
                for t in tensors_in(output):
                    if t.requires_grad:
                        producer = recorder.producer_of(t)
                        saved.count(t, producer)
                        if producer is not None:  # kept by the loss even if its module is checkpointed
                            stats = recorder.stats[producer]
                            stats.checkpoint_bytes = (stats.checkpoint_bytes or 0) + saved.kept_bytes([t])
                for i, size in saved.by_module.items():
                    recorder.stats[i].saved_bytes += size
            ran = list(model.parameters())  # the substitutes, while they are swapped in
    return recorder, output, ran


def _measure_seconds(model, inventory, args, kwargs, device, home,
                     recomputed: set[int] = frozenset()) -> tuple[list[float], float]:
    """Per module: measured forward self seconds, plus its share of the measured backward; and the
    forward's share of the model's forward + backward time.

    The forwards of ``recomputed`` modules (and what they call) run again inside the measured
    backward: that time is taken out, so the shares are those of the model without recomputation.
    """
    clock = _clock_for(device)
    _forward(model, inventory, args, kwargs, device, home)  # warm-up: first calls are slow
    start = clock()
    recorder, output, params = _forward(model, inventory, args, kwargs, device, home, clock=clock, grad=True)
    forward_s = clock() - start
    outputs = [t for t in tensors_in(output) if t.requires_grad]
    weights = [p for p in params if p.requires_grad]
    backward_s = 0.0
    if outputs and weights:
        start = clock()
        loss = sum(t.float().sum() for t in outputs)
        torch.autograd.grad(loss, weights, allow_unused=True)
        backward_s = clock() - start
        inside = _inside_any(inventory, recomputed)
        backward_s = max(backward_s - sum(recorder.stats[i].seconds for i in inside), 0.0)
    scale = 1.0 + backward_s / forward_s if forward_s > 0 else 1.0
    return [stats.seconds * scale for stats in recorder.stats], 1.0 / scale


# ==================================================================== activation checkpointing
def recomputes_forward(module: nn.Module) -> bool:
    """Whether ``module``'s instance ``forward`` (or a forward it wraps) recomputes in the backward."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return False
    try:
        inner = inspect.unwrap(forward, stop=lambda f: bool(getattr(f, RECOMPUTED_FORWARD, False)))
    except ValueError:  # a cycle of __wrapped__
        return False
    return bool(getattr(inner, RECOMPUTED_FORWARD, False))


def _recomputed_modules(inventory: ModuleInventory) -> set[int]:
    return {i for i, module in enumerate(inventory.modules) if recomputes_forward(module)}


def _inside_any(inventory: ModuleInventory, roots: set[int]) -> set[int]:
    """Indices of the modules in the subtrees of modules ``roots`` (those included)."""
    prefixes = [name for i in roots for name in inventory.names[i]]
    return {i for i, names in enumerate(inventory.names)
            if any(n == p or p == "" or n.startswith(p + ".") for n in names for p in prefixes)}


def _mark_checkpointed(tree: ModuleTree, names: list[str]) -> None:
    """Mark the nodes of checkpointed modules (outermost first) and their subtrees recomputed."""
    for name in sorted(names, key=lambda n: (n.count(".") + bool(n), n)):
        node = tree.node(name)
        if not node.recomputed:
            mark_recomputed(node)


# ==================================================================== weights and devices
Swap = Callable[[torch.Tensor], torch.Tensor] | None


def _substitutes(device: torch.device, home: torch.device) -> tuple[Swap, Swap]:
    """How to stand in for parameters and buffers on ``device`` (None: use them as they are).

    Meta: a meta tensor of the same shape for each one not on meta already (nothing allocated,
    nothing copied; a model can hold both, as a rank's does once it released the other stages'
    weights). The model's own device: the parameters in place and *copies* of the buffers, so
    BatchNorm's running statistics stay as they were. Elsewhere: copies of everything on ``device``.
    """
    if device.type == "meta":
        return (lambda p: p if p.is_meta else nn.Parameter(torch.empty_like(p, device=META), p.requires_grad),
                lambda b: b if b.is_meta else torch.empty_like(b, device=META))
    if _same_device(device, home):
        return None, torch.clone
    return (lambda p: nn.Parameter(p.detach().to(device), p.requires_grad),
            lambda b: b.to(device))


@contextlib.contextmanager
def _swapped_weights(
    modules: list[nn.Module], params: Swap, buffers: Swap
) -> Iterator[dict[int, torch.Tensor]]:
    """Temporarily replace each module's own parameters and buffers by substitutes.

    Works on each module object's own tables, so a tensor shared by several modules gets one
    substitute (ties survive) and a module registered under several names is swapped and
    restored exactly once. (``torch.func.functional_call`` restores such aliased modules with
    the substitute, corrupting the model.) Yields ``{id(original): substitute}``.
    """
    made: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in modules:
            for table, make in ((module._parameters, params), (module._buffers, buffers)):
                if make is None:
                    continue
                for name, tensor in table.items():
                    if tensor is not None:
                        if id(tensor) not in made:
                            made[id(tensor)] = make(tensor)
                        saved.append((table, name, tensor))
                        table[name] = made[id(tensor)]
        yield made
    finally:
        for table, name, tensor in reversed(saved):
            table[name] = tensor


def _weights_of(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer the model runs with right now (substitutes while swapped)."""
    return [*model.parameters(), *model.buffers()]


def _trainable(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a backward would run at all: some parameter or input requires grad."""
    return any(p.requires_grad for p in model.parameters()) or any(
        t.requires_grad for t in tensors_in((args, kwargs)))


def _named_tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _home_device(model: nn.Module) -> torch.device:
    """Where the model lives: meta if any weight is on meta, else its first weight's device."""
    devices = [t.device for _, t in _named_tensors(model)]
    if any(d.type == "meta" for d in devices):
        return META
    return devices[0] if devices else torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _to_device(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _clock_for(device: torch.device) -> Callable[[], float]:
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def _zero() -> float:
    return 0.0


# ==================================================================== argument checks
def _check_arguments(model, example_args, example_kwargs, param_memory_factor) -> tuple[tuple, dict]:
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TraceError(
            f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}"
        )
    if not param_memory_factor >= 0:
        raise ConfigError(f"param_memory_factor must be >= 0 (4 = weights, grads, two Adam moments), "
                          f"got {param_memory_factor}")
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    return args, dict(example_kwargs or {})


def _as_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise TraceError(f"unknown trace device {device!r}: use 'meta', 'cpu', 'cuda' or None") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TraceError(f"trace device {str(device)!r}: CUDA is not available here; use 'meta' or 'cpu'")
    return device
