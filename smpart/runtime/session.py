"""`init` and `shutdown`: start the runtime this process runs, and stop it.

`init` validates a `Config` and starts the stage servers this process hosts: every stage, on
threads (the embedded default, `ThreadRuntime`), or its own stage, one process per stage under
``torchrun`` (`ProcessRuntime`, `smpart.distributed.launch`). `shutdown` joins every thread and
gives placed models their plain forwards back; `init` may then be called again with another
configuration (a model is re-partitioned at its next step). Interpreter exit shuts down too.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
from typing import Any

from smpart.config import Config
from smpart.distributed.launch import launched_with_processes, teardown
from smpart.errors import ConfigError, SmpartError
from smpart.runtime.processes.runtime import ProcessRuntime
from smpart.runtime.runtime import process_setup, running_runtime, set_running
from smpart.runtime.threads import ThreadRuntime


def init(config: Config | dict[str, Any] | None = None, **kwargs: Any) -> Config:
    """Start smpart with a `Config`, a dict or keyword arguments; returns the validated `Config`.

    Under ``torchrun`` (or with a process group already initialised) every rank calls it with
    the same configuration and runs one stage; otherwise every stage runs on threads of this
    process. Calling it again first shuts the running configuration down.
    """
    cfg = Config.from_any(config, **kwargs)
    shutdown()
    if launched_with_processes():
        set_running(ProcessRuntime(cfg))
        # Exit hooks run last registered first: smpart's shutdown must run before the transport's
        # hook (registered at its import) aborts the transports still open.
        atexit.unregister(_shutdown_at_exit)
        atexit.register(_shutdown_at_exit)
        return cfg
    if cfg.device_types and len(cfg.device_types) != cfg.pipeline_parallel_degree:
        stages, given = cfg.pipeline_parallel_degree, len(cfg.device_types)
        raise ConfigError(f"on threads device_types names each stage's device: give {stages} type(s), one "
                          f"per stage, not {given}")
    if cfg.tensor_parallel_degree != 1 or (cfg.data_parallel_degree or 1) != 1 or len(
            cfg.data_parallel_shares or [1]) != 1:
        raise ConfigError("on threads (no torchrun) smpart runs pipeline parallelism only: "
                          "tensor_parallel_degree and data_parallel_degree need one process per rank "
                          "(launch with torchrun --nproc-per-node <pp x tp x dp>)")
    set_running(ThreadRuntime(cfg))
    return cfg


def shutdown() -> None:
    """Stop every execution server and join its threads (safe to call when not initialised)."""
    runtime = set_running(None)
    if runtime is not None:
        if sys.exc_info()[1] is not None:  # called while an error propagates: fail fast, answer nobody
            runtime.answer_at_shutdown = False
        stuck = runtime.shutdown()
        if stuck:
            raise SmpartError(f"threads still busy after shutdown (a module that never returns?): {stuck}")


def _shutdown_at_exit() -> None:
    """Flush and stop smpart (its last messages must leave), then the process group it made."""
    runtime, setup = running_runtime(), process_setup()
    owned = setup is not None and setup.created_default_group
    if runtime is not None and hasattr(sys, "last_value"):
        runtime.answer_at_shutdown = False  # the script ended with an uncaught exception: fail fast
    with contextlib.suppress(SmpartError):  # daemon threads still stuck in a module die with the process
        shutdown()
    if owned:
        teardown()


atexit.register(_shutdown_at_exit)
