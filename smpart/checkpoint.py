"""Checkpoints that any layout can read: save and load through ``torch.distributed.checkpoint``.

A checkpoint is a directory. ``torch.distributed.checkpoint`` (DCP) writes the tensors: every
rank hands it the tensors *it* holds, under the user's own names, and DCP merges them into one
global picture, each key with its global shape (a tensor-parallel parameter is a DTensor whose
``shape`` is the whole parameter's; data-parallel replicas of a key are written once). Loading is
the same call the other way round: each rank asks only for the keys it holds, in the shapes it
holds them, and DCP reads the byte ranges that overlap. So the layout a checkpoint was written
from (stages, tensor-parallel shards, replicas, or one plain process) and the one it is read
into are independent, and a plain ``nn.Module`` without ``smpart.init`` reads any of them.

Keys:

- ``model.<name>``: every parameter and persistent buffer, by its ``state_dict`` name; a tied
  weight is written once, under its first name, and its other names are recorded as aliases
  (a model that does not tie them gets the weight under each name);
- ``optim.state.<parameter name>.<key>``: the optimizer's tensors (Adam's ``exp_avg``, the step
  count ``step``...), keyed by the parameter's *name*, never by its position in the optimizer,
  which differs from one layout to the next.

Everything that is not a tensor is written as JSON, never pickled, so reading a checkpoint runs
no pickled code: each rank's file ``smpart/rank<r>.json`` holds its RNG states (torch, CUDA,
``random``, NumPy) and, per parameter name, its optimizer group's hyperparameters and non-tensor
state; ``smpart/extra.json`` the caller's ``extra`` (``extra.pt`` when it is not plain JSON, read
back with ``weights_only=True``). DCP's own tensor files are read with ``weights_only=True`` and
its metadata file with an unpickler that admits only DCP's metadata classes.

**Complete or refused.** A save first deletes the completion marker, then writes everything,
waits for every rank, and only then writes ``.smpart_complete`` (a JSON of what the checkpoint
holds) under a temporary name and renames it into place, which is atomic. A directory without
the marker is a save that did not finish (a crash, a full disk), and `load_checkpoint` refuses it.

`load_weights` is the other door in: a plain state dict, a ``.safetensors`` / ``.bin`` / ``.pt``
file, a Hugging Face model directory (sharded or not) or a DCP directory, read key by key, so
each rank reads only the tensors it holds (and, for a DTensor, only its shard's bytes).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import pickle
import random
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from smpart.errors import CheckpointError
from smpart.runtime.optimizer import DistributedOptimizer
from smpart.tensor_parallel.layers import from_checkpoint_layout, to_checkpoint_layout

#: The marker file written last; its presence means the checkpoint is complete.
MARKER = ".smpart_complete"
FORMAT = "smpart.checkpoint/1"
#: smpart's own files (JSON) inside a checkpoint directory.
SIDE_DIR = "smpart"
MODEL = "model."
OPTIM = "optim.state."


# ==================================================================== what a rank holds
@dataclass
class _Layout:
    """The tensors this rank holds, by ``state_dict`` name, and the names of the whole model."""

    module: nn.Module
    local: dict[str, torch.Tensor]
    all_names: list[str]


def _layout(model: Any) -> _Layout:
    """What ``model`` holds on this rank: a plain ``nn.Module``, or a wrapper with the user's module
    in ``module`` (an ``smpart.DistributedModel``, or torch's ``DistributedDataParallel``).

    A wrapper with ``local_state_dict()`` (a model under processes) holds only its stage's tensors
    (the rest are on the meta device) and says which there; those are taken from
    ``module.state_dict()`` when it has them, so a load writes into the live parameters.
    Otherwise every tensor of the module is this rank's.
    """
    wrapped = getattr(model, "module", None)
    is_wrapper = isinstance(wrapped, nn.Module) and (
        not isinstance(model, nn.Module) or isinstance(model, nn.parallel.DistributedDataParallel))
    module = wrapped if is_wrapper else model
    if not isinstance(module, nn.Module):
        raise CheckpointError("a checkpoint is made of an nn.Module or an smpart.DistributedModel, "
                              f"got {type(model).__name__}")
    live = module.state_dict()
    local_state_dict = getattr(model, "local_state_dict", None) if is_wrapper else None
    if callable(local_state_dict):
        local = {name: live.get(name, tensor) for name, tensor in local_state_dict().items()}
        return _Layout(module, local, list(live))
    meta = [name for name, t in live.items() if t.device.type == "meta"]
    if meta:
        raise CheckpointError(f"{len(meta)} tensor(s) of {type(module).__name__} are on the meta device "
                              f"({_some(meta)}): materialise the model (or wrap it in "
                              "smpart.DistributedModel, whose ranks know what they hold) first")
    return _Layout(module, dict(live), list(live))


def _optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside ``optimizer`` (an ``smpart.DistributedOptimizer`` wraps one, and
    is an ``Optimizer`` itself to schedulers: unwrap it first)."""
    if isinstance(optimizer, DistributedOptimizer):
        optimizer._adopt_replaced_parameters()  # placement may have replaced parameters (tp shards)
        return optimizer.optimizer
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise CheckpointError(f"optimizer must be a torch.optim.Optimizer or smpart.DistributedOptimizer, "
                          f"got {type(optimizer).__name__}")


def _parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Each optimizer parameter this rank holds with its name in the model (a tied weight: its
    first name); parameters of other stages (on the meta device) are not this rank's to save."""
    names = {id(p): name for name, p in module.named_parameters()}
    out, unknown = [], 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type == "meta":
                continue
            if id(p) in names:
                out.append((names[id(p)], p))
            else:
                unknown += 1
    if unknown:
        raise CheckpointError(f"the optimizer holds {unknown} parameter(s) that are not the model's: build "
                              "the optimizer from model.parameters() of the model being checkpointed")
    return out


# ==================================================================== saving
def save_checkpoint(path: str | os.PathLike, model: Any, optimizer: Any = None, extra: Any = None, *,
                    process_group: Any = None) -> None:
    """Write ``model`` (and ``optimizer``, ``extra``, every rank's RNG states) to directory ``path``.

    Every rank calls it. ``model``: an ``nn.Module`` or a ``DistributedModel``; ``optimizer``: a
    torch optimizer or a ``DistributedOptimizer`` over the model's parameters; ``extra``: anything
    JSON can hold exactly (a dict of numbers, strings, lists, tuples...) or that
    ``torch.load(weights_only=True)`` reads back (tensors, plain containers). The directory must
    be new, empty, or an earlier checkpoint (which is replaced).
    """
    path = Path(path)
    if getattr(model, "_after_placement", None):
        raise CheckpointError("this model has a load waiting for its placement, which happens at its first "
                              "step (an optimizer's state under torchrun, or tensors built on the meta "
                              "device): saving now would write what was there before the load. Run a step "
                              "first (a forward-only step under torch.no_grad() places the model without "
                              "changing it)")
    rank, world = _rank(), _world(process_group)
    layout = _layout(model)
    optim = _optimizer(optimizer)
    _every_rank_calls("save_checkpoint", process_group)
    if rank == 0:
        _prepare_directory(path)
    _barrier(process_group)
    groups = _tie_groups(layout.local)  # a tied weight is written once, under its first name
    aliases = {name: names[0] for names in groups for name in names[1:]}
    # A fused q/k/v shard is three blocks of the global tensor; DCP stores one block per rank.
    tensors = {MODEL + names[0]: to_checkpoint_layout(layout.local[names[0]]) for names in groups}
    records: dict[str, Any] = {}
    if optim is not None:
        for name, p in _parameter_names(layout.module, optim):
            state = optim.state.get(p, {})
            group = next(g for g in optim.param_groups if any(q is p for q in g["params"]))
            tensor_keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
            tensors.update({f"{OPTIM}{name}.{k}": to_checkpoint_layout(state[k]) for k in tensor_keys})
            records[name] = {
                "group": _encode_fields(group, "params", f"the hyperparameters of {name!r}'s group"),
                "tensors": tensor_keys,
                "values": _encode_fields(state, tensor_keys, f"the optimizer state of {name!r}"),
                "has_state": bool(state),
            }
    side = path / SIDE_DIR
    _write_json(side / f"rank{rank:05d}.json", {
        "rank": rank, "world_size": world, "rng": _rng_state(), "optimizer": records if optim else None,
        "model_keys": sorted(layout.local), "aliases": aliases,
    })
    extra_kind = _save_extra(side, extra) if rank == 0 else None
    with _single_process_is_meant():
        dcp.save(tensors, checkpoint_id=path, process_group=process_group, no_dist=not _distributed())
    _barrier(process_group)
    if rank == 0:
        _write_json(path / MARKER, {
            "format": FORMAT, "world_size": world, "model_keys": len(layout.all_names),
            "optimizer": optim is not None, "extra": extra_kind, "torch": torch.__version__,
            "saved_at": time.time(),
        })
    _barrier(process_group)


def _encode_fields(fields: Mapping[str, Any], skip: Iterable[str] | str, what: str) -> dict[str, Any]:
    skip = {skip} if isinstance(skip, str) else set(skip)
    out = {}
    for key, value in fields.items():
        if key in skip:
            continue
        try:
            out[key] = _encode(value)
        except TypeError as err:
            raise CheckpointError(f"cannot save {what}: {key!r} is a {type(value).__name__} ({err}); smpart "
                                  "saves tensors and JSON values (numbers, strings, tuples...)") from err
    return out


def _prepare_directory(path: Path) -> None:
    """Make ``path`` ready for a new checkpoint: the old marker goes first, so a save that dies
    halfway never leaves a directory that looks complete."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"cannot write a checkpoint to {path}: it is a file; give a directory")
    if path.is_dir() and any(path.iterdir()) and not _looks_like_checkpoint(path):
        raise CheckpointError(f"cannot write a checkpoint to {path}: the directory holds other files; "
                              "give a new or empty directory, or an earlier checkpoint to replace")
    (path / MARKER).unlink(missing_ok=True)
    (path / ".metadata").unlink(missing_ok=True)
    for old in path.glob("*.distcp"):  # a save from more ranks wrote more of them
        old.unlink()
    side = path / SIDE_DIR
    if side.is_dir():
        for old in side.iterdir():  # files of an earlier save with more ranks would otherwise stay
            old.unlink()
    side.mkdir(parents=True, exist_ok=True)


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / MARKER).exists() or (path / ".metadata").exists() or (path / SIDE_DIR).is_dir()


def _save_extra(side: Path, extra: Any) -> str | None:
    if extra is None:
        return None
    try:
        if _same(_decode(json.loads(json.dumps(_encode(extra)))), extra):
            _write_json(side / "extra.json", _encode(extra))
            return "json"
    except (TypeError, ValueError):
        pass
    target = side / "extra.pt"
    try:
        torch.save(extra, target)
        torch.load(target, weights_only=True)
    except Exception as err:
        target.unlink(missing_ok=True)
        raise CheckpointError(
            f"extra ({type(extra).__name__}) is neither plain JSON nor readable with "
            f"torch.load(weights_only=True) ({_gist(err)}). Keep extra to numbers, strings, lists, tuples, "
            "dicts and tensors") from err
    return "torch"


# ==================================================================== loading
def load_checkpoint(path: str | os.PathLike, model: Any, optimizer: Any = None, *,
                    process_group: Any = None, restore_rng: bool = True) -> Any:
    """Read the checkpoint at ``path`` into ``model`` (and ``optimizer``); returns its ``extra``.

    Each rank reads the tensors it holds, whatever layout wrote them; a plain ``nn.Module`` reads
    everything. The model's tensors are overwritten in place; the optimizer's state is replaced
    (step counts included) and its groups' hyperparameters are those saved. With ``restore_rng``
    each rank's RNG states are set to those its rank saved (when the checkpoint has that rank).

    What the model holds after the call is what was loaded, however it was built:

    - a materialised model is loaded at once, every rank reading the whole model before its first
      step (placement then keeps each rank's stage and cuts its shards from the loaded values);
      under ``torchrun`` the optimizer's state waits for the placement, where each rank reads the
      state of the parameters it holds, in their final shapes;
    - a `DistributedModel` built on the meta device has nothing to load into until its placement
      makes each stage's tensors (at its first step, on every rank, threads or processes): the
      keys are checked now and the tensors read then. Until then ``model.state_dict()`` serves the
      checkpoint's values (read from ``path`` when asked).

    ``extra`` and the RNG states are restored now. Saving a model with a load still waiting for its
    placement is refused.

    Raises `CheckpointError` when ``path`` is not a checkpoint, was only partly written, or holds
    another model (every missing, unexpected and mis-shaped key named in one message).
    """
    path = Path(path)
    info = _check_complete(path)
    ranks = _read_rank_files(path)
    if optimizer is not None and not info.get("optimizer"):
        raise CheckpointError(f"{path} holds no optimizer state (it was saved without an optimizer); "
                              "load it with optimizer=None")
    if _awaits_placement(model) or getattr(model, "_filled_at_placement", None):
        # Built on meta: the tensors are made at placement (the first step), and loaded then; or
        # a load_weights waits for it, and this load, later, must win: it waits too.
        layout = _layout(model)
        saved = _SafeReader(path).read_metadata().state_dict_metadata
        _check_model_keys(path, layout, saved, _aliases(ranks))
        model._after_placement.append(lambda: _load_tensors(path, model, optimizer, process_group, ranks))
        model._loaded_later.append(lambda: _checkpoint_values(path, layout.all_names, _aliases(ranks)))
    else:
        _every_rank_calls("load_checkpoint", process_group)
        # Under torchrun an optimizer's state waits for the placement: a rank then holds the state
        # of its own stage's parameters only, in their tensor-parallel shapes.
        later = optimizer if optimizer is not None and _placed_later(model) else None
        _load_tensors(path, model, None if later is not None else optimizer, process_group, ranks)
        if later is not None:
            model._after_placement.append(
                lambda: _load_tensors(path, model, later, process_group, ranks, model_tensors=False))
    if restore_rng:
        _restore_rng(ranks, _rank(), len(ranks))
    return _load_extra(path / SIDE_DIR, info.get("extra"))


def _awaits_placement(model: Any) -> bool:
    """A `DistributedModel` not placed yet with tensors on the meta device: nothing holds their
    values until its placement makes each stage's (threads and processes alike)."""
    if getattr(model, "_after_placement", None) is None or getattr(model, "_runtime", None) is not None:
        return False
    from smpart.runtime.runtime import running_runtime

    on_meta = any(t.is_meta for t in itertools.chain(model.module.parameters(), model.module.buffers()))
    if on_meta and running_runtime() is None:
        raise CheckpointError("this model's tensors are on the meta device, and smpart is not running to "
                              "place it: call smpart.init(...) first, and the load waits for the model's "
                              "placement at its first step")
    return on_meta


def _placed_later(model: Any) -> bool:
    """A `DistributedModel` the process runtime has not placed yet (at placement each rank keeps
    its own stage only, and tensor-parallel layers become shards)."""
    if getattr(model, "_after_placement", None) is None or getattr(model, "_runtime", None) is not None:
        return False
    from smpart.runtime.runtime import running_runtime

    return getattr(running_runtime(), "setup", None) is not None


def _checkpoint_values(path: Path, names: list[str], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of ``names`` (state dict names), whole, on the CPU: what a load
    waiting for a meta-built model's placement will write, for `DistributedModel.state_dict`."""
    saved = _SafeReader(path).read_metadata().state_dict_metadata
    keys = {name: MODEL + aliases.get(name, name) for name in names}
    targets: dict[str, torch.Tensor] = {}
    for key in set(keys.values()):
        meta = saved[key]
        targets[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with _single_process_is_meant():
        dcp.load(targets, storage_reader=_SafeReader(path), no_dist=True)
    return {name: targets[key] for name, key in keys.items()}


def _load_tensors(path: Path, model: Any, optimizer: Any, process_group: Any,
                  ranks: dict[int, dict[str, Any]], model_tensors: bool = True) -> None:
    """Read the model's (and optimizer's) tensors that this rank holds, in place
    (``model_tensors=False``: the optimizer's only, the model's being loaded already)."""
    layout = _layout(model)
    optim = _optimizer(optimizer)
    reader = _SafeReader(path)
    saved = reader.read_metadata().state_dict_metadata
    aliases = _aliases(ranks)
    _check_model_keys(path, layout, saved, aliases)
    targets, copies = _model_targets(layout, aliases) if model_tensors else ({}, [])
    restore_state = None
    if optim is not None:
        restore_state = _optimizer_targets(path, layout, optim, saved, ranks, targets)
    with _single_process_is_meant():
        dcp.load(targets, storage_reader=reader, process_group=process_group, no_dist=not _distributed())
    for target, source in copies:
        from_checkpoint_layout(target, source)
    if restore_state is not None:
        restore_state()


def _check_complete(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: no such directory")
    marker = path / MARKER
    if not marker.exists():
        if _looks_like_checkpoint(path):
            raise CheckpointError(
                f"{path} is a partially written checkpoint: it has no {MARKER}, which a save writes last "
                "(the save was interrupted, or is still running, or the directory was not written by "
                "smpart.save_checkpoint). Use an earlier checkpoint; smpart.checkpoint.load_weights reads "
                "the weights of a plain DCP directory")
        raise CheckpointError(f"{path} is not a checkpoint: it has neither {MARKER} nor DCP's .metadata")
    try:
        info = json.loads(marker.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path}: its {MARKER} is not valid JSON ({err}); the checkpoint is "
                              "damaged") from err
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{path} was written in format {info.get('format')!r}; this smpart reads "
                              f"{FORMAT!r}")
    return info


def _aliases(ranks: dict[int, dict[str, Any]]) -> dict[str, str]:
    """Name of a tied weight -> the name it was written under."""
    out: dict[str, str] = {}
    for record in ranks.values():
        out.update(record.get("aliases") or {})
    return out


def _model_targets(layout: _Layout, aliases: dict[str, str],
                   ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tensors DCP loads into, by key, and (target, source) copies to make after: a weight
    tied in the checkpoint but not in this model is read once and copied."""
    targets: dict[str, torch.Tensor] = {}
    copies = []
    for names in _tie_groups(layout.local):
        key = MODEL + aliases.get(names[0], names[0])
        tensor = layout.local[names[0]]
        if key in targets:
            copies.append((tensor, targets[key]))
        else:
            targets[key] = to_checkpoint_layout(tensor)
            if targets[key] is not tensor:  # a fused shard: read as DCP stores it, then re-laid out
                copies.append((tensor, targets[key]))
    return targets, copies


def _check_model_keys(path: Path, layout: _Layout, saved: Mapping[str, Any], aliases: dict[str, str]) -> None:
    """Every key this rank needs is there with its shape, and the checkpoint has no key the
    model lacks; all problems in one message."""
    in_checkpoint = {k[len(MODEL):]: v for k, v in saved.items() if k.startswith(MODEL)}
    in_checkpoint.update({name: in_checkpoint[source] for name, source in aliases.items()
                          if source in in_checkpoint})
    missing = [name for name in layout.local if name not in in_checkpoint]
    unexpected = sorted(set(in_checkpoint) - set(layout.all_names))
    wrong = []
    for name, tensor in layout.local.items():
        meta = in_checkpoint.get(name)
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(tensor.shape):
            wrong.append(f"{name}: checkpoint {tuple(meta.size)}, model {tuple(tensor.shape)}")
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"not in the model: {_some(unexpected)}")
    if wrong:
        problems.append(f"shape mismatch: {_some(wrong)}")
    if problems:
        raise CheckpointError(f"{path} holds another model than {type(layout.module).__name__}: "
                              + "; ".join(problems) + ". Load it into the model it was saved from "
                              "(same architecture and sizes)")


def _optimizer_targets(path: Path, layout: _Layout, optim: torch.optim.Optimizer, saved: Mapping[str, Any],
                       ranks: dict[int, dict[str, Any]], targets: dict[str, torch.Tensor]):
    """Add the optimizer's tensors to ``targets`` (allocated as saved) and return the function
    that installs them, with the non-tensor state and hyperparameters, once DCP filled them."""
    records: dict[str, Any] = {}
    for record in ranks.values():
        records.update(record.get("optimizer") or {})
    params = _parameter_names(layout.module, optim)
    states: dict[int, dict[str, Any]] = {}
    relaid: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, p in params:
        record = records.get(name)
        if record is None or not record.get("has_state", True):
            continue  # no state saved for it (it never took a step): it gets none
        state = {}
        for key in record["tensors"]:
            full = f"{OPTIM}{name}.{key}"
            meta = saved.get(full)
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{path} is damaged: optimizer state {full!r} is listed but not stored")
            state[key] = _empty_like_saved(meta, p, optim.state.get(p, {}).get(key))
            targets[full] = to_checkpoint_layout(state[key])
            if targets[full] is not state[key]:
                relaid.append((state[key], targets[full]))
        state.update({k: _decode(v) for k, v in record["values"].items()})
        states[id(p)] = state

    def install() -> None:
        for target, source in relaid:
            from_checkpoint_layout(target, source)
        for _, p in params:
            optim.state.pop(p, None)
            if id(p) in states:
                optim.state[p] = states[id(p)]
        for group in optim.param_groups:
            first = next((records[n] for n, p in params if any(q is p for q in group["params"])
                          and n in records), None)
            if first is not None:
                group.update({k: _decode(v) for k, v in first["group"].items()})

    return install


def _empty_like_saved(meta: TensorStorageMetadata, param: torch.Tensor, current: torch.Tensor | None):
    """A tensor to load a saved optimizer tensor into: the state's current one when it matches,
    else shaped like the parameter (a DTensor for a DTensor) or as saved (a step count, on CPU)."""
    dtype = meta.properties.dtype
    if current is not None and tuple(current.shape) == tuple(meta.size) and current.dtype == dtype:
        return current
    if tuple(meta.size) == tuple(param.shape) and len(meta.size) > 0:
        return torch.empty_like(param, dtype=dtype)
    device = "cpu" if len(meta.size) == 0 else param.device
    return torch.empty(tuple(meta.size), dtype=dtype, device=device)


def _read_rank_files(path: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for file in sorted((path / SIDE_DIR).glob("rank*.json")):
        record = json.loads(file.read_text())
        out[int(record["rank"])] = record
    return out


def _load_extra(side: Path, kind: str | None) -> Any:
    if kind == "json":
        return _decode(json.loads((side / "extra.json").read_text()))
    if kind == "torch":
        return torch.load(side / "extra.pt", weights_only=True)
    return None


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


# ==================================================================== plain weights
def load_weights(model: Any, source: str | os.PathLike | Mapping[str, torch.Tensor], *, prefix: str = "",
                 strict: bool = True) -> list[str]:
    """Copy weights into ``model`` from a state dict or a file, reading only the keys it holds.

    ``source``: a dict of tensors; a ``.safetensors``, ``.bin`` or ``.pt`` file (``torch.load``
    with ``weights_only=True``, memory-mapped); a directory holding ``model.safetensors``,
    ``pytorch_model.bin`` or their sharded ``*.index.json`` (a Hugging Face model's own
    weights); or a DCP directory (an smpart checkpoint's ``model.`` keys are found by
    themselves). Source keys are ``prefix`` + the model's ``state_dict`` names. A tied weight
    loads from whichever of its names the source has. Under processes each rank reads its own
    tensors, and a DTensor reads only its shard. ``strict``: raise `CheckpointError` naming every
    missing, unexpected or mis-shaped key (else skip them). Returns the names loaded.

    A model on threads, or placed, is loaded at once. A `DistributedModel` not placed yet under
    ``torchrun``, or built on the meta device, is checked now and read at its placement, as
    `load_checkpoint` reads one built on meta: then each rank knows what it holds, and reads only
    that (a 1 B-parameter model on 4 stages: a quarter of the source per rank, not all of it, and
    rank 0's values of those tensors are not sent to every rank first). Until then
    ``model.state_dict()`` serves the source's values; the model's own tensors still hold theirs.
    """
    layout = _layout(model)
    deferred = _awaits_placement(model) or _placed_later(model)
    # Not placed yet, a rank does not know what it will hold: check against the whole model now
    tensors = layout.module.state_dict(keep_vars=True) if deferred else layout.local  # tied: one object
    store = _open_store(source)
    if store.dcp_prefix is not None and not prefix:
        prefix = store.dcp_prefix
    keys = set(store.keys())
    groups = _tie_groups(tensors)
    wanted: dict[str, list[str]] = {}  # source key -> the local names it fills
    missing = []
    for names in groups:
        found = next((prefix + n for n in names if prefix + n in keys), None)
        if found is None:
            missing.extend(names)
        else:
            wanted[found] = names
    known = {prefix + n for n in layout.all_names}
    unexpected = sorted(k for k in keys if k.startswith(prefix) and k not in known)
    wrong = [f"{k}: source {store.shape(k)}, model {tuple(tensors[n[0]].shape)}"
             for k, n in wanted.items() if store.shape(k) != tuple(tensors[n[0]].shape)]
    if strict and (missing or unexpected or wrong):
        problems = [f"{label}: {_some(items)}" for label, items in
                    (("missing from the source", missing), ("not in the model", unexpected),
                     ("shape mismatch", wrong)) if items]
        raise CheckpointError(f"cannot load {store.describe()} into {type(layout.module).__name__}: "
                              + "; ".join(problems) + ". Check the model class and sizes, or pass "
                              "prefix= (source keys = prefix + the model's names) or strict=False")
    bad = {w.split(":")[0] for w in wrong}
    todo = {k: names for k, names in wanted.items() if k not in bad}
    loaded = sorted(n for names in todo.values() for n in names)
    if deferred:  # each rank reads what it will hold, once placed; served by state_dict() until then
        model._after_placement.append(lambda: load_weights(model, source, prefix=prefix, strict=strict))
        dtypes = {n: tensors[names[0]].dtype for names in todo.values() for n in names}
        model._loaded_later.append(lambda: _source_values(source, todo, dtypes))
        model._filled_at_placement.update(loaded)  # rank 0's values of these need not reach every rank
        return loaded
    with torch.no_grad():
        store.copy_all({key: layout.local[names[0]] for key, names in todo.items()})
    return loaded


def _source_values(source: Any, todo: dict[str, list[str]], dtypes: dict[str, torch.dtype],
                   ) -> dict[str, torch.Tensor]:
    """What `load_weights` will write into a meta-built model at its placement, read now: ``todo``
    maps source keys to the state dict names they fill. One process's read, no collective."""
    store = _open_store(source)
    out: dict[str, torch.Tensor] = {}
    for key, names in todo.items():
        value = torch.empty(store.shape(key), dtype=dtypes[names[0]])
        if isinstance(store, _DCPStore):
            with _single_process_is_meant():
                dcp.load({store.aliases.get(key, key): value}, storage_reader=_SafeReader(store.path),
                         no_dist=True)
        else:
            store.copy_into(key, value)
        out.update(dict.fromkeys(names, value))
    return out


def _tie_groups(local: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by the tensor they share (a tied weight is one group)."""
    groups: dict[tuple, list[str]] = {}
    for name, t in local.items():
        key = _storage_key(t)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _storage_key(t: torch.Tensor) -> tuple:
    local = t.to_local() if _is_dtensor(t) else t
    if local.is_meta:  # no storage: a tied weight is one object
        return (id(t),)
    try:
        return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.dtype)
    except (RuntimeError, NotImplementedError):
        return (id(t),)


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


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _is_fused(t: Any) -> bool:
    """A fused q/k/v shard: this rank's slice of each part (a ``_StridedShard``)."""
    if not _is_dtensor(t):
        return False
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in t.placements)


# ==================================================================== RNG states
def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state().tolist(), "python": _encode(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    with contextlib.suppress(ImportError):
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _restore_rng(ranks: dict[int, dict[str, Any]], rank: int, saved_world: int) -> None:
    record = ranks.get(rank)
    if record is None:
        warnings.warn(f"the checkpoint holds the RNG states of {saved_world} rank(s), not of rank {rank}: "
                      "its RNG states are left as they are", stacklevel=3)
        return
    state = record["rng"]
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(_decode(state["python"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if state.get("numpy"):
        with contextlib.suppress(ImportError):
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ==================================================================== JSON with tuples and tensors
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


# ==================================================================== files and ranks
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


@contextlib.contextmanager
def _single_process_is_meant() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    """The global rank: RNG states are per process, whatever group the checkpoint is saved over."""
    return dist.get_rank() if _distributed() else 0


def _world(group: Any = None) -> int:
    return dist.get_world_size(group) if _distributed() else 1


def _barrier(group: Any = None) -> None:
    if _distributed():
        dist.barrier(group)


def _every_rank_calls(what: str, group: Any) -> None:
    """Wait until every rank has called ``what``, under smpart's processes at most its ``timeout_s``,
    naming the ranks that did not come: a collective that one rank skips (``if smpart.rank() == 0:``)
    would wait for its group's timeout, half an hour, and fail without saying why."""
    from smpart.runtime.runtime import running_runtime

    runtime = running_runtime()
    setup = getattr(runtime, "setup", None)
    if group is not None or setup is None or not _distributed():
        return
    timeout = datetime.timedelta(seconds=runtime.config.timeout_s)
    try:
        dist.monitored_barrier(setup.collective_group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        raise CheckpointError(f"{what} is collective: every rank must call it ({_gist(err)}). To save "
                              "from one rank, write model.state_dict() and optimizer.state_dict() there "
                              "(the other ranks send their parts)") from err


def _gist(err: BaseException) -> str:
    """The line of a long torch error that says what went wrong."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    found = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
    return f"{type(err).__name__}: {found}"


def _some(items: list[str], shown: int = 8) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def iter_checkpoint_keys(path: str | os.PathLike) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor key of a checkpoint with its global shape (for inspection and tools)."""
    for key, meta in _SafeReader(Path(path)).read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            yield key, tuple(meta.size)
