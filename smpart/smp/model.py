"""SMP's model and optimizer wrappers and its model-building controls, on smpart's.

`DistributedModel` and `DistributedOptimizer` are smpart's, with SMP's extra keyword arguments
and methods. SMP let a script wrap one model and one optimizer; the last ones made are
``smp.state.model`` / ``smp.state.optimizer``, which ``smp.resume_from_checkpoint`` loads into.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import smpart.runtime as runtime_api
from smpart.errors import SmpartError
from smpart.runtime.grad_scaler import GradScaler
from smpart.runtime.placement.activation_checkpointing import (
    set_activation_checkpointing as _set_checkpointing,
)
from smpart.runtime.runtime import running_runtime
from smpart.smp import groups
from smpart.smp.config import say_once
from smpart.smp.state import state
from smpart.tensor_parallel import distributed_modules as _distributed_modules
from smpart.tensor_parallel import set_tensor_parallelism as _set_tensor_parallelism
from smpart.tensor_parallel import tensor_parallelism as _tensor_parallelism

#: SMP's ``DistributedModel`` keyword arguments that mean nothing here, and why.
_MODEL_KWARGS_WITHOUT_EFFECT = {
    "trace_device": "smpart traces on the meta device",
    "trace_execution_times": "the partition balances FLOPs and memory measured on the meta device",
    "trace_memory_usage": "memory is measured on the meta device",
    "overlapping_allreduce": "data-parallel gradients are always averaged in buckets as soon as a stage's "
                             "are final",
    "backward_passes_per_step": "gradients are averaged over the replicas at every step, which gives the "
                                "same sums when a script accumulates steps",
    "bucket_cap_mb": "smpart sizes its own gradient buckets",
    "gradient_as_bucket_view": "smpart averages gradients in place",
}
_MODEL_DEFAULTS = {"trace_device": "gpu", "trace_execution_times": False, "trace_memory_usage": False,
                   "overlapping_allreduce": True, "backward_passes_per_step": 1, "bucket_cap_mb": 25,
                   "gradient_as_bucket_view": False}

#: Modules created inside ``smp.partition(i)``, by weak reference: module -> i.
_PARTITION_MARKS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_PARTITION_CONTEXT: list[int] = []
_PARTITION_HOOKS: list[RemovableHandle] = []


class DistributedModel(runtime_api.DistributedModel):
    """``smp.DistributedModel(module, **SMP's keyword arguments)``: smpart's `DistributedModel`.

    ``average_grads_across_microbatches`` and ``broadcast_buffers`` act as in SMP; the others tuned
    SMP's own tracing and DDP wrapper, are accepted, and said once to have no effect here.
    """

    def __init__(self, module: nn.Module, trace_device: str = "gpu", trace_execution_times: bool = False,
                 overlapping_allreduce: bool = True, backward_passes_per_step: int = 1,
                 average_grads_across_microbatches: bool = True, bucket_cap_mb: int = 25,
                 trace_memory_usage: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False, **unknown: Any) -> None:
        if unknown:
            known = sorted([*_MODEL_KWARGS_WITHOUT_EFFECT, "average_grads_across_microbatches",
                            "broadcast_buffers"])
            raise SmpartError(f"smp.DistributedModel got unknown keyword argument(s) {sorted(unknown)}; "
                              f"SMP's are {known}")
        given = {"trace_device": trace_device, "trace_execution_times": trace_execution_times,
                 "trace_memory_usage": trace_memory_usage, "overlapping_allreduce": overlapping_allreduce,
                 "backward_passes_per_step": backward_passes_per_step, "bucket_cap_mb": bucket_cap_mb,
                 "gradient_as_bucket_view": gradient_as_bucket_view}
        for name, value in given.items():
            if value != _MODEL_DEFAULTS[name]:
                say_once(f"DistributedModel.{name}", f"DistributedModel({name}={value!r}) has no effect: "
                         f"{_MODEL_KWARGS_WITHOUT_EFFECT[name]}")
        super().__init__(module, broadcast_buffers=broadcast_buffers)
        _average_over_microbatches(average_grads_across_microbatches)
        _master_weights_in_float32(module)
        _apply_partition_contexts(module)
        #: RemovableHandle keeps its dict by weak reference, which a plain dict refuses
        self._post_partition_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
        state.model = self

    # ------------------------------------------------------------------ SMP's additions
    @property
    def partitioned(self) -> bool:
        """Whether the model was partitioned (at its first step)."""
        return self.partition is not None

    def get_module(self) -> nn.Module:
        return self.module

    def backward(self, tensors: torch.Tensor, grad_tensors: torch.Tensor | None = None) -> None:
        """The pipelined backward of this micro-batch; with fp16, of the loss times the loss scale."""
        scaler = getattr(state.optimizer, "loss_scaler", None)
        if scaler is not None and grad_tensors is None:
            tensors = scaler.scale(tensors)
        super().backward(tensors, grad_tensors)

    def register_post_partition_hook(self, hook: Callable[[Any, Any], Any]) -> RemovableHandle:
        """Run ``hook(model, optimizer)`` on every rank once the model is partitioned and placed,
        before its first forward."""
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        self._after_placement.append(lambda: self._post_partition_hooks.pop(handle.id, lambda *_: None)(
            self, state.optimizer))
        return handle

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules of this rank's stage (every module on threads, or before the partition)."""
        if self.partition is None or not groups.on_processes():
            return self.module.named_modules()
        stages, mine = self.partition.module_stages(), groups.pp_rank()
        return ((name, m) for name, m in self.module.named_modules() if stages.get(name, mine) == mine)

    def local_modules(self) -> Iterator[nn.Module]:
        return (m for _, m in self.local_named_modules())

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((name, p) for name, p in self.module.named_parameters() if not p.is_meta)

    def local_parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.local_named_parameters())

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, b) for name, b in self.module.named_buffers() if not b.is_meta)

    def local_buffers(self) -> Iterator[torch.Tensor]:
        return (b for _, b in self.local_named_buffers())

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """A full state dict (the unsplit model's, or `state_dict`'s), or a partial one: what
        `local_state_dict` gave (tensor-parallel shards as this rank holds them), merged over the
        stages by ``smp.load(..., partial=True)``."""
        state_dict = {k: v for k, v in state_dict.items() if k != "_smp_is_partial"}
        every = self.module.state_dict(keep_vars=True)
        partial = any(k not in state_dict for k in every) or any(
            tuple(state_dict[k].shape) != tuple(v.shape) for k, v in every.items())
        if not partial:
            return super().load_state_dict(state_dict, strict=strict)
        if self.partition is None and groups.tp_size() > 1:  # shards fit only once the layers are split
            self._after_placement.append(lambda: self._load_partial(state_dict))
            return nn.modules.module._IncompatibleKeys([], [])
        return self._load_partial(state_dict)

    def _load_partial(self, state_dict: dict[str, Any]) -> Any:
        live = self.module.state_dict(keep_vars=True)
        held = [k for k in live if not live[k].is_meta]
        missing = [k for k in held if k not in state_dict]
        wrong = [k for k in held
                 if k in state_dict and tuple(_local(live[k]).shape) != tuple(state_dict[k].shape)]
        if missing or wrong:
            raise SmpartError(f"this partial state dict does not hold what this rank holds (missing "
                              f"{missing[:5]}, other shapes {wrong[:5]}): it was saved under another layout. "
                              "smp.save_checkpoint / smp.resume_from_checkpoint load into any layout; or "
                              "save a full state dict (model.state_dict(), smp.save(..., partial=False))")
        with torch.no_grad():
            for key in held:
                _local(live[key]).copy_(state_dict[key])
        return nn.modules.module._IncompatibleKeys([], [])

    # tensor parallelism: SMP's questions about parameters
    def distributed_modules(self) -> Iterator[nn.Module]:
        return (m for _, m in _distributed_modules(self.module))

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        return _is_sharded(param)

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        return _is_sharded(buf)

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        """Always False: smpart's tensor-parallel ranks compute on one batch, so no parameter sees
        the group's batches apart."""
        return False

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        return False

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every parameter: all are averaged over the data-parallel replicas."""
        return self.local_named_parameters()

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(())

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise SmpartError("model.join() was DDP's training with uneven inputs; smpart's replicas step "
                          "together, so give every rank the same number of batches (a DistributedSampler "
                          "with drop_last=True over smp.rdp_size() replicas)")

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise SmpartError("model.register_comm_hook() hooked into DDP's all-reduce; smpart averages each "
                          "stage's gradients over the replicas itself. Change gradients after the step, "
                          "before optimizer.step(), instead")


class DistributedOptimizer(runtime_api.DistributedOptimizer):
    """``smp.DistributedOptimizer(optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
    **dynamic_loss_args)``: smpart's `DistributedOptimizer`. With ``fp16`` in the configuration it
    scales the loss (`smpart.amp.GradScaler`, every rank agreeing on the scale) and skips a step
    whose gradients overflowed (``optimizer.overflow``), as SMP's fp16 optimizer did."""

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float | None = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict[str, Any] | None = None,
                 **more_dynamic_loss_args: Any) -> None:
        super().__init__(optimizer)
        self.loss_scaler: GradScaler | None = None
        self._static_scale: float | None = None
        self.overflow = False
        if state.cfg.fp16:
            args = {**(dynamic_loss_args or {}), **more_dynamic_loss_args}
            self.loss_scaler = _loss_scaler(static_loss_scale, dynamic_loss_scale, args)
            if not dynamic_loss_scale:
                self._static_scale = float(static_loss_scale or 1.0)
        state.optimizer = self

    def step(self, closure: Any = None) -> Any:
        if self.loss_scaler is None:
            return super().step(closure)
        scaler, self.loss_scaler = self.loss_scaler, None  # scaler.step calls step() once, unscaled
        try:
            result = scaler.step(self)
            found = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
            self.overflow = any(bool(flag.item()) for flag in found.values())
            scaler.update(self._static_scale)
        finally:
            self.loss_scaler = scaler
        return result

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """SMP's fp16 clipping: unscale the gradients, then clip them over the whole model."""
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(self)
        return self.clip_grad_norm_(max_norm, norm_type)

    def local_state_dict(self, gather_if_shard: bool = True) -> dict[str, Any]:
        return super().local_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A full state dict, or a partial one merged by ``smp.load(..., partial=True)``; with
        tensor parallelism, shards as this rank held them, taken once the layers are split."""
        state_dict = {k: v for k, v in state_dict.items() if k != "_smp_is_partial"}
        model = state.model
        if groups.tp_size() > 1 and model is not None and model.partition is None:
            model._after_placement.append(lambda: self.load_state_dict(state_dict))
            return
        super().load_state_dict(state_dict)
        for param, entry in self.optimizer.state.items():
            if hasattr(param, "device_mesh"):  # a shard: its state read back as plain tensors
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and not hasattr(value, "device_mesh") and \
                            value.shape == param.to_local().shape:
                        entry[key] = type(param).from_local(value, param.device_mesh, param.placements)


def _loss_scaler(static_loss_scale: float | None, dynamic: bool, args: dict[str, Any]) -> GradScaler:
    unused = sorted(set(args) - {"init_scale", "scale_factor", "scale_window"})
    if unused:
        say_once("dynamic_loss_args", f"dynamic_loss_args {unused} have no equivalent in torch's GradScaler "
                 "and are not used")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dynamic:
        return GradScaler(device, init_scale=float(static_loss_scale or 1.0))
    factor = float(args.get("scale_factor", 2.0))
    return GradScaler(device, init_scale=float(args.get("init_scale", 2.0 ** 32)), growth_factor=factor,
                      backoff_factor=1.0 / factor, growth_interval=int(args.get("scale_window", 1000)))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter's shard on this rank; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _is_sharded(tensor: torch.Tensor) -> bool:
    return any(p.is_shard() for p in getattr(tensor, "placements", ()))


def _average_over_microbatches(average: bool) -> None:
    """SMP's per-model ``average_grads_across_microbatches`` is smpart's configuration's (SMP had
    one model): set on the running configuration before the model's first step."""
    runtime = running_runtime()
    if runtime is not None and runtime.config.average_grads_across_microbatches != average:
        runtime.config = runtime.config.replace(average_grads_across_microbatches=average)


