"""One process per stage: the runtime under ``torchrun``.

Every rank runs the user's script (SPMD). `ProcessRuntime` hosts this rank's stage server; the
rank of the first stage also runs the step body (drivers and coordinator, as on threads). The
other ranks, inside the same ``train_step(...)`` call, wait on their ``MAIN`` address while
their stage server serves requests in the background; the driver's rank ends each step by
sending them a `StepResult`, so every rank's call returns the same `StepOutput` (or raises the
same error).

Placement happens once, on the driver's rank, at the model's first call: it traces and
partitions (on the meta device where it can), sends the `Partition` to every rank in a
`PlaceModel` message and waits until all have placed it. Each rank keeps its own stage's
modules and releases the others' tensors to the meta device.

The transport is a `smpart.runtime.wire.routed.RoutedTransport`: the runtime's
``(place, endpoint)`` addresses over the rank-to-rank `smpart.runtime.wire.processes.ProcessTransport`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from smpart.config import Config
from smpart.distributed.attendance import Attendance
from smpart.distributed.launch import Setup, release_groups, setup
from smpart.errors import PipelineError, SmpartError
from smpart.runtime.model import DistributedModel, model_by_id
from smpart.runtime.optimizer import optimizer_by_id, optimizers_over
from smpart.runtime.placement.place import (
    module_stages,
    place_on_rank,
    recomputed_modules,
    remember_replacement,
    unplace,
)
from smpart.runtime.processes import torch_clip
from smpart.runtime.processes.data_parallel import CHECK, GradientReducer, ordinal, stage_parameters
from smpart.runtime.processes.replicas import (
    all_gather_objects,
    check_same_model,
    initialisation_seed,
    make_replicas_agree,
    make_whole,
    share_buffers,
    share_random_state,
)
from smpart.runtime.processes.shares import check_batch_shares, replica_weight
from smpart.runtime.processes.state_exchange import StateExchange
from smpart.runtime.program import steps as program_steps
from smpart.runtime.program import templates
from smpart.runtime.program.messages import PROGRAM, BeginProgram
from smpart.runtime.reference.stage import StageServer
from smpart.runtime.reference.step_run import StepRun
from smpart.runtime.reference.workers import POLL_S
from smpart.runtime.runtime import Runtime, partition_for
from smpart.runtime.wire.direct import DirectChannel
from smpart.runtime.wire.messages import (
    MAIN,
    Address,
    Placed,
    PlaceModel,
    StateRequest,
    StepResult,
)
from smpart.runtime.wire.processes import ProcessTransport
from smpart.runtime.wire.routed import RoutedTransport
from smpart.tensor_parallel import apply_tensor_parallel, plan_tensor_parallel, splittable_fraction

#: The code a replica whose batch could not be split posts in the replicas' check (`refuse_step`);
#: the others post 0 (a program step) or 1 (the reference runtime).
REFUSED = 2

if TYPE_CHECKING:
    from smpart.runtime.model import DistributedModel

_placements = itertools.count()


class ProcessRuntime(Runtime):
    """This rank's stage server, and the step body when this rank runs the first stage."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.setup: Setup = setup(config)
        layout = self.setup.layout
        self.rank = self.setup.rank
        self.layout = layout
        self.num_stages = layout.pp
        self.stage, self.dp_rank, self.tp_rank = layout.coordinates(self.rank)
        self.driver_place = self.place_of_stage(0)
        self.is_driver = self.rank == self.driver_place
        # The rank's device, as NCCL receives onto it: gloo brings CUDA tensors to the CPU.
        self.driver_device = self.setup.device
        replica = [self.place_of_stage(s) for s in range(self.num_stages)]
        # The tensor-parallel ranks of this stage follow the first one's order of work (`scheduler`).
        shards = [layout.rank_of(self.stage, self.dp_rank, t) for t in range(layout.tp)]
        peers = sorted({*replica, *shards} - {self.rank})
        self.transport: RoutedTransport = RoutedTransport(
            lambda deliver: ProcessTransport(self.rank, self.setup.world_size, self.setup.transport_group,
                                             data_groups=self.setup.data_groups, timeout_s=config.timeout_s,
                                             peers=peers, deliver=deliver),
            self.rank)
        self.transport.open((self.rank, PROGRAM))  # a program step's transfers to this rank
        #: A replayed program step's tensors, unframed (`smpart.runtime.program.routes`); None under NCCL.
        direct_group = self.setup.direct_group
        self.direct = (DirectChannel(direct_group, self.rank, config.timeout_s, self.transport.inner)
                       if direct_group is not None else None)
        self.server = StageServer(self.stage, self.num_stages, self.rank, self.setup.device, self.transport,
                                  self.place_of_stage, rank=self.rank,
                                  tp_followers=shards[1:] if self.tp_rank == 0 else [],
                                  tp_follower=self.tp_rank != 0)
        if self.is_driver:
            self.server.armed = math.inf  # its main thread is the step's coordinator
        self.servers = [self.server]
        #: Every rank's gloo group: `smpart.barrier`, and `DistributedModel.state_dict` under tensor
        #: parallelism (else the state exchange, `gather_state`).
        self.state_group = self.setup.collective_group
        #: Messages for the step function's wait that a wait for state-dict replies took.
        self._deferred: list[Any] = []
        self.states = StateExchange(self.rank, self.transport, config.timeout_s, self._deferred,
                                    self._state_part)
        #: Whether `shutdown` answers the peers' state requests until they leave too (`_await_peers_leaving`).
        self.answer_at_shutdown = True
        self._reducer: GradientReducer | None = None
        #: Whether this step's gradients were averaged already (a program step's `finish_gradients`).
        self._reduced = False
        self._reducer_lock = threading.Lock()
        #: Where this rank is in a step's collectives, for the others' errors (`attendance`).
        self.attendance = Attendance(self.rank, self._describe_rank)
        if layout.dp > 1:
            self.server.on_gradients_final = self._start_gradient_sync
        if not self.is_driver:
            self.server.on_begin = self.take_training_modes
        self.steps_taken = 0  # the next step's number; what `Leaving` tells the peers
        self.models: dict[int, DistributedModel] = {}
        self.resident_bytes: dict[int, int] = {}
        self._place_lock = threading.Lock()
        self._step_lock = threading.Lock()
        if layout.pp > 1 or layout.tp > 1:  # a rank holds part of the gradient: clip by the whole's norm
            torch_clip.install(self)

    def step_ranks(self) -> list[int]:
        """The ranks that take part in this rank's pipeline steps: every stage and tensor-parallel
        index of its replica."""
        layout = self.layout
        return [layout.rank_of(s, self.dp_rank, t) for s in range(layout.pp) for t in range(layout.tp)]

    def place_of_stage(self, stage: int) -> int:
        """The rank of ``stage`` in this rank's replica, with this rank's tensor-parallel index (each
        tensor-parallel rank talks to its peers: their messages are the same)."""
        return self.layout.rank_of(stage, self.dp_rank, self.tp_rank)

    # ================================================================ steps
    def run_step(self, fn: Callable, pieces: list[tuple[tuple, dict]],
                 model: Any = None, samples: int | None = None,
                 refused: SmpartError | None = None) -> tuple[list[Any], Any]:
        with self.stepping(self._step_lock):
            step = self.steps_taken
            self.transport.step = step
            try:
                self._start_alike(pieces)
                if self.is_driver:
                    self.states.before_step(step)  # its parameters hold still until the step begins
                    return self._drive(step, fn, pieces, model, samples, refused)
                self.states.answer_waiting()  # before the stage may begin the step (`arm`)
                self.states.done_asking(self.driver_place, step)
                return self._follow(step, fn, model, pieces)
            finally:
                self.transport.step = None
                self.steps_taken = step + 1

    def refuse_step(self, fn: Callable, error: SmpartError, model: Any) -> None:
        """This rank's batch could not be split into micro-batches: with data-parallel replicas, the
        step still takes part in what every replica's step does together (the batch check, the
        gradients' end), so that each replica raises (the others name this one's failure) and the
        next step finds them in step; then ``error`` is raised."""
        if self.layout.dp == 1:
            raise error
        self.run_step(fn, [((model,), {})], model, refused=error)

    def _drive(self, step: int, fn: Callable, pieces: list[tuple[tuple, dict]],
               model: Any, samples: int | None, refused: SmpartError | None = None) -> tuple[list[Any], Any]:
        error: BaseException | None = None
        results = timeline = None
        try:
            self._begin_gradient_sync()
            if refused is not None:
                with contextlib.suppress(SmpartError):  # what the others hear; this replica says why
                    self._post_replica_check([], None, REFUSED)()
                raise refused
            results, timeline = program_steps.drive(
                self, step, fn, pieces, model, lambda: StepRun(self, step, fn, pieces).execute(),
                lambda code: self._post_replica_check(pieces, samples, code))
        except BaseException as err:  # noqa: BLE001 - every rank hears of it, then it is raised here
            error = err
        # The program is the other ranks' own already (`BeginProgram`): not sent again every step,
        # only whether one ran (they put theirs in, `_serve_step`).
        shipped = (dataclasses.replace(timeline, program=timeline.program is not None)
                   if timeline is not None else None)
        result = StepResult(step, results, shipped, _shippable(error, self.rank))
        try:
            self.transport.send_all(self.rank, [(self.place_of_stage(stage), MAIN)
                                                 for stage in range(1, self.num_stages)], result)
        except SmpartError:  # a rank is gone (the others heard); the step's own error matters more
            if error is None:
                raise
        self._end_step(error)
        return results, timeline

    def _follow(self, step: int, fn: Callable, model: Any,
                pieces: list[tuple[tuple, dict]]) -> tuple[list[Any], Any]:
        """Serve (in the stage server's threads, or this rank's program on this thread) until the
        driver's rank says the step is over."""
        self._begin_gradient_sync()
        self.server.arm(step)
        timeout_s = self.config.timeout_s
        started = time.monotonic()
        main = (self.rank, MAIN)
        recorder = templates.Recorder() if self.config.step_programs else None
        templates.start_recording(recorder)  # a reference step records what its calls return
        try:
            return self._serve_step(step, fn, model, pieces, main, started, timeout_s, recorder)
        finally:
            templates.start_recording(None)

    def _serve_step(self, step: int, fn: Callable, model: Any, pieces: list, main: Address, started: float,
                    timeout_s: float, recorder: templates.Recorder | None) -> tuple[list[Any], Any]:
        # A step may take longer than timeout_s (a limit on each wait); give up only when neither the
        # driver's rank answered nor this stage heard anything for that long.
        program_begun = False  # a program step begins here without the stage server hearing of it
        while time.monotonic() - max(started, self.server.last_activity) < timeout_s:
            message = self._deferred.pop(0) if self._deferred else self.transport.receive(main, POLL_S)
            if isinstance(message, BeginProgram):
                program_begun = True
                templates.start_recording(None)
                program_steps.follow(self, message, fn, model, pieces)
                templates.start_recording(recorder)  # a step given up runs again on the reference runtime
                started = time.monotonic()
                continue
            if isinstance(message, StateRequest):
                # Until the step begins here (the driver's rank asking before it begins it), this
                # rank's parameters hold still; after, they do once the optimizer has stepped: a
                # rank whose step ended first asks before the driver's `StepResult` reaches this one.
                if self.server.begun < step and not program_begun:
                    self.states.answer(message)
                else:
                    self.states.keep(message)
            elif isinstance(message, PlaceModel):
                self._place_here(message)
            elif isinstance(message, StepResult):
                if message.step != step:
                    raise SmpartError(f"rank {self.rank} is at step {step} but the driver's rank finished "
                                      f"step {message.step}: every rank must call the step function the same "
                                      "number of times")
                self._end_step(message.error)
                if message.timeline is not None:
                    ran = message.timeline.program is True and program_steps.programs_of(model)
                    message.timeline.program = ran.last if ran else None
                return message.results, message.timeline
        if self._reducer is not None and self._reducer.failure is not None:
            raise self._reducer.failure  # what this stage waited for: a replica that never came
        raise PipelineError(f"rank {self.rank} heard nothing for {timeout_s} s while waiting for step {step} "
                            f"to end: its pipeline's first stage, rank {self.driver_place}, did not say it "
                            "ended (a hang there, or on a rank it waits for)", rank=self.rank)

    # ================================================================ the state dict
    def gather_state(self, kind: str, target: int, own: dict[Any, Any]) -> list[dict[Any, Any]]:
        """The parts of a state dict held by the stages of this rank's replica, in stage order
        (`state_exchange`): ``kind`` "model" or "optimizer", of the one numbered ``target``."""
        places = [self.place_of_stage(stage) for stage in range(self.num_stages)]
        return self.states.gather(places, kind, target, own)

    def _state_part(self, kind: str, target: int) -> dict[Any, Any]:
        """This rank's part of the state dict of model or optimizer #``target``."""
        if kind == "model":
            model = model_by_id(target)
            if model is None or model._runtime is not self:
                raise SmpartError(f"rank {self.rank} has not placed DistributedModel #{target}: every rank "
                                  "must create the same DistributedModels in the same order")
            return model.local_state_dict()  # the exchange copies it to the CPU once
        optimizer = optimizer_by_id(target)
        if optimizer is None:
            raise SmpartError(f"rank {self.rank} has no DistributedOptimizer #{target}: every rank must "
                              "create the same DistributedOptimizers in the same order")
        return optimizer.local_state_dict()

    # ================================================================ train / eval
    def training_modes(self) -> dict[int, bytes]:
        """The ``training`` flag of every module of every placed model, as the step body sees them."""
        return {model_id: bytes(m.training for m in _modules(model))
                for model_id, model in self.models.items()}

    def take_training_modes(self, begin: Any) -> None:
        """A step begins: this rank's modules take the driver's rank's training modes, so that
        ``model.eval()`` called there alone (inside ``if smpart.rank() == 0:``) holds for every stage."""
        for model_id, modes in (begin.modes or {}).items():
            model = self.models.get(model_id)
            modules = _modules(model) if model is not None else []
            if len(modules) == len(modes):
                for module, training in zip(modules, modes, strict=True):
                    if module.training != training:  # nn.Module's __setattr__ is slow: every step
                        module.training = bool(training)

    # ================================================================ data parallelism
    def _begin_gradient_sync(self) -> None:
        if self._reducer is not None:
            self._reducer.begin_step(self.steps_taken)

    def _start_gradient_sync(self, step: int) -> None:
        """The stage's gradients are final (every micro-batch released here): start what is left,
        on a thread of its own (this is a message handler). A replica that never comes fails it
        within timeout_s; the reducer keeps the error for `_end_step`, which raises it."""
        self._current_reducer().flush_soon()

    def _describe_rank(self, rank: int) -> str:
        stage, replica, shard = self.layout.coordinates(rank)
        where = f"stage {stage}, data-parallel replica {replica}"
        return f"rank {rank} ({where}{f', tensor-parallel rank {shard}' if self.layout.tp > 1 else ''})"

    def _current_reducer(self) -> GradientReducer:
        """The reducer of the parameters this rank holds now (a new one once another model is placed)."""
        params = stage_parameters(model.module for model in self.models.values())
        with self._reducer_lock:  # the dispatcher's flush and the main thread's finish
            if self._reducer is None or [id(p) for p in self._reducer.params] != [id(p) for p in params]:
                if self._reducer is not None:
                    self._reducer.remove()
                weight = replica_weight(self.config.data_parallel_shares, self.dp_rank)
                self._reducer = GradientReducer(params, self.setup.dp_group, self.setup.dp_control_group,
                                                self.layout.dp, replica=self.dp_rank, weight=weight,
                                                step=self.steps_taken, attendance=self.attendance,
                                                timeout_s=self.config.timeout_s)
            return self._reducer

    def finish_gradients(self, failed: bool) -> int | None:
        """A program step's end under data parallelism: average the gradients (`GradientReducer`),
        returning the replica whose step failed, if any; the step's `_end_step` averages no more.
        The replicas agree on what to average and on who failed in one exchange, here: a program's
        buckets start during its backward, as its counts say, so a flush any earlier gains nothing."""
        self._reduced = True
        return self._current_reducer().finish(failed=failed, flush_here=True)

    def most_on_replicas(self, code: int) -> int:
        """The largest ``code`` of the data-parallel replicas (one small all-reduce, at most
        ``timeout_s``: a replica that never comes is named, as of where it was last seen)."""
        value = torch.tensor([code], dtype=torch.int64)
        group = self.setup.dp_control_group
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group, async_op=True)
        mark, _ = self.attendance.last
        self.attendance.wait(work, self.config.timeout_s, mark,
                             f"the replicas' agreement on how step {self.steps_taken + 1} runs",
                             dist.get_process_group_ranks(group))
        return int(value.item())

    def begin_again(self) -> None:
        """A program step given up runs again on the reference runtime: its gradients anew."""
        self._reduced = False
        self._begin_gradient_sync()

    def replica_failed(self, failing: int) -> PipelineError:
        return PipelineError(
            f"the step failed on data-parallel replica {failing} (its ranks raised the error), so it "
            "fails on every replica: no gradient was averaged. Zero the gradients "
            "(optimizer.zero_grad()) and go on with the next step", rank=self.rank)

    def _end_step(self, error: BaseException | None) -> None:
        """Average the gradients over the data-parallel replicas, then raise the step's error if it
        failed. A step fails on every replica when it fails on one (`data_parallel`): the others
        raise here, naming it. A ``KeyboardInterrupt`` and the like skip the collectives."""
        reduced, self._reduced = self._reduced, False
        if reduced:  # a program step averaged them already (`finish_gradients`)
            if error is not None:
                raise error
            return
        if self.layout.dp > 1 and (error is None or isinstance(error, Exception)):
            try:
                failing = self._current_reducer().finish(failed=error is not None)
            except Exception:
                if error is None:
                    raise
                failing = None  # the step's own error says more
            if error is None and failing is not None:
                error = self.replica_failed(failing)
        if error is not None:
            raise error

    def _post_replica_check(self, pieces: list[tuple[tuple, dict]], samples: int | None = None,
                            code: int = 0) -> Callable[[], int]:
        """Data-parallel replicas must feed batches of one size, their gradients are averaged; with
        batch shares, batches in the shares' proportions, alike but for the batch axis. The same
        small all-reduce carries ``code`` (how this replica would run the step), and the function
        returned gives the largest of the replicas' codes, so that they run the step alike, or
        raises if the batches differ. The all-reduce is posted now and waited for once, by that
        function, at most ``timeout_s``: a program step with nothing but data parallelism asks
        only before its first backward, the round trip hidden behind the forward
        (`program.steps.drive`)."""
        if self.layout.dp == 1:
            return lambda: code
        group, phase = self.setup.dp_control_group, ordinal(self.steps_taken, CHECK)
        where = f"the check of the replicas' batches at the start of step {self.steps_taken + 1}"
        self.attendance.arrive(phase, where)
        ranks = dist.get_process_group_ranks(group)

        def wait(work: Any) -> None:
            self.attendance.wait(work, self.config.timeout_s, phase, where, ranks)

        shares = self.config.data_parallel_shares
        if shares:
            check_batch_shares(samples, shares, self.dp_rank, group, wait)
        shapes = [tuple(t.shape)[1:] if shares else tuple(t.shape) for piece in pieces
                  for t in pytree.tree_leaves(piece) if isinstance(t, torch.Tensor)]
        # every step: one small all-reduce of a digest (its max and its negated min), on CPU
        digest = int.from_bytes(hashlib.sha256(repr(shapes).encode()).digest()[:7], "little")
        extremes = torch.tensor([digest, -digest, code], dtype=torch.int64)
        work = dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group, async_op=True)
        answer: list[Any] = []  # the code, or the error: asked again, the same, with no collective

        def resolve() -> int:
            if not answer:
                try:
                    wait(work)
                    most, least, agreed = extremes.tolist()
                    if agreed >= REFUSED:
                        raise SmpartError(
                            "another data-parallel replica could not split its batch into micro-batches "
                            "(its ranks raise why): every replica must step on a batch that splits")
                    if most != -least:
                        self._name_batch_mismatch(shapes, group)
                    answer.append(agreed)
                except BaseException as err:
                    answer.append(err)
            if isinstance(answer[0], BaseException):
                raise answer[0]
            return answer[0]

        return resolve

    def _name_batch_mismatch(self, shapes: list[tuple], group: Any) -> None:
        every = all_gather_objects(shapes, group, self.config.timeout_s, "the shapes of the batches")
        if any(other != shapes for other in every):
            sizes = {d: [s[0] if s else None for s in shape][:3] for d, shape in enumerate(every)}
            raise SmpartError(f"the data-parallel replicas were fed batches of different shapes (first "
                              f"dimensions by replica: {sizes}); every replica must step on a batch of the "
                              "same size, since their gradients are averaged")

    # ================================================================ placement
    def _start_alike(self, pieces: list[tuple[tuple, dict]]) -> None:
        """The step's model, at its first step under this ``init``: the same on every rank, with
        rank 0's values, if it is new (`replicas`); if an earlier init's placement left each rank
        a part, each takes back what it will hold when it places it (`_take_back`; all of it now
        if the trace runs on the real values). Every step: the replicas take the first one's buffers
        (``broadcast_buffers``), and a stage's tensor-parallel ranks the first one's random state.
        (The model is the step's argument, the same on every rank; the models alive are not, as
        one rank may not have collected garbage another has.)"""
        group, timeout_s = self.setup.collective_group, self.config.timeout_s
        args, kwargs = pieces[0]  # the step function checked: exactly one DistributedModel among them
        model = next(v for v in (*args, *kwargs.values()) if isinstance(v, DistributedModel))
        if model._runtime is not self:
            if model._released and self.config.trace_device == "real":  # the trace runs on its values
                self._take_back(model, None)
            if not model._agreed:
                check_same_model(model, group, timeout_s)
                make_replicas_agree(model, group, timeout_s)
                model._agreed = True
        elif model.broadcast_buffers and self.layout.dp > 1:
            first_replica = self.layout.rank_of(self.stage, 0, self.tp_rank)
            share_buffers(model, self.setup.dp_control_group, first_replica, timeout_s)
        if self.layout.tp > 1:  # every step: a rank may have drawn alone between steps
            share_random_state(self.setup.tp_group, self.layout.rank_of(self.stage, self.dp_rank, 0),
                               self.setup.device, timeout_s)

    def _place_first(self, model: DistributedModel, args: tuple, kwargs: dict) -> None:
        """On the driver's rank, at the model's first call: partition, send it to every rank, place."""
        partition = self._agreed(lambda: partition_for(model, args, kwargs, self.config))
        reply_to = (self.rank, ("placed", next(_placements)))
        self.transport.open(reply_to)
        try:
            for stage in range(1, self.num_stages):
                self.transport.send(self.rank, (self.place_of_stage(stage), MAIN),
                                    PlaceModel(model.model_id, partition, reply_to))
            self._place(model, partition)
            self._await_placed(reply_to, model.model_id)
        finally:
            self.transport.close(reply_to)

    def _agreed(self, decide: Callable[[], Any]) -> Any:
        """What the first tensor-parallel driver decides, on every driver (they must agree)."""
        if self.layout.tp == 1:
            return decide()
        chosen = [decide() if self.tp_rank == 0 else None]
        leader = self.layout.rank_of(self.stage, self.dp_rank, 0)
        dist.broadcast_object_list(chosen, src=leader, group=self.setup.tp_group)
        return chosen[0]

    def _await_placed(self, reply_to: Address, model_id: int) -> None:
        waiting = self.num_stages - 1
        deadline = time.monotonic() + self.config.timeout_s
        while waiting:
            message = self.transport.receive(reply_to, POLL_S)
            if isinstance(message, Placed) and message.model == model_id:
                if message.error is not None:
                    raise message.error
                waiting -= 1
            if time.monotonic() > deadline:
                raise SmpartError(f"{waiting} rank(s) did not place the model within {self.config.timeout_s} "
                                  "s: do all ranks call the step function?")

    def _place_here(self, message: PlaceModel) -> None:
        error: BaseException | None = None
        try:
            model = model_by_id(message.model)
            if model is None:
                raise SmpartError(f"rank {self.rank} has no DistributedModel #{message.model}: every rank "
                                  "must create the same DistributedModels in the same order")
            model._partition = message.partition
            self._place(model, message.partition)
        except SmpartError as err:
            error = err
        self.transport.send(self.rank, message.reply_to, Placed(message.model, self.rank, error))
        if error is not None:
            raise error

    def _take_back(self, model: DistributedModel, partition: Any) -> None:
        """A model an earlier ``init`` placed (each rank released the others' stages): every rank
        takes back what it will hold under ``partition`` (None: everything), from the ranks that
        kept it, and its optimizers' state with it (`replicas.make_whole`)."""
        keep = None
        if partition is not None:
            stages = module_stages(model.module, partition)
            keep = lambda names: any(stages.get(name.rpartition(".")[0], 0) == self.stage  # noqa: E731
                                     for name in names)
        gc.collect()  # an optimizer left for garbage on one rank only would pair nothing
        make_whole(model, optimizers_over(model.module.parameters()), self.setup.collective_group,
                   self.config.timeout_s, keep)
        model._released = False

    def _place(self, model: DistributedModel, partition: Any) -> None:
        if model._released:  # every rank places it now: each takes back only its new stage's tensors
            self._take_back(model, partition)
        if self.layout.tp > 1:
            self._split_for_tensor_parallelism(model, partition.tree)
            partition = _as_split(partition, model.tensor_parallel_plan)
        seed = (None if model._init_seed is None else
                initialisation_seed(model._init_seed, model.model_id, self.stage))
        # A model placed before keeps no other stage's buffers: it recomputes nothing, on every rank.
        recomputed = () if model._released else recomputed_modules(model.module, partition)
        kept = place_on_rank(model.module, model.model_id, partition, self.server,
                             loading=bool(model._after_placement), seed=seed,
                             loaded=model._filled_at_placement, recomputed=recomputed)
        program_steps.placed(model, partition, recomputed)
        # every rank released the other stages' tensors, or split layers into its shards
        model._released = self.num_stages > 1 or self.layout.tp > 1
        self.resident_bytes[model.model_id] = kept
        model._partition = partition
        model._runtime = self
        self.models[model.model_id] = model
        model._placed()

    def _split_for_tensor_parallelism(self, model: DistributedModel, tree: Any) -> None:
        """Swap in the tensor-parallel layers the automatic plan chooses (``tree``, the traced one, lends
        its recorded calls to prove attention no adapter knows); parameters that become shards are
        new objects, which every optimizer adopts (`placement.remember_replacement`)."""
        before = dict(model.module.named_parameters())
        plan = plan_tensor_parallel(model.module, self.layout.tp, example_inputs=tree)
        apply_tensor_parallel(model.module, plan, self.setup.tp_group)
        after = dict(model.module.named_parameters())
        for name, old in before.items():
            new = after.get(name)
            if new is not None and new is not old:
                remember_replacement(old, new)
        model.tensor_parallel_plan = plan

    # ================================================================ the end
    def _await_peers_leaving(self) -> None:
        """Until every peer has said it is leaving too (or is gone), answer what it asks of this
        rank's state: a rank saving ``model.state_dict()`` after its last step while the others have
        reached the end of their script still gets their stages' entries. Bounded by ``timeout_s``:
        a peer busy elsewhere for longer is not waited for."""
        deadline = time.monotonic() + self.config.timeout_s
        peers = set(self.transport.inner.peers)
        with contextlib.suppress(SmpartError):  # a peer was lost: the job is failing, nobody waits
            self.states.answer_kept()
            while peers - self.transport.left.keys() - self.transport.inner.unreachable():
                if time.monotonic() > deadline:
                    return
                self.states.take(POLL_S)

    def shutdown(self, timeout_s: float = 10.0) -> list[str]:
        torch_clip.uninstall()
        self.transport.say_leaving(self.steps_taken)
        if self.answer_at_shutdown:
            self._await_peers_leaving()
        if self._reducer is not None:
            self._reducer.remove()
        for model in list(self.models.values()):
            unplace(model.module, self.servers)
            templates.forget(model.model_id)
            model._runtime = None
        stuck = self.server.stop(timeout_s)
        self.transport.shutdown()
        if self.direct is not None:
            self.direct.close()
        self.state_group = None
        release_groups(self.setup)
        return stuck


def _as_split(partition: Any, plan: Any) -> Any:
    """``partition`` with ``meta["tensor_parallel"]`` saying what ``plan`` split, per tree node, as a
    plan's partition says it (``{"degree": 2, "split": {node name: style}}``): what ran, for the views."""
    import copy

    shares = splittable_fraction(plan, partition.tree)
    ran = copy.copy(partition)
    ran.meta = {**partition.meta, "tensor_parallel": {
        "degree": plan.degree, "split": {name: share.style for name, share in shares.items() if share.split}}}
    return ran


def _shippable(error: BaseException | None, rank: int) -> BaseException | None:
    """The error as the other ranks should see it (a `SmpartError`; the cause's text goes with it)."""
    if error is None or isinstance(error, SmpartError):
        return error
    return PipelineError(f"the step failed on rank {rank}: {type(error).__name__}: {error}", rank=rank)


def _modules(model: Any) -> list[torch.nn.Module]:
    """The modules of a placed model, in ``modules()`` order: its step programs' list once it has
    them (read every step), else walked."""
    programs = getattr(model, "_programs", None)
    return programs.modules if programs is not None else list(model.module.modules())
