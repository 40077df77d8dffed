"""Counting the Python bytecodes a step runs: the host's Python work, without the machine's noise.

``sys.settrace`` with opcode events counts every bytecode the calling thread runs (a step
program's greenlets run on it too); a step's count is the same on every run, where its time on a
shared 2-core box moves by ±10 % from one minute to the next. It is not a time: a bytecode of
smpart's glue (dictionary lookups, attribute reads) costs more than an average one of a model's
forward, and what torch does in C does not count. `bench/host_overhead.py` and
`bench/processes.py` print it with ``--bytecodes``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def count_bytecodes(step: Callable[[], object], warmup: int = 0) -> int:
    """The Python bytecodes one call of ``step`` runs on this thread, after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        step()
    finally:
        sys.settrace(None)
    return count
