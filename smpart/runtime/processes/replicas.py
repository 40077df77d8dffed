"""Every rank starts from the first rank's model: under ``torchrun``, rank 0's model is the model.

Under data parallelism each replica trains its own copy of every stage, and averaging gradients
keeps copies equal only if they started equal; under tensor parallelism each rank cuts its shards
from its own copy of the full weights and keeps its own copy of the replicated ones (norms,
biases); under pipeline parallelism alone each rank keeps its own stage from its own copy. A
script that seeds each rank differently (``torch.manual_seed(seed + rank)``, common for data
order and dropout) builds different copies: replicas would train apart silently, and the model
trained would be a mix of copies. So, as DDP does when it wraps a model, smpart gives every rank
the first rank's values, once per model, whatever the layout: at the start of the model's first
step (the step's own model: every rank calls the step function with it, so every rank is there),
before anything is traced or placed. Weights loaded on rank 0 alone reach every rank too; those
a pending `smpart.load_weights` will write at placement are left out (each rank reads its own
from the source: a 1 B-parameter model is not sent to every rank first).

- Tensors already materialised are broadcast from rank 0, in buckets of one dtype, through a CPU
  copy (smpart's gloo group), so a rank that holds the model on its GPU is served too.
- Tensors on the meta device have no values yet: each rank initialises its own stage's modules at
  placement (`placement.place_on_rank`). That initialisation draws from a generator seeded with
  rank 0's seed, the model and the stage (`initialisation_seed`), so every rank holding a stage
  (its replicas, its tensor-parallel ranks) draws the same values, while different stages differ.

Before that, the ranks agree that they hold the same models, tensor by tensor
(names, shapes, dtypes, which are on the meta device; `check_same_model`): a digest's max and
min over every rank, one small all-reduce. A model that differs between ranks is an error naming
it, not a collective that never pairs, nor (a model built for real on one rank and on meta on the
others) a stage silently initialised afresh.

The tensor-parallel ranks of a stage also draw alike (`share_random_state`): a dropout after a
row-parallel layer masks an activation every one of them holds whole, and masks that differ would
make their copies differ (the next layer's shards would compute from different inputs, and the
all-reduce after it would sum them). So at every step's start they take the first one's random
state (the CPU's and their GPU's); they draw the same numbers in the same order from then on, since
they run the same modules on shards of one size. Inside a split region (attention heads, an MLP's
hidden units) each rank draws from a stream of its own, made from the shared one
(`smpart.tensor_parallel.streams`), so the heads are masked independently, as in the unsplit model.

A model placed under an earlier ``init`` left each rank only its own stage (`make_whole`): when the
next ``init`` places it, every rank takes back the tensors its new stage holds that it released,
and their optimizer state, from the lowest rank that kept each, so the placement, in any layout,
starts from the trained model, as on threads, where nothing was ever released; no rank holds
more than what it kept, what it will hold and one bucket in flight.

Under data parallelism each step also begins with the replicas taking the first replica's
buffers, those a state dict saves (`share_buffers`; ``DistributedModel(broadcast_buffers=True)``,
SMP's switch): each replica's own data moves BatchNorm's running statistics, and replicas would
evaluate apart.

Every wait is bounded by ``timeout_s``.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smpart.errors import SmpartError
from smpart.runtime.placement.place import fill_released
from smpart.runtime.processes.data_parallel import buckets, flat_copy
from smpart.tensor_parallel.layers import is_dtensor

#: Bytes per broadcast: the CPU copy made for it is at most this large.
BUCKET_BYTES = 64 * 2**20


def make_replicas_agree(model: Any, group: Any, timeout_s: float) -> None:
    """Give every rank of ``group`` rank 0's values of ``model`` (a `DistributedModel` no rank has
    placed yet) and rank 0's seed for what is still on the meta device."""
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)
    _wait(dist.broadcast(seed, src=0, group=group, async_op=True), timeout_s, "rank 0's seed")
    # A tensor-parallel layer the user built holds its own shard (a DTensor): not a copy; weights
    # to be loaded at placement (`load_weights`) are read by each rank from the source instead
    loaded = model._filled_at_placement
    _take_values([t for name, t in _tensors(model.module)
                  if not t.is_meta and not is_dtensor(t) and name not in loaded], group, 0, timeout_s)
    model._init_seed = int(seed.item())


