"""Batch shares: data-parallel replicas fed unequal parts of each step's global batch.

Replicas on devices of unequal speed finish together only when the faster ones take more samples
(``Config.data_parallel_shares``, e.g. ``[1, 2]``). smpart keeps every replica's step alike: each
splits its batch into the same number of micro-batches, so a replica with twice the share runs
micro-batches twice as large (whole micro-batches in unequal counts would change each replica's
schedule and bubble; unequal sizes change neither).

**Gradients equal one process on the global batch.** A replica's gradient is the mean over its
own samples (the step averages over micro-batches). Averaging those equally would weigh a sample
of a small replica more than one of a large replica; so replica ``r``'s gradient enters the
data-parallel all-reduce multiplied by ``dp · n_r / N`` (its samples over all), and the mean of
the weighted gradients is the mean over the global batch. The weights come from the configured
shares, which every rank knows; the first stage's ranks check at every step that the batches
they were fed are exactly in those proportions (``n_r · Σ shares = N · share_r``), so the weights
are the samples' own.

`replica_batch_sizes` says how a global batch divides, and `ReplicaBatchSampler` feeds each
replica its part of every global batch, the replicas' parts side by side in replica order, so
their concatenation is the batch one process would have taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from smpart.errors import SmpartError
from smpart.runtime.runtime import running_runtime


def replica_batch_sizes(global_batch: int, shares: Sequence[float] | None, multiple_of: int = 1) -> list[int]:
    """Samples each replica takes of a ``global_batch``, exactly in proportion to ``shares``
    (None: one replica); each a multiple of ``multiple_of`` (the micro-batch count). Raises
    `SmpartError` naming the nearest global batches that divide so."""
    shares = [1.0] if shares is None else list(shares)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise SmpartError(f"the global batch must be a positive integer, got {global_batch!r}")
    ratios = [Fraction(s).limit_denominator(1_000_000) for s in shares]
    total = sum(ratios)
    sizes = [global_batch * r / total for r in ratios]
    if all(size.denominator == 1 and size % multiple_of == 0 and size > 0 for size in sizes):
        return [int(size) for size in sizes]
    step = _smallest_global_batch(ratios, multiple_of)
    below, above = (global_batch // step) * step, (global_batch // step + 1) * step
    nearest = " or ".join(str(b) for b in (below, above) if b > 0)
    raise SmpartError(
        f"a global batch of {global_batch} does not divide into shares {shares} with every replica's part a "
        f"whole multiple of {multiple_of} (the micro-batches): the parts would be "
        f"{[float(f'{float(s):.4g}') for s in sizes]}; use a multiple of {step}, such as {nearest}")


def _smallest_global_batch(ratios: list[Fraction], multiple_of: int) -> int:
    """The least global batch that divides into ``ratios`` in whole multiples of ``multiple_of``."""
    total = sum(ratios)
    need = 1
    for ratio in ratios:  # N · p/q must be a multiple of m: N a multiple of m·q / gcd(m·q, p)
        part = ratio / total
        scaled = multiple_of * part.denominator
        need = math.lcm(need, scaled // math.gcd(scaled, part.numerator))
    return need


class ReplicaBatchSampler(Sampler[list[int]]):
    """A ``batch_sampler`` giving this data-parallel replica its share of every global batch.

    ``DataLoader(dataset, batch_sampler=smpart.ReplicaBatchSampler(dataset, global_batch=12))``:
    each iteration takes the next ``global_batch`` indices (shuffled alike on every replica with
    ``seed`` and the epoch, `set_epoch`) and yields this replica's part of them, its share of
    ``Config.data_parallel_shares`` (equal parts without shares). ``replica``, ``shares`` and
    ``microbatches`` default to the running configuration's, so call it after `smpart.init`.
    ``drop_last`` drops a final global batch smaller than ``global_batch``.
    """

    def __init__(self, data_source: Any, global_batch: int, *, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = True, replica: int | None = None, shares: Sequence[float] | None = None,
                 microbatches: int | None = None) -> None:
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self.global_batch, self.shuffle, self.seed, self.drop_last = global_batch, shuffle, seed, drop_last
        config, dp, dp_index = _running()
        self.shares = list(shares) if shares is not None else (
            config.data_parallel_shares if config is not None and config.data_parallel_shares else [1.0] * dp)
        self.replica = dp_index if replica is None else replica
        if not 0 <= self.replica < len(self.shares):
            raise SmpartError(f"replica {self.replica} does not exist: the shares {self.shares} name "
                              f"{len(self.shares)} replica(s)")
        self.microbatches = microbatches or (config.microbatches if config is not None else 1)
        self.sizes = replica_batch_sizes(global_batch, self.shares, self.microbatches)
        self.offset = sum(self.sizes[:self.replica])
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently in each epoch (alike on every replica), as DistributedSampler does."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        size = self.sizes[self.replica]
        for start in range(0, len(self) * self.global_batch, self.global_batch):
            yield order[start + self.offset:start + self.offset + size]

    def __len__(self) -> int:
        """Global batches per epoch (each yields this replica's part of one)."""
        if self.drop_last:
            return self.length // self.global_batch
        if self.length % self.global_batch:
            raise SmpartError("drop_last=False needs a dataset length that is a multiple of the global "
                              "batch: a last, smaller one would not divide into the replicas' shares")
        return self.length // self.global_batch


def replica_batch_size(global_batch: int) -> int:
    """This replica's part of ``global_batch`` under the running configuration's shares."""
    config, dp, index = _running()
    shares = config.data_parallel_shares if config is not None and config.data_parallel_shares else [1.0] * dp
    microbatches = config.microbatches if config is not None else 1
    return replica_batch_sizes(global_batch, shares, microbatches)[index]


def _running() -> tuple[Any, int, int]:
    """(the running Config or None, data-parallel degree, this rank's replica)."""
    runtime = running_runtime()
    if runtime is None:
        return None, 1, 0
    if runtime.layout is None:
        return runtime.config, 1, 0
    layout, config = runtime.layout, runtime.config
    return config, layout.dp, layout.coordinates(runtime.rank)[1]


def replica_weight(shares: Sequence[float] | None, replica: int) -> float:
    """What replica ``replica``'s gradient is multiplied by before the data-parallel mean:
    ``dp · share / Σ shares`` (1.0 with equal or no shares)."""
    if not shares or len(set(shares)) == 1:
        return 1.0
    return len(shares) * shares[replica] / sum(shares)


def check_batch_shares(samples: int | None, shares: Sequence[float], replica: int, group: Any,
                       wait: Callable[[Any], None] | None = None) -> None:
    """Every first-stage rank: the samples each replica was fed are exactly in the shares'
    proportions (collective over ``group``, the first stage's data-parallel ranks; ``wait``
    waits for it, bounded, default: without a limit)."""
    count = torch.tensor([-1 if samples is None else samples], dtype=torch.int64)
    every = [torch.zeros_like(count) for _ in shares]
    work = dist.all_gather(every, count, group=group, async_op=True)
    (wait or (lambda w: w.wait()))(work)
    fed = [int(t.item()) for t in every]
    if any(n < 0 for n in fed):
        raise SmpartError("with data_parallel_shares every replica's step needs a tensor argument to split "
                          f"(its batch); replica(s) {[r for r, n in enumerate(fed) if n < 0]} had none, or "
                          "one that does not split into micro-batches")
    total, weight = sum(fed), sum(shares)
    wrong = [r for r, (n, s) in enumerate(zip(fed, shares, strict=True))
             if not math.isclose(n * weight, total * s, rel_tol=1e-9)]
    if wrong:
        expected = [total * s / weight for s in shares]
        raise SmpartError(
            f"the data-parallel replicas were fed {fed} samples, which is not in the proportions of "
            f"data_parallel_shares={list(shares)} (of {total} samples that would be "
            f"{[float(f'{e:.4g}') for e in expected]}); the gradients are weighted by the shares, so feed "
            f"each replica its part: smpart.ReplicaBatchSampler(dataset, global_batch=...) or "
            f"smpart.replica_batch_size(global_batch)")
