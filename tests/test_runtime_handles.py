"""Handles: an output stays on the stage that made it, so activations cross each cut once per direction.

The zoo's GPT-2 has its root on stage 0 call the blocks of the other stages one by one. Without
handles every block's output went back to stage 0 and straight out again; with them the bytes a
step sends between each pair of stages (``timeline.bytes_sent``) are those of a chain: for every
cut between consecutive leaf modules in call order, one activation forward and its gradient
backward, per micro-batch. Gradients and the trained state still equal the unsplit model's.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import smpart
from examples.models import ZOO
from smpart.errors import SmpartError
from smpart.runtime.reference.boundary import Route
from smpart.runtime.reference.handles import Handle, HandleRef
from tests.launch import run_ranks, values
from tests.test_runtime import TOL, assert_same_grads, reference_step, train_step


@pytest.fixture(autouse=True)
def _reference_runtime(monkeypatch):
    """These tests look inside the reference runtime (SMP's: requests, handles, holding,
    turns); with step programs on, steps after a model's first would run as programs."""
    monkeypatch.setenv("SMPART_PROGRAMS", "0")


MICROBATCHES, BATCH = 2, 4
#: 4 stages cut at block boundaries (the partitioner itself cuts inside h.6, whose residual adds
#: then run on another stage than its attention and MLP: more than one activation must cross there).
PINS_4 = {"": 0, "transformer": 0, "transformer.wte": 0, "transformer.wpe": 0,
          **{f"transformer.h.{i}": i // 2 for i in range(8)}, "transformer.ln_f": 3}


def chain_bytes(model: torch.nn.Module, args: tuple, stages: dict[str, int], activation: int) -> Counter:
    """``(src, dst) -> bytes`` of a chain: per cut between consecutive leaves (in the order the unsplit
    model calls them), an activation forward and a gradient backward, per micro-batch."""
    order: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda _m, _a, name=name: order.append(name))
             for name, m in model.named_modules() if not any(True for _ in m.children())]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for hook in hooks:
            hook.remove()
    expected: Counter = Counter()
    for a, b in zip(order, order[1:], strict=False):
        if stages[a] != stages[b]:
            expected[(stages[a], stages[b])] += activation * MICROBATCHES
            expected[(stages[b], stages[a])] += activation * MICROBATCHES
    return expected


def _train(stages: int, steps: int = 2, check_grads: bool = True,
           **init) -> tuple[list[dict], Counter, float]:
    """Train GPT-2 (float64) split in ``stages`` next to the unsplit model; every step's bytes_sent,
    the chain's bytes and the largest difference of the trained state."""
    example = ZOO["gpt2"](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=stages, microbatches=MICROBATCHES, pipeline="1f1b", timeout_s=60,
                **init)
    try:
        model = smpart.DistributedModel(example.model)
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        sent = []
        for step in range(steps):
            args, kwargs, target = example.batch(BATCH, seed=step)
            out = train_step(model, example, args, kwargs, target)
            expected = reference_step(reference, example, args, kwargs, target, MICROBATCHES)
            assert (out.stack() - expected).abs().max().item() <= TOL
            if check_grads:  # threads: every parameter is here
                assert_same_grads(model, reference)
            sent.append(dict(out.timeline.bytes_sent))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        stage_of = dict(smpart.partition_of(model).module_stages())
        seq, width = args[0].shape[1], example.model.config.n_embd
        chain = chain_bytes(reference, (args[0].chunk(MICROBATCHES)[0],), stage_of,
                            BATCH // MICROBATCHES * seq * width * 8)
        full = model.state_dict()
        state_diff = max((full[k].double() - v.double()).abs().max().item()
                         for k, v in reference.state_dict().items())
        return sent, chain, state_diff
    finally:
        smpart.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stages", "pin"), [(2, {}), (4, PINS_4)])
def test_threads_send_what_a_chain_sends_and_train_like_the_unsplit_model(stages, pin):
    sent, chain, state_diff = _train(stages, pin=pin)
    assert len(chain) == (2 if stages == 2 else 8)  # pairs of stages with a cut between them
    for step_sent in sent:
        assert step_sent == dict(chain)
    assert state_diff <= TOL


@pytest.mark.timeout(120)
def test_without_handles_outputs_bounce_and_training_is_the_same():
    sent, chain, state_diff = _train(2, steps=1, output_handles=False)
    assert sum(sent[0].values()) > sum(chain.values())
    assert state_diff <= TOL


def _on_rank(rank: int, stages: int, pin: dict):
    sent, chain, state_diff = _train(stages, check_grads=False, pin=pin)
    return sent, dict(chain), state_diff


@pytest.mark.timeout(150)
def test_processes_send_what_a_chain_sends_and_train_like_the_unsplit_model():
    (sent, chain, state_diff), _ = values(run_ranks(_on_rank, 2, 2, {}, timeout_s=140))
    for step_sent in sent:
        assert step_sent.keys() == chain.keys()
        # The process transport also counts the step result (the float64 losses) that rank 0 sends
        # the other rank at the end of a step; it may fall into the next step's count.
        for pair, size in chain.items():
            assert step_sent[pair] - size in ((0, MICROBATCHES * 8) if pair == (0, 1) else (0,)), pair
    assert state_diff <= TOL


def test_a_handle_answers_metadata_without_its_data_and_refuses_use_outside_a_step():
    ref = HandleRef(("nowhere", "stage"), 0, 0, (1, 2), 0, (2, 3, 4), torch.float16, True,
                    Route(("nowhere", "stage"), (1, 2), 0, True))
    handle = Handle(ref, "cpu")
    assert isinstance(handle, torch.Tensor)
    assert (handle.shape, handle.size(-1), handle.dim(), len(handle)) == ((2, 3, 4), 4, 3, 2)
    assert (handle.dtype, handle.device, handle.requires_grad) == (torch.float16, torch.device("cpu"), True)
    assert handle.numel() == 24
    assert "HandleRef" in repr(handle)
    with pytest.raises(SmpartError, match="outside the step"):
        handle + 1


class _Scale(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width, dtype=torch.float64))

    def forward(self, x):
        return x * self.weight