def make_whole(model: Any, optimizers: list[Any], group: Any, timeout_s: float,
               keep: Callable[[list[str]], bool] | None = None) -> None:
    r"""A model placed under an earlier ``init`` (each rank kept only its stage's tensors, the rest
    released to the meta device) takes back, on every rank of ``group``, the tensors it will hold
    in the placement to come, and so does the state of ``optimizers`` (`DistributedOptimizer`\ s
    over it): every tensor comes from the lowest rank that kept it. ``keep(names)`` says whether
    this rank will hold the tensor of those names (a tied one has several; default: every tensor,
    the model whole again, as on threads, where nothing was ever released).

    A tensor travels only when some rank needs it, in buckets from its owner, and a rank keeps
    only its own: it holds what it kept, what it will hold and one bucket, never the whole model
    (nor the whole optimizer state)."""
    if any(is_dtensor(t) for _, t in _tensors(model.module)):
        raise SmpartError(f"DistributedModel #{model.model_id} was split for tensor parallelism under "
                          "an earlier smpart.init: to run it under another, save a checkpoint before "
                          "smpart.shutdown() (smpart.save_checkpoint) and load it into a model built anew")
    for optimizer in optimizers:
        if optimizer._sharded is not None:
            raise SmpartError("this DistributedOptimizer's state was sharded over data-parallel replicas "
                              "(shard_optimizer_state) under an earlier smpart.init: to go on under "
                              "another, save a checkpoint before smpart.shutdown() (smpart.save_checkpoint) "
                              "and load it")
    keep = keep or (lambda names: True)
    names = _names_by_tensor(model.module)
    named = list(_tensors(model.module))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    owners = torch.tensor([world if t.is_meta else rank for _, t in named], dtype=torch.int64)
    _wait(dist.all_reduce(owners, op=dist.ReduceOp.MIN, group=group, async_op=True), timeout_s,
          "who holds the model's tensors")
    items = [_Item(("model", name), tuple(t.shape), t.dtype, owner)
             for (name, t), owner in zip(named, owners.tolist(), strict=True) if owner < world]
    needed = [t.is_meta and keep(names[id(t)]) for (_, t), o in zip(named, owners.tolist(), strict=True)
              if o < world]
    # The optimizers' states: what each rank holds is described to all (no tensor data), then
    # the tensors travel with the model's
    states = [_StateShare(optimizer, names, keep) for optimizer in optimizers]
    described = all_gather_objects([share.described for share in states], group, timeout_s,
                                   "the optimizer's state")
    for k, share in enumerate(states):
        share.learn([part[k] for part in described])
        items += share.items(k)
        needed += share.needed(k)
    flags = torch.tensor([*needed, False], dtype=torch.uint8)  # never empty
    _wait(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout_s,
          "which of the model's tensors the ranks need")
    received = _receive(items, [bool(f) for f in flags.tolist()[:-1]], needed, group, timeout_s,
                        lambda item: _value_here(item, model.module, states))
    fill_released(model.module, {item.key[1]: value for item, value in received if item.key[0] == "model"})
    for k, (optimizer, share) in enumerate(zip(optimizers, states, strict=True)):
        full = optimizer.optimizer.state_dict()
        optimizer.optimizer.load_state_dict({**full, "state": share.state(k, received)})
        optimizer._loaded_before_placement = True  # the next placement drops the others' again


@dataclass(frozen=True)
class _Item:
    """A tensor that may travel: ``("model", name)`` or ``("optim", k, index, key)``, its shape, its
    dtype and the rank that holds it."""

    key: tuple
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: int


