"""The schedule is data, and the runtime follows it.

Each stage's list of actions (``F0 F1 B0 ...``) is computed before the step; a real run's
timeline starts its actions in exactly that order, whatever the thread timing. Micro-batches pass
every module in order (BatchNorm statistics match an unsplit run), long backward chains do not
grow any stack, and a stage that a micro-batch never visits (mixture-of-experts routing) passes
its actions over instead of waiting for them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import smpart
from smpart.runtime.reference.scheduler import NEW, Claim, StageScheduler
from smpart.runtime.runtime import current_runtime
from smpart.runtime.schedule import FORWARD, Action, schedule_named
from smpart.runtime.wire.messages import STAGE, Batch, ForwardDone, Gradients


@pytest.fixture(autouse=True)
def _reference_runtime(monkeypatch):
    """These tests look inside the reference runtime (SMP's: requests, handles, holding,
    turns); with step programs on, steps after a model's first would run as programs."""
    monkeypatch.setenv("SMPART_PROGRAMS", "0")



def _names(actions):
    return " ".join(map(str, actions))


def test_gpipe_and_1f1b_tables_by_hand():
    gpipe = schedule_named("simple")
    assert gpipe.name == "gpipe"
    assert _names(gpipe.actions(0, 2, 4)) == "F0 F1 F2 F3 B0 B1 B2 B3"
    one_f = schedule_named("interleaved")
    assert one_f.name == "1f1b"
    # the loss (the step body, on the first stage's rank) counts as a stage: p - s warm-up forwards
    assert one_f.describe(2, 4) == "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\nstage 1: F0 F1 B0 F2 B1 F3 B2 B3"
    assert _names(one_f.actions(0, 4, 2)) == "F0 F1 B0 B1"  # fewer micro-batches than warm-up
    assert _names(one_f.actions(1, 3, 5, active_microbatches=1)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"
    assert _names(one_f.actions(1, 3, 5, active_microbatches=2)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4"
    assert _names(one_f.actions(0, 1, 3)) == "F0 B0 F1 B1 F2 B2"  # one stage: no pipeline to feed


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(1, 3), (2, 1), (3, 4), (4, 7)])
def test_every_action_once_and_each_backward_after_its_forward(name, stages, microbatches):
    for stage in range(stages):
        actions = schedule_named(name).actions(stage, stages, microbatches)
        assert sorted(actions) == sorted([Action(k, i) for k in "FB" for i in range(microbatches)])
        for i in range(microbatches):
            assert actions.index(Action("F", i)) < actions.index(Action("B", i))


class Chain(nn.Module):
    def __init__(self, width=8, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, dtype=torch.float64) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).tanh()
        return x


@smpart.step
def train_step(model, x):
    loss = model(x).square().mean()
    model.backward(loss)
    return loss


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_a_real_run_starts_its_actions_in_the_schedules_order(schedule, stages):
    microbatches = 6
    pins = {"": 0, **{f"layers.{i}": i for i in range(stages)}}
    smpart.init(pipeline_parallel_degree=stages, microbatches=microbatches, pipeline=schedule, pin=pins)
    model = smpart.DistributedModel(Chain(depth=stages))
    expected = schedule_named(schedule).table(stages, microbatches)
    for _ in range(3):
        timeline = train_step(model, torch.randn(12, 8, dtype=torch.float64)).timeline
        assert timeline.started == {s: [str(a) for a in expected[s]] for s in range(stages)}
        for stage in range(stages):  # spans, in start order, follow the list too
            firsts = []
            for event in sorted(timeline.events, key=lambda e: e["start_s"]):
                action = ("F" if event["kind"] == "forward" else "B") + str(event["microbatch"])
                if event["stage"] == stage and action not in firsts:
                    firsts.append(action)
            assert firsts == timeline.started[stage]


_DEBUG_RUN = textwrap.dedent("""
    import json, torch, smpart
    from torch import nn
    smpart.init(pipeline_parallel_degree=2, microbatches=3, pipeline="1f1b", pin={"": 0, "0": 0, "1": 1})
    model = smpart.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))

    @smpart.step
    def step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    step(model, torch.randn(6, 4))
    print(json.dumps(step(model, torch.randn(6, 4)).timeline.started))
    smpart.shutdown()
""")


