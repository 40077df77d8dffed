"""A stage holds gradients back until every piece of them is in (`gradients.Holding`), so each part
of its graph runs its backward once per micro-batch, as in the unsplit model; and a gradient it
expected that never comes is flushed, never waited for.

The reference is the unsplit model: its gradients, and how many times each parameter's gradient is
accumulated in a step (``register_post_accumulate_grad_hook``), once per micro-batch and use.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smpart
from bench.backward_work import count_accumulations
from examples.models import ZOO
from tests.launch import run_ranks, values


@pytest.fixture(autouse=True)
def _reference_runtime(monkeypatch):
    """These tests look inside the reference runtime (SMP's: requests, handles, holding,
    turns); with step programs on, steps after a model's first would run as programs."""
    monkeypatch.setenv("SMPART_PROGRAMS", "0")


TOL = 1e-9
MICROBATCHES = 4
STEPS = 6  # holding learns from each step; 2 stages settle in 2 (bench/backward_work.py)

# GPT-2 with block 1 cut in two as smpart's partition cuts GPT-2 small's block 4 (ln_1 with its
# block, the rest on the next stage): the residual stream crosses back and forth.
SPLIT_BLOCK = {"": 0, "transformer": 0, "transformer.wte": 0, "transformer.wpe": 0, "lm_head": 0,
               "transformer.h": 0, "transformer.h.0": 0, "transformer.h.1": 0, "transformer.h.1.ln_1": 0,
               "transformer.h.1.attn": 1, "transformer.h.1.ln_2": 1, "transformer.h.1.mlp": 1,
               "transformer.h.2": 1, "transformer.h.3": 1, "transformer.ln_f": 1}


def _split_block_run(schedule: str, **config) -> dict:
    """Train the split GPT-2 and the unsplit one side by side; per step, the worst gradient
    difference and the parameters (of this rank) accumulated more or fewer times than unsplit."""
    example = ZOO["gpt2"](dtype=torch.float64, n_layer=4)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, pipeline=schedule, pin=SPLIT_BLOCK,
                timeout_s=60, **config)
    model = smpart.DistributedModel(example.model)

    @smpart.step
    def step(model, args, target):
        loss = example.loss(model(*args), target)
        model.backward(loss)
        return loss

    report = {"grad": [], "miscounted": []}
    for seed in range(STEPS):
        args, _, target = example.batch(8, seed=seed)

        def unsplit(args=args, target=target):
            for i in range(MICROBATCHES):
                out = reference(*[a.chunk(MICROBATCHES)[i] for a in args])
                (example.loss(out, target.chunk(MICROBATCHES)[i]) / MICROBATCHES).backward()

        expected = count_accumulations(reference, unsplit)
        counted = count_accumulations(model, lambda args=args, target=target: step(model, args, target))
        mine = {n for n, p in model.named_parameters() if p.device.type != "meta"}
        # The tied weight's two uses reach it in two backward passes here, in one unsplit: two
        # accumulations for one are two halves of the work, not a repeat.
        uses = {"transformer.wte.weight": 2}
        report["miscounted"].append(sorted(n for n in mine if not expected[n] <= counted.get(n, 0)
                                           <= uses.get(n, 1) * expected[n]))
        pairs = zip(model.named_parameters(), reference.named_parameters(), strict=True)
        report["grad"].append(max((p.grad - q.grad).abs().max().item()
                                  for (n, p), (_, q) in pairs if n in mine))
        model.zero_grad()
        reference.zero_grad()
    smpart.shutdown()
    return report