class _StateShare:
    """One optimizer's state in `make_whole`: this rank's entries described (shapes of tensors,
    values of the rest), everyone's descriptions, and the state this rank keeps."""

    def __init__(self, optimizer: Any, names: dict[int, list[str]],
                 keep: Callable[[list[str]], bool]) -> None:
        self.mine = optimizer.local_state_dict()["state"]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.keeps = [id(p) in names and keep(names[id(p)]) for p in params]
        self.described = {i: {key: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                              else ("value", v) for key, v in entry.items()}
                          for i, entry in self.mine.items()}
        self.everyone: dict[int, tuple[int, dict[str, Any]]] = {}  # index -> (owner, description)

    def learn(self, parts: list[dict[int, dict[str, Any]]]) -> None:
        for owner in reversed(range(len(parts))):  # the lowest rank's entry last: it wins
            for i, entry in parts[owner].items():
                self.everyone[i] = (owner, entry)

    def items(self, k: int) -> list[_Item]:
        return [_Item(("optim", k, i, key), d[1], d[2], owner)
                for i, (owner, entry) in sorted(self.everyone.items())
                for key, d in sorted(entry.items()) if d[0] == "tensor"]

    def needed(self, k: int) -> list[bool]:
        return [self.keeps[i] and i not in self.mine
                for i, (_, entry) in sorted(self.everyone.items())
                for _, d in sorted(entry.items()) if d[0] == "tensor"]

    def state(self, k: int, received: list[tuple[_Item, torch.Tensor]]) -> dict[int, Any]:
        """The state this rank holds from now on: its own, and the received entries it keeps."""
        state = {i: dict(entry) for i, entry in self.mine.items()}
        got = {item.key[2:]: value for item, value in received if item.key[:2] == ("optim", k)}
        for i, (_, entry) in self.everyone.items():
            if i in state or not self.keeps[i]:
                continue
            state[i] = {key: got[(i, key)] if d[0] == "tensor" else d[1] for key, d in entry.items()}
        return dict(sorted(state.items()))


def _value_here(item: _Item, module: nn.Module, states: list[_StateShare]) -> torch.Tensor:
    """The value of ``item`` on its owner (this rank)."""
    if item.key[0] == "model":
        return _tensor_named(module, item.key[1])
    _, k, i, key = item.key
    return states[k].mine[i][key]


def _receive(items: list[_Item], anyone: list[bool], here: list[bool], group: Any, timeout_s: float,
             value_here: Callable[[_Item], torch.Tensor]) -> list[tuple[_Item, torch.Tensor]]:
    """Broadcast every item some rank needs (``anyone``) from its owner, in buckets of one dtype,
    and keep a copy of those this rank needs (``here``): at most one bucket in flight."""
    rank = dist.get_rank(group)
    kept: list[tuple[_Item, torch.Tensor]] = []
    travelling = [(item, mine) for item, some, mine in zip(items, anyone, here, strict=True) if some]
    for owner in sorted({item.owner for item, _ in travelling}):
        for bucket in _bucketed([(item, mine) for item, mine in travelling if item.owner == owner]):
            if rank == owner:
                flat = flat_copy([value_here(item).detach().to("cpu") for item, _ in bucket])
            else:
                flat = torch.empty(sum(math.prod(item.shape) for item, _ in bucket), dtype=bucket[0][0].dtype)
            _wait(dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group, async_op=True),
                  timeout_s, "the model's values")
            offset = 0
            for item, mine in bucket:
                size = math.prod(item.shape)
                if mine:  # a copy of its own: a view would keep (and save) the whole bucket
                    kept.append((item, flat[offset:offset + size].view(item.shape).clone()))
                offset += size
    return kept


def _bucketed(pairs: list[tuple[_Item, bool]]) -> list[list[tuple[_Item, bool]]]:
    """``pairs`` in buckets of one dtype and at most `BUCKET_BYTES` (`_buckets`, on stand-ins)."""
    likes = [torch.empty(item.shape, dtype=item.dtype, device="meta") for item, _ in pairs]
    pair_of = {id(like): pair for like, pair in zip(likes, pairs, strict=True)}
    return [[pair_of[id(like)] for like in bucket] for bucket in _buckets(likes)]


