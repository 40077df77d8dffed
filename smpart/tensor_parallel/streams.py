"""Two random streams under tensor parallelism: one the group shares, one per rank for split regions.

The tensor-parallel ranks of a stage draw from one shared stream (the runtime gives them the
first rank's random state at every step): a dropout on an activation every rank holds whole
(after a row-parallel layer) must mask it alike on every rank, or their copies drift apart. A
dropout *inside a split region*, between a column-parallel layer and its row-parallel partner
(attention probabilities over the rank's heads, an MLP's hidden units), masks what only this rank
holds: drawn from the shared stream, every rank would mask its heads exactly as the others mask
theirs, a correlation the unsplit model never has. So, as Megatron's ``get_cuda_rng_tracker()``,
a split region draws from a stream of its own rank:

- a column-parallel layer whose output stays split *enters* the region (`enter`): it draws one
  seed from the shared stream (the same on every rank, which keeps the shared stream in step)
  and seeds the device's default generator with that seed mixed with its tensor-parallel rank;
- the row-parallel partner *leaves* it (`leave`) before its all-reduce: the generator takes back
  the shared stream's state from the entry, so what follows draws alike on every rank again.

The per-rank stream is made from the shared one at each entry, never kept: an activation
checkpoint's recomputation, which restores the shared state the forward started from, enters
the region again with the same seed and draws the same masks; and nothing needs saving in a
checkpoint. A region is live while the generator still holds the stream it set (its seed is the
token): once the state was put back by someone else (a checkpoint's ``fork_rng``, the next step's
shared state) the region is over and is not restored twice.

The reference runtime keeps regions within a stage's turn: a call to another stage leaves the
region (its row partner may be there, and what follows the call draws alike again), and the end
of a call leaves any region still open. A step program does the same with a call to a module
another rank holds and the end of the body, and a micro-batch that stops mid-body suspends its
region and resumes it with the micro-batch (`suspend` / `resume`), since the other work the rank
runs meanwhile draws from the shared stream.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import torch


@dataclass
class _Region:
    generator: torch.Generator
    seed: int  # the rank's stream's seed: the generator's initial_seed() while the region is live
    shared: torch.Tensor  # the shared stream's state at the entry, taken back at the exit


@dataclass
class Suspended:
    """A region taken off the generator while its call waits (`suspend`), for `resume`."""

    generator: torch.Generator
    seed: int
    own: torch.Tensor  # the rank's stream's state when it was suspended


#: The split region open now, at most one (only the holder of a stage's turn draws); None outside
#: one, which the step program's hot paths test before calling `leave` or `suspend`.
live: _Region | None = None
_lock = threading.Lock()


def enter(device: torch.device, tp_rank: int) -> None:
    """A split region begins: ``device``'s default generator draws from ``tp_rank``'s stream."""
    global live
    generator = _generator(device)
    with _lock:
        if _is_live(live, generator):
            return  # q, k and v projections split one after the other: one region
        shared_seed = _draw_seed(generator)
        seed = _mix(shared_seed, tp_rank)
        live = _Region(generator, seed, generator.get_state())
        generator.manual_seed(seed)


def leave() -> None:
    """The split region ends: the generator takes back the shared stream (no-op outside one)."""
    global live
    with _lock:
        region, live = live, None
        if _is_live(region, region.generator if region else None):
            region.generator.set_state(region.shared)


def suspend() -> Suspended | None:
    """Leave a live region for now, keeping the rank's stream where it is (None outside one)."""
    global live
    with _lock:
        region, live = live, None
        if not _is_live(region, region.generator if region else None):
            return None
        kept = Suspended(region.generator, region.seed, region.generator.get_state())
        region.generator.set_state(region.shared)
        return kept


def resume(suspended: Suspended | None) -> None:
    """Go on drawing from a suspended region's stream, from the shared stream's present state."""
    global live
    if suspended is None:
        return
    with _lock:
        generator = suspended.generator
        live = _Region(generator, suspended.seed, generator.get_state())
        generator.set_state(suspended.own)


def _is_live(region: _Region | None, generator: torch.Generator | None) -> bool:
    return (region is not None and region.generator is generator
            and region.generator.initial_seed() == region.seed)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return torch.default_generator


def _draw_seed(generator: torch.Generator) -> int:
    """One number from the shared stream, advancing it alike on every rank. A CUDA generator's
    state lives on the host (seed and offset): read it and move the offset on, with no sync."""
    if generator.device.type == "cuda":
        seed, offset = generator.initial_seed(), generator.get_offset()
        generator.set_offset(offset + 4)  # Philox offsets advance in fours
        return _mix(seed, offset)
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def _mix(a: int, b: int) -> int:
    digest = hashlib.blake2b(f"{a}/{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63
