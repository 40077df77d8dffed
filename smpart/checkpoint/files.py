"""A checkpoint directory's files: the completion marker, smpart's JSON side files (with a JSON
encoding that keeps tuples and one-element tensors), and DCP's metadata read without running
pickled code.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from smpart.checkpoint.layout import _is_dtensor
from smpart.errors import CheckpointError

#: The marker file written last; its presence means the checkpoint is complete.
MARKER = ".smpart_complete"
FORMAT = "smpart.checkpoint/1"
#: smpart's own files (JSON) inside a checkpoint directory.
SIDE_DIR = "smpart"
MODEL = "model."
OPTIM = "optim.state."


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / MARKER).exists() or (path / ".metadata").exists() or (path / SIDE_DIR).is_dir()


def _aliases(ranks: dict[int, dict[str, Any]]) -> dict[str, str]:
    """Name of a tied weight -> the name it was written under."""
    out: dict[str, str] = {}
    for record in ranks.values():
        out.update(record.get("aliases") or {})
    return out


def _read_rank_files(path: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for file in sorted((path / SIDE_DIR).glob("rank*.json")):
        record = json.loads(file.read_text())
        out[int(record["rank"])] = record
    return out


class _SafeReader(FileSystemReader):
    """DCP's reader, but its metadata file is unpickled admitting only DCP's metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except FileNotFoundError as err:
            raise CheckpointError(f"{self.path} has no DCP metadata ({path.name}): not a checkpoint") from err
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{path} holds something other than DCP metadata: {err}") from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts and memory formats."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") and not name.startswith("__"):
            return super().find_class(module, name)
        if (module, name) in {("torch", "Size"), ("torch.serialization", "_get_layout"),
                              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                              ("collections", "OrderedDict")}:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout
                                            | torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def _encode(value: Any) -> Any:
    """``value`` as JSON data that `_decode` turns back into an equal value of the same types."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
            return {k: _encode(v) for k, v in value.items()}
        raise TypeError("dict keys must be strings not starting with '__'")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not _is_dtensor(value):
        return {"__tensor__": value.item(), "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape), "device": str(value.device)}
    raise TypeError(f"{type(value).__name__} is not JSON data")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            t = torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
            return t.reshape(value["shape"]).to(value["device"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (so a JSON round trip lost nothing)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file in the same directory, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(data, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def iter_checkpoint_keys(path: str | os.PathLike) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor key of a checkpoint with its global shape (for inspection and tools)."""
    for key, meta in _SafeReader(Path(path)).read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            yield key, tuple(meta.size)
