"""The ranks a checkpoint is saved over: who this rank is, the barriers, and the check that
every rank called a collective save or load (naming the ones that did not come)."""

from __future__ import annotations

import contextlib
import datetime
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from smpart.errors import CheckpointError
from smpart.runtime.runtime import process_setup, running_runtime


@contextlib.contextmanager


def _single_process_is_meant() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    """The global rank: RNG states are per process, whatever group the checkpoint is saved over."""
    return dist.get_rank() if _distributed() else 0


def _world(group: Any = None) -> int:
    return dist.get_world_size(group) if _distributed() else 1


def _barrier(group: Any = None) -> None:
    if _distributed():
        dist.barrier(group)


def _every_rank_calls(what: str, group: Any) -> None:
    """Wait until every rank has called ``what``, under smpart's processes at most its ``timeout_s``,
    naming the ranks that did not come: a collective that one rank skips (``if smpart.rank() == 0:``)
    would wait for its group's timeout, half an hour, and fail without saying why."""
    setup = process_setup()
    if group is not None or setup is None or not _distributed():
        return
    timeout = datetime.timedelta(seconds=running_runtime().config.timeout_s)
    try:
        dist.monitored_barrier(setup.collective_group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        raise CheckpointError(f"{what} is collective: every rank must call it ({_gist(err)}). To save "
                              "from one rank, write model.state_dict() and optimizer.state_dict() there "
                              "(the other ranks send their parts)") from err


def _gist(err: BaseException) -> str:
    """The line of a long torch error that says what went wrong."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    found = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
    return f"{type(err).__name__}: {found}"


def _some(items: list[str], shown: int = 8) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
