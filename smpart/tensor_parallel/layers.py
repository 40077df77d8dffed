"""`DistributedLinear` and `DistributedEmbedding`: drop-in layers whose weights are shards.

Each rank of a tensor-parallel group holds 1/tp of the layer's weight and computes 1/tp of its
work; the collectives of `smpart.tensor_parallel.collectives` stitch the pieces back together:

- **column** (`DistributedLinear`, ``style="column"``): the rows of ``weight`` (output features)
  are split, so each rank computes its slice of the output from the whole input. The output
  stays split (``gather_output=False``), ready for a row-parallel partner, or is all-gathered.
- **row** (``style="row"``): the columns of ``weight`` (input features) are split, so each rank
  multiplies its slice of the input and the partial sums are all-reduced; the bias is added
  once, after the reduce.
- **fused** column (``fused=3``): one projection computes q, k and v side by side (GPT-2's
  ``c_attn``). A contiguous third would hand rank 0 all of q; instead each rank gets *its*
  slice of q, of k and of v, so it owns whole heads of all three.
- **vocab** (`DistributedEmbedding`, ``style="vocab"``): each rank holds a range of the
  vocabulary, looks up the ids in its range, zeroes the others and the all-reduce adds the
  single non-zero row per token. **dim**: each rank holds a slice of every embedding vector
  and the slices are all-gathered.

Parameters are ``DTensor``\\s over a one-dimensional ``DeviceMesh`` of the tensor-parallel group:
they keep the *global* shape and name of the original parameter (``Shard(0)`` for split rows,
``Shard(1)`` for split columns, ``_StridedShard`` for a fused projection, ``Replicate()`` for a
row-parallel bias), so an optimizer steps them, ``.grad`` comes back as a DTensor of the same
layout and a state dict describes the whole tensor. Forward computes on ``.to_local()``, which
is differentiable, so no DTensor dispatch happens in the matmuls themselves.

Hugging Face's ``Conv1D`` (GPT-2) stores its weight transposed, ``[in, out]``; a layer built
from one keeps that layout (and the parameter's global shape), splitting the other dimension.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from smpart.errors import SmpartError
from smpart.tensor_parallel import streams
from smpart.tensor_parallel.collectives import (
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement

COLUMN, ROW, VOCAB, DIM = "column", "row", "vocab", "dim"


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor``. ``torch.distributed.tensor`` is imported only where a
    layer is split (importing it costs ~1.2 s, a third of ``import smpart``): before that no
    tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


class TensorParallelError(SmpartError, ValueError):
    """A module cannot be split as asked (sizes, degree, an unsupported option)."""


# ==================================================================== groups and meshes
def tp_mesh(group_or_mesh: Any = None, device_type: str | None = None) -> DeviceMesh:
    """The one-dimensional ``DeviceMesh`` of a tensor-parallel group.

    ``group_or_mesh``: a 1-D ``DeviceMesh`` (returned as is), a ``ProcessGroup`` or None (the
    default group). ``device_type`` of a mesh built here: given, else "cuda" for an NCCL group,
    else "cpu".
    """
    if isinstance(group_or_mesh, DeviceMesh):
        if group_or_mesh.ndim != 1:
            raise TensorParallelError(
                f"tensor parallelism needs the 1-D mesh of the tp group, got a {group_or_mesh.ndim}-D mesh "
                f"{group_or_mesh.mesh_dim_names or ''}: pass mesh['tp']")
        return group_or_mesh
    if not dist.is_available() or not dist.is_initialized():
        raise TensorParallelError("tensor-parallel layers need torch.distributed: call "
                                  "torch.distributed.init_process_group (or smpart.init) first")
    group = group_or_mesh if group_or_mesh is not None else dist.group.WORLD
    if device_type is None:
        device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device_type)


def _mesh_for(group_or_mesh: Any, like: Tensor) -> DeviceMesh:
    device = like.device.type
    return tp_mesh(group_or_mesh, None if device == "meta" else device)


# ==================================================================== shards
def shard_placement(dim: int, fused: int = 1) -> Placement:
    """``Shard(dim)``, or for ``fused`` parts side by side ``_StridedShard``: each rank holds its
    slice of every part, which is exactly what a fused q/k/v projection needs."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return Shard(dim) if fused == 1 else _StridedShard(dim, split_factor=fused)


