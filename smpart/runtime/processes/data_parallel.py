"""Data parallelism: every stage averages its gradients over its data-parallel group.

Each data-parallel replica runs its own pipeline on its own batch, and each stage averages its
gradients over the replicas of that stage (its dp group) before the optimizer steps. Why smpart
does this itself and not DDP's hooks: the runtime calls autograd stage by stage, call by call,
not through one ``loss.backward()`` on a wrapped module, so nothing would fire them.

**Buckets, started as the gradients become final.** The stage's parameters are cut into
buckets (reverse registration order, the order a backward usually finishes them; at most
``bucket_bytes`` of one dtype each), one asynchronous all-reduce per bucket. A parameter is final
once it has received as many gradient accumulations in this step as it did in the last one (a
layer called once per micro-batch: one per micro-batch), which a hook after each accumulation
counts; a bucket whose parameters are all final starts its all-reduce at once, while the backward
goes on with the other layers and other micro-batches. Buckets start in index order on every
rank, so the collectives pair up. The first step has no count to go by and starts every bucket
when the stage's gradients are final as a whole (all its micro-batches released).

**Always exact, whatever the routing.** Counts from the last step are a guess: data-dependent
routing (an expert no token reached) or control flow can change them. So when the stage's
gradients are final as a whole (`flush`), the replicas agree, over a second (gloo) group so as
not to interleave with the buckets in flight, on (1) the buckets any of them started early: the
others start them now, a gradient they lack counting as zeros; (2) which parameters of the
remaining buckets have a gradient anywhere: those take part, zeros where missing, the rest keep
no gradient, exactly as one process on the concatenated batch; (3) parameters that received a
gradient after their bucket started (a guess too early): what arrived late, caught by a hook
before accumulation, is averaged in one more all-reduce and added. `finish`, before the
optimizer step, waits for every all-reduce and makes the averages the gradients: views of
the buckets, no copy (each replica scaled its part by ``1 / dp`` as it filled the bucket).

**A step that fails on one replica fails on all of them.** The replicas' collectives must pair
up step after step, and a replica whose step failed never flushes by itself (its micro-batches
are not all released). So `finish` takes the failure: a rank whose step failed before it flushed
flushes then, saying so, and every rank's flush (the agreement's first flag) learns whether any
replica failed; if one did, only the buckets some replica already started are all-reduced, so
the collectives still pair. A step can also fail after its gradients were final (in the step
body, after the backward): so `finish` ends every step with one more small all-reduce, of which
replica failed (a step program's replicas flush from `finish`, after their step's body: their
agreement says it, and they exchange nothing more). When one did, no average is written
anywhere: each replica keeps its own unaveraged gradients, and every replica's step raises (the
others' naming the replica that failed), so no replica steps its optimizer on gradients the
others do not have. A replica whose step failed before its first model call holds none of the
stage's parameters yet, so its flags would not match the others' in size: a fixed-size
all-reduce of the sizes goes first, and replicas that differ pair nothing more than it (a step
program's flush skips it once one found the sizes equal: a program runs only where every replica
placed the model).

**Replicas with batch shares** (`smpart.runtime.processes.shares`) weigh their gradients by samples: each
replica multiplies what it all-reduces (the buckets and the late correction) by ``weight / dp``,
``weight = dp · its samples / all samples``, so the mean is that of one process on the global batch.

**A replica that never comes.** One whose rank hangs (in its backward, say) or dies without
closing its connections never joins these collectives. Every wait here is bounded by
``timeout_s`` (`smpart.distributed.attendance`): before its flush and its finish a rank marks
where it is, and a wait that expires raises an `SmpartError` naming the ranks of the group that
never came and where they were last seen. The first such failure is kept: the group is unusable
from then on, and the flush (on a thread of its own, `flush_soon`: the stage server calls it from
a message handler, which must not block) and the finish (on the main thread) raise the same error.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _unflatten_dense_tensors

from smpart.distributed.attendance import Attendance
from smpart.errors import SmpartError

#: Bytes per bucket, DDP's defaults: the first (the last layers, final first) small, so that an
#: all-reduce starts early in the backward; the others large, so that each all-reduce is not
#: dominated by its latency and a step starts few (on the 2-core box, where every all-reduce
#: takes CPU from the backward, 1 MB buckets were 12 % slower; 4 MB ones within the noise).
FIRST_BUCKET_BYTES = 1 * 2**20
BUCKET_BYTES = 25 * 2**20

#: Where a step is, for `Attendance` (the same ordinal on every replica at the same collective).
CHECK, FLUSH, FINISH, OPTIMIZER = range(4)


def ordinal(step: int, phase: int) -> int:
    return step * 4 + phase


class _Bucket:
    """Parameters all-reduced together; ``flat`` holds their gradients once started."""

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.taking: list[nn.Parameter] = []
        self.flat: torch.Tensor | None = None
        self.work: Any = None

    @property
    def started(self) -> bool:
        return self.flat is not None


class GradientReducer:
    """Averages one stage's gradients over its dp group, step after step (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], group: Any, control_group: Any, size: int,
                 bucket_bytes: int | None = None, replica: int = 0, weight: float = 1.0, step: int = 0,
                 attendance: Attendance | None = None, timeout_s: float = 1800.0) -> None:
        self.group, self.control_group, self.size = group, control_group, size
        #: This replica's gradients enter the mean multiplied by it (its share of the samples × dp).
        self.weight = weight
        self.attendance = attendance or Attendance(dist.get_rank(), store=False)  # names nobody
        self.timeout_s = timeout_s
        self._ranks = dist.get_process_group_ranks(control_group)
        self._step = step  # the step under way (numbered from 0), in the waits' marks
        #: The first wait that failed (a replica that never came): the groups are unusable after it.
        self.failure: SmpartError | None = None
        self.params = params
        by_size = buckets(list(reversed(params)), bucket_bytes or BUCKET_BYTES,
                          min(FIRST_BUCKET_BYTES, bucket_bytes or BUCKET_BYTES))
        self.buckets = [_Bucket(i, b) for i, b in enumerate(by_size)]
        #: Of the last step: buckets started during the backward (before `flush`), and parameters
        #: whose gradient arrived after their bucket started (averaged by the correction).
        self.started_early = 0
        self.corrected = 0
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._expected: dict[int, int] = {}
        self._count: dict[int, int] = {}
        self._unfinal: list[int] = [len(b.params) for b in self.buckets]
        self._late: dict[int, torch.Tensor] = {}
        self._next = 0  # index of the next bucket to start (they start in order)
        self._correction: tuple[list[nn.Parameter], torch.Tensor, Any] | None = None
        self._lock = threading.Lock()
        self._armed = False
        self._flushed = False
        self._flushing: threading.Thread | None = None  # `flush_soon`'s thread, joined by `finish`
        self._mismatch: SmpartError | None = None  # see `_same_parameters_everywhere`
        self._unpairable = False
        #: Every replica's reducer was found to hold as many parameters as this one (in a flush).
        self._sizes_agreed = False
        self._failing_told: int | None = None
        self._replica = replica  # this rank's data-parallel index, named when its step fails
        self._handles = [h for p in params for h in (p.register_hook(self._make_pre_hook(p)),
                                                     p.register_post_accumulate_grad_hook(self._accumulated))]

    # ---------------------------------------------------------------- per step
    def begin_step(self, step: int = 0) -> None:
        """Arm the hooks for step ``step`` (counts restart; buckets are free)."""
        with self._lock:
            self._step = step
            self._count = {}
            self._unfinal = [len(b.params) for b in self.buckets]  # per bucket: parameters not final yet
            self._late = {}
            self._next = 0
            for bucket in self.buckets:
                bucket.taking, bucket.flat, bucket.work = [], None, None
            self._correction = None
            self.started_early = self.corrected = 0
            self._armed = True
            self._flushed = False
            self._failing_told = None  # which replica failed, when `flush` was told
            self._mismatch, self._unpairable = None, False

    def flush_soon(self) -> None:
        """`flush` on a thread of its own: the stage server calls this from a message handler,
        which must not block (a replica that never comes would hold it for ``timeout_s``, and
        the peers' messages to it with it). `finish` joins it; an error is kept in `failure`."""
        def flush() -> None:
            with contextlib.suppress(SmpartError):
                self.flush()

        self._flushing = threading.Thread(target=flush, name="smpart-gradient-flush", daemon=True)
        self._flushing.start()

    def flush(self, failed: bool = False, finishing: bool = False) -> None:
        """The stage's gradients are final (or, ``failed``, this rank's step failed before they
        were): start everything not started yet (collective). Once per step. ``finishing``: `finish`
        calls it at the step's very end, where nothing can fail after it, so the agreement also
        tells it which replica failed and `finish` exchanges nothing of its own; every replica must
        flush the same way in a step (a step program's replicas all flush from `finish`)."""
        with self._lock:
            if self._flushed:
                return
            self._flushed = True
            self._armed = False
            self.started_early = self._next
            self._arrive(FLUSH)
            # A step program runs only where every replica placed the model: what a flush found
            # of these parameters holds (every replica's reducer agreed in the same flush).
            if not (finishing and self._sizes_agreed) and not self._same_parameters_everywhere():
                return  # a replica failed before it placed the model (`finish` tells)
            started = [int(b.started) for b in self.buckets]
            has_grad = [int(p.grad is not None) for p in self.params]
            late = [int(id(p) in self._late) for p in self.params]
            nb, np_ = len(self.buckets), len(self.params)
            who = self._replica + 1 if failed else 0
            flags = torch.tensor([who] + started + has_grad + late, dtype=torch.int64)
            self._control_max(flags, FLUSH)
            who, *flags = flags.tolist()
            failed_anywhere = who > 0
            if finishing:
                self._failing_told = who - 1
            if self._count and not failed:  # a step with a backward teaches the next one its counts
                self._expected = dict(self._count)
            started_anywhere = flags[:nb]
            with_grad = {id(p) for p, f in zip(self.params, flags[nb:nb + np_], strict=True) if f}
            late_anywhere = [p for p, f in zip(self.params, flags[nb + np_:], strict=True) if f]
            for bucket in self.buckets[self._next:]:
                if started_anywhere[bucket.index]:
                    self._start(bucket, bucket.params)
                elif not failed_anywhere:
                    self._start(bucket, [p for p in bucket.params if id(p) in with_grad])
            if failed_anywhere:  # nothing will be averaged: only pair the all-reduces already under way
                return
            self.corrected = len(late_anywhere)
            if late_anywhere:
                extra = [self._late.get(id(p), torch.zeros_like(_local(p))) for p in late_anywhere]
                flat = scaled_copy(extra, self._scale)
                work = dist.all_reduce(flat, group=self.group, async_op=True)
                self._correction = (late_anywhere, flat, work)

    def _same_parameters_everywhere(self) -> bool:
        """Whether every replica holds as many of this stage's parameters, in as many buckets, as this
        one: the flags of `flush` have that many entries, so a fixed-size all-reduce comes first and
        they cannot mismatch. Not so when a replica's step failed before its first model call in
        the job (or before its first call of a newly placed model): it holds none of the stage's
        parameters yet (or not the new ones). Nothing was started early then, unless one replica
        learnt its counts with other buckets: nothing to pair, and `finish` finds the replica that
        failed (an error if none did, or if some all-reduce was started and cannot be paired)."""
        sizes = (len(self.params), len(self.buckets))
        shape = torch.tensor([int(self._next > 0), *sizes, *(-n for n in sizes)], dtype=torch.int64)
        self._control_max(shape, FLUSH)
        started_anywhere, most_params, most_buckets, fewest_params, fewest_buckets = shape.tolist()
        if (most_params, most_buckets) == (-fewest_params, -fewest_buckets):
            self._sizes_agreed = True
            return True
        what = (f"the data-parallel replicas of a stage hold different parameters ({-fewest_params} to "
                f"{most_params} tensors)")
        self._mismatch = SmpartError(
            f"{what}, and one of them already averaged some during its backward: those all-reduces cannot "
            "be paired; restart from a checkpoint" if started_anywhere else
            f"{what} at the end of a step in which none failed: every replica must call the same models "
            "in each step")
        self._unpairable = bool(started_anywhere)
        return False

    def finish(self, failed: bool = False, flush_here: bool = False) -> int | None:
        """Wait for every all-reduce and write the averages into the gradients (collective). With
        ``failed`` (this rank's step failed), or when another replica's did, write nothing and
        return the index of a replica whose step failed; None when every replica's step ran.
        ``flush_here``: the step did not flush before (a step program's): flush and finish agree
        in one exchange (`flush`'s ``finishing``)."""
        if self._flushing is not None:
            self._flushing.join()  # its waits are bounded by timeout_s
            self._flushing = None
        with contextlib.suppress(SmpartError):  # kept in `failure`, raised below
            self.flush(failed, finishing=flush_here)  # or a step that failed before its gradients were final
        with self._lock:
            if self.failure is not None:
                self._drop_buckets()
                raise self.failure
            try:
                self._wait_for_buckets()
                failing = self._failing_told
                if failing is None:  # the step may have failed after the flush (in the body, after backward)
                    who = torch.tensor([self._replica + 1 if failed else 0], dtype=torch.int64)
                    self._arrive(FINISH)
                    self._control_max(who, FINISH)
                    failing = int(who.item()) - 1  # a rank whose flush said so says so here too
            except SmpartError:
                self._drop_buckets()
                raise
            if self._mismatch is not None and (failing < 0 or self._unpairable):
                raise self._mismatch
            if failing >= 0:
                self._drop_buckets()
                return failing
            for bucket in self.buckets:
                if bucket.work is None:
                    continue
                averages = _unflatten_dense_tensors(bucket.flat, [_local(p.grad) for p in bucket.taking])
                for p, averaged in zip(bucket.taking, averages, strict=True):
                    adopt_average(p, averaged)
                bucket.flat, bucket.work = None, None
            if self._correction is not None:
                params, flat, _ = self._correction  # waited for above
                for p, extra in zip(params, _unflatten_dense_tensors(flat, [_local(p) for p in params]),
                                    strict=True):
                    _local(p.grad).add_(extra)
                self._correction = None
        return None

    def remove(self) -> None:
        if self._flushing is not None:  # a step that never finished (interrupted)
            self._flushing.join(self.timeout_s)
        for handle in self._handles:
            handle.remove()

    # ---------------------------------------------------------------- bounded waits
    def _arrive(self, phase: int) -> None:
        self.attendance.arrive(ordinal(self._step, phase), self._where(phase))

    def _where(self, phase: int) -> str:
        what = "the end of the gradient averaging" if phase == FINISH else "the gradient averaging"
        return f"{what} of step {self._step + 1}"

    def _control_max(self, flags: torch.Tensor, phase: int) -> None:
        """All-reduce ``flags`` (MAX) over the control group, at most ``timeout_s``."""
        if self.failure is not None:
            raise self.failure
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
        self._wait(work, phase)

    def _wait(self, work: Any, phase: int, timeout_s: float | None = None) -> None:
        try:
            self.attendance.wait(work, self.timeout_s if timeout_s is None else timeout_s,
                                 ordinal(self._step, phase), self._where(phase), self._ranks)
        except SmpartError as err:
            self.failure = err
            raise

    def _wait_for_buckets(self) -> None:
        """Wait for every all-reduce started (not those of a replica that cannot pair), together
        at most ``timeout_s``."""
        if self._unpairable:  # an all-reduce started early has no partner
            return
        works = [b.work for b in self.buckets if b.work is not None]
        if self._correction is not None:
            works.append(self._correction[2])
        deadline = time.monotonic() + self.timeout_s
        for work in works:
            self._wait(work, FLUSH, max(0.001, deadline - time.monotonic()))

    def _drop_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.flat, bucket.work = None, None
        self._correction = None

    # ---------------------------------------------------------------- hooks (autograd threads)
    def _make_pre_hook(self, param: nn.Parameter):
        def before_accumulation(grad: torch.Tensor) -> None:
            # a gradient reaching a parameter whose bucket already started: keep it for the correction
            with self._lock:
                if self._armed and self._bucket_of[id(param)].started:
                    local = _local(grad).detach()
                    held = self._late.get(id(param))
                    self._late[id(param)] = local.clone() if held is None else held + local
        return before_accumulation

    def _accumulated(self, param: nn.Parameter) -> None:
        with self._lock:
            if not self._armed:
                return
            key = id(param)
            count = self._count[key] = self._count.get(key, 0) + 1
            if count == self._expected.get(key, 0):  # final now (a parameter expecting none never is)
                self._unfinal[self._bucket_of[key].index] -= 1
            while self._next < len(self.buckets) and not self._unfinal[self._next]:
                bucket = self.buckets[self._next]
                self._start(bucket, bucket.params)

    def _start(self, bucket: _Bucket, taking: list[nn.Parameter]) -> None:
        """All-reduce ``taking`` (a gradient missing here counts as zeros); call with the lock held."""
        self._next = bucket.index + 1
        bucket.taking = taking
        for p in taking:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket.flat = scaled_copy([_local(p.grad) for p in taking], self._scale)
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True) if taking else None

    @property
    def _scale(self) -> float:
        """What a replica's gradients are multiplied by before the sum: the sum is then the mean
        (DDP divides first too; by a power of two, as for dp = 2, exactly)."""
        return self.weight / self.size


