"""SMP's ranks, groups and object collectives, over smpart's layout of ranks.

SMP named five groups of processes; smpart's layout (`smpart.distributed.launch.Layout`, a
``(pp, dp, tp)`` grid) holds all of them:

==========  ==============================================  ==========================
SMP group   the ranks that ...                              in smpart's grid
==========  ==============================================  ==========================
PP_GROUP    hold the stages of one replica's pipeline       same dp and tp
TP_GROUP    split one stage's layers                        same pp and dp
RDP_GROUP   hold the same stage and shard (replicas)        same pp and tp: smpart's dp
DP_GROUP    hold the same stage: RDP x TP                   same pp
MP_GROUP    hold one whole replica: PP x TP                 same dp
WORLD       every rank
==========  ==============================================  ==========================

A rank's rank in a group is its position among the group's global ranks, sorted, which is also
its rank in the group's ``torch.distributed`` process group. ``get_<x>_group()`` returns the
ranks (a list, as SMP did); ``get_<x>_process_group()`` the ``ProcessGroup``. Every group with more
than one rank is made at ``smp.init`` on every rank, in one order (``new_group`` is collective);
a group of one rank is made when first asked for, by that rank alone. On threads (no
``torchrun``) the job is one process: every group is ``[0]``, and the first process group asked
for starts ``torch.distributed`` over that one process, so code written for many ranks
(``dist.all_reduce(loss, group=smp.get_dp_process_group())``) runs unchanged.

The object collectives (`broadcast`, `send`, `recv_from`, `allgather`, `barrier`) pickle Python
objects over gloo groups of their own, with smpart's timeout: a rank that never comes is named
instead of waited for.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import enum
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from smpart.errors import SmpartError
from smpart.runtime.ranks import local_rank, rank, size  # noqa: F401 - SMP's names too
from smpart.runtime.runtime import process_layout, running_runtime


class CommGroup(enum.Enum):
    WORLD = "world"
    MP_GROUP = "mp"
    DP_GROUP = "dp"
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    RDP_GROUP = "rdp"


class RankType(enum.Enum):
    WORLD_RANK = CommGroup.WORLD
    MP_RANK = CommGroup.MP_GROUP
    DP_RANK = CommGroup.DP_GROUP
    PP_RANK = CommGroup.PP_GROUP
    TP_RANK = CommGroup.TP_GROUP
    RDP_RANK = CommGroup.RDP_GROUP


WORLD, MP_GROUP, DP_GROUP = CommGroup.WORLD, CommGroup.MP_GROUP, CommGroup.DP_GROUP
PP_GROUP, TP_GROUP, RDP_GROUP = CommGroup.PP_GROUP, CommGroup.TP_GROUP, CommGroup.RDP_GROUP
WORLD_RANK, MP_RANK, DP_RANK = RankType.WORLD_RANK, RankType.MP_RANK, RankType.DP_RANK
PP_RANK, TP_RANK, RDP_RANK = RankType.PP_RANK, RankType.TP_RANK, RankType.RDP_RANK


# ==================================================================== who is in which group
def _layout() -> Any:
    return process_layout()


def _axes(kind: CommGroup) -> tuple[str, ...]:
    """The grid axes along which a group of ``kind`` varies."""
    return {CommGroup.PP_GROUP: ("pp",), CommGroup.TP_GROUP: ("tp",), CommGroup.RDP_GROUP: ("dp",),
            CommGroup.DP_GROUP: ("dp", "tp"), CommGroup.MP_GROUP: ("pp", "tp"),
            CommGroup.WORLD: ("pp", "dp", "tp")}[kind]


def _group_of(layout: Any, rank: int, kind: CommGroup) -> list[int]:
    pp, dp, tp = layout.coordinates(rank)
    axes = _axes(kind)
    ranges = {"pp": range(layout.pp) if "pp" in axes else [pp],
              "dp": range(layout.dp) if "dp" in axes else [dp],
              "tp": range(layout.tp) if "tp" in axes else [tp]}
    return sorted(layout.rank_of(p, d, t) for p in ranges["pp"] for d in ranges["dp"] for t in ranges["tp"])


def every_group(layout: Any, kind: CommGroup) -> list[list[int]]:
    """Every group of ``kind`` in the job, each once, in one order (the same on every rank)."""
    seen: dict[tuple[int, ...], None] = {}
    for member in range(layout.world_size):
        seen.setdefault(tuple(_group_of(layout, member, kind)), None)
    return [list(g) for g in seen]


def members(kind: CommGroup) -> list[int]:
    """The global ranks of this rank's group of ``kind``, sorted."""
    layout = _layout()
    return [0] if layout is None else _group_of(layout, rank(), kind)


