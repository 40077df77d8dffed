"""A step under a program: which runtime runs it, and the program step itself on threads.

`run_step` is where a step begins on threads: `guards` decides from the step's key, the step runs
on the reference runtime (recording) or as a program (discovering, or scheduled), and a program
step that diverges is undone and run again on the reference runtime. The timeline says which
ran and why (``timeline.runtime``, ``timeline.reason``). Under ``torchrun`` the same happens in
`processes`, with the decision sent from the first stage's rank.

On threads every stage runs its list on a thread of its own (stage 0 on the caller's), with
transfers passed by reference between them (`executor.ThreadWire`). The file holds the step on
both runtimes (750 lines): `ThreadProgramStep` and `ProcessProgramStep` make the same decisions
in the same order, and side by side a change to one is seen to need the other.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from smpart.errors import PipelineError, SmpartError
from smpart.runtime.ambient import Ambient, capture, compute_thread
from smpart.runtime.program import routes, templates
from smpart.runtime.program.actions import Program, RankShape, build
from smpart.runtime.program.executor import Aborted, ProcessWire, RankReport, RankRun, ThreadWire
from smpart.runtime.program.guards import Decision, ModelPrograms, Snapshot, step_key
from smpart.runtime.program.messages import PROGRAM, BeginProgram, ProgramAbort, ProgramReport
from smpart.runtime.program.one_thread import OneThread
from smpart.runtime.program.templates import Diverged
from smpart.runtime.timeline import Timeline
from smpart.runtime.wire.messages import MAIN


@dataclass
class RankContext:
    """What a rank's program needs to know of its model and place."""

    me: int
    size: int
    stage: int
    device: torch.device
    owners: dict[int, int]
    whole: dict[tuple[int, str], int]
    templates: dict[tuple, Any]
    process_rank: int | None = None
    varies: set = frozenset()  # type: ignore[assignment]
    meta_cache: dict = None  # type: ignore[assignment]
    kept_placeholders: dict = None  # type: ignore[assignment]
    recomputed: dict = None  # type: ignore[assignment]

    @classmethod
    def of(cls, programs: ModelPrograms, me: int, stage: int, device: torch.device,
           process_rank: int | None = None) -> RankContext:
        return cls(me, programs.size, stage, device, programs.owners, programs.whole, programs.templates,
                   process_rank, programs.varies, programs.meta_cache,
                   programs.kept_placeholders.setdefault(me, {}), programs.recomputed)


def programs_of(model: Any) -> ModelPrograms | None:
    return getattr(model, "_programs", None)


def placed(model: Any, partition: Any, recomputed: Collection[str] = ()) -> ModelPrograms:
    """A model was placed: its program state starts empty, its whole modules are known, and the
    ``recomputed`` ones (`placement.place.recomputed_modules`)."""
    programs = ModelPrograms(model, partition, recomputed=recomputed)
    model._programs = programs
    templates.note_placed(programs.whole)
    return programs


# ==================================================================== threads
def run_step(
    runtime: Any,
    model: Any,
    fn: Callable,
    pieces: list[tuple[tuple, dict]],
    reference: Callable[[], tuple[list[Any], Timeline]],
) -> tuple[list[Any], Timeline]:
    """One step on threads: the program if it may, else ``reference()`` (the reference runtime)."""
    programs = programs_of(model) if model._runtime is runtime else None
    ambient = capture()
    config = runtime.config
    if programs is None:
        results, timeline, recorded = _reference(reference, "the first step places the model (recording)",
                                                 record=config.step_programs)
        programs = programs_of(model) if model._runtime is runtime else None
        if programs is not None:
            programs.learn_templates(step_key(fn, pieces, runtime.config, ambient, model), recorded)
        return results, timeline
    key = step_key(fn, pieces, runtime.config, ambient, model)
    decision = programs.decide(key, runtime.config.step_programs)
    if decision.reference:
        results, timeline, recorded = _reference(reference, programs.reason_for(key) or decision.reason,
                                                 record=decision.record)
        if decision.record:
            programs.learn_templates(key, recorded)
        return results, timeline
    snapshot = Snapshot(programs)
    try:
        results, timeline, reports = ThreadProgramStep(
            runtime, model, programs, decision, fn, pieces, ambient
        ).execute()
    except (Diverged, Aborted) as err:
        if isinstance(err, Aborted) and not err.diverged:
            raise
        snapshot.restore()
        why = str(err)
        again = _record_again(programs, key, decision, err)
        results, timeline, recorded = _reference(reference, f"the program diverged: {why}")
        if again:
            programs.learn_templates(key, recorded)
        return results, timeline
    if decision.discover:
        programs.mutable_buffers = snapshot.changed_buffers()
        _build(programs, key, reports, runtime.config, data_parallel=False)
    return results, timeline