def _assert_split_block(report: dict) -> None:
    assert max(report["grad"]) <= TOL, report["grad"]
    assert report["miscounted"][0], "the first step (nothing learnt yet) repeats work, or the test is blind"
    assert report["miscounted"][-2:] == [[], []], report["miscounted"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_block_split_between_stages_runs_each_backward_once_per_microbatch(schedule):
    _assert_split_block(_split_block_run(schedule))


@pytest.mark.timeout(120)
def test_with_holding_off_the_gradients_are_the_same_and_the_work_repeats():
    """``Config.gradient_holding=False`` turns the mechanism off: still the unsplit model's gradients,
    and the blocks before the cut run their backward again at every step (nothing is held back)."""
    report = _split_block_run("1f1b", gradient_holding=False)
    assert max(report["grad"]) <= TOL, report["grad"]
    assert all(report["miscounted"]), report["miscounted"]


@pytest.mark.timeout(120)
def test_a_block_split_between_processes_runs_each_backward_once_per_microbatch():
    for report in values(run_ranks(_split_block_on_rank, 2, timeout_s=100)):
        _assert_split_block(report)


def _split_block_on_rank(rank):
    return _split_block_run("1f1b")


# ---------------------------------------------------------------------------- a message that never comes
class SometimesUnused(nn.Module):
    """``c``'s output counts only when ``use_c``: otherwise no gradient comes back for the ``h``
    that stage 0 sent it, though one came in the steps before."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_c):
        h = torch.tanh(self.a(x))
        y, z = self.b(h), self.c(h)
        return y + h + z if use_c else y + h


@pytest.mark.timeout(60)
def test_an_expected_gradient_that_never_comes_is_flushed_not_waited_for():
    torch.manual_seed(0)
    module = SometimesUnused().double()
    reference = copy.deepcopy(module)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin={"": 0, "a": 0, "b": 1, "c": 1}, timeout_s=20)
    model = smpart.DistributedModel(module)

    @smpart.step
    def step(model, x, y, use_c):
        loss = F.mse_loss(model(x, use_c), y)
        model.backward(loss)
        return loss

    for use_c in (True, True, False, True, False, False):
        x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
        step(model, x, y, use_c)
        for i in range(2):
            (F.mse_loss(reference(x.chunk(2)[i], use_c), y.chunk(2)[i]) / 2).backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None or p.grad.abs().max() == 0, name
            else:
                assert (p.grad - q.grad).abs().max().item() <= TOL, (use_c, name)
        model.zero_grad()
        reference.zero_grad()


def test_the_blocked_part_is_what_lies_upstream_of_calls_still_expecting_a_message():
    """Hand-worked: ``w -> b -> c`` with ``b`` sent to one call and ``c`` to another, each
    expecting one message. ``b``'s graph lies upstream of both; ``c``'s own node only of ``c``;
    the parameter ``w`` (a leaf) blocks nothing."""
    from torch.autograd.graph import get_gradient_edge

    from smpart.runtime.reference.gradients import Holding
    from smpart.runtime.wire.messages import Gradients

    w = torch.ones(2, requires_grad=True)
    b = (w * 2).exp()
    c = b.sin()
    node = {name: get_gradient_edge(t).node for name, t in (("b", b), ("c", c))}
    mul = node["b"].next_functions[0][0]
    sent = {"first": ("m", [b]), "second": ("m", [c])}
    holding = Holding(lambda call_id, to_outputs: 1)

    assert set(holding.blocked({}, sent)) == {node["b"], mul, node["c"]}  # the leaf never blocks
    holding.count([Gradients(0, 0, [("second", False, {0: torch.ones(2)})], 1)])
    assert set(holding.blocked({}, sent)) == {node["b"], mul}
    holding.count([Gradients(0, 0, [("first", False, {0: torch.ones(2)})], 1)])
    assert not holding.blocked({}, sent)

    flushed = Holding(lambda call_id, to_outputs: 1)
    assert flushed.blocked({}, sent)
    flushed.count([Gradients(0, 0, [], 0, flush=True)])
    assert not flushed.blocked({}, sent)


@pytest.mark.timeout(120)
def test_holding_walks_each_kept_calls_graph_once_however_many_calls_a_stage_makes(monkeypatch):
    """A root calling another stage's module ``n`` times keeps ``n`` calls per micro-batch on
    each side. Holding must find what each call blocks once, O(n) autograd nodes a step, not again
    for every gradient message: O(n²) made `bench/overhead.py`'s thread round trip 3x slower."""
    from bench.overhead import PINS, PingPong
    from bench.overhead import train_step as ping_pong_step
    from smpart.runtime.reference import gradients

    walked: list[int] = []
    upstream = gradients._upstream

    def counting(nodes):
        found = upstream(nodes)
        walked.append(len(found))
        return found

    monkeypatch.setattr(gradients, "_upstream", counting)
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin=PINS, timeout_s=60)
    try:
        net = PingPong()
        net.calls = 60
        model = smpart.DistributedModel(net)
        x = torch.randn(1, 4)
        for _ in range(3):  # place, learn how many messages each call gets
            ping_pong_step(model, x)
        walked.clear()
        ping_pong_step(model, x)
    finally:
        smpart.shutdown()
    assert walked, "holding never looked at the graph: the test is blind"
    assert sum(walked) <= 10 * net.calls, sum(walked)  # here 237 (about 4 per call); 7140 before
