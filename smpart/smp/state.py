"""``smp.state``: what SMP kept about the running job, read by scripts and by Hugging Face's
``Trainer`` (``smp.state.cfg.fp16``, ``smp.state.cfg.shard_optimizer_state``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smpart.smp.config import SMPConfig


@dataclass
class State:
    #: The configuration ``smp.init`` read (SMP's defaults before it).
    cfg: SMPConfig = field(default_factory=SMPConfig)
    #: The last `smp.DistributedModel` made, and `smp.DistributedOptimizer`: SMP allowed one of each,
    #: and ``smp.resume_from_checkpoint`` loads into them.
    model: Any = None
    optimizer: Any = None
    initialized: bool = False


state = State()
