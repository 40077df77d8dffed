"""Seeing the launcher and setting up the process groups smpart needs.

Under ``torchrun`` every rank runs the same script; `smpart.init` calls `setup` on every rank.
It initialises the default process group from the launcher's environment (``env://``) unless the
user already did (then it is reused and left alone), checks that every rank asked for the same
configuration and that the world size fits it, picks each rank's device (``LOCAL_RANK``-th GPU
under NCCL, the CPU under gloo), and makes a gloo group of its own for the process transport
(its headers always travel on gloo; see `smpart.distributed.transport`).

Ranks are laid out as a ``(pp, dp, tp)`` grid (`Layout`): with ``placement_strategy="cluster"``
the tensor-parallel ranks of a stage are adjacent (they stay inside one node), with ``"spread"``
the pipeline stages are (ranks ``r`` and ``r + 1`` belong to different tensor-parallel groups).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smpart.config import Config
from smpart.errors import ConfigError


def launched_with_processes() -> bool:
    """True under ``torchrun`` with more than one process, or with a process group already set up."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(frozen=True)
class Layout:
    """Where each (stage, data-parallel replica, tensor-parallel rank) lives."""

    pp: int
    dp: int
    tp: int
    strategy: str = "cluster"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def rank_of(self, pp: int, dp: int = 0, tp: int = 0) -> int:
        if self.strategy == "cluster":
            return (pp * self.dp + dp) * self.tp + tp
        return (tp * self.dp + dp) * self.pp + pp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` of ``rank``."""
        if self.strategy == "cluster":
            rest, tp = divmod(rank, self.tp)
            pp, dp = divmod(rest, self.dp)
            return pp, dp, tp
        rest, pp = divmod(rank, self.pp)
        tp, dp = divmod(rest, self.dp)
        return pp, dp, tp


@dataclass
class Setup:
    """What `setup` made: this rank, its device, the transport's group, and what to tear down."""

    rank: int
    world_size: int
    local_rank: int
    layout: Layout
    device: torch.device
    backend: str
    transport_group: Any
    created_default_group: bool
    #: Collectives of smpart's own (gathering a state dict, barriers); never the transport's group.
    collective_group: Any = None
    #: This rank's data-parallel group: the same stage (and tensor-parallel rank) of every replica.
    dp_group: Any = None
    #: This rank's pipeline group: every stage of its own replica (same dp and tp coordinates).
    pp_group: Any = None
    #: This rank's tensor-parallel group: the ranks sharing its stage in its replica.
    tp_group: Any = None
    #: torch's ``DeviceMesh`` of the whole job, dimensions ``("pp", "dp", "tp")``; the three groups
    #: above are its dimensions' groups (None where a dimension has one rank).
    mesh: Any = None
    #: A second (gloo) group of ``dp_group``'s ranks, for small agreements on CPU that must not
    #: interleave with the gradient all-reduces in flight on ``dp_group``.
    dp_control_group: Any = None


def layout_for(config: Config, world_size: int) -> Layout:
    """The (pp, dp, tp) grid for ``world_size`` processes; dp derived when not given."""
    pp, tp = config.pipeline_parallel_degree, config.tensor_parallel_degree
    dp_asked = config.data_parallel_degree
    if dp_asked is not None and pp * tp * dp_asked != world_size:
        need = pp * tp * dp_asked
        raise ConfigError(f"this configuration needs pp x tp x dp = {pp} x {tp} x {dp_asked}"
                          f" = {need} processes, but the job has {world_size}; launch it with "
                          f"torchrun --nproc-per-node {need} (or leave data_parallel_degree unset)")
    if world_size % (pp * tp):
        raise ConfigError(f"the job has {world_size} processes, which is not a multiple of "
                          f"pipeline_parallel_degree x tensor_parallel_degree = {pp} x {tp} = {pp * tp}; "
                          f"launch a multiple of {pp * tp} processes (torchrun --nproc-per-node ...)")
    dp = world_size // (pp * tp)
    return Layout(pp, dp, tp, config.placement_strategy)


def config_digest(config: Config) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def setup(config: Config) -> Setup:
    """Initialise (or reuse) the default process group and check the job against ``config``.

    A default group smpart initialised lives until the interpreter exits (`teardown`, called
    after smpart's own shutdown at exit),
    not until `smpart.shutdown`: initialising a second default group in one process would meet
    the first one's rendezvous keys in the launcher's store. Each `setup` makes a new transport
    group instead, so ``init`` -> ``shutdown`` -> ``init`` starts clean."""
    backend = _backend(config)
    created = False
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        created = True
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    transport_group = dist.new_group(backend="gloo")
    _check_same_config(config, rank, transport_group)
    layout = layout_for(config, world)
    device = torch.device("cuda", local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    collective_group = dist.new_group(backend="gloo")
    mesh = device_mesh(layout, device.type)
    groups = {name: mesh.get_group(name) if size > 1 else None
              for name, size in (("pp", layout.pp), ("dp", layout.dp), ("tp", layout.tp))}
    return Setup(rank, world, local_rank, layout, device, dist.get_backend(), transport_group, created,
                 collective_group, groups["dp"], groups["pp"], groups["tp"], mesh,
                 _dp_control_group(layout, rank))


def _dp_control_group(layout: Layout, rank: int) -> Any:
    """This rank's data-parallel ranks as a gloo group (None without data parallelism). Collective:
    every rank creates every such group, in one order."""
    mine = None
    if layout.dp == 1:
        return mine
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            ranks = [layout.rank_of(pp, dp, tp) for dp in range(layout.dp)]
            group = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                mine = group
    return mine


def device_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The job's ``DeviceMesh``: ``mesh[pp, dp, tp]`` is the rank at those coordinates, so the
    placement strategy (which ranks are neighbours) is the layout's. Collective: every rank calls it."""
    ranks = torch.tensor([[[layout.rank_of(pp, dp, tp) for tp in range(layout.tp)] for dp in range(layout.dp)]
                          for pp in range(layout.pp)])
    return DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "dp", "tp"))


def teardown() -> None:
    """Destroy the default process group smpart initialised (at interpreter exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _backend(config: Config) -> str:
    if dist.is_initialized():
        return dist.get_backend()
    if config.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend='nccl' needs CUDA GPUs, and this process sees none; use backend='gloo' "
                          "(or 'auto') on CPU")
    if config.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return config.backend


def _check_same_config(config: Config, rank: int, group: Any) -> None:
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, (config_digest(config), config.to_dict()), group=group)
    mine = digests[rank][0]
    differ = [r for r, (digest, _) in enumerate(digests) if digest != mine]
    if differ:
        ours, theirs = digests[rank][1], digests[differ[0]][1]
        keys = sorted(k for k in ours if ours[k] != theirs.get(k))
        raise ConfigError(f"ranks called smpart.init with different configurations: rank {rank} and rank "
                          f"{differ[0]} differ in {keys}; every rank must pass the same configuration")
