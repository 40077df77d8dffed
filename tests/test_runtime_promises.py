"""Promised calls (``Config.promised_calls``): a stage calling another stage's module goes on without
waiting for the answer once it can predict it, and nothing a user sees changes but the speed.

The model is a chain whose root, on stage 0, calls the blocks of stage 1 (and 2) one by one, as
GPT-2's root calls its blocks. The references are the unsplit model and the same run with the
switch off.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter

import pytest
import torch
from torch import nn

import smpart
from smpart.errors import PipelineError
from smpart.runtime.reference import stage as stage_module
from smpart.runtime.reference.promises import UnpredictableOutput
from smpart.runtime.wire.messages import Request, Response
from tests.launch import run_ranks, values


@pytest.fixture(autouse=True)
def _reference_runtime(monkeypatch):
    """These tests look inside the reference runtime (SMP's: requests, handles, promised calls,
    holding, turns); with step programs on, steps after a model's first would run as programs."""
    monkeypatch.setenv("SMPART_PROGRAMS", "0")


WIDTH, BATCH, MICROBATCHES = 64, 8, 2  # an activation of a micro-batch: 2 KiB, above SMALL_BYTES


class Block(nn.Module):
    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return x + torch.tanh(self.lin(x))


class Chain(nn.Module):
    """``first`` then ``blocks`` in order, then ``head``, each called by the root."""

    def __init__(self, blocks: int = 4, delay_s: float = 0.0) -> None:
        super().__init__()
        self.first = Block()
        self.blocks = nn.ModuleList([Block(delay_s) for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _pins(stages_of_blocks: list[int]) -> dict[str, int]:
    return {"": 0, "first": 0, "head": 0, **{f"blocks.{i}": s for i, s in enumerate(stages_of_blocks)}}


def _step(model, x):
    loss = model(x).square().mean()
    model.backward(loss)
    return loss


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    losses = [model(part).square().mean() for part in x.chunk(MICROBATCHES)]
    loss = torch.stack(losses).mean()
    loss.backward()
    return torch.stack(losses).detach()


def _count_requests(monkeypatch) -> Counter:
    """(stage, promised) -> requests received, counted at every stage server."""
    seen: Counter = Counter()
    receive = stage_module.StageServer._on_request

    def counted(self, message: Request) -> None:
        seen[(self.stage, message.promised is not None)] += 1
        receive(self, message)

    monkeypatch.setattr(stage_module.StageServer, "_on_request", counted)
    return seen


def _train(model: nn.Module, stages: int, pins: dict, steps: int = 2, **init) -> float:
    """Train ``model`` split as pinned next to its unsplit copy; the largest parameter difference."""
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, pipeline="1f1b", timeout_s=60,
                pin=pins, **init)
    split = smpart.DistributedModel(model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(split.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = smpart.step(_step)
    for i in range(steps):
        x = torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        out = step(split, x)
        expected = _reference(reference, x)
        assert (out.stack() - expected).abs().max().item() <= 1e-9
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    state = split.state_dict()
    return max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("promised", [True, False])
def test_calls_with_a_known_answer_are_promised_and_train_like_the_unsplit_model(monkeypatch, promised):
    seen = _count_requests(monkeypatch)
    assert _train(Chain().double(), 2, _pins([1, 1, 1, 1]), steps=3, promised_calls=promised) <= 1e-9
    calls = 4 * MICROBATCHES * 3  # blocks x micro-batches x steps, all on stage 1
    assert seen[(1, True)] + seen[(1, False)] == calls
    if promised:  # the first step waits for every answer (it learns them); the others never do
        assert seen[(1, False)] == 4 * MICROBATCHES
    else:
        assert seen[(1, True)] == 0


@pytest.mark.timeout(60)
def test_the_caller_does_not_wait_between_promised_calls(monkeypatch):
    """Blocks that take 50 ms each: in the second step, every request of a micro-batch reaches
    stage 1 before the first answer of that micro-batch reaches stage 0."""
    events: list[tuple[str, int, int]] = []
    receive, answer = stage_module.StageServer._on_request, stage_module.StageServer._on_response

    def on_request(self, message: Request) -> None:
        events.append(("request", message.step, message.microbatch))
        receive(self, message)

    def on_response(self, message: Response) -> None:
        events.append(("answer", message.step, message.microbatch))
        answer(self, message)

    monkeypatch.setattr(stage_module.StageServer, "_on_request", on_request)
    monkeypatch.setattr(stage_module.StageServer, "_on_response", on_response)
    assert _train(Chain(delay_s=0.05).double(), 2, _pins([1, 1, 1, 1]), steps=2) <= 1e-9
    last = max(step for _, step, _ in events)
    for mb in range(MICROBATCHES):
        seen = [kind for kind, step, m in events if (step, m) == (last, mb)]
        assert seen[:4] == ["request"] * 4, (mb, seen)


@pytest.mark.timeout(60)
def test_promised_outputs_travel_between_three_stages_as_on_a_chain(monkeypatch):
    """Stage 2 gets references to outputs stage 1 may not have computed yet (it fetches them before
    its turn), and stage 1 gets its own back from stage 2's output."""
    seen = _count_requests(monkeypatch)
    assert _train(Chain(blocks=6).double(), 3, _pins([1, 2, 1, 2, 1, 2]), steps=3) <= 1e-9
    assert seen[(1, True)] > 0 and seen[(2, True)] > 0


@pytest.mark.timeout(60)
def test_outputs_fetched_before_come_with_the_confirmation(monkeypatch):
    """The root on stage 0 returns the last block's output, held on stage 1, and the driver computes
    the loss from it: fetched in the first step, brought along by the confirmation of the promised
    calls afterwards (no Fetch), and no byte crosses twice."""
    fetches: Counter = Counter()
    answer_fetch = stage_module.StageServer._on_fetch

    def on_fetch(self, message) -> None:
        fetches[message.step] += 1
        answer_fetch(self, message)

    monkeypatch.setattr(stage_module.StageServer, "_on_fetch", on_fetch)
    model = nn.Sequential(Block(), Block(), Block()).double()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, timeout_s=30,
                pin={"": 0, "0": 0, "1": 1, "2": 1})
    split = smpart.DistributedModel(model)
    step = smpart.step(_step)
    sent = []
    for i in range(3):
        x = torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        out = step(split, x)
        sent.append(out.timeline.bytes_sent)
        assert (out.stack() - _reference(reference, x)).abs().max().item() <= 1e-9
    assert fetches[0] >= 1 and fetches[2] == 0, fetches
    # Per micro-batch, each way: an activation, and the gradient of the other way's.
    activation = BATCH // MICROBATCHES * WIDTH * 8
    assert sent[2] == {(0, 1): 2 * MICROBATCHES * activation, (1, 0): 2 * MICROBATCHES * activation}


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Block(), Block(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


@pytest.mark.timeout(60)
def test_freezing_and_unfreezing_between_steps_keeps_the_gradients_of_the_unsplit_model():
    """A promised output requires grad whenever it may, so a block frozen after its answers were
    learned, then unfrozen, still trains like the unsplit model."""
    model = Frozen().double()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, timeout_s=30,
                pin={"": 0, "a": 1, "b": 0, "c": 0})
    split = smpart.DistributedModel(model)
    step = smpart.step(_step)
    x = torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    # 'a' gets the input, which does not require grad: whether its output does is up to its weights.
    for frozen in (True, False, True, False):
        for m in (model, reference):
            m.a.requires_grad_(not frozen)
        split.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        step(split, x)
        _reference(reference, x)
        for (name, p), q in zip(split.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), (frozen, name)
            assert p.grad is None or torch.allclose(p.grad, q.grad, atol=1e-12), (frozen, name)


class Shrink(nn.Module):
    """Keeps as many rows as the first value says: an output shape that depends on the data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[: 3 + int(x[0, 0].item() > 0)]


class Unpredictable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shrink, self.c = Shrink(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.shrink(x))


def _batch_with_rows(first: list[float]) -> torch.Tensor:
    x = torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    per = BATCH // MICROBATCHES
    for mb, value in enumerate(first):
        x[mb * per, 0] = value
    return x


@pytest.mark.timeout(60)
def test_an_output_shape_that_depends_on_the_data_fails_one_step_then_calls_wait():
    model = Unpredictable().double()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, timeout_s=30,
                pin={"": 0, "shrink": 1, "c": 1})
    split = smpart.DistributedModel(model)
    step = smpart.step(lambda model, x: (model.backward(model(x).square().mean()), None)[1])
    step(split, _batch_with_rows([-1.0, -1.0]))  # every call's answer is known from now on: 3 rows
    split.zero_grad()
    x = _batch_with_rows([-1.0, 1.0])  # micro-batch 0 keeps 3 rows, micro-batch 1 keeps 4
    with pytest.raises(UnpredictableOutput, match=r"module 'shrink' on stage 1 returned outputs \[\[4, 64\]"):
        step(split, x)
    split.zero_grad()
    step(split, x)  # 'shrink' is called and waited for from now on
    for part in x.chunk(MICROBATCHES):
        (reference(part).square().mean() / MICROBATCHES).backward()
    for (name, p), q in zip(split.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-12), name


class Failing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 1e3).any():
            raise ValueError("value out of range")
        return x * 2


@pytest.mark.timeout(60)
def test_an_error_in_a_promised_call_names_where_it_happened_and_the_next_step_runs():
    model = nn.Sequential(Block(), Block(), Failing(), Block()).double()
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, timeout_s=30,
                pin={"": 0, "0": 0, "1": 1, "2": 1, "3": 1})
    split = smpart.DistributedModel(model)
    step = smpart.step(_step)
    good = _batch_with_rows([0.0, 0.0])
    step(split, good)  # every call's answer is known from now on
    bad = _batch_with_rows([0.0, 1e4])  # micro-batch 1's call to '2' is promised, and fails
    failure = "micro-batch 1 failed on stage 1.*'2'.*value out of range"
    with pytest.raises(PipelineError, match=failure) as info:
        step(split, bad)
    assert (info.value.stage, info.value.module, info.value.microbatch) == (1, "2", 1)
    assert torch.isfinite(step(split, good).stack()).all()


def _on_rank(rank: int):
    torch.manual_seed(0)
    return _train(Chain(blocks=6).double(), 3, _pins([1, 2, 1, 2, 1, 2]), steps=2)


@pytest.mark.timeout(120)
def test_promised_calls_between_three_processes_train_like_the_unsplit_model():
    assert all(diff <= 1e-9 for diff in values(run_ranks(_on_rank, 3, timeout_s=110)))


_threads: dict[tuple[int, int], set[int]] = {}  # (step, micro-batch) -> threads that ran its blocks


class ThreadRecordingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from smpart.runtime.reference.calls import current_frame

        frame = current_frame()
        if frame is not None:  # None: tracing, before the first step runs
            _threads.setdefault((frame.step, frame.microbatch), set()).add(threading.get_ident())
        return super().forward(x)


def _threads_of_batches(rank: int) -> dict[tuple[int, int], int]:
    """On every rank: train the chain; on stage 1's rank, how many threads ran the blocks of each
    (step, micro-batch)."""
    torch.manual_seed(0)
    model = Chain().double()
    model.blocks = nn.ModuleList([ThreadRecordingBlock() for _ in model.blocks]).double()
    assert _train(model, 2, _pins([1, 1, 1, 1]), steps=3) <= 1e-9
    return {key: len(ids) for key, ids in _threads.items()}


@pytest.mark.timeout(120)
def test_a_batch_of_promised_calls_runs_on_one_thread():
    """From the second step on, the root's four calls to stage 1 come in one `Batch` per
    micro-batch; they run one after another on one thread, not on a thread each (which woke
    four threads at once, three of them only to wait for the turn)."""
    counts = values(run_ranks(_threads_of_batches, 2, timeout_s=110))[1]
    last = max(step for step, _ in counts)
    assert [counts[(last, mb)] for mb in range(MICROBATCHES)] == [1] * MICROBATCHES, counts


@pytest.mark.timeout(60)
def test_a_batch_that_arrives_before_its_step_begins_still_runs_on_one_thread(monkeypatch):
    """Under load the root's `Batch` can reach stage 1 before stage 1 has begun the step: it is
    kept until then and runs whole, not as a call each (a CI run of the test above failed so). Here
    stage 1's `BeginStep` of the third step is held back until that step's batch has arrived."""
    from smpart.runtime.wire.messages import STAGE, BeginStep
    from smpart.runtime.wire.transport import ThreadTransport

    send, held, order = ThreadTransport.send, [], []

    def reordering(self, src, address, message):
        step = getattr(message, "step", None)
        if address == (1, STAGE) and step == 2:
            order.append(type(message).__name__)
            if isinstance(message, BeginStep) and len(order) == 1:
                held.append((src, message))
                return
            send(self, src, address, message)  # the message after it overtakes it
            while held:
                sender, begin = held.pop()
                send(self, sender, address, begin)
            return
        send(self, src, address, message)

    monkeypatch.setattr(ThreadTransport, "send", reordering)
    _threads.clear()
    torch.manual_seed(0)
    model = Chain().double()
    model.blocks = nn.ModuleList([ThreadRecordingBlock() for _ in model.blocks]).double()
    assert _train(model, 2, _pins([1, 1, 1, 1]), steps=3) <= 1e-9
    assert order[:2] == ["BeginStep", "Batch"]  # the step's batch came first, as arranged
    assert [len(_threads[(2, mb)]) for mb in range(MICROBATCHES)] == [1] * MICROBATCHES, _threads


def test_the_switch_is_validated():
    with pytest.raises(smpart.SmpartError, match="promised_calls must be True or False"):
        smpart.init(pipeline_parallel_degree=1, promised_calls="yes")


@pytest.fixture(autouse=True)
def _fresh_runtime():
    yield
    smpart.shutdown()


class _Busy(torch.autograd.Function):
    """Records when the forward (after its input's data is here) and the backward run, and takes
    a while in each: two pieces of work of one stage must never overlap."""

    intervals: list[tuple[str, float, float]] = []

    @staticmethod
    def work(kind: str) -> None:
        start = time.monotonic()
        time.sleep(0.03)
        _Busy.intervals.append((kind, start, time.monotonic()))

    @staticmethod
    def forward(ctx, x):
        _Busy.work("F")
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Busy.work("B")
        return grad * 2


class Consumer(nn.Module):
    """On stage 0: touches a promised output of stage 1 (a fetch, the turn given back meanwhile),
    then works with it."""

    def forward(self, x):
        return _Busy.apply(x + 0)


class Fetching(nn.Module):
    def __init__(self):
        super().__init__()
        self.remote = Block()
        self.consumer = Consumer()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.consumer(self.remote(x)))


@pytest.mark.timeout(60)
def test_a_stage_that_fetches_a_promised_output_takes_its_turn_again_before_computing_on():
    """Under gpipe with 4 micro-batches, the backward of micro-batch 0 may start on stage 0 once
    micro-batch 3's forward started there. That forward gives the turn back while it fetches
    stage 1's promised output; it must take it again before computing on with it, or the two
    run at once (and tensor-parallel ranks, whose collectives pair up in order, hang)."""
    torch.manual_seed(0)
    model = Fetching().double()
    smpart.init(pipeline_parallel_degree=2, microbatches=4, pipeline="gpipe", timeout_s=60,
                pin={"": 0, "remote": 1, "consumer": 0, "head": 0})
    split = smpart.DistributedModel(model)
    step = smpart.step(_step)
    x = torch.randn(16, WIDTH, dtype=torch.float64)
    for _ in range(2):  # the second step's calls to stage 1 are promised
        _Busy.intervals.clear()
        step(split, x)
    assert [kind for kind, _, _ in _Busy.intervals].count("B") == 4
    ordered = sorted(_Busy.intervals, key=lambda i: i[1])
    for (_, _, end), (_, start, _) in zip(ordered, ordered[1:], strict=False):
        assert start >= end, f"two pieces of stage 0's work overlapped: {ordered}"