def _names_by_tensor(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter and buffer (a tied one has several), by its identity."""
    names: dict[int, list[str]] = {}
    for name, t in (*module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False)):
        if t is not None:
            names.setdefault(id(t), []).append(name)
    return names


def _tensor_named(module: nn.Module, name: str) -> torch.Tensor:
    prefix, _, attr = name.rpartition(".")
    owner = module.get_submodule(prefix)
    found = owner._parameters.get(attr)
    return found if found is not None else owner._buffers[attr]


def share_buffers(model: Any, group: Any, src: int, timeout_s: float) -> None:
    """Every rank of ``group`` (a stage's replicas) takes rank ``src``'s values of the model's
    persistent buffers it holds. A replica that has not placed the model yet (its first step
    failed before the model was called) holds other buffers: then nobody takes any, this step."""
    every = list(_persistent_buffers(model.module))
    if not every:  # the same on every rank (its released buffers included): nothing to agree on
        return
    held = [b for _, b in every if not b.is_meta]
    count = torch.tensor([len(held), -len(held)], dtype=torch.int64)
    _wait(dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout_s,
          "the buffers held")
    if held and count[0].item() == -count[1].item():
        _take_values(held, group, src, timeout_s)


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a state dict saves, each once: the model's state. The others (``persistent=False``:
    causal masks, rotary frequencies) are made from constants, the same everywhere."""
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        for name, buffer in owner._buffers.items():
            persistent = name not in owner._non_persistent_buffers_set
            if buffer is not None and persistent and id(buffer) not in seen:
                seen.add(id(buffer))
                yield (f"{prefix}.{name}" if prefix else name), buffer


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


def check_same_model(model: Any, group: Any, timeout_s: float) -> None:
    """Raise unless every rank of ``group`` holds ``model`` alike: the same tensors by name, shape,
    dtype and meta-ness (one small all-reduce)."""
    described = [(name, tuple(t.shape), str(t.dtype), t.is_meta) for name, t in _tensors(model.module)]
    digest = int.from_bytes(hashlib.sha256(repr(described).encode()).digest()[:7], "little")
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)
    _wait(dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout_s,
          "the model's description")
    if extremes[0].item() != -extremes[1].item():
        raise SmpartError(
            f"the ranks hold different models (DistributedModel #{model.model_id}: its parameters' and "
            "buffers' names, shapes, dtypes or meta-ness differ between ranks). Every rank must build the "
            "same models in the same order, all of them materialised (rank 0's values then reach every "
            "rank) or all on the meta device (then load weights with smpart.load_checkpoint): a rank that "
            "built on meta has nowhere to take rank 0's values")


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in buckets of one dtype and at most `BUCKET_BYTES` (in order within a dtype)."""
    return buckets(sorted(tensors, key=lambda t: str(t.dtype)), BUCKET_BYTES)


def _take_values(tensors: list[torch.Tensor], group: Any, src: int, timeout_s: float) -> None:
    """Every rank of ``group`` writes global rank ``src``'s values into its ``tensors``."""
    for bucket in _buckets(tensors):
        flat = _broadcast(bucket, group, src, timeout_s)
        if dist.get_rank() != src:
            with torch.no_grad():
                for t, value in zip(bucket, _pieces(flat, bucket), strict=True):
                    t.copy_(value)


def _broadcast(bucket: list[torch.Tensor], group: Any, src: int, timeout_s: float) -> torch.Tensor:
    """Global rank ``src``'s values of ``bucket`` (one dtype) side by side on the CPU, on every rank
    of ``group`` (the others' own tensors may be on the meta device)."""
    if dist.get_rank() == src:
        flat = flat_copy([t.detach().to("cpu") for t in bucket])
    else:
        flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype)
    _wait(dist.broadcast(flat, src=src, group=group, async_op=True), timeout_s, "the model's values")
    return flat


def _pieces(flat: torch.Tensor, like: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``flat`` cut back into tensors shaped as ``like`` (views)."""
    offset = 0
    for t in like:
        yield flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()


def all_gather_objects(obj: Any, group: Any, timeout_s: float, what: str) -> list[Any]:
    """Every rank's ``obj`` (pickled), as ``all_gather_object``, but with every wait bounded."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _wait(dist.all_gather(sizes, torch.tensor([data.numel()]), group=group, async_op=True), timeout_s, what)
    most = int(max(sizes).item())
    padded = torch.zeros(most, dtype=torch.uint8)
    padded[:data.numel()] = data
    out = [torch.empty(most, dtype=torch.uint8) for _ in range(world)]
    _wait(dist.all_gather(out, padded, group=group, async_op=True), timeout_s, what)
    return [pickle.loads(o[:int(n.item())].numpy().tobytes()) for o, n in zip(out, sizes, strict=True)]


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise SmpartError(f"the ranks did not agree on {what} within {timeout_s} s at the start of a "
                          f"step (every rank must call the step function): {err}") from err
