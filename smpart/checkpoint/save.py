"""`save_checkpoint`: every rank hands DCP the tensors it holds, writes its JSON side file, and
the completion marker is written last, atomically, once every rank is done.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from smpart.checkpoint.collective import (
    _barrier,
    _distributed,
    _every_rank_calls,
    _gist,
    _rank,
    _single_process_is_meant,
    _world,
)
from smpart.checkpoint.files import (
    FORMAT,
    MARKER,
    MODEL,
    OPTIM,
    SIDE_DIR,
    _decode,
    _encode,
    _looks_like_checkpoint,
    _same,
    _write_json,
)
from smpart.checkpoint.layout import _layout, _optimizer, _parameter_names, _tie_groups
from smpart.checkpoint.rng import _rng_state
from smpart.errors import CheckpointError
from smpart.tensor_parallel.layers import to_checkpoint_layout


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