def replicated() -> Placement:
    """``Replicate()``: every rank holds the whole tensor (a row-parallel layer's bias)."""
    from torch.distributed.tensor import Replicate

    return Replicate()


def local_shard(full: Tensor, dim: int, rank: int, size: int, fused: int = 1) -> Tensor:
    """This rank's shard of ``full`` along ``dim`` (of each of its ``fused`` parts), as a copy."""
    if fused == 1:
        return full.chunk(size, dim)[rank].clone()
    return torch.cat([part.chunk(size, dim)[rank] for part in full.chunk(fused, dim)], dim).clone()


def _distributed(full: Tensor, mesh: DeviceMesh, placement: Placement) -> nn.Parameter:
    """A parameter holding this rank's part of ``full`` as a DTensor of ``full``'s global shape."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    rank, size = mesh.get_local_rank(), mesh.size()
    if isinstance(placement, Shard | _StridedShard):
        fused = getattr(placement, "split_factor", 1)
        local = local_shard(full.detach(), placement.dim, rank, size, fused)
    else:
        local = full.detach().clone()
    tensor = DTensor.from_local(local, mesh, [placement], run_check=False, shape=full.shape,
                                stride=full.stride())
    return nn.Parameter(tensor, requires_grad=full.requires_grad)


class _Shared:
    """Distributed parameters already made, by the original's id, so tied weights stay one parameter."""

    def __init__(self, table: dict[int, nn.Parameter] | None) -> None:
        self.table = table if table is not None else {}

    def get(self, original: Tensor, mesh: DeviceMesh, placement: Placement, owner: str) -> nn.Parameter:
        made = self.table.get(id(original))
        if made is None:
            made = self.table[id(original)] = _distributed(original, mesh, placement)
        elif tuple(made.placements) != (placement,):
            raise TensorParallelError(
                f"{owner}: its weight is shared with a module already split as {made.placements[0]}, but "
                f"this module needs {placement}; split both the same way or leave both whole")
        return made


def _describe(name: str | None, module: nn.Module | None) -> str:
    label = type(module).__name__ if module is not None else "layer"
    return f"{name!r} ({label})" if name else label


def _check_divides(size: int, parts: int, degree: int, what: str, where: str) -> None:
    if size % (parts * degree):
        fused = f" (as {parts} fused parts of {size // parts})" if parts > 1 else ""
        raise TensorParallelError(
            f"{where}: {what}={size}{fused} does not divide into {degree} equal shards for tensor-parallel "
            f"degree {degree}; use a degree that divides {size // parts if size % parts == 0 else size}, or "
            f"leave this module whole (set_tensor_parallelism(module, False))")


# ==================================================================== linear
def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's GPT-2 ``Conv1D`` (weight ``[in, out]``), recognised without importing transformers."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(module, "nf")


