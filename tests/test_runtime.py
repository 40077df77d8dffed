"""Pipelined training equals unsplit training: losses and every gradient, for every zoo model.

The reference is a deep copy of the same model trained on one device with the same micro-batch
semantics (the loss of a step is the mean of the per-micro-batch losses; gradients are averaged).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from dataclasses import dataclass, field

import pytest
import torch
import torch.utils._pytree as pytree

import smpart
from examples.models import ZOO

TOL = 1e-5


@smpart.step
def train_step(model, example, args, kwargs, target):
    output = model(*args, **kwargs)
    OUTPUT_DEVICES.add(str(_device_of(output)))
    loss = example.loss(output, target.to(_device_of(output)))  # the last stage may be on a GPU
    model.backward(loss)
    return loss


@smpart.step
def cross_entropy_step(model, x, y):
    """A classifier's training step, as a user writes it."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


@smpart.step
def lm_step(model, ids):
    """A Hugging Face causal LM's training step: its own loss, the labels being the inputs."""
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


#: Where `train_step`'s body got the model's output, in this process (drivers add to it).
OUTPUT_DEVICES: set[str] = set()


def _device_of(output) -> torch.device:
    return next(leaf.device for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor))


def reference_step(model, example, args, kwargs, target, microbatches):
    """Unsplit model, same micro-batching: mean of micro-batch losses, gradients averaged."""
    losses = []
    for i in range(microbatches):
        a = [x.chunk(microbatches)[i] for x in args]
        k = {n: v.chunk(microbatches)[i] for n, v in kwargs.items()}
        loss = example.loss(model(*a, **k), target.chunk(microbatches)[i])
        (loss / microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


@dataclass
class Differences:
    """Pipelined training against the unsplit model, the worst over a run's steps. Plain data, so
    a rank can report it; gradients are those of the parameters held where it was measured (all of
    them on threads, the rank's own stage on processes)."""

    loss: float = 0.0
    grad: float = 0.0
    state: float = 0.0
    one_sided_grads: list[str] = field(default_factory=list)  # a gradient on one side only
    same_state_keys: bool = True
    devices: list[str] = field(default_factory=list)  # where the parameters held here are
    bytes_sent: int = 0  # crossing stages in the last step
    output_devices: list[str] = field(default_factory=list)  # where the step body got the model's output

    def assert_within(self, tol: float, context: object = None) -> None:
        assert not self.one_sided_grads, (context, self.one_sided_grads)
        assert self.same_state_keys, context
        for key in ("loss", "grad", "state"):
            assert getattr(self, key) <= tol, (context, key, getattr(self, key))


def grad_differences(pipelined, reference) -> tuple[dict[str, float], list[str]]:
    """Per parameter held here, the largest gradient difference; and the parameters with a
    (nonzero) gradient on one side only."""
    names = [n for n, _ in pipelined.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()]
    differences, one_sided = {}, []
    for (name, p), (_, q) in zip(pipelined.named_parameters(), reference.named_parameters(), strict=True):
        if p.device.type == "meta":  # another rank's stage
            continue
        if q.grad is None:
            if p.grad is not None and p.grad.abs().max() != 0:
                one_sided.append(name)
        elif p.grad is None:
            one_sided.append(name)
        else:
            differences[name] = (p.grad.cpu() - q.grad).abs().max().item()
    return differences, one_sided


def assert_same_grads(pipelined, reference):
    differences, one_sided = grad_differences(pipelined, reference)
    assert not one_sided, f"a gradient on one side only: {one_sided}"
    off = {name: d for name, d in differences.items() if d > TOL}
    assert not off, off


def train_side_by_side(factory, stages, microbatches, schedule, steps=3, batch_size=4, **init):
    """Train a zoo model pipelined as configured, and a deep copy unsplit on the CPU, with SGD for
    ``steps`` steps; returns the pipelined model, the reference, the last `StepOutput` and the
    `Differences`. The runtime stays up (the caller shuts it down)."""
    example = factory(dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=stages, microbatches=microbatches, pipeline=schedule,
                timeout_s=60, **init)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    diff = Differences()
    OUTPUT_DEVICES.clear()
    for step in range(steps):
        args, kwargs, target = example.batch(batch_size, seed=step)
        out = train_step(model, example, args, kwargs, target)
        expected = reference_step(reference, example, args, kwargs, target, microbatches)
        diff.loss = max(diff.loss, (out.stack().cpu() - expected).abs().max().item())
        differences, one_sided = grad_differences(model, reference)
        diff.grad = max([diff.grad, *differences.values()])
        diff.one_sided_grads += [name for name in one_sided if name not in diff.one_sided_grads]
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full, expected_state = model.state_dict(), reference.state_dict()
    diff.same_state_keys = full.keys() == expected_state.keys()
    diff.state = max((full[k].double().cpu() - v.double()).abs().max().item()
                     for k, v in expected_state.items())
    diff.devices = sorted({str(p.device) for p in model.parameters() if p.device.type != "meta"})
    diff.bytes_sent = sum(out.timeline.bytes_sent.values())
    diff.output_devices = sorted(OUTPUT_DEVICES)
    return model, reference, out, diff


def train_and_compare(factory, stages, microbatches, schedule, steps=3, batch_size=4, **init):
    """`train_side_by_side` on threads, asserting that it trained like the unsplit model."""
    model, reference, out, diff = train_side_by_side(factory, stages, microbatches, schedule, steps,
                                                      batch_size, **init)
    diff.assert_within(TOL, (factory, stages, microbatches, schedule))
    return model, reference, out


GRID = [(s, m, p) for s in (1, 2, 3, 4) for m in (1, 2, 4) for p in ("simple", "interleaved")]
#: Half the grid that still holds every pair of its values (stages and micro-batches, stages and
#: schedule, micro-batches and schedule): what the other zoo models run; GPT-2 runs the whole grid.
PAIRS = [(s, m, ("simple", "interleaved")[(s + i) % 2])
         for s in (1, 2, 3, 4) for i, m in enumerate((1, 2, 4))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stages", "microbatches", "schedule"), GRID)
def test_gpt2_matches_unsplit(stages, microbatches, schedule):
    model, _, out = train_and_compare(ZOO["gpt2"], stages, microbatches, schedule)
    assert smpart.partition_of(model).num_stages == stages
    assert len(out.outputs) == microbatches


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n in ZOO if n != "gpt2"])
@pytest.mark.parametrize(("stages", "microbatches", "schedule"), PAIRS)
def test_zoo_model_matches_unsplit(name, stages, microbatches, schedule):
    train_and_compare(ZOO[name], stages, microbatches, schedule)


