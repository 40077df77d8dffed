"""`StageStep`: what one stage keeps during one step.

Its order of work (`StageScheduler` over the schedule's list), the calls it served and made with
the tensors each kept for the backward, the outputs it holds for other stages (`handles`), the
gradient messages waiting for a segment and what it holds back (`gradients.Holding`), its spans.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from smpart.runtime.reference.gradients import CallRecords, Holding, Outbox
from smpart.runtime.reference.scheduler import StageScheduler
from smpart.runtime.reference.workers import Waiter
from smpart.runtime.schedule import schedule_named
from smpart.runtime.wire.messages import Address, BeginStep, Gradients, driver_endpoint


class StageStep:
    """What one stage keeps during one step."""

    def __init__(self, begin: BeginStep, stage: int, num_stages: int, follower: bool = False) -> None:
        self.step = begin.step
        self.microbatches = begin.microbatches
        self.timeout_s = begin.timeout_s
        self.coordinator = begin.coordinator
        self.driver_place = begin.coordinator[0]
        actions = schedule_named(begin.schedule).actions(stage, num_stages, begin.microbatches,
                                                          begin.active_microbatches)
        self.scheduler = StageScheduler(actions, follower)
        self.requests: dict[int, int] = defaultdict(int)  # forward calls received per micro-batch
        self.resumes: dict[int, int] = defaultdict(int)  # resumed calls per micro-batch
        self.gradients_sent: dict[int, dict] = defaultdict(dict)  # per micro-batch: endpoint -> count
        self.served: dict[int, CallRecords] = defaultdict(dict)  # outputs this stage returned
        #: Outputs answered as handles, per micro-batch: (call id, tensor index) -> tensor.
        self.held: dict[int, dict[tuple[Any, int], torch.Tensor]] = defaultdict(dict)
        self.handles = begin.handles
        self.holding = begin.holding
        self.sent: dict[int, CallRecords] = defaultdict(dict)  # arguments this stage sent
        #: Each kept call's name across steps, (module, to_outputs, n-th such call of its
        #: micro-batch here), by (call id, to_outputs); the gradient messages each name got in this
        #: step (the most over its micro-batches), and what each micro-batch holds back (`gradients`).
        self.record_names: dict[tuple[Any, bool], tuple[str, bool, int]] = {}
        self.record_counts: dict[tuple[int, str, bool], int] = defaultdict(int)
        self.messages_per_record: dict[tuple[str, bool, int], int] = {}
        self.holdings: dict[int, Holding] = {}
        self.waiting: dict[Any, Waiter] = {}
        self.backlog: dict[int, list[Gradients]] = defaultdict(list)
        self.segment_queued: set[int] = set()
        self.released: set[int] = set()
        self.outbox = Outbox()
        self.bytes_before: dict[tuple[int, int], int] = {}
        self.spans: list[tuple[int, str, float, float]] = []
        self.aborted = False
        self.lock = threading.Lock()
        #: Notified when a gradient message joins the backlog or the step is aborted: what a
        #: tensor-parallel follower's segment waits on for the messages its leader's consumed.
        self.gradients_came = threading.Condition(self.lock)

    def home(self, microbatch: int) -> Address:
        return (self.driver_place, driver_endpoint(self.step, microbatch))

    def keep_record(self, records: dict[int, CallRecords], mb: int, call_id: Any, module: str,
                    kept: list, to_outputs: bool) -> None:
        """Keep a call's tensors for the gradients that will come back, under a name that the
        same call has in the next step too."""
        with self.lock:
            n = self.record_counts[(mb, module, to_outputs)]
            self.record_counts[(mb, module, to_outputs)] = n + 1
            self.record_names[(call_id, to_outputs)] = (module, to_outputs, n)
        records[mb][call_id] = (module, kept)

    def learn_messages(self, holding: Holding) -> None:
        """How many gradient messages each kept call of a released micro-batch got."""
        for key, count in holding.received.items():
            name = self.record_names.get(key)
            if name is not None:
                self.messages_per_record[name] = max(count, self.messages_per_record.get(name, 0))