class _OnMesh:
    """The tensor-parallel group of a layer, read from its mesh (a ProcessGroup cannot be deep-copied),
    and its first values when it was built on the meta device."""

    mesh: DeviceMesh

    @property
    def group(self) -> Any:
        return self.mesh.get_group()

    def plain_twin(self, device: Any) -> nn.Module:
        """An unsplit module of the kind this layer splits, its tensors made on ``device`` but not
        initialised: what gives this layer its first values (`take_values`), so that any scheme
        for the plain kind (its ``reset_parameters``, a Hugging Face model's ``_init_weights``)
        initialises the split layer too."""
        with torch.device("meta"):
            twin = self._plain_kind()
        return twin.to_empty(device=device)

    def _plain_kind(self) -> nn.Module:
        raise NotImplementedError

    def take_values(self, twin: nn.Module) -> None:
        """Keep this rank's shard of each of ``twin``'s tensors (every rank of the group computed the
        same twin: the same seed, the same draws)."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        rank, size = self.mesh.get_local_rank(), self.mesh.size()
        with torch.no_grad():
            for name, param in self.named_parameters(recurse=False):
                full = getattr(twin, name).detach()
                (placement,) = param.placements
                fused = getattr(placement, "split_factor", 1)
                if isinstance(placement, Shard | _StridedShard):  # a view where it can (no copy)
                    full = (full.chunk(size, placement.dim)[rank] if fused == 1
                            else local_shard(full, placement.dim, rank, size, fused))
                param.to_local().copy_(full)

    def reset_parameters(self) -> None:
        """Initialise as the plain kind does, each rank keeping its shard."""
        twin = self.plain_twin(self.weight.to_local().device)
        twin.reset_parameters()
        self.take_values(twin)


class DistributedLinear(_OnMesh, nn.Module):
    """A linear layer split over a tensor-parallel group (see the module docstring for the styles).

    ``in_features``/``out_features`` are the *global* sizes; ``local_in_features`` and
    ``local_out_features`` what this rank computes. Build one from an existing layer with
    `from_module` (weights sharded from the original), or directly (weights initialised like
    ``nn.Linear``, then sharded: ranks must share an RNG state, as seeded SPMD scripts do).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        style: str = COLUMN,
        group: Any = None,
        gather_output: bool = False,
        input_is_parallel: bool = True,
        fused: int = 1,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(full.weight, full.bias, False, style, group, gather_output, input_is_parallel, fused,
                    None, full, None)

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        style: str = COLUMN,
        *,
        group: Any = None,
        gather_output: bool = False,
        input_is_parallel: bool = True,
        fused: int = 1,
        name: str | None = None,
        shared: dict[int, nn.Parameter] | None = None,
    ) -> DistributedLinear:
        """Split an ``nn.Linear`` or a Hugging Face ``Conv1D`` over ``group`` (ProcessGroup or 1-D mesh).

        ``name`` labels errors; ``shared`` maps ``id(original parameter)`` to the distributed
        parameter already made from it, so tied weights stay one parameter (filled as it goes).
        """
        transposed = _is_conv1d(module)
        if not (isinstance(module, nn.Linear) or transposed):
            raise TensorParallelError(f"{_describe(name, module)}: DistributedLinear splits nn.Linear or "
                                      "transformers' Conv1D, not this module")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(module.weight, module.bias, transposed, style, group, gather_output, input_is_parallel,
                     fused, name, module, shared)
        return layer

    def _setup(self, weight, bias, transposed, style, group, gather_output, input_is_parallel, fused, name,
               module, shared) -> None:
        where = _describe(name, module)
        if style not in (COLUMN, ROW):
            raise TensorParallelError(f"{where}: style must be 'column' or 'row', got {style!r}")
        if fused < 1 or (fused > 1 and style != COLUMN):
            raise TensorParallelError(f"{where}: fused={fused}: fused parts (q, k, v) split column-wise only")
        mesh = _mesh_for(group, weight)
        degree = mesh.size()
        in_dim, out_dim = (0, 1) if transposed else (1, 0)
        in_features, out_features = weight.shape[in_dim], weight.shape[out_dim]
        if style == COLUMN:
            _check_divides(out_features, fused, degree, "out_features", where)
        else:
            _check_divides(in_features, 1, degree, "in_features", where)
        self.in_features, self.out_features = in_features, out_features
        self.style, self.fused, self.transposed = style, fused, transposed
        self.gather_output, self.input_is_parallel = gather_output, input_is_parallel
        self.mesh = mesh
        self.tp_size, self.tp_rank = degree, mesh.get_local_rank()
        if transposed:  # Conv1D's own attribute names, for code that reads them
            self.nf, self.nx = out_features, in_features
        split = _Shared(shared)
        weight_dim = out_dim if style == COLUMN else in_dim
        self.weight = split.get(weight, mesh, shard_placement(weight_dim, fused), where)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = split.get(bias, mesh, shard_placement(0, fused) if style == COLUMN else replicated(),
                                  where)

    def _plain_kind(self) -> nn.Module:
        bias = self.bias is not None
        dtype = self.weight.dtype
        if self.transposed:  # Hugging Face's Conv1D (weight [in, out]) has no bias switch
            from transformers.pytorch_utils import Conv1D

            return Conv1D(self.out_features, self.in_features).to(dtype)
        return nn.Linear(self.in_features, self.out_features, bias, dtype=dtype)

    @property
    def local_in_features(self) -> int:
        return self.in_features // self.tp_size if self.style == ROW else self.in_features

    @property
    def local_out_features(self) -> int:
        return self.out_features // self.tp_size if self.style == COLUMN else self.out_features

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to_local()
        bias = None if self.bias is None else self.bias.to_local()
        if self.style == COLUMN:
            y = self._matmul(copy_to_tp(x, self.group), weight, bias)
            if self.gather_output:
                return gather_from_tp(y, self.group, self.fused)
            if self.training and self.tp_size > 1:  # a dropout on y masks this rank's part alone
                streams.enter(y.device, self.tp_rank)
            return y
        streams.leave()  # what follows is whole on every rank, and draws alike
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(self._matmul(x, weight, None), self.group)
        return y if bias is None else y + bias

    def _matmul(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not self.transposed:
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.size(-1))  # Conv1D's own formula, on the shard
        y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
        return y.view(*x.shape[:-1], weight.size(1))

    def full_state(self) -> dict[str, Tensor]:
        """The unsplit ``weight`` (and ``bias``) in the original layout: a collective, call on every rank."""
        return full_state_dict(self)

    def extra_repr(self) -> str:
        parts = [f"in_features={self.in_features}", f"out_features={self.out_features}",
                 f"style={self.style}", f"tp={self.tp_rank}/{self.tp_size}", f"bias={self.bias is not None}"]
        if self.fused > 1:
            parts.append(f"fused={self.fused}")
        if self.style == COLUMN and self.gather_output:
            parts.append("gather_output=True")
        if self.style == ROW and not self.input_is_parallel:
            parts.append("input_is_parallel=False")
        if self.transposed:
            parts.append("layout=Conv1D")
        return ", ".join(parts)


