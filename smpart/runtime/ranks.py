"""Where this process stands in the job, as in SMP: ``smpart.rank()``, ``pp_rank()``, ``barrier()``...

On threads (no ``torchrun``) there is one process: rank 0 of 1, every degree but the pipeline's 1.
Under ``torchrun`` the answers come from the running configuration's layout of ranks
(`smpart.distributed.launch.Layout`), or from the launcher's environment before ``init``.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from smpart.errors import SmpartError
from smpart.runtime.runtime import process_layout, process_setup, running_runtime


def _layout():
    return process_layout()


def rank() -> int:
    """This process's global rank (0 on threads)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def size() -> int:
    """Processes in the job (1 on threads)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its machine (its GPU under NCCL)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def pp_rank() -> int:
    """This process's pipeline stage (0 on threads, where every stage is here)."""
    layout = _layout()
    return layout.coordinates(rank())[0] if layout is not None else 0


def pp_size() -> int:
    layout = _layout()
    if layout is not None:
        return layout.pp
    runtime = running_runtime()
    return runtime.num_stages if runtime is not None else 1


def dp_rank() -> int:
    layout = _layout()
    return layout.coordinates(rank())[1] if layout is not None else 0


def dp_size() -> int:
    layout = _layout()
    return layout.dp if layout is not None else 1


def tp_rank() -> int:
    layout = _layout()
    return layout.coordinates(rank())[2] if layout is not None else 0


def tp_size() -> int:
    layout = _layout()
    return layout.tp if layout is not None else 1


def barrier() -> None:
    """Wait until every rank gets here (a no-op on threads): at most ``Config.timeout_s``, then an
    `SmpartError` naming the ranks that did not come."""
    runtime = running_runtime()
    group = None if runtime is None else runtime.state_group
    if group is None:
        return
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=runtime.config.timeout_s),
                               wait_all_ranks=True)
    except RuntimeError as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise SmpartError(f"smpart.barrier(): not every rank came within {runtime.config.timeout_s} s "
                          f"({first}); raise Config.timeout_s if one rank is busy for longer") from err


def _setup():
    return process_setup()


def device_mesh():
    """torch's ``DeviceMesh`` of the job, dimensions ``("pp", "dp", "tp")`` (None on threads):
    ``device_mesh()["tp"]`` is this rank's tensor-parallel mesh, as DTensor APIs take it."""
    setup = _setup()
    return setup.mesh if setup is not None else None


def get_pp_group():
    """This rank's pipeline group: the stages of its replica (None when it is alone in it)."""
    setup = _setup()
    return setup.pp_group if setup is not None else None


def get_dp_group():
    """This rank's data-parallel group: its stage and tp rank in every replica (None when alone)."""
    setup = _setup()
    return setup.dp_group if setup is not None else None


def get_tp_group():
    """This rank's tensor-parallel group: the ranks sharing its stage (None when alone)."""
    setup = _setup()
    return setup.tp_group if setup is not None else None
