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

The package, one job a file: `save` and `load` (the two doors of a checkpoint), `weights` (the
other door in, with its sources in `stores`), and what they share: `files` (the directory's
files and their JSON), `layout` (what a rank holds), `rng` and `collective`.
"""

from smpart.checkpoint.files import FORMAT, MARKER, iter_checkpoint_keys
from smpart.checkpoint.load import load_checkpoint
from smpart.checkpoint.save import save_checkpoint
from smpart.checkpoint.weights import load_weights
from smpart.errors import CheckpointError

__all__ = ["CheckpointError", "FORMAT", "MARKER", "iter_checkpoint_keys", "load_checkpoint", "load_weights",
           "save_checkpoint"]