class _PingPong(torch.nn.Module):
    """The root (stage 0) computes with each output of a stage-1 module: every output is used
    where it is not held."""

    def __init__(self, width: int):
        super().__init__()
        self.local, self.remote = _Scale(width), _Scale(width)

    def forward(self, x):
        for _ in range(3):
            x = self.local(self.remote(x)).tanh()
        return x


@smpart.step
def _ping_pong_step(model, x):
    loss = model(x).square().sum()
    model.backward(loss)
    return loss


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("width", "fetches"), [(8, 0), (512, 3 * MICROBATCHES)])
def test_a_small_output_comes_with_its_handle_and_needs_no_fetch(width, fetches):
    # 2 rows x 8 float64 = 128 B per output: under SMALL_BYTES; 2 x 512 x 8 = 8 KiB: over it.
    from smpart.runtime.runtime import current_runtime
    from smpart.runtime.wire.messages import Fetch

    reference = _PingPong(width)
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, pin={"": 0, "local": 0, "remote": 1})
    try:
        model = smpart.DistributedModel(copy.deepcopy(reference))
        x = torch.randn(2 * MICROBATCHES, width, dtype=torch.float64)
        _ping_pong_step(model, x)  # placed
        model.zero_grad()
        transport = current_runtime().transport
        sent: list[str] = []
        send = transport.send
        transport.send = lambda src, address, message: (sent.append(type(message).__name__),
                                                        send(src, address, message))[1]
        try:
            loss = _ping_pong_step(model, x).reduce_mean()
        finally:
            del transport.send
        assert sent.count(Fetch.__name__) == fetches
        losses = [reference(part).square().sum() for part in x.chunk(MICROBATCHES)]
        (sum(losses) / MICROBATCHES).backward()
        assert abs(loss.item() - (sum(losses) / MICROBATCHES).item()) <= TOL
        assert_same_grads(model, reference)
    finally:
        smpart.shutdown()


class _TwiceRemote(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.remote = _Scale(width)

    def forward(self, x):
        return self.remote(self.remote(x))


@pytest.mark.timeout(60)
def test_a_small_handle_passed_back_to_its_owner_does_not_carry_its_data_again():
    width, rows = 8, 2  # 2 x 8 float64 = 128 B per micro-batch and tensor
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, pin={"": 0, "remote": 1})
    try:
        model = smpart.DistributedModel(_TwiceRemote(width))
        out = _ping_pong_step(model, torch.randn(rows * MICROBATCHES, width, dtype=torch.float64))
        size = rows * width * 8 * MICROBATCHES
        # 0 -> 1: the input, then the loss gradient; the first call's output goes back as a bare
        # reference. 1 -> 0: both outputs, each with its reference; the step body uses the second
        # without a fetch (which would send it once more).
        assert dict(out.timeline.bytes_sent) == {(0, 1): 2 * size, (1, 0): 2 * size}
    finally:
        smpart.shutdown()


class _Doubled(torch.autograd.Function):
    """A custom autograd function: ``Function.apply`` hands it its input as is, a `Handle` too,
    and autograd sends the input's gradient to that very object (as tensor-parallel layers do)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Through(torch.nn.Module):
    """Stage 0's root calls ``inner`` (stage 1, its output held there) and then uses that output on
    stage 0 in a custom function and in a plain operation: both gradients must reach stage 1."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.outer = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        h = self.inner(x)
        return self.outer(_Doubled.apply(h)) + h.tanh()


@pytest.mark.timeout(60)
def test_a_custom_autograd_function_given_a_handle_sends_its_gradient_to_the_owner():
    torch.manual_seed(0)
    net = _Through()
    reference = copy.deepcopy(net)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin={"": 0, "outer": 0, "inner": 1})
    model = smpart.DistributedModel(net)

    @smpart.step
    def step(model, x):
        loss = model(x).square().sum()
        model.backward(loss)
        return loss

    x = torch.randn(4, 4, dtype=torch.float64)
    for _ in range(2):
        model.zero_grad()
        step(model, x)
    reference.zero_grad()
    for piece in x.chunk(2):
        (reference(piece).square().sum() / 2).backward()
    assert_same_grads(model, reference)
