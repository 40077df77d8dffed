"""Every rank starts from the first rank's model: under ``torchrun``, rank 0's model is the model.

Under data parallelism each replica trains its own copy of every stage, and averaging gradients
keeps copies equal only if they started equal; under tensor parallelism each rank cuts its shards
from its own copy of the full weights and keeps its own copy of the replicated ones (norms,
biases); under pipeline parallelism alone each rank keeps its own stage from its own copy. A
script that seeds each rank differently (``torch.manual_seed(seed + rank)``, common for data
order and dropout) builds different copies: replicas would train apart silently, and the model
trained would be a mix of copies. So, as DDP does when it wraps a model, smpart gives every rank
the first rank's values, once per model, whatever the layout: at the start of the first step
after the model was made (every rank calls the step function, so every rank is there), before
anything is traced or placed. Weights loaded on rank 0 alone reach every rank too.

- Tensors already materialised are broadcast from rank 0, in buckets of one dtype, through a CPU
  copy (smpart's gloo group), so a rank that holds the model on its GPU is served too.
- Tensors on the meta device have no values yet: each rank initialises its own stage's modules at
  placement (`placement.place_on_rank`). That initialisation draws from a generator seeded with
  rank 0's seed, the model and the stage (`initialisation_seed`), so every rank holding a stage
  (its replicas, its tensor-parallel ranks) draws the same values, while different stages differ.

Before that, the ranks agree that they hold the same models, tensor by tensor
(names, shapes, dtypes, which are on the meta device; `check_same_models`): a digest's max and
min over every rank, one small all-reduce. A model that differs between ranks is an error naming
it, not a collective that never pairs, nor (a model built for real on one rank and on meta on the
others) a stage silently initialised afresh.

The tensor-parallel ranks of a stage also draw alike (`share_random_state`): a dropout after a
row-parallel layer masks an activation every one of them holds whole, and masks that differ would
make their copies differ (the next layer's shards would compute from different inputs, and the
all-reduce after it would sum them). So at every step's start they take the first one's random
state (the CPU's and their GPU's); they draw the same numbers in the same order from then on, since
they run the same modules on shards of one size. Dropout inside a sharded region (attention heads)
then masks each rank's shard alike: valid masks, correlated across shards, where Megatron keeps a
second generator for those regions.

Every wait is bounded by ``timeout_s``.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from smpart.errors import SmpartError

#: Bytes per broadcast: the CPU copy made for it is at most this large.
BUCKET_BYTES = 64 * 2**20


def make_replicas_agree(models: list[Any], group: Any, timeout_s: float) -> None:
    """Give every rank of ``group`` rank 0's values of ``models`` (`DistributedModel`\\ s no rank
    has placed yet, in creation order) and rank 0's seed for what is still on the meta device."""
    if not models:
        return
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)
    _wait(dist.broadcast(seed, src=0, group=group, async_op=True), timeout_s, "rank 0's seed")
    for model in models:
        # A tensor-parallel layer the user built holds its own shard (a DTensor): not a copy
        tensors = [t for _, t in _tensors(model.module) if not t.is_meta and not isinstance(t, DTensor)]
        for bucket in _buckets(tensors):
            _broadcast(bucket, group, timeout_s)
        model._init_seed = int(seed.item())


def share_random_state(group: Any, src: int, device: torch.device, timeout_s: float) -> None:
    """Every rank of ``group`` takes rank ``src``'s random state: the CPU's, and ``device``'s if a GPU."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    flat = torch.cat(parts).to(on)
    _wait(dist.broadcast(flat, src=src, group=group, async_op=True), timeout_s, "the random state")
    flat = flat.cpu()
    cpu_size = parts[0].numel()
    torch.set_rng_state(flat[:cpu_size])
    if device.type == "cuda":
        torch.cuda.set_rng_state(flat[cpu_size:], device)


def initialisation_seed(base: int, model_id: int, stage: int) -> int:
    """The seed of a stage's first values when its modules come from the meta device: another for
    each stage, the same on every rank that holds the stage (its replicas and its tensor-parallel
    ranks, whose modules kept whole must agree)."""
    digest = hashlib.sha256(f"{base}/{model_id}/{stage}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer once (a tied one under its first name), in a fixed order."""
    yield from module.named_parameters()
    yield from ((name, b) for name, b in module.named_buffers() if b is not None)


def check_same_models(models: list[Any], group: Any, timeout_s: float) -> None:
    """Raise unless every rank of ``group`` holds ``models`` alike: the same tensors by name, shape,
    dtype and meta-ness (one small all-reduce)."""
    if not models:
        return
    described = [(model.model_id, [(name, tuple(t.shape), str(t.dtype), t.is_meta)
                                   for name, t in _tensors(model.module)]) for model in models]
    digest = int.from_bytes(hashlib.sha256(repr(described).encode()).digest()[:7], "little")
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)
    _wait(dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout_s,
          "the models' description")
    if extremes[0].item() != -extremes[1].item():
        numbers = ", ".join(f"#{model.model_id}" for model in models)
        raise SmpartError(
            f"the ranks hold different models (DistributedModel {numbers}: their parameters' and buffers' "
            "names, shapes, dtypes or meta-ness differ between ranks). Every rank must build the same "
            "models in the same order, all of them materialised (rank 0's values then reach every rank) "
            "or all on the meta device (then load weights with smpart.load_checkpoint): a rank that "
            "built on meta has nowhere to take rank 0's values")


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in same:
            if bucket and size + t.numel() * t.element_size() > BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket


def _broadcast(bucket: list[torch.Tensor], group: Any, timeout_s: float) -> None:
    flat = _flatten_dense_tensors([t.detach().to("cpu") for t in bucket])
    _wait(dist.broadcast(flat, src=0, group=group, async_op=True), timeout_s, "the model's values")
    if dist.get_rank() == 0:
        return
    with torch.no_grad():
        for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            t.copy_(value)


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise SmpartError(f"the ranks did not agree on {what} within {timeout_s} s at the start of a "
                          f"step (every rank must call the step function): {err}") from err
