"""Placement the partitioner would not choose: nested pins, shared modules called from several
stages, a Hugging Face model; each compared with the unsplit model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smpart
from tests.test_runtime import lm_step

TOL = 1e-5


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = nn.Linear(8, 8)
        self.own = nn.Linear(8, 8)

    def forward(self, x):
        return self.own(torch.tanh(self.child(x))) + x


class Nested(nn.Module):
    """Root and ``pre`` on stage 0; ``inner`` on stage 1, whose ``child`` is pinned back to 0."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = Inner()
        self.post = nn.Linear(8, 1)

    def forward(self, x):
        return self.post(self.inner(self.pre(x)))


class SharedUse(nn.Module):
    """One ``shared`` Linear called by ``a`` (stage 0) and by ``b`` (stage 1), twice by ``b``."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.a = Caller(self.shared)
        self.b = Caller(self.shared, times=2)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


class Caller(nn.Module):
    def __init__(self, shared, times=1):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.uses = [shared]  # a plain list: not registered, the module lives where its owner put it
        self.times = times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.relu(self.uses[0](self.proj(x)))
        return x


def run_both(model, pins, stages=2, microbatches=2, schedule="interleaved", steps=2, use_set_partition=None,
             **init):
    model = model.double()
    reference = copy.deepcopy(model)
    for module, stage in (use_set_partition or {}).items():
        smpart.set_partition(model.get_submodule(module), stage)
    smpart.init(pipeline_parallel_degree=stages, microbatches=microbatches, pipeline=schedule, pin=pins,
                timeout_s=30, **init)
    dm = smpart.DistributedModel(model)

    @smpart.step
    def step(model, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    for seed in range(steps):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        y = torch.randn(4, 1, generator=g, dtype=torch.float64)
        out = step(dm, x, y)
        ref_losses = []
        for xi, yi in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = torch.nn.functional.mse_loss(reference(xi), yi)
            (loss / microbatches).backward()
            ref_losses.append(loss.detach())
        assert (out.stack() - torch.stack(ref_losses)).abs().max() <= TOL
        for (n, p), (_, q) in zip(dm.named_parameters(), reference.named_parameters(), strict=True):
            assert (p.grad - q.grad).abs().max() <= TOL, n
            p.grad = q.grad = None
    return dm


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_nested_placement_child_back_on_stage_0(schedule):
    dm = run_both(Nested(), {"": 0, "pre": 0, "inner": 1, "post": 0}, schedule=schedule, microbatches=4,
                  use_set_partition={"inner.child": 0})
    stages = smpart.partition_of(dm).module_stages()
    assert (stages["inner"], stages["inner.child"], stages[""]) == (1, 0, 0)


@pytest.mark.timeout(60)
def test_shared_module_called_from_two_stages():
    dm = run_both(SharedUse(), {"a": 0, "shared": 0, "b": 1, "head": 1})
    stages = smpart.partition_of(dm).module_stages()
    assert stages["a"] != stages["b"]


@pytest.mark.timeout(120)
def test_hugging_face_gpt2_from_a_tiny_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    dm = smpart.DistributedModel(model)
    ids = torch.randint(64, (4, 8), generator=torch.Generator().manual_seed(0))
    out = lm_step(dm, ids)
    ref_losses = []
    for chunk in ids.chunk(2):
        loss = reference(input_ids=chunk, labels=chunk).loss
        (loss / 2).backward()
        ref_losses.append(loss.detach())
    assert (out.stack() - torch.stack(ref_losses)).abs().max() <= TOL
    assert len(set(smpart.partition_of(dm).module_stages().values())) == 2
    for (n, p), (_, q) in zip(dm.named_parameters(), reference.named_parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= TOL, n


class TiedEncoderDecoder(nn.Module):
    """The first layer of ``enc`` and the last of ``dec`` share one weight (like a tied embedding
    and LM head), so the shared node is called from inside two modules on different stages."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8), nn.Tanh())
        self.dec = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8, bias=False))
        self.dec[2].weight = self.enc[0].weight
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.dec(self.enc(x)))


@pytest.mark.timeout(60)
def test_tied_weight_between_modules_on_different_stages_callers():
    dm = run_both(TiedEncoderDecoder(), {"enc": 0, "dec": 1, "head": 1}, microbatches=4)
    stages = smpart.partition_of(dm).module_stages()
    assert stages["enc.0"] == stages["dec.2"]
    assert stages["enc"] != stages["dec"]
    assert len(list(dm.parameters())) == len(list(TiedEncoderDecoder().parameters()))


@pytest.mark.timeout(60)
def test_trace_on_the_real_device_and_calls_outside_a_step():
    dm = run_both(Nested(), {}, stages=2, schedule="simple", steps=1, trace_device="real")
    x = torch.randn(2, 8, dtype=torch.float64)
    expected = copy.deepcopy(dm.module)
    with torch.no_grad():
        assert torch.equal(dm(x), expected(x))  # outside a step: runs inline like a plain module


@pytest.mark.timeout(60)
def test_non_split_inputs_and_split_axes():
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin={"": 0, "pre": 0, "inner": 1, "post": 1})
    model = Nested().double()
    dm = smpart.DistributedModel(model)

    @smpart.step(non_split_inputs=["scale"], input_split_axes={"xt": 1})
    def step(model, xt, scale):
        return model(xt.t()) * scale

    xt = torch.randn(8, 4, dtype=torch.float64)  # batch along axis 1
    scale = torch.tensor([2.0], dtype=torch.float64)  # given whole to both micro-batches
    out = step(dm, xt, scale)
    with torch.no_grad():
        expected = copy.deepcopy(model)(xt.t()) * 2
    assert (out.concat() - expected).abs().max() <= TOL


@pytest.mark.timeout(60)
def test_a_tensor_meant_whole_that_the_step_split_is_named_in_the_error():
    """Class weights passed to the step are split like the batch (SMP's rule): the body's error
    says so and names the way out, which then gives the unsplit model's loss."""
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    reference = copy.deepcopy(model)
    dm = smpart.DistributedModel(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3])
    weights = torch.arange(1.0, 9.0, dtype=torch.float64)  # one per class of 8

    def body(model, x, y, weights):
        return F.cross_entropy(model(x), y, weight=weights)

    with pytest.raises(smpart.PipelineError, match=r"split into 2 micro-batches.*non_split_inputs"):
        smpart.step(body)(dm, x, y, weights)
    out = smpart.step(non_split_inputs=["weights"])(body)(dm, x, y, weights)
    with torch.no_grad():
        expected = [F.cross_entropy(reference(xs), ys, weight=weights)
                    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True)]
    assert (out.stack() - torch.stack(expected)).abs().max() <= TOL


class Relay(nn.Module):
    """The root passes one stage's output to the next: unchanged, then changed in place."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        y = self.b(self.a(x))  # a's output goes on to b unchanged: its gradient skips the root
        y.mul_(2)  # changed in place: this one must go back through the root's own graph
        return self.head(self.c(y) + y)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_relayed_tensors_unchanged_and_changed_in_place(schedule):
    run_both(Relay(), {"": 0, "a": 1, "b": 2, "c": 1, "head": 0}, stages=3, microbatches=4, schedule=schedule)