@pytest.mark.timeout(60)
def test_batchnorm_running_stats_match_unsplit():
    model, reference, _ = train_and_compare(ZOO["resnet"], 3, 4, "interleaved", steps=3)
    for (name, b), (_, r) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(b.cpu(), r) if b.dtype == torch.int64 else (b.cpu() - r).abs().max() <= 1e-10, name


@pytest.mark.timeout(60)
def test_sum_instead_of_average():
    example = ZOO["gpt2"](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, average_grads_across_microbatches=False)
    model = smpart.DistributedModel(example.model)
    args, kwargs, target = example.batch(4)
    train_step(model, example, args, kwargs, target)
    reference_step(reference, example, args, kwargs, target, 2)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.grad - 2 * q.grad).abs().max() <= TOL


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "inference_mode around the call"])
def test_eval_step_runs_forward_only(mode):
    example = ZOO["t5"](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=3, microbatches=2)
    model = smpart.DistributedModel(example.model)

    @smpart.step
    def eval_step(model, args, kwargs):
        modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
        with modes.get(mode, contextlib.nullcontext)():
            return model(*args, **kwargs)["logits"]

    args, kwargs, _ = example.batch(4)
    with torch.inference_mode(mode == "inference_mode around the call"):
        out = eval_step(model, args, kwargs)
    with torch.no_grad():
        expected = reference(*args, **kwargs)["logits"]
    assert (out.concat() - expected).abs().max() <= TOL
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.timeout(60)
def test_state_dict_is_the_full_unsplit_one():
    example = ZOO["gpt2"]()
    smpart.init(pipeline_parallel_degree=3, microbatches=2)
    model = smpart.DistributedModel(example.model)
    args, kwargs, target = example.batch(4)
    train_step(model, example, args, kwargs, target)
    state = model.state_dict()
    plain = ZOO["gpt2"](seed=1).model
    plain.load_state_dict(state)
    assert set(state) == set(plain.state_dict())
    model.load_state_dict(ZOO["gpt2"](seed=2).model.state_dict())
    assert torch.equal(model.module.lm_head.weight, ZOO["gpt2"](seed=2).model.lm_head.weight)