#: What a program step that gave up means for its kind of step: run it on the reference runtime
#: and record again (a program may follow), or never try a program for it again.
RERECORD, NEVER = 1, 2


def divergence_code(error: BaseException | None, decision: Decision) -> int:
    """0: no divergence; `RERECORD` or `NEVER` (see `_record_again`)."""
    if not (isinstance(error, Diverged) or (isinstance(error, Aborted) and error.diverged)):
        return 0
    if decision.discover and not getattr(error, "rerecord", False):
        return NEVER
    return RERECORD


def _record_again(programs: ModelPrograms, key: Any, decision: Decision, err: BaseException) -> bool:
    """Note a program step that gave up; whether the reference step that follows records anew."""
    why = str(err)
    if decision.discover and not getattr(err, "rerecord", False):
        programs.cannot(key, why)
        return False
    programs.diverged(key, why)
    return True


def _reference(
    reference: Callable[[], tuple[list[Any], Timeline]], reason: str, record: bool = True
) -> tuple[list[Any], Timeline, dict[tuple, Any]]:
    """The step on the reference runtime, recording the templates of its calls (``record``)."""
    if not record:
        results, timeline = reference()
        timeline.runtime, timeline.reason = "reference", reason
        return results, timeline, {}
    recorder = templates.Recorder()
    templates.start_recording(recorder)
    try:
        results, timeline = reference()
    finally:
        templates.start_recording(None)
    timeline.runtime = "reference"
    timeline.reason = reason
    return results, timeline, recorder.recorded()


def _build(
    programs: ModelPrograms, key: Any, reports: list[RankReport], config: Any, data_parallel: bool
) -> None:
    """Turn a discovery step's reports into the scheduled program for ``key``."""
    try:
        shapes, events = shapes_of(reports)
        finishers = frozenset(report.rank for report in reports if report.provided)
        programs.programs[key] = programs.last = build(
            config.schedule, shapes, events, len(reports[0].specs), config.active_microbatches, data_parallel,
            finishers,
        )
    except (Diverged, SmpartError) as err:
        programs.cannot(key, f"no program for this step: {err}")


def shapes_of(reports: list[RankReport]) -> tuple[list[RankShape], list[list[tuple]]]:
    """Each rank's shape of one micro-batch, checking every micro-batch did the same."""
    shapes, events = [], []
    for report in reports:
        mbs = sorted(report.events)
        first = mbs[0]
        for mb in mbs[1:]:
            if (
                report.events[mb] != report.events[first]
                or report.forward[mb] != report.forward[first]
                or report.backward.get(mb) != report.backward.get(first)
            ):
                raise Diverged(
                    f"micro-batch {mb} did other transfers than micro-batch {first} on rank "
                    f"{report.rank} (routing that depends on the data, across ranks)"
                )
        shapes.append(RankShape(report.forward[first], report.backward.get(first, [((), ())])))
        events.append(report.events[first])
    return shapes, events