def _master_weights_in_float32(module: nn.Module) -> None:
    """With fp16 / bf16 configured, weights made in that dtype (``smp.model_creation(dtype=...)``) are
    kept in float32 and the steps run under autocast: SMP's float32 master copy, by torch's means."""
    half = torch.float16 if state.cfg.fp16 else torch.bfloat16 if state.cfg.bf16 else None
    if half is None or not any(p.dtype == half for p in module.parameters()):
        return
    say_once("master_weights", f"the model's {half} weights are kept in float32 and the steps run under "
             f"torch.autocast({half}), in place of SMP's {half} model with float32 master weights")
    for param in module.parameters():
        if param.dtype == half:
            param.data = param.data.float()


# ==================================================================== partitions
def _mark_partition(_parent: nn.Module, _name: str, value: Any) -> None:
    if _PARTITION_CONTEXT and isinstance(value, nn.Module):
        _PARTITION_MARKS[value] = _PARTITION_CONTEXT[-1]


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created (attached to a parent) inside the block go to partition ``index``; nested
    blocks: the innermost wins. Used with ``auto_partition: False`` (the rest goes to
    ``default_partition``); with auto-partitioning SMP ignored these blocks, and so does smpart."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise SmpartError(f"smp.partition(index): index must be an int >= 0, got {index!r}")
    if not _PARTITION_CONTEXT:
        from torch.nn.modules import module as module_hooks

        _PARTITION_HOOKS.append(module_hooks.register_module_module_registration_hook(_mark_partition))
    _PARTITION_CONTEXT.append(index)
    try:
        yield
    finally:
        _PARTITION_CONTEXT.pop()
        if not _PARTITION_CONTEXT:
            while _PARTITION_HOOKS:
                _PARTITION_HOOKS.pop().remove()