@pytest.mark.timeout(60)
def test_step_output_reductions_and_timeline(tmp_path):
    import json

    example = ZOO["gpt2"]()
    smpart.init(pipeline_parallel_degree=2, microbatches=4)
    model = smpart.DistributedModel(example.model)

    @smpart.step
    def step_with_two_outputs(model, args, kwargs, target):
        logits = model(*args, **kwargs)
        loss = example.loss(logits, target)
        model.backward(loss)
        return loss, logits

    args, kwargs, target = example.batch(8)
    loss, logits = step_with_two_outputs(model, args, kwargs, target)
    assert torch.allclose(loss.reduce_mean(), loss.stack().mean())
    assert torch.allclose(loss.reduce_sum(), loss.stack().sum())
    assert logits.concat().shape[0] == 8 and logits.stack().shape[0] == 4
    timeline = loss.timeline
    kinds = {(e["stage"], e["microbatch"], e["kind"]) for e in timeline.events}
    assert kinds == {(s, m, k) for s in range(2) for m in range(4) for k in ("forward", "backward")}
    assert 0.0 <= timeline.bubble_fraction < 1.0
    path = timeline.save(str(tmp_path / "step.json"))
    trace = json.loads(open(path, encoding="utf-8").read())  # noqa: SIM115
    assert {e["tid"] for e in trace["traceEvents"]} == {0, 1}
    assert timeline.to_dict()["events"] == timeline.events


@pytest.mark.timeout(60)
def test_reinit_after_shutdown_leaves_no_threads():
    example = ZOO["gpt2"]()
    model = smpart.DistributedModel(example.model)
    args, kwargs, target = example.batch(4)
    for stages, microbatches in ((2, 2), (3, 4)):
        smpart.init(pipeline_parallel_degree=stages, microbatches=microbatches)
        out = train_step(model, example, args, kwargs, target)
        assert len(out.outputs) == microbatches
        assert smpart.partition_of(model).num_stages == stages
        smpart.shutdown()
        assert [t.name for t in threading.enumerate() if t.name.startswith("smpart")] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activation_checkpointing_on_the_pipeline_keeps_gradients(schedule):
    # Blocks recompute their forward inside the backward segments of their stage; tied embeddings
    # and the 2-stage cut are unchanged. Gradients equal those of the unsplit model without it.
    model, _, _ = train_and_compare(ZOO["gpt2"], 2, 2, schedule,
                                    activation_checkpointing=["transformer.h.*"])
    from smpart.runtime.placement.activation_checkpointing import is_checkpointed

    blocks = [m for n, m in model.named_modules() if n.startswith("transformer.h.") and n.count(".") == 2]
    assert blocks and all(is_checkpointed(b) for b in blocks)
    smpart.shutdown()
    assert not any(is_checkpointed(b) for b in blocks)  # shutdown gives the model back as it was


@pytest.mark.timeout(60)
def test_a_learning_rate_scheduler_drives_the_distributed_optimizer():
    """LR schedulers accept only a `torch.optim.Optimizer`; the rates they set reach the optimizer
    that steps: three steps under `StepLR` train as the unsplit model does under its own."""
    example = ZOO["gpt2"](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    for step in range(3):
        args, kwargs, target = example.batch(4, seed=step)
        train_step(model, example, args, kwargs, target)
        reference_step(reference, example, args, kwargs, target, 2)
        for o, scheduler in zip((opt, ref_opt), schedulers, strict=True):
            o.step()
            o.zero_grad()
            scheduler.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 / 8
    full = model.state_dict()
    assert max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()) <= TOL


def test_the_wrappers_refuse_what_they_cannot_wrap():
    model = torch.nn.Linear(2, 2)
    optimizer = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for wrap, wrong, message in [
        (smpart.DistributedOptimizer, optimizer, "already a DistributedOptimizer"),
        (smpart.DistributedOptimizer, model, "wraps a torch.optim.Optimizer, got Linear"),
        (smpart.DistributedModel, smpart.DistributedModel(model), "already a DistributedModel"),
        (smpart.DistributedModel, optimizer, "wraps a torch.nn.Module, got DistributedOptimizer"),
    ]:
        with pytest.raises(smpart.SmpartError, match=message):
            wrap(wrong)


@pytest.mark.timeout(120)
def test_a_model_built_on_meta_is_materialised_on_threads_too():
    """The same script as under torchrun: each stage's modules are made on its device and
    initialised (a Hugging Face model by its own scheme); an optimizer made before then steps them.
    It failed with "Cannot copy out of meta tensor"."""
    import math

    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=2, vocab_size=64, n_positions=32)
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        with torch.device("meta"):
            model = smpart.DistributedModel(transformers.GPT2LMHeadModel(config))
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ids = torch.randint(64, (4, 16), generator=torch.Generator().manual_seed(0))
        loss = lm_step(model, ids).reduce_mean().item()
        assert abs(loss - math.log(64)) < 0.1, loss
        assert not any(p.is_meta for p in model.parameters())
        before = model.module.transformer.h[3].mlp.c_fc.weight.clone()
        assert 0.01 < before.std().item() < 0.03  # GPT-2's initializer_range, 0.02
        opt.step()
        assert not torch.equal(before, model.module.transformer.h[3].mlp.c_fc.weight)
    finally:
        smpart.shutdown()


