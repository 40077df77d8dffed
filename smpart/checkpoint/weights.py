"""`load_weights`: a model's weights from a plain state dict, a ``.safetensors`` / ``.bin`` /
``.pt`` file, a Hugging Face model directory or a DCP directory, key by key, each rank reading
only the tensors it holds (and, for a DTensor, only its shard's bytes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from smpart.checkpoint.collective import _single_process_is_meant, _some
from smpart.checkpoint.files import _SafeReader
from smpart.checkpoint.layout import _awaits_placement, _layout, _placed_later, _tie_groups
from smpart.checkpoint.stores import _DCPStore, _open_store
from smpart.errors import CheckpointError


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