def set_partition(module: nn.Module, index: int) -> None:
    """Put ``module`` (and what it holds) on partition ``index``; before the model's first step."""
    runtime_api.set_partition(module, index)


def _apply_partition_contexts(model: nn.Module) -> None:
    marked = [(m, _PARTITION_MARKS[m]) for m in model.modules() if m in _PARTITION_MARKS]
    if state.cfg.auto_partition:
        if marked:
            say_once("partition contexts", "smp.partition(...) blocks are ignored with auto_partition (as in "
                     "SMP); set auto_partition: False and default_partition to partition by hand")
        return
    runtime_api.set_partition(model, state.cfg.default_partition)
    for module, index in marked:
        runtime_api.set_partition(module, index)


# ==================================================================== model building
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> contextlib.AbstractContextManager:
    """Mark the modules created inside for tensor parallelism (``enabled``) or to stay whole."""
    _said_kwargs("tensor_parallelism", kwargs)
    return _tensor_parallelism(enabled)


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    _said_kwargs("set_tensor_parallelism", kwargs)
    _set_tensor_parallelism(module, enabled)


def _said_kwargs(where: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        say_once(f"{where} kwargs", f"{where}({', '.join(sorted(kwargs))}=...) configured SMP's own "
                 "distributed modules and fused kernels; smpart splits torch's layers as they are, so these "
                 "have no effect")


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False, strategy: str = "each") -> None:
    """Recompute ``module``'s forward in the backward; for an ``nn.Sequential``, each of its layers."""
    if strategy != "each" or pack_args_as_tuple:
        say_once("checkpoint strategy", f"set_activation_checkpointing(strategy={strategy!r}, "
                 f"pack_args_as_tuple={pack_args_as_tuple}) checkpoints each layer of the sequential: the "
                 "same gradients, memory saved per layer")
    layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    for layer in layers:
        _set_checkpointing(layer, preserve_rng_state=preserve_rng_state)


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Build the model inside on the meta device: no memory, no initialisation until each rank
    materialises its own stage at the first step (a Hugging Face model by its ``_init_weights``,
    others by each module's ``reset_parameters()``)."""
    with torch.device("meta") if enabled else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config: Any) -> Iterator[None]:
    """SMP's one block for making a model: tensor parallelism marks, delayed initialisation (when
    ``delayed_parameter_initialization`` is configured) and a default dtype."""
    _said_kwargs("model_creation", tensor_parallel_config)
    previous = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        if tensor_parallelism:
            stack.enter_context(_tensor_parallelism(True))
        stack.enter_context(delay_param_initialization(state.cfg.delayed_parameter_initialization))
        if dtype is not None:
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, previous)
        yield
