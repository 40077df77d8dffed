"""The RNG states a checkpoint keeps per rank (torch, CUDA, ``random``, NumPy), as JSON."""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any

import torch

from smpart.checkpoint.files import _decode, _encode


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state().tolist(), "python": _encode(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    with contextlib.suppress(ImportError):
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _restore_rng(ranks: dict[int, dict[str, Any]], rank: int, saved_world: int) -> None:
    record = ranks.get(rank)
    if record is None:
        warnings.warn(f"the checkpoint holds the RNG states of {saved_world} rank(s), not of rank {rank}: "
                      "its RNG states are left as they are", stacklevel=3)
        return
    state = record["rng"]
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(_decode(state["python"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if state.get("numpy"):
        with contextlib.suppress(ImportError):
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
