"""The caller's thread-local state, carried to wherever a module runs.

torch keeps grad mode, inference mode and autocast per thread. A module on another stage runs on
that stage's thread (or process), where nothing the caller set applies: ``torch.autocast("cpu",
dtype=torch.bfloat16)`` around the model inside a step silently did nothing on the stages' threads,
so a split model computed in float32 what the unsplit one computed in bfloat16. The fix is to treat
that state as an implicit argument of every cross-stage call: the caller `capture`\\ s an `Ambient`
with the request, and the callee runs the module inside ``ambient.applied()``.

An `Ambient` holds what changes *what a module computes*: grad mode, inference mode, and for each
device type autocast's on/off and dtype, and whether autocast caches its casts. Process-wide settings
(deterministic algorithms, matmul precision, the default dtype) are not in it: every thread of a
process already shares them, and every rank runs the same script.

`capture` runs on every cross-stage call, so it is a handful of flag reads (about 1 µs), and when
nothing is set, or only ``no_grad``, it returns one shared instance instead of building a new one;
`Ambient.applied` enters nothing when the thread already runs under the same state. An `Ambient` is
a frozen dataclass of plain values, so it pickles into a process transport's message header.

One more per-thread setting is inherited, not carried: torch's intra-op thread count is per thread
under OpenMP, so ``torch.set_num_threads(1)`` in a rank's main thread (what torchrun's
``OMP_NUM_THREADS=1`` is for) does not reach threads started later, and a stage's worker running a
matmul would fan out over every core while the idle OpenMP workers spin. `compute_thread` starts
its target with its creator's count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def _device_types() -> tuple[str, ...]:
    """The device types whose autocast state is carried: CPU, CUDA and this machine's accelerator."""
    types = ["cpu", "cuda"]
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is not None and current.type not in types:
        types.append(current.type)
    return tuple(types)


#: Device types whose autocast state `capture` reads and `Ambient.applied` sets.
AUTOCAST_DEVICE_TYPES = _device_types()


@dataclass(frozen=True)
class Ambient:
    """Thread-local state that changes what a module computes.

    ``autocast`` lists ``(device_type, dtype)`` for each device type where autocast is on (an
    absent device type has it off); ``autocast_cache`` is ``torch.is_autocast_cache_enabled()``.
    """

    grad_enabled: bool = True
    inference_mode: bool = False
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    autocast_cache: bool = True

    @contextmanager
    def applied(self) -> Iterator[Ambient]:
        """Run the current thread under this state inside the block, and restore its own after."""
        if capture() == self:
            yield self
            return
        with ExitStack() as stack:
            if torch.is_inference_mode_enabled() != self.inference_mode:
                stack.enter_context(torch.inference_mode(self.inference_mode))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            wanted = dict(self.autocast)
            for device_type in AUTOCAST_DEVICE_TYPES:
                dtype = wanted.get(device_type)
                if dtype is not None or torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=dtype is not None,
                                                       cache_enabled=self.autocast_cache))
            if torch.is_autocast_cache_enabled() != self.autocast_cache:  # autocast off everywhere
                stack.enter_context(_autocast_cache(self.autocast_cache))
            yield self


#: What `capture` returns when nothing is set, and under ``torch.no_grad()`` alone.
DEFAULT = Ambient()
NO_GRAD = Ambient(grad_enabled=False)


#: One call for "is autocast on for any device" (torch's own, where this torch has it): `capture`
#: runs at every cross-stage call and glue operation, and asking each device type costs ~1 us.
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def capture() -> Ambient:
    """The current thread's `Ambient` (one shared instance when nothing, or only no_grad, is set)."""
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    cache = torch.is_autocast_cache_enabled()
    if cache and not inference and _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return DEFAULT if grad else NO_GRAD
    autocast = tuple([(kind, torch.get_autocast_dtype(kind)) for kind in AUTOCAST_DEVICE_TYPES
                      if torch.is_autocast_enabled(kind)])
    if not autocast and cache and not inference:
        return DEFAULT if grad else NO_GRAD
    return Ambient(grad, inference, autocast, cache)


def ambient_key() -> Any:
    """`capture` as a dictionary key: the grad mode alone (a bool, hashed without Python) when
    nothing else is set, as `capture`'s fast path finds, else the `Ambient`. Every template lookup
    of a step program's calls holds one."""
    if (torch.is_autocast_cache_enabled() and not torch.is_inference_mode_enabled()
            and _ANY_AUTOCAST is not None and not _ANY_AUTOCAST()):
        return torch.is_grad_enabled()
    return capture()


@contextmanager
def _autocast_cache(enabled: bool) -> Iterator[None]:
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


def compute_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """A daemon thread (not started) running ``target(*args)`` with the calling thread's
    ``torch.get_num_threads()``."""
    count = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(count)  # unconditionally: a new thread may report the count, not use it
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)