def test_a_model_built_on_meta_takes_a_state_dict_at_its_placement():
    """Loaded before the first step, the entries wait for each stage's tensors to be made (they
    went nowhere: the meta tensors hold nothing)."""
    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    plain = make()
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        with torch.device("meta"):
            model = smpart.DistributedModel(make())
        model.load_state_dict(plain.state_dict())
        x = torch.randn(4, 4)
        assert torch.equal(_predict(model, x).concat(), plain(x))
    finally:
        smpart.shutdown()


@smpart.step
def _predict(model, x):
    return model(x)


def _activation(x):
    return torch.tanh(x) * 2


class _CompiledInside(torch.nn.Module):
    def __init__(self, activation):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.activation = activation

    def forward(self, x):
        return self.activation(self.linear(x))


@pytest.mark.timeout(120)
def test_compiled_models_are_refused_and_compiled_code_inside_a_module_runs():
    """smpart routes module calls between stages in Python: a torch.compile'd model or a module
    compiled with Module.compile() would contain that routing, which dynamo cannot trace (it failed
    deep inside it). A compiled function a module's forward calls runs on its stage."""
    with pytest.raises(smpart.SmpartError, match="torch.compile'd model.*_orig_mod"):
        smpart.DistributedModel(torch.compile(torch.nn.Linear(2, 2)))
    blocks = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    blocks[1].compile()
    with pytest.raises(smpart.SmpartError, match="compiled with Module.compile\\(\\): 1"):
        smpart.DistributedModel(blocks)

    # Compiled here, not at import: other test modules import this one (and their ranks would import dynamo).
    activation = torch.compile(_activation, backend="eager")  # dynamo's tracing, not inductor's compile time
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), _CompiledInside(activation),
                                 _CompiledInside(activation), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(module)
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        model = smpart.DistributedModel(module)
        x = torch.randn(4, 4)
        out = _sum_step(model, x)
        (reference(x).sum() / 2).backward()  # smpart averages the micro-batches' gradients
        assert torch.allclose(out.stack().sum(), reference(x).sum(), atol=1e-5)
        for mine, theirs in zip(module.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(mine.grad, theirs.grad, atol=1e-5)
    finally:
        smpart.shutdown()


@smpart.step
def _sum_step(model, x):
    out = model(x).sum()
    model.backward(out)
    return out


@pytest.mark.timeout(60)
def test_casting_a_distributed_model_returns_it_and_moving_a_placed_one_is_refused():
    """``model = model.double()`` keeps the wrapper (the module's own method returns the module,
    which a step refuses); a device move after placement would undo it: refused."""
    example = ZOO["gpt2"]()
    model = smpart.DistributedModel(example.model)
    assert model.double() is model and model.to("cpu") is model  # before placement, devices too
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    args, kwargs, target = example.batch(4)
    train_step(model, example, args, kwargs, target)
    assert model.float() is model and {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.isfinite(train_step(model, example, args, kwargs, target).stack()).all()
    for move in (lambda: model.to("cpu"), model.cpu, model.cuda, lambda: model.to(torch.zeros(1))):
        with pytest.raises(smpart.SmpartError, match="placed on their devices"):
            move()


def test_a_grad_scaler_unscales_before_a_fused_optimizer_steps():
    """`torch.amp.GradScaler` gives a fused optimizer its scale as attributes, which set on the
    wrapper would never reach it (it would step with the scaled gradient): the wrapper takes the
    scaler's unscale-then-step path instead, and SGD moves by the learning rate times the gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    before = model.weight.detach().clone()
    gradient = torch.autograd.grad(model(x).square().sum(), model.weight)[0]
    optimizer = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, fused=True))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(x).square().sum()).backward()
    scaler.step(optimizer)
    torch.testing.assert_close(model.weight.detach(), before - 0.1 * gradient)


@pytest.mark.timeout(60)
def test_global_gradient_clipping_equals_the_unsplit_models():
    example = ZOO["gpt2"](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=3, microbatches=2)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    args, kwargs, target = example.batch(4)
    train_step(model, example, args, kwargs, target)
    reference_step(reference, example, args, kwargs, target, 2)
    total = opt.clip_grad_norm_(0.01)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    assert abs(total.item() - expected.item()) <= 1e-10
    assert_same_grads(model, reference)
