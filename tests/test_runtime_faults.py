"""Faults and bad input: each a clear SmpartError, bounded in time, and the next step still runs."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import smpart
from smpart.errors import ConfigError, PipelineError, SmpartError
from smpart.runtime.wire.transport import ThreadTransport


class Faulty(nn.Module):
    """Raises (or sleeps, or returns an opaque object) when ``mode`` says so."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mode = None

    def forward(self, x):
        if self.mode == "raise":
            raise ValueError("boom")
        if self.mode == "sleep":
            time.sleep(1.0)
        if self.mode == "opaque":
            return Opaque(self.lin(x))
        if self.mode == "backward":
            return FailingBackward.apply(self.lin(x))
        return self.lin(x)


class Opaque:
    def __init__(self, tensor):
        self.tensor = tensor


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward boom")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = Faulty()

    def forward(self, x):
        out = self.second(self.first(x))
        return out if isinstance(out, torch.Tensor) else out.tensor


@smpart.step
def train_step(model, x):
    loss = model(x).sum()
    model.backward(loss)
    return loss


def setup(timeout_s=10.0, microbatches=2):
    smpart.init(pipeline_parallel_degree=2, microbatches=microbatches, pin={"first": 0, "second": 1},
                timeout_s=timeout_s)
    net = Net()
    return smpart.DistributedModel(net), net


@pytest.mark.timeout(60)
def test_module_error_names_stage_module_and_microbatch_and_next_step_runs():
    model, net = setup()
    x = torch.randn(4, 4)
    train_step(model, x)
    net.second.mode = "raise"
    with pytest.raises(PipelineError) as info:
        train_step(model, x)
    err = info.value
    assert (err.stage, err.module, err.microbatch) == (1, "second", 0)
    assert isinstance(err.__cause__, ValueError) and "boom" in str(err)
    net.second.mode = None
    assert len(train_step(model, x).outputs) == 2


@pytest.mark.timeout(60)
def test_backward_error_is_reported_with_its_stage():
    model, net = setup()
    net.second.mode = "backward"
    with pytest.raises(PipelineError) as info:
        train_step(model, torch.randn(4, 4))
    assert info.value.stage == 1 and "backward boom" in str(info.value)
    net.second.mode = None
    train_step(model, torch.randn(4, 4))


@pytest.mark.timeout(60)
def test_a_hang_becomes_a_pipeline_error_then_the_pipeline_recovers():
    model, net = setup(timeout_s=0.3)
    net.second.mode = "sleep"
    start = time.monotonic()
    with pytest.raises(PipelineError, match="waited more than"):
        train_step(model, torch.randn(4, 4))
    assert time.monotonic() - start < 5
    net.second.mode = None
    time.sleep(1.2)  # the sleeping module finishes; its late answer is dropped
    train_step(model, torch.randn(4, 4))


@pytest.mark.timeout(60)
def test_opaque_object_holding_tensors_is_refused():
    model, net = setup()
    net.second.mode = "opaque"
    with pytest.raises(SmpartError, match="holds tensors"):
        train_step(model, torch.randn(4, 4))


@pytest.mark.timeout(30)
def test_batch_not_divisible_by_microbatches():
    model, _ = setup(microbatches=4)
    with pytest.raises(SmpartError, match="divisible by 4"):
        train_step(model, torch.randn(6, 4))


@pytest.mark.timeout(30)
def test_backward_twice_and_outside_a_step():
    model, _ = setup()

    @smpart.step
    def twice(model, x):
        loss = model(x).sum()
        model.backward(loss)
        model.backward(loss)

    with pytest.raises(SmpartError, match="twice"):
        twice(model, torch.randn(4, 4))
    with pytest.raises(SmpartError, match="inside an @smpart.step"):
        model.backward(model.module(torch.randn(2, 4)).sum())
    train_step(model, torch.randn(4, 4))


@pytest.mark.timeout(30)
def test_plain_module_and_missing_init():
    with pytest.raises(SmpartError, match="not initialised"):
        train_step(smpart.DistributedModel(Net()), torch.randn(4, 4))
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    with pytest.raises(SmpartError, match="DistributedModel"):
        train_step(Net(), torch.randn(4, 4))


def test_more_stages_than_devices():
    with pytest.raises(ConfigError, match="devices"):
        smpart.init(pipeline_parallel_degree=3, devices=["cpu", "cpu"])


@pytest.mark.timeout(30)
def test_shutdown_joins_every_thread():
    model, _ = setup()
    train_step(model, torch.randn(4, 4))
    smpart.shutdown()
    assert [t.name for t in threading.enumerate() if t.name.startswith("smpart")] == []


