"""Threads that compute the way the thread that made them would.

torch's intra-op thread count is per thread under OpenMP: ``torch.set_num_threads(1)`` in a
rank's main thread (what torchrun's ``OMP_NUM_THREADS=1`` is for) does not reach threads started
later, so a stage's worker running a matmul would fan out over every core, and the idle OpenMP
workers spin. `compute_thread` starts its target with its creator's count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


def compute_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """A daemon thread (not started) running ``target(*args)`` with the calling thread's
    ``torch.get_num_threads()``."""
    count = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(count)  # unconditionally: a new thread may report the count, not use it
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)