def stage_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The trainable parameters this rank holds, each once, in registration order."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for param in module.parameters():
            if param.requires_grad and param.device.type != "meta" and id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    return out


def flat_copy(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors side by side in a new buffer. Never a view (``_flatten_dense_tensors`` of one
    tensor is one): a gradient may still grow after its bucket started."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def scaled_copy(tensors: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The tensors times ``scale``, side by side in a new buffer, in one pass (a product written
    into each tensor's place; a copy and a scaling of the whole would be two)."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype if tensors else torch.float32,
                       device=tensors[0].device if tensors else None)
    for t, place in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
        torch.mul(t, scale, out=place)
    return flat


def adopt_average(param: nn.Parameter, averaged: torch.Tensor) -> None:
    """Make ``averaged`` (a view of its all-reduced bucket) the parameter's gradient, without a copy
    (DDP's ``gradient_as_bucket_view``): a step's buckets are new buffers, so the gradients of the
    last step stay untouched. A tensor-parallel gradient (a DTensor) takes the values instead."""
    if type(param.grad) is torch.Tensor:
        param.grad = averaged
    else:
        _local(param.grad).copy_(averaged)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel tensor's own shard (a DTensor's local tensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def buckets(params: list[torch.Tensor], bucket_bytes: int,
            first_bytes: int | None = None) -> list[list[torch.Tensor]]:
    """``params`` in order, cut where the dtype changes or a bucket would pass ``bucket_bytes``
    (the first bucket: ``first_bytes``, when given)."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = _local(p).numel() * p.element_size()
        cap = first_bytes if first_bytes is not None and not buckets else bucket_bytes
        if current and (size + nbytes > cap or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
