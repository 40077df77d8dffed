"""Activation checkpointing: a module keeps only its inputs, and runs its forward again in the backward.

Between a micro-batch's forward and its backward, autograd keeps every tensor some backward
formula needs: a transformer block's attention scores, its MLP's hidden states. A *checkpointed*
module keeps only the tensors it was called with; when the backward reaches it,
``torch.utils.checkpoint`` (the non-reentrant variant) runs its forward once more and its
activations live only for the length of its own backward. The model's activation memory drops
from the sum of every block's saved tensors to the sum of the blocks' inputs (plus one block's
saved tensors, rebuilt at a time), for the price of one more forward of each checkpointed module.

Three tricks keep it invisible to the user's model:

- **No wrapper module.** Checkpointing goes into the module's own ``forward``, as an instance
  attribute (`CheckpointedForward`), not around it: the module tree, parameter names, state dicts,
  the trace and the partition are the user's, unchanged. ``module(...)`` still runs the module's
  own hooks, once, outside the recomputed region; ``inspect.signature(module.forward)`` is the
  original's. Placement (`smpart.runtime.reference.calls.StagedForward`) is installed *after* and calls the
  instance forward it finds, so `apply` must run before the model is placed.
- **The same dropout twice.** The recomputation restores the RNG state the first forward started
  from (``preserve_rng_state=True``), so a dropout inside the module draws the same mask and the
  gradients are those of the model without checkpointing.
- **Keyword arguments travel as positional ones.** ``checkpoint`` saves its positional tensors for
  the backward (checking they were not modified in place meanwhile) but would merely close over
  keyword ones; flattening them into the positional list gives every input the same treatment,
  avoids clashes with checkpoint's own keywords (``debug=...``), and lets the tracer's saved-bytes
  counter see exactly what a checkpointed module keeps.

Which modules: `checkpointed_names` resolves `Config.activation_checkpointing` (qualified names or
fnmatch patterns) plus the modules registered with `set_activation_checkpointing` (SMP's call) to
module names, outermost first: a module inside a checkpointed one is already recomputed.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from smpart.errors import ConfigError
from smpart.runtime.reference.calls import WrappedForward
from smpart.runtime.reference.handles import materialise_all
from smpart.tracing.tracer import RECOMPUTED_FORWARD


class CheckpointRegistry:
    """Modules marked for checkpointing by `set_activation_checkpointing`, held by weak reference
    (marking a module never keeps it, or its model, alive)."""

    def __init__(self) -> None:
        self._modules: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    def add(self, module: nn.Module, preserve_rng_state: bool = True) -> None:
        self._modules[module] = preserve_rng_state

    def discard(self, module: nn.Module) -> None:
        self._modules.pop(module, None)

    def __contains__(self, module: object) -> bool:
        try:
            return module in self._modules
        except TypeError:  # unhashable
            return False

    def preserve_rng_state(self, module: nn.Module, default: bool = True) -> bool:
        return self._modules.get(module, default)

    def __len__(self) -> int:
        return len(self._modules)


#: The registry `set_activation_checkpointing` writes to and `checkpointed_names` reads by default.
REGISTRY = CheckpointRegistry()


def set_activation_checkpointing(module: nn.Module, *, preserve_rng_state: bool = True) -> None:
    """Mark ``module`` to be checkpointed when its model is wrapped (SMP's ``set_activation_checkpointing``).

    ``preserve_rng_state=False`` skips saving and restoring the RNG state: faster, but a dropout
    inside the module then draws a different mask in the recomputation.
    """
    if not isinstance(module, nn.Module):
        raise ConfigError(f"set_activation_checkpointing takes an nn.Module, got {type(module).__name__}")
    REGISTRY.add(module, preserve_rng_state)


class CheckpointedForward(WrappedForward):
    """A module's ``forward`` whose activations are recomputed in the backward instead of kept."""

    def __init__(self, module: nn.Module, preserve_rng_state: bool = True) -> None:
        super().__init__(module)
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward, as it was before checkpointing."""
        return self.original(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved without autograd: nothing to recompute
            return self.forward(*args, **kwargs)
        # A tensor held by another stage (`handles`) is fetched now, not inside the recomputed region.
        args, kwargs = materialise_all((args, kwargs))
        keys = tuple(kwargs)
        return checkpoint(self._unflatten, len(args), keys, *args, *kwargs.values(),
                          use_reentrant=False, preserve_rng_state=self.preserve_rng_state)

    def _unflatten(self, num_args: int, keys: tuple[str, ...], *flat: Any) -> Any:
        return self.forward(*flat[:num_args], **dict(zip(keys, flat[num_args:], strict=True)))

    def __repr__(self) -> str:
        return f"CheckpointedForward({type(self.module).__name__})"


# what the tracer looks for: this forward's activations are not kept, it runs twice
setattr(CheckpointedForward, RECOMPUTED_FORWARD, True)


# ------------------------------------------------------------------------------ which modules
def checkpointed_names(model: nn.Module, patterns: Iterable[str] = (),
                       registry: CheckpointRegistry | None = REGISTRY) -> list[str]:
    """Names of the modules of ``model`` to checkpoint, in registration order.

    A module is chosen when one of its qualified names equals a pattern or matches it as an
    fnmatch pattern (``"transformer.h.*"``; the root only by the exact name ``""``), or when it is
    in ``registry``. Only the outermost chosen modules are returned (``"transformer.h.*"`` also
    matches ``transformer.h.0.attn``, which its block already recomputes), each module once, under
    its first name. Raises `ConfigError` naming a pattern that matches no module.
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not all(isinstance(p, str) for p in patterns):
        raise ConfigError("activation_checkpointing must be a list of module names or patterns, "
                          f"got {patterns!r}")
    chosen: dict[int, str] = {}
    matched: set[str] = set()
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
        hits = [p for p in patterns if _matches(name, p)]
        matched.update(hits)
        if hits or (registry is not None and module in registry):
            chosen.setdefault(id(module), names[id(module)][0])
    unmatched = [p for p in patterns if p not in matched]
    if unmatched:
        raise ConfigError(f"activation_checkpointing pattern(s) {unmatched} match no module of "
                          f"{type(model).__name__}; use qualified names as model.named_modules() gives "
                          f"them, e.g. {_examples(model)}")
    # outermost only: drop a module if any name of an ancestor module was chosen
    chosen_names = {n for i in chosen for n in names[i]}
    return [name for i, name in chosen.items()
            if not any(_inside(n, c) for n in names[i] for c in chosen_names if c != n)]


def _matches(name: str, pattern: str) -> bool:
    if name == pattern:
        return True
    return name != "" and fnmatch.fnmatchcase(name, pattern)


def _inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name.startswith(ancestor + ".")


def _examples(model: nn.Module, count: int = 4) -> list[str]:
    return [name for name, _ in model.named_modules() if name][:count]


# ------------------------------------------------------------------------------ installing
def apply(model: nn.Module, names: Iterable[str], *, preserve_rng_state: bool = True,
          registry: CheckpointRegistry | None = REGISTRY) -> list[str]:
    """Checkpoint each named module of ``model``; returns the names newly checkpointed.

    Call it before the model is placed on stages. A module already checkpointed is left as it is.
    ``preserve_rng_state`` applies to modules the registry holds no choice for.
    """
    done = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError as err:
            raise ConfigError(f"activation checkpointing: {type(model).__name__} has no module {name!r}; "
                              "give names as model.named_modules() lists them") from err
        if is_checkpointed(module):
            continue
        keep_rng = registry.preserve_rng_state(module, preserve_rng_state) if registry else preserve_rng_state
        module.forward = CheckpointedForward(module, keep_rng)  # type: ignore[method-assign]
        done.append(name)
    return done


def remove(model: nn.Module) -> int:
    """Undo `apply` on every module of ``model`` (call it after the model's placement was removed).

    Returns how many modules were restored.
    """
    return sum(uncheckpoint(module) for module in model.modules())


def uncheckpoint(module: nn.Module) -> bool:
    """Undo `apply` on one module; False if it was not checkpointed."""
    wrapper = module.__dict__.get("forward")
    if not isinstance(wrapper, CheckpointedForward):
        return False
    if wrapper.instance_forward is not None:
        module.forward = wrapper.instance_forward  # type: ignore[method-assign]
    else:
        del module.forward
    return True


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` recomputes its forward in the backward (also once placed on a stage,
    where the runtime's routing forward wraps the checkpointed one)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, CheckpointedForward) or isinstance(getattr(forward, "instance_forward", None),
                                                                  CheckpointedForward)