def _rank_in(kind: CommGroup) -> int:
    return members(kind).index(rank())


def local_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def pp_rank() -> int:
    return _rank_in(CommGroup.PP_GROUP)


def pp_size() -> int:
    layout = _layout()
    if layout is None:
        runtime = running_runtime()
        return runtime.num_stages if runtime is not None else 1
    return layout.pp


def tp_rank() -> int:
    return _rank_in(CommGroup.TP_GROUP)


def tp_size() -> int:
    return len(members(CommGroup.TP_GROUP))


def rdp_rank() -> int:
    return _rank_in(CommGroup.RDP_GROUP)


def rdp_size() -> int:
    return len(members(CommGroup.RDP_GROUP))


def dp_rank() -> int:
    return _rank_in(CommGroup.DP_GROUP)


def dp_size() -> int:
    return len(members(CommGroup.DP_GROUP))


def mp_rank() -> int:
    return _rank_in(CommGroup.MP_GROUP)


def mp_size() -> int:
    """Processes holding one replica of the model (pp x tp); on threads the pipeline's stages."""
    layout = _layout()
    return pp_size() if layout is None else len(members(CommGroup.MP_GROUP))


def get_world_group() -> list[int]:
    return list(range(size()))


def get_mp_group() -> list[int]:
    return members(CommGroup.MP_GROUP)


def get_dp_group() -> list[int]:
    return members(CommGroup.DP_GROUP)


def get_pp_group() -> list[int]:
    return members(CommGroup.PP_GROUP)


def get_tp_group() -> list[int]:
    return members(CommGroup.TP_GROUP)


def get_rdp_group() -> list[int]:
    return members(CommGroup.RDP_GROUP)


# ==================================================================== process groups
class _Groups:
    """The process groups made for this ``smp.init``: ``(backend, members) -> ProcessGroup``."""

    def __init__(self) -> None:
        self.made: dict[tuple[str, tuple[int, ...]], Any] = {}
        self.runtime: Any = None

    def make_all(self, runtime: Any) -> None:
        """Every group of more than one rank, for tensors (the job's backend) and objects (gloo).
        Collective: every rank calls it, in one order."""
        self.release()
        self.runtime = runtime
        layout = runtime.layout
        backends = sorted({dist.get_backend(), "gloo"})
        timeout = datetime.timedelta(seconds=runtime.config.timeout_s)
        for kind in CommGroup:
            for ranks in every_group(layout, kind):
                if len(ranks) == 1:
                    continue
                for backend in backends:
                    group = dist.new_group(ranks, backend=backend, timeout=timeout)
                    if rank() in ranks:
                        self.made[(backend, tuple(ranks))] = group

    def get(self, kind: CommGroup, backend: str | None = None) -> Any:
        backend = backend or dist.get_backend()
        ranks = tuple(members(kind))
        group = self.made.get((backend, ranks))
        if group is None:  # one rank: made by itself, no one else takes part
            group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
            self.made[(backend, ranks)] = group
        return group

    def release(self) -> None:
        skip = (None, dist.GroupMember.NON_GROUP_MEMBER, dist.group.WORLD)
        for group in self.made.values():
            if not any(group is s for s in skip):
                with contextlib.suppress(Exception):  # a group a lost peer broke still goes
                    dist.destroy_process_group(group)
        self.made.clear()


GROUPS = _Groups()


def on_processes() -> bool:
    return _layout() is not None


