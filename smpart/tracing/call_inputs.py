"""What a module was called with, as plain data, and arguments made again from that description.

The tracer writes down each module's first call (`describe_call`): every tensor argument's shape
and dtype (and whether it required grad), plain values (None, booleans, numbers, strings) as
they were, containers of those recursively, and the type name of anything else. The
description is JSON, costs a few numbers per module, and is exact on the meta device, where the
trace usually runs.

`example_call` turns a description back into arguments with random values, so a module can be
run alone, on the CPU, without the model or its batch: tensor parallelism proves a split of an
attention it has no adapter for that way (`smpart.tensor_parallel.heads`). A description that
holds something it cannot make (an object of a user's class: a cache, a config) gives None.
``shrink`` makes the tensors small: the first tensor argument's leading sizes (batch, sequence)
become at most 2 and 8, and every other tensor's sizes equal to one of those shrink with them.
"""

from __future__ import annotations

from typing import Any

import torch

Described = dict[str, Any]

_PLAIN = (type(None), bool, int, float, str)
#: Leading sizes of the first tensor argument once shrunk: batch, then every other leading axis.
_SHRUNK_BATCH, _SHRUNK_OTHER = 2, 8


def describe_call(args: tuple, kwargs: dict[str, Any]) -> Described:
    """``{"args": [...], "kwargs": {...}}`` describing a call's arguments (see the module doc)."""
    return {"args": [_describe(a) for a in args], "kwargs": {k: _describe(v) for k, v in kwargs.items()}}


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        described = {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        if value.requires_grad:
            described["grad"] = True
        return described
    if isinstance(value, _PLAIN):
        return {"value": value}
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        return {type(value).__name__: [_describe(v) for v in value]}
    return {"other": type(value).__qualname__}


def example_call(described: Described, *, generator: torch.Generator, floating: torch.dtype = torch.float64,
                 shrink: bool = False) -> tuple[tuple, dict[str, Any]] | None:
    """Arguments matching ``described``: floating tensors drawn from a normal distribution (in
    ``floating``, complex ones in its complex counterpart; requiring grad where the traced ones
    did), integer tensors zeros, boolean ones True. None when the description holds something that
    cannot be made."""
    sizes = _shrunk_sizes(described) if shrink else {}
    made = _Maker(generator, floating, sizes)
    try:
        args = tuple(made(a) for a in described["args"])
        kwargs = {k: made(v) for k, v in described["kwargs"].items()}
    except _Unmakeable:
        return None
    return args, kwargs


def tensor_shapes(described: Described) -> list[tuple[int, ...]]:
    """The shapes of the tensor arguments, in order."""
    shapes: list[tuple[int, ...]] = []

    def visit(entry: Any) -> None:
        if "tensor" in entry:
            shapes.append(tuple(entry["tensor"]))
        for key in ("list", "tuple"):
            for item in entry.get(key, ()):
                visit(item)

    for entry in [*described["args"], *described["kwargs"].values()]:
        visit(entry)
    return shapes


def _shrunk_sizes(described: Described) -> dict[int, int]:
    """Original size -> shrunk size, from the first tensor argument's leading axes."""
    shapes = tensor_shapes(described)
    if not shapes or len(shapes[0]) < 2:
        return {}
    sizes: dict[int, int] = {}
    for axis, size in enumerate(shapes[0][:-1]):
        small = min(size, _SHRUNK_BATCH if axis == 0 else _SHRUNK_OTHER)
        if size != small:
            sizes.setdefault(size, small)
    return sizes


class _Unmakeable(Exception):
    pass


class _Maker:
    def __init__(self, generator: torch.Generator, floating: torch.dtype, sizes: dict[int, int]) -> None:
        self.generator, self.floating, self.sizes = generator, floating, sizes

    def __call__(self, entry: Any) -> Any:
        if "value" in entry:
            return entry["value"]
        if "list" in entry:
            return [self(v) for v in entry["list"]]
        if "tuple" in entry:
            return tuple(self(v) for v in entry["tuple"])
        if "tensor" in entry:
            made = self.tensor([self.sizes.get(s, s) for s in entry["tensor"]], entry["dtype"])
            return made.requires_grad_() if entry.get("grad") and made.is_floating_point() else made
        raise _Unmakeable(entry.get("other"))

    def tensor(self, shape: list[int], dtype_name: str) -> torch.Tensor:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise _Unmakeable(dtype_name)
        if dtype.is_complex:
            complex_dtype = torch.complex128 if self.floating == torch.float64 else torch.complex64
            return torch.randn(shape, dtype=complex_dtype, generator=self.generator)
        if dtype.is_floating_point:
            return torch.randn(shape, dtype=self.floating, generator=self.generator)
        if dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool)
        return torch.zeros(shape, dtype=dtype)