# ==================================================================== embedding
class DistributedEmbedding(_OnMesh, nn.Module):
    """An embedding split over a tensor-parallel group by vocabulary (``"vocab"``) or dimension (``"dim"``).

    Vocabulary split: rank r holds ids ``[r·V/tp, (r+1)·V/tp)``; an id outside its range looks up
    row 0 and is zeroed, so after the all-reduce every token has exactly its one row. The weight
    gradient of a rank then only ever touches its own rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        style: str = VOCAB,
        group: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        self._setup(full, style, group, None, None)

    @classmethod
    def from_module(
        cls,
        module: nn.Embedding,
        style: str = VOCAB,
        *,
        group: Any = None,
        name: str | None = None,
        shared: dict[int, nn.Parameter] | None = None,
    ) -> DistributedEmbedding:
        """Split an ``nn.Embedding`` over ``group`` (see `DistributedLinear.from_module` for the rest)."""
        if not isinstance(module, nn.Embedding):
            raise TensorParallelError(f"{_describe(name, module)}: DistributedEmbedding splits nn.Embedding "
                                      "only")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(module, style, group, name, shared)
        return layer

    def _setup(self, module: nn.Embedding, style: str, group: Any, name: str | None, shared) -> None:
        where = _describe(name, module)
        if style not in (VOCAB, DIM):
            raise TensorParallelError(f"{where}: style must be 'vocab' or 'dim', got {style!r}")
        if module.max_norm is not None or module.sparse:
            raise TensorParallelError(f"{where}: max_norm and sparse embeddings cannot be split; leave it "
                                      "whole")
        mesh = _mesh_for(group, module.weight)
        degree = mesh.size()
        num, dim = module.weight.shape
        if style == VOCAB:
            _check_divides(num, 1, degree, "num_embeddings", where)
        else:
            _check_divides(dim, 1, degree, "embedding_dim", where)
        self.num_embeddings, self.embedding_dim = num, dim
        self.padding_idx, self.scale_grad_by_freq = module.padding_idx, module.scale_grad_by_freq
        self.max_norm, self.sparse = None, False
        self.style, self.mesh = style, mesh
        self.tp_size, self.tp_rank = degree, mesh.get_local_rank()
        placement = shard_placement(0 if style == VOCAB else 1)
        self.weight = _Shared(shared).get(module.weight, mesh, placement, where)

    def _plain_kind(self) -> nn.Module:
        return nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                            scale_grad_by_freq=self.scale_grad_by_freq, dtype=self.weight.dtype)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The ids ``[start, end)`` this rank holds (all of them for a dimension split)."""
        if self.style == DIM:
            return 0, self.num_embeddings
        per = self.num_embeddings // self.tp_size
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def forward(self, ids: Tensor) -> Tensor:
        weight = self.weight.to_local()
        if self.style == DIM:
            out = F.embedding(ids, weight, self.padding_idx, scale_grad_by_freq=self.scale_grad_by_freq)
            return gather_from_tp(out, self.group)
        start, end = self.vocab_range
        local = ids - start
        outside = (ids < start) | (ids >= end)
        padding = self.padding_idx
        if padding is not None:
            padding = padding % self.num_embeddings
            padding = padding - start if start <= padding < end else None
        out = F.embedding(local.masked_fill(outside, 0), weight, padding,
                          scale_grad_by_freq=self.scale_grad_by_freq)
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0), self.group)

    def full_state(self) -> dict[str, Tensor]:
        """The unsplit ``weight``: a collective, call on every rank."""
        return full_state_dict(self)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, style={self.style}, "
                f"tp={self.tp_rank}/{self.tp_size}" + (f", padding_idx={self.padding_idx}"
                                                         if self.padding_idx is not None else ""))


