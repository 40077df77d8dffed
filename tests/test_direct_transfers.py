"""Direct transfers (`smpart.runtime.program.routes`): from a model's fourth step under torchrun,
its tensors travel as their bytes alone; the results stay the unsplit model's, and a step that
gives up mid-way leaves the channel ready for the next."""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch

import smpart
from smpart.runtime.program import routes
from tests.launch import run_ranks, values
from tests.test_programs import Chain, batch, chain_pins
from tests.test_programs_processes import TOL, _Boom, _state_difference, _two_stages_against_unsplit


@smpart.step
def classify(model, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


def _cross_entropy(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def _batch_of(i):
    return batch(i, size=4)


# ==================================================================== what crosses, and how
class _Encoder(torch.nn.Module):
    """What crosses the cut: a float64 activation, an odd-sized float32 tensor (the next one's
    offset is aligned), an int64 tensor, a tensor of 320 KB a micro-batch (then the message's
    tensors are sent as they are, its flag behind them on its own) and an empty one (nothing sent)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return h, h[:, :3].float() * 2, x.argmax(dim=1), h.repeat(1, 2500), h[:, :0] * 2


class _Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = _Encoder()
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h, small, index, big, empty = self.encoder(x)
        mixed = h + 0.1 * big[:, 8:16] + 0.1 * small.double().sum(1, keepdim=True) + 0.01 * index[:, None]
        mixed = mixed + empty.sum(1, keepdim=True)
        return self.head(mixed)


def _mixed(rank):
    seen = []
    for direct in (True, False):
        torch.manual_seed(0)
        seen.append(_two_stages_against_unsplit(
            _Mixed().double(), {"": 1, "encoder": 0, "head": 1}, 5, _batch_of, classify, _cross_entropy,
            seen=lambda timeline: timeline.transfers, direct_transfers=direct))
        smpart.shutdown()
    return seen


@pytest.mark.timeout(200)
def test_a_program_sends_its_tensors_direct_from_its_third_run_of_every_dtype_and_size():
    for (direct, worst), (framed, worst_framed) in values(run_ranks(_mixed, 2, timeout_s=190)):
        # the first step runs on the reference runtime, the second discovers the program, the
        # third notes what crosses: the fourth on go direct
        assert direct == ["", "framed", "framed", "direct", "direct"], direct
        assert framed == ["", "framed", "framed", "framed", "framed"], framed  # direct_transfers=False
        assert worst <= TOL and worst_framed <= TOL, (worst, worst_framed)


def _virtual(rank):
    torch.manual_seed(0)
    return _two_stages_against_unsplit(
        Chain().double(), chain_pins(4), 5, _batch_of, classify, _cross_entropy,
        seen=lambda timeline: timeline.transfers, virtual_stages=2, pipeline="1f1b")


@pytest.mark.timeout(200)
def test_virtual_stages_on_two_processes_go_direct_too():
    """Two stages per rank: a micro-batch crosses the cut between the ranks three times forward
    and three times back, all of it direct from the fourth step."""
    for transfers, worst in values(run_ranks(_virtual, 2, timeout_s=190)):
        assert transfers == ["", "framed", "framed", "direct", "direct"], transfers
        assert worst <= TOL, worst


# ==================================================================== a step that gives up
class _Narrowing(torch.nn.Linear):
    """Its output loses a column when ``narrow`` is set: a shape its program never saw."""

    narrow = False

    def forward(self, x):
        out = super().forward(x)
        return out[:, :3] if self.narrow else out


class _Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.head = _Narrowing(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.first(x)))


def _narrow_once(rank):
    def narrow_at_step_4(i, models):
        for model in models:
            model.head.narrow = i == 4

    torch.manual_seed(0)
    return _two_stages_against_unsplit(
        _Chain().double(), {"": 0, "first": 0, "head": 1}, 8, lambda i: batch(i, size=4, classes=3), classify,
        _cross_entropy, seen=lambda timeline: (timeline.runtime, timeline.transfers), before=narrow_at_step_4)


@pytest.mark.timeout(200)
def test_a_direct_step_that_diverges_on_the_second_rank_runs_again_on_the_reference_runtime():
    """The second rank finds the head's new shape mid-step, while the first waits for the
    gradients it posted receives for: the second sends what it still owed, flagged, so the first
    gives up too (not a hang, not a gradient of garbage), and the step runs on the reference
    runtime with the unsplit model's result."""
    for seen, worst in values(run_ranks(_narrow_once, 2, timeout_s=190)):
        assert seen[3] == ("program", "direct") and seen[4] == ("reference", ""), seen
        assert worst <= TOL, worst


def _fails_once(rank):
    """A direct step whose head fails on the second rank, then more steps, against the unsplit
    model (which skips the failed step): how each step's tensors travelled, what the failed step
    raised, and the worst difference of the losses and the final state."""
    torch.manual_seed(0)
    model = _Chain().double()
    model.head = _Boom(8, 4).double()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60, pin={"": 0, "first": 0, "head": 1})
    dm = smpart.DistributedModel(model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    seen, caught, worst = [], "", 0.0
    for i in range(8):
        x, y = batch(i, size=4)
        model.head.fail = i == 4
        try:
            out = classify(dm, x, y)
        except smpart.SmpartError as err:
            seen.append("failed")
            caught = str(err)
            dm.zero_grad()
            continue
        losses = [_cross_entropy(reference, x[2 * j:2 * j + 2], y[2 * j:2 * j + 2]) for j in range(2)]
        for loss in losses:
            (loss / 2).backward()
        worst = max(worst, (out.stack() - torch.stack(losses).detach()).abs().max().item())
        seen.append(out.timeline.transfers)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    return seen, caught, max(worst, _state_difference(dm, reference))


@pytest.mark.timeout(200)
def test_a_direct_step_that_fails_on_one_rank_fails_on_both_and_the_next_steps_go_direct_again():
    """The first rank waits for a gradient the second will never compute: the second's error
    reaches it as the flag of what the second still owed, and every transfer of the step is
    settled, so the next run (noting again) and the ones after (direct) meet a quiet channel."""
    for seen, caught, worst in values(run_ranks(_fails_once, 2, timeout_s=190)):
        assert seen == ["", "framed", "framed", "direct", "failed", "framed", "direct", "direct"], seen
        assert "boom on the second stage" in caught, caught
        assert worst <= TOL, worst


def _one_hangs(rank):
    """Three steps, then, in the first direct one, the second rank stops (SIGSTOP: alive, its sockets
    open, silent) before its loss's backward, while the first waits for that gradient."""
    torch.manual_seed(0)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=300, pin={"": 0, "first": 0, "head": 1})
    dm = smpart.DistributedModel(_Chain().double())

    @smpart.step
    def step(model, x, y):
        loss = _cross_entropy(model, x, y)
        if smpart.rank() == 1 and os.environ.get("SMPART_TEST_HANG") == "now":
            os.kill(os.getpid(), signal.SIGSTOP)
        model.backward(loss)
        return loss

    x, y = batch(0, size=4)
    for _ in range(3):
        step(dm, x, y)
        dm.zero_grad()
    os.environ["SMPART_TEST_HANG"] = "now"
    started = time.monotonic()
    try:
        out = step(dm, x, y)
    except smpart.SmpartError as err:
        return time.monotonic() - started, str(err)
    return None, out.timeline.transfers


@pytest.mark.timeout(120)
def test_a_rank_that_hangs_in_a_direct_step_is_named_by_the_others_once_its_heartbeat_stops():
    """The first rank waits for a gradient on its own thread, outside the transport: the
    transport's heartbeats find the second rank lost (~15 s) and release that wait, instead of the
    step's timeout (300 s) running out."""
    first, second = run_ranks(_one_hangs, 2, timeout_s=100, stray={1})
    assert first.error is None and first.value is not None, first
    took, text = first.value
    assert took is not None and took < 45, (took, text)
    assert "rank 1" in text, text


# ==================================================================== the routes' agreement
def _notes(me, sent, came):
    notes = routes.Notes(me)
    for to, items in sent:
        notes.sent(to, items)
    for src, items in came:
        notes.arrived(src, items)
    return notes


def test_two_ranks_agree_on_a_route_only_where_both_ends_noted_the_same_messages():
    activation, labels = torch.zeros(2, 8), torch.tensor([1, 2])
    forward = [(("F", 0, 0), activation, True), (("F", 0, 1), labels, False)]
    gradient = [(("B", 0, 0), torch.ones(2, 8), False)]
    first = _notes(0, [(1, forward)], [(1, gradient)])
    second = _notes(1, [(0, gradient)], [(0, forward)])
    assert routes.agree([first.digests(), second.digests()])
    # the second rank saw the labels in another message than the one the first sent them in
    split = _notes(1, [(0, gradient)], [(0, forward[:1]), (0, forward[1:])])
    assert not routes.agree([first.digests(), split.digests()])
    # a gradient the second rank sent that never arrived (the first rank ended before it came)
    unheard = _notes(0, [(1, forward)], [])
    assert not routes.agree([unheard.digests(), second.digests()])
    # a tensor that cannot go direct: not this program
    meta = _notes(1, [(0, [(("B", 0, 0), torch.ones(2, 8, device="meta"), False)])], [(0, forward)])
    assert meta.digests() is None and not routes.agree([first.digests(), meta.digests()])


def test_a_message_lays_its_tensors_out_where_any_dtype_can_view_them():
    message = (("F", 0, 0), (3,), torch.float32, False), (("F", 0, 1), None, None, False), \
        (("F", 0, 2), (2,), torch.float64, False), (("F", 0, 3), (5,), torch.bool, False)
    offsets, sizes, end = routes._layout(message)
    assert offsets == [0, None, 16, 32] and sizes == [12, 0, 16, 5] and end == 37
