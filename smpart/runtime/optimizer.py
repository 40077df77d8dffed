"""`DistributedOptimizer`: any torch optimizer, over parameters that live on their stages.

Placement moves parameters in place (the same `nn.Parameter` objects), so the wrapped optimizer
needs no translation: each parameter's state is created on its own device at the first step.
With ``shard_optimizer_state=True`` and data parallelism, the first step hands each replica its
share of the parameters (`zero`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from smpart.errors import SmpartError
from smpart.runtime.placement.place import adopt_replacements
from smpart.runtime.processes.grad_clip import clip_grad_norm_, model_parallel_groups
from smpart.runtime.processes.zero import ShardedState
from smpart.runtime.runtime import process_setup, running_runtime

_optimizer_ids = itertools.count()
_optimizers: weakref.WeakValueDictionary[int, DistributedOptimizer] = weakref.WeakValueDictionary()


def optimizer_by_id(optimizer_id: int) -> DistributedOptimizer | None:
    return _optimizers.get(optimizer_id)


def optimizers_over(params: Iterable[torch.Tensor]) -> list[DistributedOptimizer]:
    """The optimizers that step any of ``params``, in creation order."""
    wanted = {id(p) for p in params}
    found = []
    for _, optimizer in sorted(_optimizers.items()):
        optimizer._adopt_replaced_parameters()
        if any(id(p) in wanted for group in optimizer.param_groups for p in group["params"]):
            found.append(optimizer)
    return found


class DistributedOptimizer(torch.optim.Optimizer):
    """``smpart.DistributedOptimizer(optimizer)``: steps ``optimizer`` over the model's parameters,
    wherever their stages put them; ``.optimizer`` is the one it wraps.

    It is a `torch.optim.Optimizer` to whoever asks (learning-rate schedulers check), but
    `Optimizer.__init__` never runs: its parameter groups, state, defaults and hooks are the
    wrapped optimizer's, shared, so a scheduler's learning rates reach the optimizer that steps.
    """

    #: `torch.amp.GradScaler` gives an optimizer that unscales in its own step (a fused Adam) the
    #: scale as attributes; set on this wrapper they would not reach the wrapped optimizer, which
    #: would step with scaled gradients. False: the scaler unscales the gradients, then steps.
    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise SmpartError("this optimizer is already a DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SmpartError("DistributedOptimizer wraps a torch.optim.Optimizer, "
                              f"got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._sharded: Any = None  # zero.ShardedState, from the first step on when enabled
        # Numbered in creation order, the same on every rank (SPMD): how a rank asks another for
        # its part of the state dict.
        self.optimizer_id = next(_optimizer_ids)
        _optimizers[self.optimizer_id] = self
        self._loaded_before_placement = False  # state for every stage, until a step drops the others'

    def step(self, closure: Any = None) -> Any:
        self._adopt_replaced_parameters()
        self._drop_released_state()
        sharded = self._sharded_state()
        result = self.optimizer.step(closure)
        if sharded is not None:
            steps = running_runtime().steps_taken
            sharded.broadcast(max(0, steps - 1))  # after the last step
        return result

    def _sharded_state(self) -> Any:
        if self._sharded is None:
            runtime = running_runtime()
            setup = process_setup()
            if setup is not None and runtime.config.shard_optimizer_state and setup.layout.dp > 1:
                self._sharded = ShardedState(self.optimizer, setup.dp_group, setup.layout.dp,
                                             runtime.attendance, runtime.config.timeout_s)
        return self._sharded

    def _all_parameters(self) -> list[torch.Tensor]:
        """Every parameter of the optimizer, including those another replica's state owns."""
        if self._sharded is not None:
            return list(self._sharded.params)
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _adopt_replaced_parameters(self) -> None:
        """Hold the parameters placement put in place of others (`placement.REPLACED`) before
        anything reads them, not only at a step."""
        adopt_replacements(self.optimizer)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every gradient by the norm over the whole model (all stages, all shards), counting
        a tied or replicated parameter once; returns the total norm, as the unsplit model's
        ``torch.nn.utils.clip_grad_norm_`` would. Under ``torchrun`` every rank must call it."""
        groups, replicated_over = model_parallel_groups(process_setup())
        self._adopt_replaced_parameters()
        params = self._all_parameters()
        return clip_grad_norm_(params, max_norm, norm_type, groups=groups or None,
                               replicated_over=replicated_over, error_if_nonfinite=error_if_nonfinite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._sharded is not None:  # the parameters other replicas update have gradients too
            for p in self._sharded.params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict for the whole model: what the same optimizer over the
        unsplit model would give, to load into it or into this one under any pipeline split.

        Under ``torchrun`` each rank holds the state of its own stage's parameters; the other
        stages' ranks send theirs (tensors on the CPU), as for `DistributedModel.state_dict`: call
        it on every rank, or on the first rank alone. With tensor parallelism or sharded optimizer
        state the state is split in ways a plain optimizer cannot load: save a checkpoint
        (`smpart.save_checkpoint`), which loads into any layout; `local_state_dict` is this rank's."""
        runtime = self._process_runtime()
        if runtime is None:
            return self.optimizer.state_dict()
        if runtime.layout.tp > 1 or self._sharded is not None or (
                runtime.config.shard_optimizer_state and runtime.layout.dp > 1):
            raise SmpartError("with tensor parallelism or sharded optimizer state, the optimizer's state "
                              "dict is split in ways a plain optimizer cannot load: use "
                              "smpart.save_checkpoint(path, model, optimizer) (it loads into any layout), "
                              "or local_state_dict() for this rank's part")
        own = self.local_state_dict()
        parts = runtime.gather_state("optimizer", self.optimizer_id, own)
        state = {index: entry for part in parts for index, entry in part["state"].items()}
        return {"state": dict(sorted(state.items())), "param_groups": own["param_groups"]}

    def local_state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict with the state of only the parameters this rank holds
        (its stage's; under ``torchrun`` the others are on the meta device), every group."""
        full = self.optimizer.state_dict()
        held = self._held_indices()
        return {"state": {i: entry for i, entry in full["state"].items() if i in held},
                "param_groups": full["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of the whole model's optimizer (`state_dict`, or a plain optimizer's):
        each rank takes the state of the parameters it holds."""
        held = self._held_indices()
        state = {i: entry for i, entry in state_dict["state"].items() if int(i) in held}
        self.optimizer.load_state_dict({**state_dict, "state": state})
        self._loaded_before_placement = self._process_runtime() is None

    def _drop_released_state(self) -> None:
        """A state dict loaded before the model's placement (a resumed job) gave this rank the state
        of every stage's parameters; once the others' are released to the meta device, so is theirs."""
        if self._loaded_before_placement and self._process_runtime() is not None:
            self._loaded_before_placement = False
            for param in [p for p in self.optimizer.state if p.is_meta]:
                del self.optimizer.state[param]

    def _held_indices(self) -> set[int]:
        """The state-dict indices (torch numbers the parameters group by group) of the parameters
        held here, not released to the meta device."""
        params = (p for group in self.optimizer.param_groups for p in group["params"])
        return {i for i, p in enumerate(params) if not p.is_meta}

    @staticmethod
    def _process_runtime() -> Any:
        """The running process runtime once it placed a model (this rank then holds a stage only)."""
        runtime = running_runtime()
        placed = runtime is not None and runtime.setup is not None and runtime.models
        return runtime if placed else None

    def add_param_group(self, group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(group)

    def __getattr__(self, name: str) -> Any:
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    # Optimizer's own pickle support would keep only the groups and the state, not what is wrapped.
    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