@pytest.mark.timeout(120)
def test_smpart_debug_logs_what_each_stage_receives_and_runs_in_the_order_it_runs_it():
    env = {**os.environ, "SMPART_DEBUG": "1"}
    done = subprocess.run([sys.executable, "-c", _DEBUG_RUN], env=env, capture_output=True, text=True,
                          timeout=100, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    started = {int(stage): actions for stage, actions in json.loads(done.stdout.splitlines()[-1]).items()}
    lines = done.stderr.splitlines()
    # The second step's lines: from the second BeginStep each stage receives on.
    runs: dict[int, list[str]] = {0: [], 1: []}
    for stage in (0, 1):
        begins = [i for i, line in enumerate(lines) if f"stage {stage} receives BeginStep(step=1" in line]
        assert len(begins) == 1, done.stderr
        for line in lines[begins[0]:]:
            found = re.search(rf"^\[rank - (smpart-[\w-]+)\] stage {stage} (runs|resumes) ([FB]\d+)", line)
            if found and found.group(3) not in runs[stage]:
                runs[stage].append(found.group(3))
    assert runs == started
    for kind in ("Request", "Gradients", "Release"):
        assert any(re.search(rf"^\[rank - smpart-[\w-]+\] stage 1 receives {kind}\(step=1, mb=2", line)
                   for line in lines), kind
    assert any(re.search(r"stage 1 runs F0: module '1' \(call", line) for line in lines)
    assert any("stage 0 runs B2: a backward segment for 1 gradient message(s)" in line for line in lines)


@pytest.mark.timeout(60)
def test_the_end_of_a_forward_rides_with_the_gradients_of_its_loss():
    """Every stage hears once per micro-batch that its forward is over; the stage that gets the
    gradients of the loss hears it in the same message, before them (one message, not two)."""
    stages, microbatches = 3, 2
    smpart.init(pipeline_parallel_degree=stages, microbatches=microbatches,
                pin={"": 0, "layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 2})
    model = smpart.DistributedModel(Chain(depth=4))
    x = torch.randn(4, 8, dtype=torch.float64)
    train_step(model, x)
    transport = current_runtime().transport
    sent: list[tuple[tuple, object]] = []
    send = transport.send

    def recording_send(src, address, message):
        sent.append((address, message))
        send(src, address, message)

    transport.send = recording_send  # an instance attribute: the runtime looks it up at every call
    try:
        train_step(model, x)
    finally:
        del transport.send
    heard = {(address, m.microbatch) for address, message in sent
             for m in (message.messages if isinstance(message, Batch) else [message])
             if isinstance(m, ForwardDone)}
    stage_addresses = {address for address, _ in sent if address[1] == STAGE}
    assert len(stage_addresses) == stages
    assert heard == {(address, mb) for address in stage_addresses for mb in range(microbatches)}
    notices = [(address, message) for address, message in sent
               if isinstance(message, ForwardDone) or (isinstance(message, Batch)
                                                       and isinstance(message.messages[0], ForwardDone))]
    assert len(notices) == stages * microbatches  # one message each, never a second one
    together = [message for _, message in notices if isinstance(message, Batch)]
    assert len(together) == microbatches  # one stage gets the loss's gradients, per micro-batch
    for batch in together:
        notice, gradients = batch.messages
        assert isinstance(gradients, Gradients) and gradients.microbatch == notice.microbatch


class Routed(nn.Module):
    """Each micro-batch goes to one of two experts by the sign of its mean: data-dependent routing.
    The expert a micro-batch skips never sees it: its stage must pass those actions over."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 4, dtype=torch.float64)
        self.up = nn.Linear(4, 4, dtype=torch.float64)
        self.down = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        h = self.gate(x)
        return self.up(h) if h.mean() > 0 else self.down(h)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_no_micro_batch_visits_passes_its_actions_over(schedule):
    smpart.init(pipeline_parallel_degree=3, microbatches=4, pipeline=schedule,
                pin={"": 0, "gate": 0, "up": 1, "down": 2})
    torch.manual_seed(0)  # the route depends on the gate's weights: with this seed, both experts are used
    model = smpart.DistributedModel(Routed())
    reference = Routed()
    reference.load_state_dict(model.state_dict())
    x = torch.cat([torch.full((2, 4), 5.0), torch.full((2, 4), -5.0)] * 2).double()
    out = train_step(model, x)
    losses = []
    for piece in x.chunk(4):
        loss = reference(piece).square().mean()
        (loss / 4).backward()
        losses.append(loss.detach())
    torch.testing.assert_close(out.stack(), torch.stack(losses))
    grads = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, msg=name)
    started = out.timeline.started
    assert len(started[1]) < 8 and len(started[2]) < 8  # each expert saw only some micro-batches


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
def test_a_long_backward_chain_of_stage_local_segments_matches_the_unsplit_model():
    # 600 backward segments, each posting the next one's gradient: none may nest in another.
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
def test_micro_batches_pass_each_module_in_order(schedule):
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


@pytest.mark.timeout(30)
def test_a_tensor_parallel_follower_grants_its_turn_in_its_leaders_order():
    """Claims arrive at the follower in another order than the leader granted them; the follower
    still grants them in the leader's order, and only once the leader has announced each."""
    actions = schedule_named("gpipe").actions(1, 2, 2)
    follower = StageScheduler(actions, follower=True)
    claims = {
        ("F", 1, 0): Claim(Action(FORWARD, 1), NEW, 0),
        ("F", 0, 1): Claim(Action(FORWARD, 0), NEW, 1),
        ("F", 0, 0): Claim(Action(FORWARD, 0), NEW, 0),
    }
    leader_order = [("F", 0, 0), ("F", 0, 1), ("F", 1, 0)]
    granted: list[tuple] = []

    def work(claim: Claim) -> None:
        follower.acquire(claim, 10, lambda: "test")
        granted.append(claim.key)
        follower.release(claim)

    threads = [threading.Thread(target=work, args=(claim,)) for claim in claims.values()]
    for thread in threads:  # arrival order: F1 first, then F0's second call, then its first
        thread.start()
        time.sleep(0.02)
    time.sleep(0.1)
    assert granted == [], "nothing is granted before the leader announces it"
    for key in leader_order:
        follower.follow(key)
    for thread in threads:
        thread.join(10)
    assert granted == leader_order
