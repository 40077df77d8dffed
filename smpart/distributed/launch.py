"""Seeing the launcher and setting up the process groups smpart needs.

Under ``torchrun`` every rank runs the same script; `smpart.init` calls `setup` on every rank.
It initialises the default process group from the launcher's environment (``env://``) unless the
user already did (then it is reused and left alone), checks that every rank asked for the same
configuration and that the world size fits it, picks each rank's device, and makes a gloo group of
its own for the process transport (its headers always travel on gloo; see
`smpart.runtime.wire.processes`).

Devices. Under NCCL each process owns one GPU, the ``LOCAL_RANK``-th, so ``backend="auto"`` picks
NCCL only when the machine has a GPU for every local process (``LOCAL_WORLD_SIZE``); with fewer it
falls back to gloo and says so. Under gloo a rank's device is ``config.devices[stage]`` when given
(stages may share a GPU: tensors cross processes through the CPU), else the CPU.

Ranks are laid out as a ``(pp, dp, tp)`` grid (`Layout`): with ``placement_strategy="cluster"``
the tensor-parallel ranks of a stage are adjacent (they stay inside one node), with ``"spread"``
the pipeline stages are (ranks ``r`` and ``r + 1`` belong to different tensor-parallel groups).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smpart.config import Config
from smpart.distributed.device_check import check_rank_devices
from smpart.errors import ConfigError
from smpart.runtime.wire.processes import pair_groups


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
    #: Under NCCL, one NCCL group per ordered pair of ranks that exchange pipeline messages and
    #: include this rank: the transport's tensors travel on them (its headers on gloo). Else None.
    data_groups: dict[tuple[int, int], Any] | None = None
    #: Under gloo with pipeline stages, a group of every rank for a replayed step program's tensors
    #: alone (`smpart.runtime.wire.direct`); None under NCCL, and with one stage.
    direct_group: Any = None


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
    shares = config.data_parallel_shares
    if shares is not None and len(shares) != dp:
        raise ConfigError(f"data_parallel_shares lists {len(shares)} share(s) but the job has {dp} "
                          f"data-parallel replica(s) ({world_size} processes / (pp x tp = {pp * tp})); give "
                          "one per replica")
    return Layout(pp, dp, tp, config.placement_strategy)


def config_digest(config: Config) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def setup(config: Config) -> Setup:
    """Initialise (or reuse) the default process group and check the job against ``config``.

    A default group smpart initialised lives until the interpreter exits (`teardown`, called
    after smpart's own shutdown at exit),
    not until `smpart.shutdown`: initialising a second default group in one process would meet
    the first one's rendezvous keys in the launcher's store. Each `setup` makes new groups of its
    own instead, which `release_groups` destroys at `smpart.shutdown`, so ``init`` -> ``shutdown``
    -> ``init`` starts clean."""
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
    try:
        _check_same_config(config, rank, transport_group)
        layout = layout_for(config, world)
        nccl = dist.get_backend() == "nccl"
        device = rank_device(config, nccl, local_rank, layout.coordinates(rank)[0])
        if config.device_types:
            check_rank_devices(config.device_types, rank, device, transport_group,
                               [layout.coordinates(r) for r in range(world)])
    except BaseException:
        dist.destroy_process_group(transport_group)  # a refused configuration leaves nothing behind
        raise
    if nccl:
        torch.cuda.set_device(device)  # the transport sends and receives on the current device
    collective_group = dist.new_group(backend="gloo")
    mesh = device_mesh(layout, "cuda" if nccl else "cpu")
    groups = {name: mesh.get_group(name) if size > 1 else None
              for name, size in (("pp", layout.pp), ("dp", layout.dp), ("tp", layout.tp))}
    data_groups = pair_groups(message_pairs(layout), "nccl") if nccl else None
    direct_group = None if nccl or layout.pp == 1 else dist.new_group(backend="gloo")
    return Setup(rank, world, local_rank, layout, device, dist.get_backend(), transport_group, created,
                 collective_group, groups["dp"], groups["pp"], groups["tp"], mesh,
                 _dp_control_group(layout, rank), data_groups, direct_group)


def message_pairs(layout: Layout) -> list[tuple[int, int]]:
    """Every ordered pair of ranks that exchange pipeline messages: the stages of one replica
    (any stage may call any other) and the tensor-parallel ranks of one stage."""
    pairs: set[tuple[int, int]] = set()
    for dp in range(layout.dp):
        for tp in range(layout.tp):
            stages = [layout.rank_of(pp, dp, tp) for pp in range(layout.pp)]
            pairs.update((a, b) for a in stages for b in stages if a != b)
        for pp in range(layout.pp):
            shards = [layout.rank_of(pp, dp, tp) for tp in range(layout.tp)]
            pairs.update((a, b) for a in shards for b in shards if a != b)
    return sorted(pairs)


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


#: The meshes made so far, by layout and device type, with the default group they were made in.
_meshes: dict[tuple[Layout, str], tuple[Any, DeviceMesh]] = {}


def device_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The job's ``DeviceMesh``: ``mesh[pp, dp, tp]`` is the rank at those coordinates, so the
    placement strategy (which ranks are neighbours) is the layout's. Collective: every rank calls it.

    Made once per layout and reused by every later ``init`` with that layout, its groups never
    destroyed: DTensor caches its sharding decisions under meshes, which compare equal when their
    ranks do, so a tensor-parallel parameter of a later ``init`` can carry an earlier mesh, and a
    collective on it needs that mesh's groups ("Could not resolve the process group" otherwise).
    Every rank calls ``init`` with the same configurations in the same order, so all of them find
    the same meshes here."""
    world = dist.group.WORLD
    key = (layout, device_type)
    kept = _meshes.get(key)
    if kept is not None and kept[0] is world:
        return kept[1]
    if any(made_in is not world for made_in, _ in _meshes.values()):
        _meshes.clear()  # the default group was destroyed and made again: those meshes are gone
    ranks = torch.tensor([[[layout.rank_of(pp, dp, tp) for tp in range(layout.tp)] for dp in range(layout.dp)]
                          for pp in range(layout.pp)])
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "dp", "tp"))
    _meshes[key] = (world, mesh)
    return mesh


