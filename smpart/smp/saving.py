"""SMP's saving and loading, on smpart's checkpoints.

- ``smp.save(obj, f, partial=True)`` writes one file per (pipeline stage, tensor-parallel rank),
  ``f_<pp_rank>_<tp_rank>``, with the layout it was written under; ``smp.load(f, partial=True)``
  reads every stage's file of this rank's tensor-parallel rank and merges them (dicts are joined
  key by key, this rank's own entries first), so a partial model or optimizer state dict saved
  under one pipeline split loads under another. Shards of split layers fit only the same
  tensor-parallel degree; checkpoints (below) load anywhere. ``partial=False`` is ``torch.save``.
- ``smp.save_checkpoint(path, tag, partial=True, ...)`` writes ``path/<tag>_partial``, an smpart
  checkpoint (`smpart.save_checkpoint`): written by every rank, read back under any layout of
  pipeline, tensor and data parallelism, or by the plain model. ``path/newest`` names the newest
  tag; ``num_kept_partial_checkpoints`` keeps that many. ``partial=False`` writes the full state
  dict to ``path/<tag>`` (first rank), as SMP's full checkpoints were.
- ``smp.resume_from_checkpoint(path, tag=None, partial=True)`` loads into ``smp.state.model`` and
  ``smp.state.optimizer`` (under ``torchrun`` the tensors arrive at the model's first step, when
  each rank knows what it holds) and returns the ``user_content``.

``user_content`` may hold any Python object (SMP's GPT-2 example keeps its ``GPT2Config`` there),
so it is pickled, as SMP did, and so are ``smp.save`` files: load only checkpoints you trust. The
tensors of a partial checkpoint are read by smpart's checkpoint code, which unpickles nothing.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from smpart.errors import CheckpointError
from smpart.smp import groups
from smpart.smp.config import say_once
from smpart.smp.state import state

PARTIAL_KEY = "_smpart_partial"
NEWEST = "newest"
USER_CONTENT = "user_content.pt"


def _checkpoints() -> Any:
    """smpart's checkpoint module, imported at first use (``torch.distributed.checkpoint`` imports slowly)."""
    from smpart import checkpoint

    return checkpoint


