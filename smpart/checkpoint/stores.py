"""Where `load_weights` reads from: one `_Store` per kind of source (a dict, safetensors or
torch files, a DCP directory), each answering keys, shapes and reads of a slice, and the part
of a global tensor a DTensor's local shard holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from smpart.checkpoint.collective import _single_process_is_meant
from smpart.checkpoint.files import MARKER, MODEL, OPTIM, SIDE_DIR, _aliases, _read_rank_files, _SafeReader
from smpart.checkpoint.layout import _is_dtensor, _is_fused
from smpart.errors import CheckpointError


class _Store:
    """A source of named tensors that reads one tensor (or one slice) at a time."""

    dcp_prefix: str | None = None

    def keys(self) -> Iterable[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, key: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def copy_into(self, key: str, target: torch.Tensor) -> None:
        if _is_dtensor(target):
            target.to_local().copy_(_local_part(target, lambda index: self.read(key, index)))
        else:
            target.copy_(self.read(key, None))

    def copy_all(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Fill each target with its key's values (a DTensor: its own shard only)."""
        for key, target in targets.items():
            self.copy_into(key, target)


class _DictStore(_Store):
    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str = "the state dict") -> None:
        self.tensors, self.where = tensors, where

    def keys(self) -> Iterable[str]:
        return [k for k, v in self.tensors.items() if isinstance(v, torch.Tensor)]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        t = self.tensors[key]
        t = t.full_tensor() if _is_dtensor(t) else t
        return t if index is None else t[index]

    def describe(self) -> str:
        return self.where


class _SafetensorsStore(_Store):
    def __init__(self, files: list[Path], where: str) -> None:
        from safetensors import safe_open

        self.where = where
        self.handles = {}
        self.file_of = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            self.handles[file] = handle
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                self.file_of[key] = file

    def keys(self) -> Iterable[str]:
        return self.file_of.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handles[self.file_of[key]].get_slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        handle = self.handles[self.file_of[key]]
        if index is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[index]  # reads only the slice's bytes

    def describe(self) -> str:
        return self.where


class _DCPStore(_Store):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = _SafeReader(path)
        self.meta = {k: v for k, v in self.reader.read_metadata().state_dict_metadata.items()
                     if isinstance(v, TensorStorageMetadata)}
        self.aliases: dict[str, str] = {}
        if (path / MARKER).exists() or all(k.startswith((MODEL, OPTIM)) for k in self.meta):
            self.dcp_prefix = MODEL
            if (path / SIDE_DIR).is_dir():
                self.aliases = {MODEL + a: MODEL + s for a, s in _aliases(_read_rank_files(path)).items()
                                if MODEL + s in self.meta}

    def keys(self) -> Iterable[str]:
        return [*self.meta, *self.aliases]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.meta[self.aliases.get(key, key)].size)

    def copy_all(self, targets: Mapping[str, torch.Tensor]) -> None:
        """One read of every target, by this rank alone: the ranks of different stages hold other
        keys (a collective load per key would pair one rank's key with another's, or wait for a
        rank that has no more keys), and DCP reads a DTensor's shard by its own offsets. A fused
        q/k/v shard is three blocks, which DCP does not describe: its tensor is read whole, one
        at a time, and this rank's slice of each part kept."""
        fused = {key: t for key, t in targets.items() if _is_fused(t)}
        self._load({key: t for key, t in targets.items() if key not in fused})
        for key, target in fused.items():
            whole = torch.empty(target.shape, dtype=target.dtype)
            self._load({key: whole})
            target.to_local().copy_(_local_part(target, lambda index, whole=whole: whole[index]))

    def _load(self, targets: Mapping[str, torch.Tensor]) -> None:
        stored: dict[str, torch.Tensor] = {}  # by the key DCP stores: an alias reads its original
        copies = []
        for key, target in targets.items():
            original = self.aliases.get(key, key)
            if original in stored:
                copies.append((target, stored[original]))
            else:
                stored[original] = target
        with _single_process_is_meant():
            dcp.load(stored, storage_reader=_SafeReader(self.path), no_dist=True)
        for target, source in copies:
            target.copy_(source)

    def describe(self) -> str:
        return f"the DCP checkpoint {self.path}"


def _open_store(source: Any) -> _Store:
    if isinstance(source, Mapping):
        return _DictStore(source)
    path = Path(source)
    if path.is_dir():
        if (path / ".metadata").exists():
            return _DCPStore(path)
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (path / index).exists():
                shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
                return _file_store([path / s for s in shards], f"{path} ({len(shards)} shards)")
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (path / single).exists():
                return _file_store([path / single], str(path / single))
        raise CheckpointError(f"{path} holds no weights smpart can read: expected DCP's .metadata, "
                              "model.safetensors, pytorch_model.bin or their *.index.json")
    if path.is_file():
        return _file_store([path], str(path))
    raise CheckpointError(f"cannot load weights from {source!r}: no such file or directory")


def _file_store(files: list[Path], where: str) -> _Store:
    if all(f.suffix == ".safetensors" for f in files):
        return _SafetensorsStore(files, where)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:
            raise CheckpointError(f"cannot read {file} with torch.load(weights_only=True): {err}") from err
        if not isinstance(loaded, Mapping):
            raise CheckpointError(f"{file} holds a {type(loaded).__name__}, not a state dict of tensors")
        tensors.update(loaded)
    return _DictStore(tensors, where)


def _local_part(target: torch.Tensor, read: Any) -> torch.Tensor:
    """What a DTensor's local shard holds of the global tensor, ``read(index)`` reading a slice of
    it (None: all). A fused q/k/v shard (``_StridedShard``) is this rank's slice of each part, not
    one slice: it is cut from the whole tensor."""
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = [p for p in target.placements if isinstance(p, _StridedShard)]
    if not strided:
        return read(_local_index(target))
    if len(target.placements) != 1:
        raise CheckpointError("a fused (strided) shard on a mesh of more than one dimension cannot be read "
                              "from this source; load a checkpoint (smpart.load_checkpoint) instead")
    mesh, (placement,) = target.device_mesh, strided
    dim, parts, rank, size = placement.dim, placement.split_factor, mesh.get_local_rank(), mesh.size()
    part = target.shape[dim] // parts
    piece = part // size
    pieces = []
    for j in range(parts):  # this rank's slice of each part (q, k, v): only its bytes are read
        index = [slice(None)] * len(target.shape)
        index[dim] = slice(j * part + rank * piece, j * part + (rank + 1) * piece)
        pieces.append(read(tuple(index)))
    return torch.cat(pieces, dim)


def _local_index(target: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the global tensor that a DTensor's local shard holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