def _one_process() -> None:
    """On threads: ``torch.distributed`` over this one process, for scripts that use process groups."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _process_group(kind: CommGroup) -> Any:
    if not on_processes():
        _one_process()
        return dist.group.WORLD
    if kind is CommGroup.WORLD:
        return dist.group.WORLD
    return GROUPS.get(kind)


def get_world_process_group() -> Any:
    return _process_group(CommGroup.WORLD)


def get_mp_process_group() -> Any:
    return _process_group(CommGroup.MP_GROUP)


def get_dp_process_group() -> Any:
    return _process_group(CommGroup.DP_GROUP)


def get_pp_process_group() -> Any:
    return _process_group(CommGroup.PP_GROUP)


def get_tp_process_group() -> Any:
    return _process_group(CommGroup.TP_GROUP)


def get_rdp_process_group() -> Any:
    return _process_group(CommGroup.RDP_GROUP)


# ==================================================================== object collectives
_mailbox: collections.deque[Any] = collections.deque()  # threads: what this process sent itself


def _kind(group: Any) -> CommGroup:
    if isinstance(group, RankType):
        return group.value
    if not isinstance(group, CommGroup):
        raise SmpartError(f"expected an smp.CommGroup (smp.WORLD, smp.DP_GROUP, ...), got {group!r}")
    return group


def _objects_group(kind: CommGroup) -> Any:
    return GROUPS.get(kind, "gloo")


def _guarded(what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except RuntimeError as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        timeout = running_runtime().config.timeout_s
        raise SmpartError(f"smp.{what}: the other ranks did not take part within {timeout} s ({first}); "
                          "every rank of the group must make the matching call") from err


def _global_rank(peer: int, rank_type: RankType) -> int:
    if not isinstance(rank_type, RankType):
        raise SmpartError("rank_type must be an smp.RankType (smp.WORLD_RANK, smp.DP_RANK, ...), got "
                          f"{rank_type!r}")
    ranks = members(rank_type.value)
    if not 0 <= peer < len(ranks):
        raise SmpartError(f"rank {peer} of {rank_type.name}: this rank's {rank_type.value.name} has ranks "
                          f"0..{len(ranks) - 1}")
    return ranks[peer]


def send(obj: Any, dest_rank: int, rank_type: RankType = RankType.WORLD_RANK) -> None:
    """Send ``obj`` to ``dest_rank`` (a rank of the kind ``rank_type`` names); it calls `recv_from`."""
    dest = _global_rank(dest_rank, rank_type)
    if not on_processes():
        _mailbox.append(obj)
        return
    if dest == rank():
        raise SmpartError("smp.send: a rank cannot send to itself")
    group = _objects_group(CommGroup.WORLD)
    _guarded("send", lambda: dist.send_object_list([obj], dst=dest, group=group))


def recv_from(src_rank: int, rank_type: RankType = RankType.WORLD_RANK) -> Any:
    """The object ``src_rank`` sent (`send`) or broadcast (`broadcast`) to this rank."""
    src = _global_rank(src_rank, rank_type)
    if not on_processes():
        if not _mailbox:
            raise SmpartError("smp.recv_from: nothing was sent to this process (one process on threads)")
        return _mailbox.popleft()
    got: list[Any] = [None]
    group = _objects_group(CommGroup.WORLD)
    _guarded("recv_from", lambda: dist.recv_object_list(got, src=src, group=group))
    return got[0]


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD) -> None:
    """Send ``obj`` to every other rank of this rank's ``group``; each of them calls `recv_from`."""
    for peer in members(_kind(group)):
        if peer != rank():
            send(obj, peer, RankType.WORLD_RANK)


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    """Every rank's ``obj``, in the order of their ranks in ``group``."""
    kind = _kind(group)
    if len(members(kind)) == 1:
        return [obj]
    out: list[Any] = [None] * len(members(kind))
    objects = _objects_group(kind)
    _guarded("allgather", lambda: dist.all_gather_object(out, obj, group=objects))
    return out


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every rank of this rank's ``group`` gets here."""
    kind = _kind(group)
    if len(members(kind)) == 1:
        return
    timeout = datetime.timedelta(seconds=running_runtime().config.timeout_s)
    objects = _objects_group(kind)
    _guarded("barrier", lambda: dist.monitored_barrier(objects, timeout=timeout, wait_all_ranks=True))


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def tp_barrier() -> None:
    barrier(CommGroup.TP_GROUP)


def rdp_barrier() -> None:
    barrier(CommGroup.RDP_GROUP)