# ==================================================================== smp.save / smp.load
def save(obj: Any, f: str, partial: bool = True, pickle_module: Any = pickle, pickle_protocol: int = 2,
         **options: Any) -> None:
    """``torch.save(obj, f)``; with ``partial``, into this rank's file ``f_<pp_rank>_<tp_rank>``."""
    if options:
        say_once("save options", f"smp.save({', '.join(sorted(options))}=...) has no effect here")
    if not partial:
        torch.save(obj, f, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
        return
    obj = pytree.tree_map(lambda v: v.to_local() if hasattr(v, "to_local") else v, obj)  # shards as held
    layout = {"pp_rank": groups.pp_rank(), "tp_rank": groups.tp_rank(), "pp_size": groups.pp_size(),
              "tp_size": groups.tp_size()}
    torch.save({PARTIAL_KEY: layout, "obj": obj}, _partial_name(f, layout["pp_rank"], layout["tp_rank"]),
               pickle_module=pickle_module, pickle_protocol=pickle_protocol)


def load(f: str, map_location: Any = None, pickle_module: Any = None, partial: bool = True,
         **pickle_load_args: Any) -> Any:
    """What `save` wrote; with ``partial``, every stage's file of this tensor-parallel rank, merged."""
    extra = {"pickle_module": pickle_module} if pickle_module is not None else {}
    if not partial:
        return torch.load(f, map_location=map_location, weights_only=False, **extra, **pickle_load_args)
    found = sorted(Path(f).parent.glob(Path(f).name + "_*_*"))
    parts = [torch.load(p, map_location=map_location, weights_only=False, **extra, **pickle_load_args)
             for p in found]
    parts = [p for p in parts if isinstance(p, dict) and PARTIAL_KEY in p]
    if not parts:
        raise CheckpointError(f"no partial files {f}_<pp_rank>_<tp_rank> (written by smp.save(obj, {f!r}, "
                              "partial=True)); for one file, load with partial=False")
    tp_sizes = {p[PARTIAL_KEY]["tp_size"] for p in parts}
    if tp_sizes != {groups.tp_size()}:
        raise CheckpointError(f"{f}: partial files saved at tensor-parallel degree {sorted(tp_sizes)} hold "
                              f"shards that do not fit degree {groups.tp_size()}; smp.save_checkpoint / "
                              "smp.resume_from_checkpoint load into any layout")
    mine = [p for p in parts if p[PARTIAL_KEY]["tp_rank"] == groups.tp_rank()]
    if not mine:
        raise CheckpointError(f"{f}: no partial file of tensor-parallel rank {groups.tp_rank()}; every rank "
                              "of a stage's tensor-parallel group saves its own shards (save where "
                              "smp.rdp_rank() == 0, not smp.dp_rank() == 0)")
    mine.sort(key=lambda p: (p[PARTIAL_KEY]["pp_rank"] != groups.pp_rank(), p[PARTIAL_KEY]["pp_rank"]))
    merged = mine[0]["obj"]
    for part in mine[1:]:
        merged = _merge(merged, part["obj"])
    return merged


def _partial_name(f: str, pp_rank: int, tp_rank: int) -> str:
    return f"{f}_{pp_rank}_{tp_rank}"


def _merge(mine: Any, theirs: Any) -> Any:
    """Dicts joined key by key (``mine`` first); anything else: ``mine``."""
    if not (isinstance(mine, dict) and isinstance(theirs, dict)):
        return mine
    out = dict(mine)
    for key, value in theirs.items():
        out[key] = _merge(out[key], value) if key in out else value
    return out


# ==================================================================== checkpoints
def save_checkpoint(path: str | os.PathLike, tag: str, partial: bool = True, model: Any = None,
                    optimizer: Any = None, user_content: Any = None, translate_if_full: bool = True,
                    num_kept_partial_checkpoints: int | None = None) -> None:
    """Every rank calls it. See the module docstring for what it writes where."""
    model = model if model is not None else state.model
    if model is None:
        raise CheckpointError("smp.save_checkpoint: no model to save; pass model=... (a DistributedModel)")
    root = Path(path)
    if groups.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    if not partial:
        full = model.state_dict()  # collective with tensor parallelism: every rank asks
        if groups.rank() == 0:
            torch.save(full, root / tag)
            torch.save(user_content, root / f"user_content_{tag}")
        groups.barrier()
        return
    target = root / f"{tag}_partial"
    scaler = getattr(optimizer, "loss_scaler", None)
    extra = {"smp": {"loss_scaler": scaler.state_dict()}} if scaler is not None else None
    _checkpoints().save_checkpoint(target, model, optimizer, extra)
    if groups.rank() == 0:
        torch.save(user_content, target / USER_CONTENT)
        (root / NEWEST).write_text(tag)
        if num_kept_partial_checkpoints is not None:
            _keep_newest(root, num_kept_partial_checkpoints)
    groups.barrier()


def _keep_newest(root: Path, kept: int) -> None:
    complete = [d for d in root.glob("*_partial") if (d / _checkpoints().MARKER).exists()]
    complete.sort(key=lambda d: (d / _checkpoints().MARKER).stat().st_mtime)
    for old in complete[:max(len(complete) - kept, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def resume_from_checkpoint(path: str | os.PathLike, tag: str | None = None, partial: bool = True,
                           strict: bool = True, load_optimizer: bool = True,
                           load_sharded_optimizer_state: bool = True, translate_function: Any = None) -> Any:
    """Load the checkpoint into ``smp.state.model`` (and ``smp.state.optimizer``); returns its
    ``user_content``. ``tag`` None: the newest one ``save_checkpoint`` wrote under ``path``."""
    model, optimizer = state.model, state.optimizer if load_optimizer else None
    if model is None:
        raise CheckpointError("smp.resume_from_checkpoint loads into the smp.DistributedModel: make it (and "
                              "the smp.DistributedOptimizer) first")
    root = Path(path)
    if not partial:
        if tag is None:
            raise CheckpointError("a full checkpoint is one file: pass its tag (the file name under path)")
        full = torch.load(root / tag, map_location="cpu", weights_only=True)
        if translate_function is not None:
            full = translate_function(full)
        model.load_state_dict(full, strict=strict)
        return _user_content(root / f"user_content_{tag}")
    if tag is None:
        if not (root / NEWEST).exists():
            raise CheckpointError(f"{root} holds no {NEWEST} file: no smp.save_checkpoint(..., partial=True) "
                                  "finished there; pass tag=...")
        tag = (root / NEWEST).read_text().strip()
    source = root / f"{tag}_partial"
    if not strict:
        say_once("resume strict", "resume_from_checkpoint(strict=False) loads the model's weights that match "
                 "and not the optimizer's state")
        _checkpoints().load_weights(model, source, strict=False)
        return _user_content(source / USER_CONTENT)
    if optimizer is not None and not _has_optimizer(source):
        optimizer = None
    extra = _checkpoints().load_checkpoint(source, model, optimizer)
    scaler_state = ((extra or {}).get("smp") or {}).get("loss_scaler")
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and scaler_state:
        scaler.load_state_dict(scaler_state)
    return _user_content(source / USER_CONTENT)


def _has_optimizer(source: Path) -> bool:
    try:
        return bool(json.loads((source / _checkpoints().MARKER).read_text()).get("optimizer"))
    except (OSError, ValueError):
        return False


def _user_content(file: Path) -> Any:
    return torch.load(file, weights_only=False) if file.exists() else None