def release_groups(setup: Setup) -> None:
    """Destroy the process groups `setup` made for this ``init`` alone: the transport's, the
    collectives' and the pair groups. Never the default group, which `teardown` or the user owns,
    nor the mesh's (`device_mesh` keeps them for later inits). Call it once the transport is closed.

    A group nobody destroys stays in torch's registry for the life of the process, and with it
    its threads (gloo: two workers and a socket loop that wakes every 10 ms); each ``init`` on 2
    ranks left 12 threads behind before this."""
    made = [setup.transport_group, setup.collective_group, setup.dp_control_group, setup.direct_group,
            *(setup.data_groups or {}).values()]
    skip = (None, dist.GroupMember.NON_GROUP_MEMBER, dist.group.WORLD)
    for group in {id(g): g for g in made if not any(g is s for s in skip)}.values():
        with contextlib.suppress(Exception):  # a group a lost peer broke still goes; nothing to tell
            dist.destroy_process_group(group)
    # Its threads end when the group object is freed; the runtime's objects refer to each other,
    # so without this the group would wait for the cycle collector.
    setup.transport_group = setup.collective_group = setup.dp_control_group = setup.data_groups = None
    setup.direct_group = None


def teardown() -> None:
    """Destroy the default process group smpart initialised (at interpreter exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def named_device(spec: str | torch.device) -> torch.device:
    """The device ``spec`` names, as a tensor on it names its own: ``"cpu:0"`` is ``cpu``, and
    ``"cuda"`` the current CUDA device. A stage's device is compared with its tensors' at every
    call, and an unequal name for the same device would move (in effect, walk) every argument."""
    try:
        device = torch.device(spec)
    except RuntimeError as err:
        raise ConfigError(f"devices: {err}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def rank_device(config: Config, nccl: bool, local_rank: int, stage: int) -> torch.device:
    """This rank's device: its own GPU under NCCL, else its stage's entry of ``config.devices``,
    else the CPU."""
    if nccl:
        return torch.device("cuda", local_rank)
    if config.devices:
        device = named_device(config.devices[min(stage, len(config.devices) - 1)])
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"devices: stage {stage} is to run on {device}, but this process sees no "
                              "CUDA GPU; name 'cpu' for it")
        return device
    return torch.device("cpu")


def _backend(config: Config) -> str:
    if dist.is_initialized():
        return dist.get_backend()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if config.backend == "nccl" and gpus < local:
        seen = f"sees {gpus} GPU{'s' * (gpus != 1)}" if gpus else "sees no GPU"
        raise ConfigError(f"backend='nccl' gives every process a GPU of its own, but this machine runs "
                          f"{local} processes and {seen}; launch at most {gpus} per machine, or use "
                          "backend='gloo' (devices=['cuda:0', ...] puts stages on a shared GPU)")
    if config.backend != "auto":
        return config.backend
    if 0 < gpus < local:
        warnings.warn(f"smpart: {local} processes on this machine and {gpus} GPU{'s' * (gpus != 1)}: NCCL "
                      "needs a GPU per process, so the backend is gloo and stages run where `devices` "
                      "says (default: the CPU)", stacklevel=5)
    return "nccl" if gpus >= local and gpus > 0 else "gloo"


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
