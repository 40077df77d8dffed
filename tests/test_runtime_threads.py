"""The runtime's threading: schedule order among messages that arrive together, no thread per
message for a stage that never waits, held gradient messages, gradients run on the posting thread
(a long chain of them), micro-batches kept in order when forward calls run on the calling thread,
and the in-flight cap."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import smpart
from smpart.runtime.baton import Baton
from smpart.runtime.gradients import PendingGradients, gradient_poster, held_posts
from smpart.runtime.runtime import current_runtime
from smpart.runtime.schedule import BACKWARD, FORWARD, Interleaved


@pytest.fixture(autouse=True)
def _clean_runtime():
    yield
    smpart.shutdown()


def test_tickets_admitted_together_go_to_the_best_one_not_the_first():
    policy = Interleaved()
    baton = Baton()
    baton.set_schedule(policy.rank, lambda kind: True)
    with baton.deferred():
        forward = baton.take(FORWARD, 1)
        backward = baton.take(BACKWARD, 0)
        assert not forward.granted and not backward.granted
    assert backward.granted and not forward.granted  # 1F1B: backward first
    baton.release(backward)
    assert forward.granted


def test_gradient_messages_are_held_until_flushed_and_nested_holds_flush_outward():
    sent: list = []
    post = gradient_poster(lambda address, message: sent.append((address, message)),
                           PendingGradients(1), step=0, microbatch=0)
    outer = held_posts()
    post((1, 7, True), {0: torch.ones(1)})
    inner = held_posts()
    post((2, 8, False), {0: torch.ones(1)})
    inner.flush()
    assert [address for address, _ in sent] == [2]
    outer.flush()
    assert [address for address, _ in sent] == [2, 1]
    post((3, 9, True), {0: torch.ones(1)})  # not holding any more: sent at once
    assert [address for address, _ in sent] == [2, 1, 3]


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x):
        return self.second(self.first(x).relu())


@smpart.step
def train_step(model, x):
    loss = model(x).square().mean()
    model.backward(loss)
    return loss


@pytest.mark.timeout(60)
def test_a_stage_that_never_waits_needs_no_thread_per_message():
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin={"": 0, "first": 0, "second": 1})
    model = smpart.DistributedModel(Chain())
    x = torch.randn(4, 4)
    for _ in range(3):
        train_step(model, x)
    stage1 = current_runtime().servers[1]
    threads = len(stage1.threads._threads)
    for _ in range(5):
        train_step(model, x)
    # one receiver, plus at most one follower taking the turn while stage 1's thread runs stage 0's
    # backward segment inline (`ExecutionServer.deliver`); reused, never one per message
    assert threads <= 2
    assert len(stage1.threads._threads) == threads


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(0.002)  # keeps micro-batches in flight long enough to overlap
        return self.second(self.first(x))


@pytest.mark.timeout(60)
def test_no_more_micro_batches_run_at_once_than_active_microbatches():
    smpart.init(pipeline_parallel_degree=2, microbatches=8, pipeline="interleaved", active_microbatches=2,
                pin={"": 0, "first": 0, "second": 1})
    model = smpart.DistributedModel(Slow())
    lock = threading.Lock()
    running = peak = 0

    @smpart.step
    def counted_step(model, x):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        loss = model(x).square().mean()
        model.backward(loss)
        with lock:
            running -= 1
        return loss

    reference = Slow()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(16, 4)
    out = counted_step(model, x)
    expected = torch.stack([reference(piece).square().mean() for piece in x.chunk(8)])
    torch.testing.assert_close(out.stack(), expected)
    assert 1 <= peak <= 2


class PingPong(nn.Module):
    """A root on stage 0 alternating ``hops`` times with a module on stage 1: in the backward, a
    chain of 2 * hops segments, each one posting the next one's gradient."""

    def __init__(self, hops: int):
        super().__init__()
        self.local = nn.Linear(4, 4, dtype=torch.float64)
        self.remote = nn.Linear(4, 4, dtype=torch.float64)
        self.hops = hops

    def forward(self, x):
        for _ in range(self.hops):
            x = self.local(self.remote(x)).tanh()
        return x


@pytest.mark.timeout(60)
def test_a_long_backward_chain_run_on_the_posting_threads_matches_the_unsplit_model():
    # Idle stages run the gradients posted to them on the posting thread (`ExecutionServer.deliver`);
    # 600 hops would overflow the stack if each ran nested in the previous one.
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin={"": 0, "local": 0, "remote": 1})
    model = smpart.DistributedModel(PingPong(hops=300))
    reference = PingPong(hops=300)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 4, dtype=torch.float64)
    out = train_step(model, x)
    expected = reference(x).square().mean()
    expected.backward()
    torch.testing.assert_close(out.reduce_mean(), expected.detach())
    grads = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-9, rtol=1e-7)


class NormChain(nn.Module):
    """A root on stage 0 passing each micro-batch through BatchNorms on stages 1 and 2 and back:
    forward calls race for those stages, which may run them on the calling thread."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(6, 6, dtype=torch.float64)
        self.norm1 = nn.BatchNorm1d(6, momentum=0.5, dtype=torch.float64)
        self.norm2 = nn.BatchNorm1d(6, momentum=0.5, dtype=torch.float64)

    def forward(self, x):
        return self.norm2(self.mix(self.norm1(self.mix(x))).tanh())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_micro_batches_pass_each_stage_in_order_when_forwards_run_on_the_calling_thread(schedule):
    # BatchNorm's running statistics depend on the order micro-batches pass through it (momentum
    # 0.5 makes any swap visible); the reference runs them one after the other, unsplit.
    microbatches = 6
    smpart.init(pipeline_parallel_degree=3, microbatches=microbatches, pipeline=schedule,
                pin={"": 0, "mix": 0, "norm1": 1, "norm2": 2})
    model = smpart.DistributedModel(NormChain())
    reference = NormChain()
    reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        x = torch.randn(4 * microbatches, 6, dtype=torch.float64, generator=generator)
        x = x * torch.arange(1, 4 * microbatches + 1, dtype=torch.float64)[:, None]  # unlike micro-batches
        train_step(model, x)
        for piece in x.chunk(microbatches):
            reference(piece)
    buffers = dict(model.named_buffers())
    for name, expected in reference.named_buffers():
        torch.testing.assert_close(buffers[name], expected, atol=1e-12, rtol=0, msg=name)
