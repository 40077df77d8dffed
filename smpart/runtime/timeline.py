"""`Timeline`: what every stage did during one step, as spans of forward and backward work.

A span is a stretch during which a stage held its baton for one micro-batch (a call waiting for
another stage gives the baton back, which ends its span). Times are seconds from the start of
the step. ``save`` writes Chrome/Perfetto trace JSON (one track per stage); ``events`` is the
plain list of dicts other views (the HTML explorer) render.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timeline:
    num_stages: int
    #: Wall-clock seconds of the whole step.
    duration_s: float
    #: ``{"stage", "microbatch", "kind" ("forward"|"backward"), "start_s", "end_s"}``, by start.
    events: list[dict[str, Any]] = field(default_factory=list)
    schedule: str = ""
    microbatches: int = 0
    #: Stage -> the actions it started, in order (``["F0", "F1", "B0", ...]``): compare with
    #: ``smpart.runtime.schedule.schedule_named(schedule).actions(stage, ...)``.
    started: dict[int, list[str]] = field(default_factory=dict)
    #: ``(src_stage, dst_stage) -> bytes`` of tensors sent between stages during the step.
    bytes_sent: dict[tuple[int, int], int] = field(default_factory=dict)
    #: ``(src_stage, dst_stage) -> messages`` sent between stages (step programs count them).
    messages: dict[tuple[int, int], int] = field(default_factory=dict)
    #: Which runtime ran the step: ``"program"`` (a step program) or ``"reference"``.
    runtime: str = "reference"
    #: Why the step ran on the reference runtime, or is a program's discovery (empty otherwise).
    reason: str = ""
    #: The step program that ran (`smpart.runtime.program.actions.Program`), if one did.
    program: Any = None
    #: Under ``torchrun``, how a program step's tensors travelled between ranks: ``"framed"``
    #: (the process transport's messages) or ``"direct"`` (`smpart.runtime.program.routes`).
    transfers: str = ""

    @classmethod
    def from_spans(cls, spans_by_stage: dict[int, list[tuple[int, str, float, float]]], origin: float,
                   duration_s: float, num_stages: int, schedule: str = "", microbatches: int = 0) -> Timeline:
        events = [
            {"stage": stage, "microbatch": mb, "kind": kind, "start_s": start - origin, "end_s": end - origin}
            for stage, spans in spans_by_stage.items()
            for mb, kind, start, end in spans
        ]
        events.sort(key=lambda e: (e["start_s"], e["stage"]))
        return cls(num_stages, duration_s, events, schedule, microbatches)

    def busy_s(self, stage: int) -> float:
        return sum(e["end_s"] - e["start_s"] for e in self.events if e["stage"] == stage)

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle: 1 - busy / (stages x step duration)."""
        capacity = self.num_stages * self.duration_s
        if capacity <= 0:
            return 0.0
        busy = sum(self.busy_s(s) for s in range(self.num_stages))
        return max(0.0, 1.0 - busy / capacity)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "smpart.timeline/1",
            "num_stages": self.num_stages,
            "duration_s": self.duration_s,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "bubble_fraction": self.bubble_fraction,
            "events": list(self.events),
            "bytes_sent": [[src, dst, n] for (src, dst), n in sorted(self.bytes_sent.items())],
            "runtime": self.runtime,
            "reason": self.reason,
            "transfers": self.transfers,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        return cls(data["num_stages"], data["duration_s"], list(data["events"]), data.get("schedule", ""),
                   data.get("microbatches", 0))

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome/Perfetto "trace event" JSON: one complete event ("X") per span, µs units."""
        names = [{"ph": "M", "pid": 0, "tid": s, "name": "thread_name", "args": {"name": f"stage {s}"}}
                 for s in range(self.num_stages)]
        spans = [
            {
                "name": f"{'F' if e['kind'] == 'forward' else 'B'}{e['microbatch']}",
                "cat": e["kind"],
                "ph": "X",
                "pid": 0,
                "tid": e["stage"],
                "ts": e["start_s"] * 1e6,
                "dur": (e["end_s"] - e["start_s"]) * 1e6,
                "args": {"microbatch": e["microbatch"]},
            }
            for e in self.events
        ]
        return {"traceEvents": names + spans, "displayTimeUnit": "ms"}

    def save(self, path: str) -> str:
        """Write the Chrome/Perfetto trace JSON to ``path`` (open it in ui.perfetto.dev); return path."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_chrome_trace(), fh)
        return path

    def __repr__(self) -> str:
        return (f"Timeline(stages={self.num_stages}, spans={len(self.events)}, "
                f"duration={self.duration_s * 1e3:.1f} ms, bubble={self.bubble_fraction:.1%}, "
                f"runtime={self.runtime})")
