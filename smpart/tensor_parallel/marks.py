"""SMP's tensor-parallel controls: `set_tensor_parallelism(module, enabled)` and the context
manager `tensor_parallelism(enabled)` mark subtrees; the planner reads the marks.

``False`` keeps a subtree whole, ``True`` also splits a standalone Linear there (column-wise,
output gathered), and the planner's ``only_marked=True`` splits nothing unmarked, as SMP did. A
mark lives as long as its module (a weak reference); the nearest marked ancestor wins.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from smpart.tensor_parallel.layers import TensorParallelError

_MARKS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
_CONTEXT: list[bool] = []
_HOOKS: list[Any] = []


def set_tensor_parallelism(module: nn.Module, enabled: bool = True) -> None:
    """Mark ``module``'s subtree: ``False`` keeps it whole, ``True`` splits it (even a standalone
    Linear, column-wise with its output gathered). The nearest marked ancestor wins; the mark
    lives as long as the module (a weak reference)."""
    if not isinstance(module, nn.Module):
        raise TensorParallelError(f"set_tensor_parallelism needs an nn.Module, got {type(module).__name__}")
    _MARKS[module] = bool(enabled)


def tensor_parallelism_of(module: nn.Module) -> bool | None:
    """The mark set on ``module`` itself (None: unmarked, inherits from its parent)."""
    return _MARKS.get(module)


def _mark_registered(_parent: nn.Module, _name: str, value: Any) -> None:
    if _CONTEXT and isinstance(value, nn.Module):
        _MARKS[value] = _CONTEXT[-1]


def _mark_owner(owner: nn.Module, _name: str, _param: Any) -> None:
    if _CONTEXT:
        _MARKS[owner] = _CONTEXT[-1]


@contextlib.contextmanager


def tensor_parallelism(enabled: bool = True) -> Iterator[None]:
    """Mark every module created (or attached to a model) inside the block, as
    `set_tensor_parallelism` would. Uses torch's global module and parameter registration hooks
    while the block runs; nested blocks: the innermost wins."""
    if not _CONTEXT:
        from torch.nn.modules import module as module_hooks

        _HOOKS.append(module_hooks.register_module_module_registration_hook(_mark_registered))
        _HOOKS.append(module_hooks.register_module_parameter_registration_hook(_mark_owner))
    _CONTEXT.append(bool(enabled))
    try:
        yield
    finally:
        _CONTEXT.pop()
        if not _CONTEXT:
            while _HOOKS:
                _HOOKS.pop().remove()
