"""`load_checkpoint`: refuse an incomplete checkpoint, ask DCP for the tensors this rank holds
in the shapes it holds them, and restore the optimizer's state and the RNG states.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from smpart.checkpoint.collective import (
    _distributed,
    _every_rank_calls,
    _rank,
    _single_process_is_meant,
    _some,
)
from smpart.checkpoint.files import (
    FORMAT,
    MARKER,
    MODEL,
    OPTIM,
    SIDE_DIR,
    _aliases,
    _decode,
    _looks_like_checkpoint,
    _read_rank_files,
    _SafeReader,
)
from smpart.checkpoint.layout import (
    _awaits_placement,
    _Layout,
    _layout,
    _optimizer,
    _parameter_names,
    _placed_later,
    _tie_groups,
)
from smpart.checkpoint.rng import _restore_rng
from smpart.errors import CheckpointError
from smpart.tensor_parallel.layers import from_checkpoint_layout, to_checkpoint_layout


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


def _load_extra(side: Path, kind: str | None) -> Any:
    if kind == "json":
        return _decode(json.loads((side / "extra.json").read_text()))
    if kind == "torch":
        return torch.load(side / "extra.pt", weights_only=True)
    return None