class ThreadProgramStep:
    """A program step on threads: every stage's `RankRun` at once, each on a thread of its own
    (stage 0 on this one) or all on this thread (`one_thread`, ``Config.stage_threads``)."""

    def __init__(
        self,
        runtime: Any,
        model: Any,
        programs: ModelPrograms,
        decision: Decision,
        fn: Callable,
        pieces: list[tuple[tuple, dict]],
        ambient: Ambient,
    ) -> None:
        self.runtime = runtime
        self.model = model
        self.programs = programs
        self.program: Program | None = decision.program
        self.fn = fn
        self.pieces = pieces
        self.ambient = ambient
        self.size = programs.size
        self.config = runtime.config
        self.step = next(runtime.steps)

    def execute(self) -> tuple[list[Any], Timeline, list[RankReport]]:
        config = self.config
        wire = ThreadWire(self.size, config.timeout_s)
        scale = 1.0 / len(self.pieces) if config.average_grads_across_microbatches else 1.0
        runs = []
        for stage in range(self.size):
            context = RankContext.of(self.programs, stage, stage, self.runtime.devices[stage])
            runs.append(
                RankRun(
                    context,
                    self.step,
                    self.program,
                    self.fn,
                    lambda mb, run: self.pieces[mb],
                    wire.at(stage),
                    self.ambient,
                    scale,
                    len(self.pieces),
                )
            )
        start = time.time()
        done: queue.SimpleQueue = queue.SimpleQueue()
        if config.stage_threads == "one":
            OneThread(wire).run([lambda run=run: _run_reporting(run, wire, done) for run in runs])
        else:
            pool = program_threads(self.runtime, self.size)
            for stage in range(1, self.size):
                pool[stage - 1].submit(lambda run=runs[stage]: _run_reporting(run, wire, done))
            _run_reporting(runs[0], wire, done)
        reports: list[RankReport | None] = [None] * self.size
        errors = []
        deadline = time.monotonic() + config.timeout_s + 5
        for _ in range(self.size):
            left = max(0.0, deadline - time.monotonic())
            try:
                report, error = done.get(timeout=left)
            except queue.Empty:
                raise SmpartError(f"a stage's program did not end within {config.timeout_s} s") from None
            reports[report.rank] = report
            if error is not None:
                errors.append(error)
        if errors:
            raise _first_error(errors)
        duration = time.time() - start
        results = assemble(reports, len(self.pieces))  # type: ignore[arg-type]
        timeline = Timeline.from_spans(
            {r.rank: r.spans for r in reports},
            start,
            duration,
            self.size,  # type: ignore[union-attr]
            self.program.schedule if self.program is not None else config.schedule,
            len(self.pieces),
        )
        timeline.started = {r.rank: list(r.started) for r in reports}  # type: ignore[union-attr]
        timeline.bytes_sent = dict(wire.sent_bytes)
        timeline.messages = dict(wire.messages)
        timeline.runtime = "program"
        timeline.reason = "" if self.program is not None else "discovering: this step records its program"
        timeline.program = self.program
        return results, timeline, reports  # type: ignore[return-value]


def _run_reporting(run: RankRun, wire: ThreadWire, done: queue.SimpleQueue) -> None:
    try:
        report = run.run()
        done.put((report, None))
    except BaseException as err:  # noqa: BLE001 - every stage's failure reaches the step
        wire.fail(
            Aborted(f"stage {run.me} failed: {type(err).__name__}: {err}", diverged=isinstance(err, Diverged))
        )
        done.put((run.report, err))


def _first_error(errors: list[BaseException]) -> BaseException:
    """The error to raise: a divergence first (the step runs again), else the first real failure
    (not another rank giving up because of it)."""
    for error in errors:
        if isinstance(error, Diverged):
            return error
    real = [e for e in errors if not isinstance(e, Aborted)]
    return real[0] if real else errors[0]


def assemble(reports: list[RankReport], microbatches: int) -> list[Any]:
    """Each micro-batch's result, its tensors taken from the ranks that hold them."""
    import torch.utils._pytree as pytree

    provided: dict[tuple[int, int], torch.Tensor] = {}
    for report in reports:
        provided.update(report.provided)
    results = []
    for mb in range(microbatches):  # the structure from a rank that ran the body to its end
        spec, constants, tensors = next(r.specs[mb] for r in reports if r.specs.get(mb) is not None)
        leaves = [provided[(mb, i)] if i in tensors else constants[i] for i in range(len(constants))]
        results.append(pytree.tree_unflatten(leaves, spec))
    return results


