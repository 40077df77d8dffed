"""`Placeholder`: a tensor this rank does not hold, seen as its shape, dtype and where it lives.

Under a step program every rank runs the step body and the code of the modules the partition
split (the *glue*, see `glue`), and a call to a module another rank holds returns at once: its
outputs are placeholders with the shapes the recording step saw. A placeholder knows which ranks
hold the real tensor (``avail``, a bit mask over the pipeline's ranks), and, for the result of
glue computed on placeholders, the operation that makes it (``node``), evaluated only where a rank
needs the data. ``.shape``, ``.dtype``, ``.size()``, ``len()`` and the like are answered from
the metadata; every other torch operation on one goes through the rank's `glue.GlueMode`, which
either computes lazily or asks for the data (`glue.MicrobatchRun.make_available`).

Once the data arrived here (``value``), the placeholder stands for it: the glue keeps using the
same Python object, and nothing crosses twice.
"""

from __future__ import annotations

from typing import Any

import torch

from smpart.errors import SmpartError

_T = torch.Tensor
#: Questions a placeholder answers from its metadata.
METADATA = frozenset(
    {
        _T.shape.__get__,
        _T.size,
        _T.dim,
        _T.ndimension,
        _T.ndim.__get__,
        _T.dtype.__get__,  # type: ignore[attr-defined]
        _T.device.__get__,
        _T.__len__,
        _T.requires_grad.__get__,
        _T.numel,
        _T.nelement,  # type: ignore[attr-defined]
        _T.element_size,
        _T.is_floating_point,
        _T.is_complex,
        _T.__hash__,
        _T.layout.__get__,  # type: ignore[attr-defined]
        _T.is_cuda.__get__,
        _T.is_sparse.__get__,
        _T.is_quantized.__get__,
        _T.is_meta.__get__,  # type: ignore[attr-defined]
        _T.stride,
        _T.is_contiguous,
        _T.storage_offset,
        _T.get_device,
        _T.is_leaf.__get__,  # type: ignore[attr-defined]
        _T.grad_fn.__get__,
        _T.is_inference,  # type: ignore[attr-defined]
    }
)


class LazyNode:
    """An operation of the glue on placeholders, evaluated where its result is first needed:
    ``func(*args, **kwargs)``; ``outputs`` are the placeholders standing for its tensor results."""

    __slots__ = ("func", "args", "kwargs", "outputs", "result")

    def __init__(self, func: Any, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.outputs: list[Placeholder] = []
        self.result: Any = None


class Placeholder(torch.Tensor):
    """A tensor held by other ranks (``avail``), or made lazily from them (``node``)."""

    _avail: int
    _pos: int
    _node: LazyNode | None
    _index: int
    _value: torch.Tensor | None
    _run: Any
    #: ``("T", shape, dtype, requires_grad)``: what `templates.signature` reads, without asking torch.
    _sig: tuple
    _stride: tuple

    @staticmethod
    def __new__(
        cls,
        shape: Any,
        dtype: torch.dtype,
        device: torch.device,
        requires_grad: bool,
        avail: int,
        pos: int,
        run: Any,
        stride: Any = None,
        node: LazyNode | None = None,
        index: int = 0,
    ) -> Placeholder:
        kwargs = {} if stride is None else {"strides": stride}
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad, **kwargs
        )
        self._avail = avail
        self._pos = pos
        self._node = node
        self._index = index
        self._value = None
        self._run = run
        self._sig = ("T", tuple(shape), dtype, requires_grad)
        self._stride = tuple(stride) if stride is not None else None
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is _T.__repr__:
            return (
                f"Placeholder(shape={list(args[0].shape)}, dtype={args[0].dtype}, held by ranks "
                f"{holders(args[0]._avail)})"
            )
        raise SmpartError(
            f"a tensor of shape {list(args[0].shape) if args and isinstance(args[0], _T) else '?'} held by "
            "another pipeline rank was used outside the step that made it (stored in a module, or kept "
            "from a step's body); keep what a step returns, and read it from its StepOutput"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise SmpartError(
            f"{func} reached a tensor held by another pipeline rank without going through "
            "smpart's step program (a custom autograd function or a C++ extension in the "
            "code between stages); such a step runs on the reference runtime"
        )


def holders(avail: int) -> list[int]:
    """The ranks in the bit mask ``avail``."""
    return [i for i in range(avail.bit_length()) if avail >> i & 1]


def lowest(avail: int) -> int:
    """The lowest rank in a non-empty bit mask."""
    return (avail & -avail).bit_length() - 1


def meta_of(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor like ``tensor`` (real or placeholder), for shape inference."""
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    if tensor.requires_grad and (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        meta = meta.requires_grad_(True).clone()  # not a leaf: in-place operations must follow
    return meta
