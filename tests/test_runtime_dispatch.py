"""The transport's speed path (``Config.direct_dispatch``): on, off, and over processes.

`Endpoint` is where the switch acts: with it on, a message for an idle stage server is handled on
the thread that delivers it. These tests pin down what must hold either way (one handler at a
time, each sender's messages in order, nothing lost that arrived early) and run the runtime with
the switch off, on threads and on processes; the rest of the suite runs it on (the default).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import smpart
from examples.models import ZOO
from smpart.runtime.reference.workers import run_job
from smpart.runtime.runtime import current_runtime
from smpart.runtime.wire.transport import Endpoint, ThreadTransport
from tests.launch import run_ranks
from tests.test_processes import _assert_report, _train_zoo
from tests.test_runtime import train_and_compare


@pytest.fixture(autouse=True)
def _reference_runtime(monkeypatch):
    """These tests look inside the reference runtime (SMP's: requests, handles, holding,
    turns); with step programs on, steps after a model's first would run as programs."""
    monkeypatch.setenv("SMPART_PROGRAMS", "0")



def _serve(endpoint: Endpoint, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            endpoint.serve_one(0.01)

    thread = threading.Thread(target=loop, name="test-endpoint")
    thread.start()
    return thread


@pytest.mark.timeout(30)
@pytest.mark.parametrize("direct", [True, False])
def test_an_idle_endpoint_handles_on_the_delivering_thread_only_when_direct(direct):
    ran_on: list[str] = []
    endpoint = Endpoint(lambda m: ran_on.append(threading.current_thread().name), direct)
    stop = threading.Event()
    server = _serve(endpoint, stop)
    try:
        sender = threading.Thread(target=lambda: endpoint.deliver("hello"), name="sender")
        sender.start()
        sender.join(5)
        deadline = time.monotonic() + 5
        while not ran_on and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        stop.set()
        server.join(5)
    assert ran_on == ["sender" if direct else "test-endpoint"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [True, False])
def test_one_handler_at_a_time_and_each_senders_messages_in_order(direct):
    senders, count = 4, 400
    seen: dict[int, list[int]] = {s: [] for s in range(senders)}
    inside = [0]
    overlaps = [0]

    def handler(message: tuple[int, int]) -> None:
        inside[0] += 1
        if inside[0] > 1:
            overlaps[0] += 1
        sender, seq = message
        seen[sender].append(seq)
        if seq % 7 == 0:
            time.sleep(0)  # let other threads in while this one handles
        inside[0] -= 1

    endpoint = Endpoint(handler, direct)
    stop = threading.Event()
    server = _serve(endpoint, stop)

    def send(sender: int) -> None:
        for seq in range(count):
            endpoint.deliver((sender, seq))

    threads = [threading.Thread(target=send, args=(s,)) for s in range(senders)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        deadline = time.monotonic() + 10
        while sum(map(len, seen.values())) < senders * count and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        stop.set()
        server.join(5)
    assert overlaps[0] == 0
    assert all(seen[s] == list(range(count)) for s in range(senders))


@pytest.mark.timeout(30)
def test_a_handler_never_runs_another_handler_inside_itself_and_early_messages_wait():
    order: list[str] = []
    depth = [0]
    second = Endpoint(None, direct=True)  # no handler yet: what arrives waits

    def first_handler(message: str) -> None:
        depth[0] += 1
        order.append(f"first {message} depth {depth[0]}")
        second.deliver(message)  # queued, not handled inside this handler
        depth[0] -= 1

    def second_handler(message: str) -> None:
        depth[0] += 1
        order.append(f"second {message} depth {depth[0]}")
        depth[0] -= 1

    first = Endpoint(first_handler, direct=True)
    first.deliver("a")
    first.deliver("b")
    assert order == ["first a depth 1", "first b depth 1"]
    second.handler = second_handler
    second.deliver("c")  # two messages queued before it: it waits behind them
    assert order == ["first a depth 1", "first b depth 1"]
    while second.serve_one(0.01):
        pass
    assert order[2:] == ["second a depth 1", "second b depth 1", "second c depth 1"]


@pytest.mark.parametrize("direct", [True, False])
def test_a_sender_about_to_wait_runs_the_job_its_message_starts_only_when_handled_at_once(direct):
    transport = ThreadTransport(direct=direct)
    submitted: list[str] = []
    transport.serve((1, "stage"), lambda message: transport.start(lambda: message, submitted.append))
    job = transport.lend(lambda: transport.send(0, (1, "stage"), "call"))
    assert (job() if job else None, submitted) == (("call", []) if direct else (None, []))
    if not direct:  # queued: the endpoint's own thread handles it and a worker gets the job
        assert transport.endpoints[(1, "stage")].serve_one(1.0) and len(submitted) == 1
    transport.send(0, (1, "stage"), "not lent")  # a sender that will not wait lends nothing
    transport.endpoints[(1, "stage")].serve_one(0.01)
    assert len(submitted) == (1 if direct else 2)


def _depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def test_a_chain_of_handed_on_jobs_runs_in_a_loop_not_nested():
    depths: list[int] = []

    def job(left: int):
        depths.append(_depth())
        return (lambda: job(left - 1)) if left else None

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RecursionError inside would only be warned of
        run_job(lambda: job(3 * sys.getrecursionlimit()))
    assert len(depths) == 3 * sys.getrecursionlimit() + 1 and len(set(depths)) == 1


class _TwoBlocks(nn.Module):
    """A root on stage 0 calling one block there and one on stage 1; it notes where it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.ran_on: list[str] = []

    def forward(self, x):
        self.ran_on.append(threading.current_thread().name)
        return self.second(self.first(x))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [True, False])
def test_the_driver_runs_its_root_call_and_the_losss_segments_itself_outside_the_bodys_autocast(direct):
    """With the switch on, the thread of a micro-batch's step body would only wait while its call
    to the root and the backward segments its loss starts run: it runs them itself. A segment
    runs as on a worker thread either way: not under the body's autocast. One micro-batch: with
    more, a message may find its stage busy with another's (a 16-core machine did), and then it
    is queued and a worker runs its job, as it should."""
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin={"first": 0, "second": 1},
                direct_dispatch=direct)
    torch.manual_seed(0)
    model = _TwoBlocks()
    segments: list[tuple[str, bool]] = []
    for layer in (model.first, model.second):
        layer.weight.register_hook(lambda grad: segments.append(
            (threading.current_thread().name, torch.is_autocast_enabled("cpu"))))
    dm = smpart.DistributedModel(model)

    @smpart.step
    def step(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().sum()
            model.backward(loss)
        return loss

    x = torch.randn(4, 4)
    step(dm, x)  # traces and places the model on the driver's thread
    model.ran_on.clear()
    segments.clear()
    step(dm, x)
    drivers = [name.startswith("smpart-step") for name in model.ran_on + [name for name, _ in segments]]
    assert len(model.ran_on) == 1 and len(segments) == 2
    assert all(drivers) if direct else not any(drivers)
    assert not any(autocast for _, autocast in segments)


# ------------------------------------------------------------------ the runtime with the switch off
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(ZOO))
def test_threads_train_like_the_unsplit_model_with_the_speed_path_off(name):
    train_and_compare(ZOO[name], 3, 2, "1f1b", steps=2, direct_dispatch=False)
    assert current_runtime().transport.direct is False


@pytest.mark.timeout(120)
def test_a_run_follows_the_schedule_with_the_speed_path_off():
    from tests.test_runtime_schedule import test_a_real_run_starts_its_actions_in_the_schedules_order as check

    os.environ["SMPART_DIRECT_DISPATCH"] = "0"
    try:
        check("1f1b", 4)
    finally:
        del os.environ["SMPART_DIRECT_DISPATCH"]


def _train_zoo_without_the_speed_path(rank, configs):
    os.environ["SMPART_DIRECT_DISPATCH"] = "0"
    assert smpart.Config().direct_dispatch is False  # what each smpart.init in _train_zoo gets
    return _train_zoo(rank, configs, steps=2)


@pytest.mark.timeout(300)
def test_processes_train_like_the_unsplit_model_with_the_speed_path_off():
    configs = [("gpt2", 2, "1f1b"), ("moe", 2, "gpipe"), ("t5", 4, "1f1b")]
    _assert_report(run_ranks(_train_zoo_without_the_speed_path, 2, configs, timeout_s=280))


def test_the_switch_is_validated():
    with pytest.raises(smpart.SmpartError, match="direct_dispatch must be True or False"):
        smpart.init(pipeline_parallel_degree=1, direct_dispatch="yes")