# ==================================================================== the threads stages run on
class ProgramThread:
    """A stage's thread for program steps (stages 1..p-1; stage 0 runs on the caller's)."""

    def __init__(self, stage: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = compute_thread(self._loop, f"smpart-program-stage{stage}")
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()
            del job  # a step's state goes as it ends, not when the next step comes

    def stop(self, timeout_s: float) -> list[str]:
        self.jobs.put(None)
        self.thread.join(timeout_s)
        return [self.thread.name] if self.thread.is_alive() else []


def program_threads(runtime: Any, size: int) -> list[ProgramThread]:
    pool = runtime.program_threads
    with _pool_lock:
        while len(pool) < size - 1:
            pool.append(ProgramThread(len(pool) + 1))
    return pool


_pool_lock = threading.Lock()


# ==================================================================== processes
def drive(
    runtime: Any,
    step: int,
    fn: Callable,
    pieces: list[tuple[tuple, dict]],
    model: Any,
    reference: Callable[[], tuple[list[Any], Timeline]],
    check: Callable[[int], Callable[[], int]],
) -> tuple[list[Any], Timeline]:
    """One step on the first stage's rank under ``torchrun``: decide, tell the other ranks, run.
    ``check(code)``, called once in every step, posts the data-parallel replicas' check of the
    batches and returns what waits for its answer: the largest ``code`` of the replicas (1: the
    reference runtime). They run a step alike, on one runtime, so their averages pair up (a
    replica whose first step failed places later). A program step of one stage and one
    tensor-parallel rank waits for it only before its first backward (no collective of the
    replicas comes earlier): until then the forward hides the round trip, and should another
    replica run the step on the reference runtime, this one gives its forward up and does too."""
    programs = programs_of(model) if model._runtime is runtime else None
    ambient = capture()
    config = runtime.config
    if programs is None:
        check(1)()
        results, timeline, recorded = _reference(reference, "the first step places the model (recording)",
                                                 record=config.step_programs)
        programs = programs_of(model) if model._runtime is runtime else None
        if programs is not None:
            programs.learn_templates(
                step_key(fn, pieces, config, ambient, model), _with_reports(recorded, timeline)
            )
        return results, timeline
    try:
        key = step_key(fn, pieces, config, ambient, model)
        decision = programs.decide(key, config.step_programs)
    except BaseException:
        check(1)()  # the replicas' collectives still pair; the step fails on every replica
        raise
    agreed = check(int(decision.reference))
    deferred = not decision.reference and programs.size == 1 and runtime.layout.tp == 1
    if not deferred and agreed() and not decision.reference:
        decision = Decision(key, "another data-parallel replica runs this step on the reference runtime")
    if decision.reference:
        results, timeline, recorded = _reference(reference, programs.reason_for(key) or decision.reason,
                                                 record=decision.record)
        if decision.record:
            programs.learn_templates(key, _with_reports(recorded, timeline))
        return results, timeline
    snapshot = Snapshot(programs)
    attempt = ProcessProgramStep(runtime, model, programs, decision, fn, step, ambient,
                                 before_backward=_unless_replicas_differ(agreed) if deferred else None)
    error: BaseException | None = None
    try:
        results, timeline, reports = attempt.lead(pieces)
    except BaseException as err:  # noqa: BLE001 - settled with the other replicas first
        error = err
    if deferred and _replicas_differ(agreed, snapshot):  # another replica runs it on the reference runtime
        return _reference(reference, "another data-parallel replica runs this step on the reference runtime",
                          record=False)[:2]
    code = attempt.settle(error)
    if code:  # this replica's program, or another's, diverged: run the step again
        snapshot.restore()
        why = str(error) if error is not None else "another data-parallel replica's program diverged"
        # every replica keeps the same account of its programs
        again = _record_again(programs, key, decision, Diverged(why, rerecord=code == RERECORD))
        results, timeline, recorded = _reference(reference, f"the program diverged: {why}")
        if again:
            programs.learn_templates(key, _with_reports(recorded, timeline))
        return results, timeline
    if error is not None:
        raise error
    if decision.discover:
        programs.mutable_buffers = snapshot.changed_buffers()
        _build(programs, key, reports, config, data_parallel=runtime.layout.dp > 1)
    return results, timeline


class _ReplicaRunsReference(Exception):  # noqa: N818 - not an error: the step runs again
    """Another data-parallel replica runs this step on the reference runtime: so does this one."""


def _replicas_differ(agreed: Callable[[], int], snapshot: Snapshot) -> bool:
    """After a deferred program step's forward: whether another replica runs the step on the
    reference runtime; either way of leaving it (that, or the replicas' check failing: batches of
    other shapes, a replica that could not split its batch) puts back what the forward changed."""
    try:
        differ = bool(agreed())
    except BaseException:
        snapshot.restore()
        raise
    if differ:
        snapshot.restore()
    return differ


def _unless_replicas_differ(agreed: Callable[[], int]) -> Callable[[], None]:
    """What a deferred program step runs before its first backward: the replicas' check."""
    def before_backward() -> None:
        if agreed():
            raise _ReplicaRunsReference("another data-parallel replica runs this step on the reference "
                                        "runtime")
    return before_backward


def _with_reports(recorded: dict[tuple, Any], timeline: Timeline) -> dict[tuple, Any]:
    """This rank's templates and those the other ranks' stages recorded (their `StageReport`\\ s)."""
    merged = dict(recorded)
    for theirs in getattr(timeline, "templates", None) or ():
        for call, template in theirs.items():
            known = merged.get(call)
            merged[call] = template if known is None or known == template else templates.UNPREDICTABLE
    return merged


def input_templates(pieces: list[tuple[tuple, dict]]) -> list[Any]:
    """Each micro-batch's inputs as a template, for the other ranks: tensors by shape and dtype (the
    ranks get placeholders for them), plain values as they are. Any other object (the model, a
    loss function, a config) each rank takes from its own call of the step function."""
    return [templates.OutputTemplate.of(piece) for piece in pieces]


class ProcessProgramStep:
    """A program step under ``torchrun``: this rank's `RankRun` on its main thread, the others told
    by the first stage's rank (`lead`) and answering it (`follow`)."""

    def __init__(
        self,
        runtime: Any,
        model: Any,
        programs: ModelPrograms,
        decision: Decision,
        fn: Callable,
        step: int,
        ambient: Ambient,
        before_backward: Callable[[], None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.model = model
        self.programs = programs
        self.decision = decision
        self.before_backward = before_backward
        self.program: Program | None = decision.program
        self.fn = fn
        self.step = step
        self.ambient = ambient
        self.size = programs.size
        self.me = runtime.stage

    # ================================================================ the first stage's rank
    def lead(
        self, pieces: list[tuple[tuple, dict]]
    ) -> tuple[list[Any], Timeline, list[RankReport]]:
        runtime, step = self.runtime, self.step
        scale = 1.0 / len(pieces) if runtime.config.average_grads_across_microbatches else 1.0
        programs = self.programs
        news = programs.sent_to_ranks != len(programs.templates) or self.decision.discover
        key = self.decision.key
        new_program = self.program is not None and programs.sent_programs.get(key) is not self.program
        direct = self.program is not None and key in programs.direct and self._channel() is not None
        inputs = input_templates(pieces)
        reports_at = (runtime.rank, ("program-reports", step))
        begin = BeginProgram(
            step,
            key,
            self.decision.discover,
            inputs if inputs != programs.sent_inputs.get(key) else None,
            dict(programs.templates) if news else None,
            self.program if new_program else None,
            scale,
            self.ambient,
            reports_at,
            runtime.training_modes(),
            direct,
        )
        programs.sent_to_ranks = len(programs.templates)
        programs.sent_inputs[key] = inputs
        if self.program is not None:
            programs.sent_programs[key] = self.program
        runtime.transport.open(reports_at)
        start = time.time()
        try:
            runtime.transport.send_all(runtime.rank, [(runtime.place_of_stage(stage), MAIN)
                                                      for stage in range(1, self.size)], begin)
            first_rank = 1 << 0

            def real_inputs(mb: int, run: Any) -> tuple[tuple, dict]:
                run.mark(pieces[mb], first_rank)
                return pieces[mb]

            report, error, wire = self._run(real_inputs, scale, len(pieces), direct)
            reports: list[RankReport] = [report]
            deadline = time.monotonic() + runtime.config.timeout_s
            theirs: list[ProgramReport] = []
            while len(theirs) < self.size - 1:
                message = runtime.transport.receive(reports_at, POLL)
                if isinstance(message, ProgramReport) and message.step == step:
                    theirs.append(message)
                elif time.monotonic() > deadline:
                    raise SmpartError(
                        f"the program step {step} did not end on every rank within "
                        f"{runtime.config.timeout_s} s"
                    )
        finally:
            runtime.transport.close(reports_at)
        errors = [error] if error is not None else []
        errors += [m.report.error for m in theirs if m.report.error is not None]
        if errors:
            programs.direct.discard(key)
            raise _first_error(errors)
        if wire.notes is not None:  # a framed run: the next goes direct where every pair agrees
            agreed = routes.agree([wire.notes.digests()] + [m.routes for m in theirs])
            (programs.direct.add if agreed else programs.direct.discard)(key)
        reports += [m.report for m in sorted(theirs, key=lambda m: m.pipeline_rank)]
        results = assemble(reports, len(pieces))
        duration = time.time() - start
        timeline = Timeline.from_spans(
            {r.rank: r.spans for r in reports},
            start,
            duration,
            self.size,
            self.program.schedule if self.program is not None else runtime.config.schedule,
            len(pieces),
        )
        timeline.started = {r.rank: list(r.started) for r in reports}
        for source, (sent, messages) in [(0, (wire.sent_bytes, wire.messages))] + [
            (m.pipeline_rank, (m.bytes_sent, m.messages)) for m in theirs
        ]:
            for to, size in sent.items():
                timeline.bytes_sent[(source, to)] = size
            for to, count in messages.items():
                timeline.messages[(source, to)] = count
        timeline.runtime = "program"
        timeline.reason = "" if self.program is not None else "discovering: this step records its program"
        timeline.transfers = "direct" if direct else "framed"
        timeline.program = self.program
        return results, timeline, reports

    # ================================================================ every other rank
    def follow(self, begin: Any, own: list[tuple[tuple, dict]]) -> None:
        """Run this rank's part of the program ``begin`` announced, and report to its sender;
        ``own``: this rank's own call's micro-batches (its objects that are neither tensors nor
        plain values stand in for the first rank's)."""
        runtime = self.runtime
        first_rank = 1 << 0
        device = runtime.setup.device

        def stand_ins(mb: int, run: Any) -> tuple[tuple, dict]:
            args, kwargs = begin.inputs[mb].placeholders(first_rank, 0, run, device, own=own[mb])
            return tuple(args), kwargs

        snapshot = Snapshot(self.programs)
        report, error, wire = self._run(stand_ins, begin.grad_scale, len(begin.inputs), begin.direct)
        if self.decision.discover and error is None:
            self.programs.mutable_buffers = snapshot.changed_buffers()
        if error is not None:
            report.error = _shippable(error, runtime.rank)
        runtime.transport.send(
            runtime.rank,
            begin.reply_to,
            ProgramReport(
                self.step, runtime.rank, self.me, report, dict(wire.sent_bytes), dict(wire.messages),
                routes=wire.notes.digests() if wire.notes is not None else None,
            ),
        )
        if self.settle(error):  # the step runs again on the reference runtime, the driver's rank leading
            snapshot.restore()

    # ================================================================ both
    def settle(self, error: BaseException | None) -> int:
        """After this rank's part (and, on the first stage's rank, the reports): whether the step
        must run again on the reference runtime, every replica alike. Under data parallelism the
        replicas' gradient averages end here (`GradientReducer.finish`): a replica whose program
        failed makes every replica keep its own gradients, and one more small all-reduce says
        whether a program diverged somewhere (then every replica runs the step again) or failed."""
        runtime = self.runtime
        code = divergence_code(error, self.decision)
        if runtime.layout.dp == 1:
            return code
        failing = runtime.finish_gradients(failed=error is not None)
        if failing is None:
            return 0
        code = runtime.most_on_replicas(code)
        if code:
            runtime.begin_again()
            return code
        if error is None and runtime.is_driver:  # the others hear it in the step's `StepResult`
            raise runtime.replica_failed(failing)
        return 0

    def _run(
        self, inputs: Callable, scale: float, microbatches: int, direct: bool = False
    ) -> tuple[RankReport, BaseException | None, Any]:
        runtime, key = self.runtime, self.decision.key
        context = RankContext.of(self.programs, self.me, runtime.stage, runtime.setup.device, runtime.rank)
        wire = self._wire(direct)
        run = RankRun(context, self.step, self.program, self.fn, inputs, wire, self.ambient, scale,
                      microbatches, before_backward=self.before_backward)
        try:
            if direct and not isinstance(wire, routes.DirectWire):
                raise SmpartError(f"rank {runtime.rank} was told to send step {self.step}'s transfers "
                                  "direct, but it noted no route for them: every rank runs the same steps")
            report = run.run()
            wire.settle(None)
        except BaseException as err:  # noqa: BLE001 - every rank of the step hears of it
            if not isinstance(err, Aborted):
                self._abort_others(err)
            with contextlib.suppress(Exception):  # the step's own error is what matters
                wire.settle(err)
            self.programs.routes.pop(key, None)
            return run.report, err, wire
        if wire.notes is not None:
            self.programs.routes[key] = wire.notes.route()
        elif self.program is None:  # a discovery: the program that follows may cross otherwise
            self.programs.routes.pop(key, None)
            self.programs.direct.discard(key)
        return report, None, wire

    def _channel(self) -> Any:
        """The rank's `DirectChannel`, where direct transfers are on and it works; else None."""
        channel = self.runtime.direct
        usable = channel is not None and channel.usable and self.runtime.config.direct_transfers
        return channel if usable else None

    def _wire(self, direct: bool) -> ProcessWire:
        runtime = self.runtime
        address = (runtime.rank, PROGRAM)
        args = (runtime.transport, runtime.rank, runtime.place_of_stage, self.step, runtime.config.timeout_s,
                lambda t: runtime.transport.receive(address, t), PROGRAM)
        route, channel = self.programs.routes.get(self.decision.key), self._channel()
        if direct and route is not None and channel is not None:
            return routes.DirectWire(*args, me=self.me, route=route, channel=channel)
        notes = routes.Notes(self.me) if self.program is not None and channel is not None else None
        return ProcessWire(*args, me=self.me, notes=notes)

    def _abort_others(self, err: BaseException) -> None:
        runtime = self.runtime
        why = f"pipeline rank {self.me} (rank {runtime.rank}) gave up the step: {type(err).__name__}: {err}"
        abort = ProgramAbort(self.step, why, isinstance(err, Diverged))
        for rank in runtime.step_ranks():
            if rank != runtime.rank:
                with contextlib.suppress(SmpartError):
                    runtime.transport.send(runtime.rank, (rank, PROGRAM), abort)


def follow(runtime: Any, begin: Any, fn: Callable, model: Any, pieces: list[tuple[tuple, dict]]) -> None:
    """A rank other than the first stage's runs its part of the program step ``begin`` announces."""
    programs = programs_of(model)
    if programs is None:
        raise SmpartError(f"rank {runtime.rank} was told to run a step program for a model it has not placed")
    if begin.templates is not None:
        programs.templates.clear()
        programs.learn_templates(None, begin.templates)
        programs.recorded.discard(None)
        for call in begin.templates:
            if call[0] == "demoted":
                templates.WHOLE.pop(call[1:], None)
    program = None
    if not begin.discover:
        if begin.program is not None:
            programs.programs[begin.key] = begin.program
        program = programs.last = programs.programs.get(begin.key)
    decision = Decision(begin.key, "", discover=begin.discover, program=program)
    if begin.inputs is None:  # as in the last step of this key (`ProcessProgramStep.lead`)
        begin.inputs = programs.inputs.get(begin.key)
        if begin.inputs is None:
            raise SmpartError(f"rank {runtime.rank} was told to reuse the inputs of a step program it never "
                              "ran: every rank must place the same models and call their steps alike")
    programs.inputs[begin.key] = begin.inputs
    if len(pieces) != len(begin.inputs):
        raise SmpartError(f"rank {runtime.rank} split its step's arguments into {len(pieces)} micro-batches, "
                          f"the first stage's rank into {len(begin.inputs)}: every rank calls the step alike")
    runtime.take_training_modes(begin)  # `model.eval()` on the first rank alone holds here too
    attempt = ProcessProgramStep(runtime, model, programs, decision, fn, begin.step, begin.ambient)
    attempt.follow(begin, pieces)


def _shippable(error: BaseException, rank: int) -> BaseException:
    if isinstance(error, SmpartError):
        return error
    return PipelineError(f"the step failed on rank {rank}: {type(error).__name__}: {error}", rank=rank)


POLL = 0.05