@pytest.mark.timeout(60)
def test_after_a_failed_step_nothing_is_left_running_and_shutdown_is_quick():
    model, net = setup()
    train_step(model, torch.randn(4, 4))
    net.second.mode = "raise"
    with pytest.raises(PipelineError):
        train_step(model, torch.randn(4, 4))
    net.second.mode = None
    train_step(model, torch.randn(4, 4))  # the next step works
    start = time.monotonic()
    smpart.shutdown()  # quick and silent: no thread of the failed step is stuck
    assert time.monotonic() - start < 2
    assert [t.name for t in threading.enumerate() if t.name.startswith("smpart")] == []


@pytest.mark.timeout(30)
def test_a_step_called_inside_a_step_is_refused_at_once():
    model, _ = setup()

    @smpart.step
    def outer(model, x):
        return train_step(model, x)

    start = time.monotonic()
    with pytest.raises(SmpartError, match="steps do not nest"):
        outer(model, torch.randn(4, 4))
    assert time.monotonic() - start < 5
    train_step(model, torch.randn(4, 4))


@pytest.mark.timeout(30)
def test_set_partition_to_a_stage_that_does_not_exist():
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    net = Faulty()
    with pytest.raises(SmpartError, match="stage 5 does not exist"):
        smpart.set_partition(net.lin, 5)
    smpart.shutdown()
    smpart.set_partition(net.lin, 5)  # before init nobody knows the stage count: said at the first step
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    model = smpart.DistributedModel(net)
    with pytest.raises(SmpartError, match="5"):
        train_step(model, torch.randn(4, 4))


def test_a_pipeline_error_sent_on_twice_carries_its_original_traceback_once():
    """A stage's error goes to the driver's rank and from there to every rank: pickled twice."""
    import pickle

    try:
        try:
            raise ValueError("a bad sample")
        except ValueError as cause:
            raise PipelineError("forward failed on stage 1", stage=1, rank=2) from cause
    except PipelineError as err:
        original = err
    twice = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(original))))
    assert (twice.stage, twice.rank) == (1, 2)
    assert str(twice).startswith("forward failed on stage 1\n\nOriginal traceback (on rank 2):")
    assert str(twice).count("Original traceback") == 1 and "ValueError: a bad sample" in str(twice)


class _CountingTransport(ThreadTransport):
    """Threads' transport, counting its checks for lost peers (every wait of a stage makes them)."""

    checks = 0

    def check(self) -> None:
        self.checks += 1


def _waiting_follower():
    """A tensor-parallel follower's stage in a step whose micro-batch 0 has a segment running, and
    a thread in which that segment waits for the gradient message its leader's consumed."""
    from smpart.runtime.reference.scheduler import SEGMENT, Claim
    from smpart.runtime.reference.stage import StageServer
    from smpart.runtime.reference.stage_step import StageStep
    from smpart.runtime.schedule import BACKWARD, Action
    from smpart.runtime.wire.messages import BeginStep

    transport = _CountingTransport()
    server = StageServer(0, 1, 0, torch.device("cpu"), transport, lambda stage: 0, rank=1, tp_follower=True)
    begin = BeginStep(step=0, microbatches=1, schedule="simple", active_microbatches=None, timeout_s=30,
                      coordinator=(0, "main"))
    server.run = run = StageStep(begin, 0, 1, follower=True)
    run.segment_queued.add(0)  # the waiting segment: a message that comes joins its backlog
    claim = Claim(Action(BACKWARD, 0), SEGMENT)
    claim.payload = ((1, 0),)  # the leader's segment consumed stage 1's first message
    outcome: list = []

    def segment():
        try:
            outcome.append([m.origin for m in server._take_backlog(run, 0, claim)])
        except BaseException as err:  # noqa: BLE001 - what the wait ended with (Cancelled is no Exception)
            outcome.append(err)

    thread = threading.Thread(target=segment)
    thread.start()
    return server, run, transport, thread, outcome


@pytest.mark.timeout(30)
def test_a_tensor_parallel_follower_sleeps_until_its_leaders_gradients_come():
    """It waited in a 1 ms polling loop (a thousand wake-ups a second per waiting segment, each
    checking the transport); it sleeps on a condition now, woken by the message, and checks for
    lost peers every 50 ms."""
    from fractions import Fraction

    from smpart.runtime.wire.messages import Gradients

    server, run, transport, thread, outcome = _waiting_follower()
    time.sleep(0.5)
    checks_while_waiting = transport.checks
    server._on_gradients(Gradients(0, 0, [], Fraction(1), origin=(1, 0)))
    thread.join(5)
    server.stop(5)
    assert outcome == [[(1, 0)]]
    assert 1 <= checks_while_waiting <= 25, checks_while_waiting  # ~10 at 50 ms; ~500 at 1 ms


@pytest.mark.timeout(30)
def test_an_aborted_step_wakes_a_follower_waiting_for_its_leaders_gradients():
    from smpart.runtime.reference.scheduler import Cancelled

    server, run, _, thread, outcome = _waiting_follower()
    time.sleep(0.2)
    server._abort(run)
    thread.join(5)
    server.stop(5)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Cancelled)