# ==================================================================== whole tensors
def full_tensor(t: Any) -> Any:
    """``t`` whole: a DTensor is gathered (a collective: every rank of its mesh must call), the rest
    is returned as is."""
    return t.full_tensor() if is_dtensor(t) else t


def full_state_dict(model_or_state: nn.Module | dict[str, Any]) -> dict[str, Any]:
    """A state dict with every DTensor gathered to the full tensor of the original layout.

    Keys and shapes are those of the unsplit model, so the result loads into it with
    ``load_state_dict``. A collective: every rank of the tensor-parallel group must call it.
    """
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    return {key: full_tensor(value.detach() if isinstance(value, Tensor) else value)
            for key, value in state.items()}


def local_state_dict(model_or_state: nn.Module | dict[str, Any]) -> dict[str, Any]:
    """A state dict of this rank's shards (plain tensors, local shapes); no communication."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    return {key: value.to_local() if is_dtensor(value) else value for key, value in state.items()}


# ==================================================================== checkpoints
def _is_strided(t: Any) -> bool:
    if not is_dtensor(t):
        return False
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in t.placements)


def to_checkpoint_layout(t: Any) -> Any:
    """``t`` as ``torch.distributed.checkpoint`` can store it.

    DCP describes each rank's part as one contiguous block of the global tensor; a fused
    projection's strided shard is three blocks, so it is re-laid out as a plain ``Shard``
    (one all-gather). Anything else is returned unchanged (no copy).
    """
    if not _is_strided(t):
        return t
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return t.detach().redistribute(placements=[Shard(p.dim) if isinstance(p, _StridedShard) else p
                                               for p in t.placements])


def from_checkpoint_layout(target: Any, source: Any) -> None:
    """Copy ``source`` (as `to_checkpoint_layout` made it, after a DCP load) into ``target`` in place."""
    if target is source:
        return
    with torch.no_grad():
        if is_dtensor(target):
            source = source if is_dtensor(source) else None
            local = (source.redistribute(placements=target.placements).to_local() if source is not None
                     else None)
            if local is None:
                raise TensorParallelError("from_checkpoint_layout: a split parameter needs a DTensor source")
            target.to_local().copy_(local)
        else:
            target.copy_(full_tensor(source))


def dcp_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` ready for ``torch.distributed.checkpoint.save``/``load``.

    Global shapes and the user's names throughout; fused projections re-laid out by
    `to_checkpoint_layout`. After ``dcp.load(state, ...)`` call `load_dcp_state_dict` to copy the
    re-laid-out entries back (the others were loaded in place).
    """
    return {key: to_checkpoint_layout(value) for key, value in model.state_dict().items()}


def load_dcp_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Copy the entries of a loaded `dcp_state_dict` into ``model`` where they are not its own tensors."""
    own = model.state_dict()
    for key, value in state.items():
        if key in own and own[key] is not value:
            from_checkpoint_layout(own[key], value)


def grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of all gradients as the unsplit model has them: a split gradient (a DTensor)
    contributes its global norm, a replicated one its own. A collective over each mesh involved.

    ``torch.nn.utils.clip_grad_norm_`` refuses lists that mix DTensors and plain tensors.
    """
    norms = []
    for p in parameters:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad.detach(), norm_type)
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    if not norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for models with split parameters; returns the total norm."""
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, norm_type)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in parameters:
        grad = p.grad.to_local() if is_dtensor(p.grad) else p.grad
        grad.detach().mul_(scale.to(grad.device))
    return total


def distributed_modules(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """Every `DistributedLinear` / `DistributedEmbedding` inside ``model``, by qualified name."""
    layers = (DistributedLinear, DistributedEmbedding)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, layers)]
