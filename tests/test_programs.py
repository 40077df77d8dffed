"""Step programs on threads: from a model's second step on, each stage runs its list of actions.

Every test compares with the unsplit model, and checks which runtime ran each step
(``out.timeline.runtime``): the first step of a kind records (reference runtime), the second
discovers the program, the later ones run it; a step the program cannot run goes back to the
reference runtime, and says why (``out.timeline.reason``).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import smpart
from smpart.runtime.program.actions import Action

TOL = 1e-6


class Chain(nn.Module):
    """``width`` -> ``width`` layers, one per stage when pinned, and a classifier head."""

    def __init__(self, layers: int = 4, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def chain_pins(stages: int, layers: int = 4) -> dict[str, int]:
    pins = {"": 0, "head": stages - 1}
    for i in range(layers):
        pins[f"layers.{i}"] = i * stages // layers
    return pins


@smpart.step
def classify(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


def reference_step(model, x, y, microbatches):
    losses = []
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
        loss = F.cross_entropy(model(xs), ys)
        (loss / microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def batch(seed: int, size: int = 8, width: int = 8, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(size, width, generator=g, dtype=torch.float64),
        torch.randint(classes, (size,), generator=g),
    )


def train_both(
    model, steps, microbatches, step_fn=classify, make_batch=batch, ref_step=reference_step, **init
):
    """Train ``model`` split and a copy unsplit, SGD, asserting every step's loss and gradients
    agree; returns the split model and each step's timeline."""
    model = model.double()
    reference = copy.deepcopy(model)
    smpart.init(microbatches=microbatches, timeout_s=60, **init)
    dm = smpart.DistributedModel(model)
    opt = torch.optim.SGD(dm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    timelines = []
    for step in range(steps):
        args = make_batch(step)
        out = step_fn(dm, *args)
        expected = ref_step(reference, *args, microbatches)
        assert (out.stack() - expected).abs().max() <= TOL, (step, out.timeline.runtime)
        for (name, p), q in zip(dm.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad - q.grad).abs().max() <= TOL, (step, name, out.timeline.runtime)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        timelines.append(out.timeline)
    return dm, timelines


def runtimes(timelines) -> list[str]:
    return [t.runtime for t in timelines]


# ==================================================================== the program's lists
def torch_1f1b(stage: int, stages: int, microbatches: int) -> list[str]:
    """torch's ``Schedule1F1B`` order of one stage (its last stage's backward right after its
    forward, as its loss is computed there)."""
    warmup = min(microbatches, stages - 1 - stage)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(microbatches - warmup, microbatches)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [2, 4])
def test_a_chain_runs_torchs_1f1b_lists_and_its_timeline_follows_them(stages):
    microbatches = 8
    dm, timelines = train_both(
        Chain(), 4, microbatches, pipeline_parallel_degree=stages, pipeline="1f1b", pin=chain_pins(stages)
    )
    assert runtimes(timelines) == ["reference", "program", "program", "program"]
    assert timelines[0].reason.startswith("the first step")
    assert timelines[1].reason.startswith("discovering")
    program = smpart.program_of(dm)
    assert [[str(a) for a in actions] for actions in program.actions] == [
        torch_1f1b(s, stages, microbatches) for s in range(stages)
    ]
    for timeline in timelines[2:]:
        assert timeline.program is program
        assert timeline.started == {s: torch_1f1b(s, stages, microbatches) for s in range(stages)}
    text = io.StringIO()
    program.show(Console(file=text, width=200))
    assert "B7" in text.getvalue() and f"{stages} ranks" in text.getvalue()
    assert program.lines()[1].startswith("rank 1: RECV_F0 F0")


@pytest.mark.timeout(120)
def test_virtual_stages_give_each_rank_two_stages_interleaved_as_torchs_interleaved_1f1b():
    """``virtual_stages=2`` on 2 ranks: 4 stages, rank r holding stages r and r + 2, each step equal
    to the unsplit model (`train_both`). Each micro-batch's forward on a rank is cut where it
    leaves for the other rank and comes back; the first rank warms up as torch's
    ``ScheduleInterleaved1F1B`` does with 2 ranks and 4 micro-batches: (pp - rank - 1) x 2 + (v - 1)
    x pp = 4 forwards, two micro-batches on its first stage, then the same two on its second."""
    dm, timelines = train_both(Chain(), 5, 4, pipeline_parallel_degree=2, virtual_stages=2, pipeline="1f1b",
                               pin=chain_pins(4))
    assert runtimes(timelines) == ["reference"] + ["program"] * 4
    program = smpart.program_of(dm)
    assert len(program.actions) == 2
    assert timelines[-1].started[0][:5] == ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0"]
    for started in timelines[-1].started.values():
        for mb in range(4):
            assert started.index(f"F{mb}.0") < started.index(f"F{mb}.1")


@pytest.mark.timeout(120)
def test_gpipe_runs_every_forward_before_the_backwards_but_the_losss():
    dm, timelines = train_both(Chain(), 3, 4, pipeline_parallel_degree=2, pipeline="gpipe", pin=chain_pins(2))
    program = smpart.program_of(dm)
    assert [str(a) for a in program.actions[0]] == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    # the last stage computes the loss: its backward runs as soon as the loss exists
    assert [str(a) for a in program.actions[1]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert all(a.inline for a in program.actions[1] if a.kind == "B")
    assert timelines[2].started[0] == [str(a) for a in program.actions[0]]


@pytest.mark.timeout(120)
def test_a_chain_sends_one_activation_and_one_gradient_per_micro_batch_across_each_cut():
    stages, microbatches = 3, 4
    _, timelines = train_both(
        Chain(layers=3), 3, microbatches, pipeline_parallel_degree=stages, pin=chain_pins(stages, layers=3)
    )
    timeline = timelines[-1]
    activation = 8 // microbatches * 8 * 8  # rows x width x float64
    for s in range(stages - 1):
        assert timeline.messages[(s, s + 1)] == microbatches
        assert timeline.messages[(s + 1, s)] == microbatches
        assert timeline.bytes_sent[(s, s + 1)] == microbatches * activation
        assert timeline.bytes_sent[(s + 1, s)] == microbatches * activation
    assert set(timeline.messages) == {(s, s + 1) for s in range(stages - 1)} | {
        (s + 1, s) for s in range(stages - 1)
    }


class TiedLM(nn.Module):
    """An embedding and a head sharing one weight (rank 0), blocks on rank 1: the forward comes back."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


@smpart.step
def lm(model, ids, targets):
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    model.backward(loss)
    return loss


def lm_reference(model, ids, targets, microbatches):
    losses = []
    for i, t in zip(ids.chunk(microbatches), targets.chunk(microbatches), strict=True):
        loss = F.cross_entropy(model(i).flatten(0, 1), t.flatten())
        (loss / microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def tokens(seed: int, size: int = 8, length: int = 6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(16, (size, length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def test_a_rank_stops_its_body_after_the_last_event_it_takes_part_in():
    from smpart.runtime.program.actions import stop_points

    events = [  # a 3-rank chain: rank 0 sends to 1, 1 to 2, the loss on 2, the result on 2
        ("call", "layers.0", 0), ("call", "layers.1", 1), ("x", 0, 0, 1),
        ("call", "layers.2", 2), ("x", 1, 1, 2), ("backward", 2), ("end", 1),
    ]
    assert stop_points([events] * 3, {2}) == [3, 5, None]
    # a value read in Python needs every rank; a rank holding part of the result runs to the end
    read = events[:4] + [("need",)] + events[4:]
    assert stop_points([read] * 3, {1, 2}) == [5, None, None]


@pytest.mark.timeout(120)
def test_the_body_after_the_model_call_runs_once_per_micro_batch_where_its_result_is():
    reached = []

    @smpart.step
    def counted(model, x, y):
        out = model(x)
        reached.append(1)  # after the model's call: only the rank holding the loss still runs the body
        loss = F.cross_entropy(out, y)
        model.backward(loss)
        return loss

    stages, microbatches, steps = 3, 4, 4
    dm, timelines = train_both(Chain(), steps, microbatches, step_fn=counted, pipeline_parallel_degree=stages,
                               pipeline="1f1b", pin=chain_pins(stages))
    assert runtimes(timelines) == ["reference", "program", "program", "program"]
    program = smpart.program_of(dm)
    assert program.stops[0] is not None and program.stops[1] is not None and program.stops[2] is None
    # the reference step: once per micro-batch; discovery: on every rank; then once again
    assert len(reached) == microbatches * (1 + stages + 2)
    kept = dm._programs.kept_placeholders
    assert kept and all(m._value is None and m._node is None for per_rank in kept.values()
                        for _, made in per_rank.values() for m in made)  # nothing of a step outlives it


@pytest.mark.timeout(120)
def test_a_rank_whose_forward_comes_back_to_it_runs_it_in_two_actions():
    """The tied head runs on rank 0 after the blocks of rank 1: rank 0's forward is cut there, so
    it embeds the next micro-batch while rank 1 runs the blocks (as two virtual stages would)."""
    dm, timelines = train_both(
        TiedLM(),
        4,
        4,
        step_fn=lm,
        make_batch=tokens,
        ref_step=lm_reference,
        pipeline_parallel_degree=2,
        pin={"": 0, "embed": 0, "blocks": 1, "head": 0},
    )
    assert runtimes(timelines)[2:] == ["program", "program"]
    program = smpart.program_of(dm)
    first = [str(a) for a in program.actions[0]]
    assert {"F0.0", "F0.1", "B0.0", "B0.1"} <= set(first)
    assert first.index("F1.0") < first.index("F0.1")  # the next micro-batch is embedded meanwhile
    assert program.suspend_at[0] and not program.suspend_at[1]
    assert timelines[-1].started[0] == first


# ==================================================================== guards
@pytest.mark.timeout(120)
def test_each_input_shape_gets_its_own_program_and_keeps_it():
    """Dynamic padding: batches of two sequence lengths alternate; each length is recorded once,
    discovered once, then runs its program."""

    def padded(seed):
        return tokens(seed, length=6 if seed % 2 == 0 else 9)

    _, timelines = train_both(
        TiedLM(),
        8,
        2,
        step_fn=lm,
        make_batch=padded,
        ref_step=lm_reference,
        pipeline_parallel_degree=2,
        pin={"": 0, "embed": 0, "blocks": 1, "head": 0},
    )
    assert runtimes(timelines) == ["reference", "reference", "program", "program"] + ["program"] * 4
    assert timelines[1].reason.startswith("recording")
    assert timelines[6].program is timelines[4].program
    assert timelines[7].program is timelines[5].program
    assert timelines[4].program is not timelines[5].program


@smpart.step
def scaled(model, x, y, scale, index):
    loss = F.cross_entropy(model(x), y) * scale
    if index == 3:  # once, another path: another sequence of calls
        loss = loss + 0.0 * model(x).sum()
    model.backward(loss)
    return loss


def scaled_reference(model, x, y, scale, index, microbatches):
    losses = []
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
        loss = F.cross_entropy(model(xs), ys) * scale
        if index == 3:
            loss = loss + 0.0 * model(xs).sum()
        (loss / microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.timeout(120)
def test_numbers_the_step_takes_may_change_every_step_inside_its_program():
    """A loss scale and the step's index change every step: one program runs them all; the step
    whose index takes another path (another sequence of calls) runs on the reference runtime."""
    _, timelines = train_both(
        Chain(),
        6,
        2,
        step_fn=scaled,
        make_batch=lambda step: (*batch(step), 1.0 + 0.25 * step, step),
        ref_step=scaled_reference,
        pipeline_parallel_degree=2,
        pin=chain_pins(2),
    )
    assert runtimes(timelines) == ["reference", "program", "program", "reference", "program", "program"]
    assert "diverged" in timelines[3].reason


@smpart.step
def tasks(model, batch, task):
    loss = F.cross_entropy(model(batch["x"]), batch["y"]) * (2.0 if task == "double" else 1.0)
    model.backward(loss)
    return loss


def tasks_reference(model, batch, task, microbatches):
    scale = 2.0 if task == "double" else 1.0
    return scaled_reference(model, batch["x"], batch["y"], scale, 0, microbatches)


@pytest.mark.timeout(120)
def test_sample_ids_in_the_batch_keep_the_program_and_a_task_name_gets_its_own():
    """Strings in a list (sample ids, new every step) are data; a string on its own chooses: two
    tasks in turn record a program each and keep them."""

    def make_batch(step):
        x, y = batch(step)
        ids = [f"sample-{8 * step + i}" for i in range(8)]
        return {"x": x, "y": y, "ids": ids}, ("single", "double")[step % 2]

    _, timelines = train_both(
        Chain(),
        8,
        2,
        step_fn=tasks,
        make_batch=make_batch,
        ref_step=tasks_reference,
        pipeline_parallel_degree=2,
        pin=chain_pins(2),
    )
    assert runtimes(timelines) == ["reference", "reference"] + ["program"] * 6
    assert timelines[6].program is timelines[4].program and timelines[7].program is timelines[5].program
    assert timelines[4].program is not timelines[5].program


class Switch(nn.Module):
    """The root's own code decides which stage's module runs, by a plain attribute: a program
    recorded one way cannot run the other."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.go_left = True

    def forward(self, x):
        x = torch.tanh(self.first(x))
        x = self.left(x) if self.go_left else self.right(x)
        return self.head(x)


@pytest.mark.timeout(120)
def test_a_step_that_calls_other_modules_than_its_program_runs_on_the_reference_runtime():
    model = Switch().double()
    reference = copy.deepcopy(model)
    smpart.init(
        pipeline_parallel_degree=2,
        microbatches=2,
        timeout_s=60,
        pin={"": 0, "first": 0, "left": 1, "right": 0, "head": 1},
    )
    dm = smpart.DistributedModel(model)
    seen = []
    for step in range(6):
        model.go_left = reference.go_left = step != 3
        x, y = batch(step)
        out = classify(dm, x, y)
        assert (out.stack() - reference_step(reference, x, y, 2)).abs().max() <= TOL
        for p, q in zip(dm.parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                assert (p.grad - q.grad).abs().max() <= TOL
            p.grad = q.grad = None
        seen.append((out.timeline.runtime, out.timeline.reason))
    assert [r for r, _ in seen] == ["reference", "program", "program", "reference", "program", "program"]
    assert "diverged" in seen[3][1] and "'right'" in seen[3][1]


@pytest.mark.timeout(120)
def test_routing_across_stages_that_depends_on_the_data_runs_on_the_reference_runtime():
    """A mixture of experts whose experts sit on another stage than its router: which expert a
    micro-batch calls depends on its values, so no fixed program can hold it."""
    from examples.models import ZOO

    example = ZOO["moe"](dtype=torch.float64)
    model = example.model
    reference = copy.deepcopy(model)
    pins = {name: 1 for name, _ in model.named_modules() if ".experts." in name}
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60, pin={"": 0, **pins})
    dm = smpart.DistributedModel(model)

    @smpart.step
    def step(model, args, target):
        loss = example.loss(model(*args), target)
        model.backward(loss)
        return loss

    reasons = []
    for seed in range(4):
        args, _, target = example.batch(4, seed=seed)
        out = step(dm, args, target)
        losses = []
        for i in range(2):
            loss = example.loss(reference(*[a.chunk(2)[i] for a in args]), target.chunk(2)[i])
            (loss / 2).backward()
            losses.append(loss.detach())
        assert (out.stack() - torch.stack(losses)).abs().max() <= TOL
        for p, q in zip(dm.parameters(), reference.parameters(), strict=True):
            if q.grad is not None:
                assert (p.grad - q.grad).abs().max() <= TOL
            p.grad = q.grad = None
        reasons.append((out.timeline.runtime, out.timeline.reason))
    assert all(runtime == "reference" for runtime, _ in reasons[2:]), reasons
    assert any(word in reasons[-1][1] for word in ("data", "shape")), reasons


class Gate(nn.Module):
    """The root reads, in Python, a value the first stage computed, to decide what to do."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x):
        h = self.first(x)
        if h.sum().item() > 1e9:  # never true: but only the data can tell
            h = h * 0
        return self.second(torch.tanh(h))


@pytest.mark.timeout(120)
def test_a_value_read_in_python_across_stages_reaches_every_rank_and_the_program_runs():
    _, timelines = train_both(Gate(), 4, 2, pipeline_parallel_degree=2, pin={"": 0, "first": 0, "second": 1})
    assert runtimes(timelines)[2:] == ["program", "program"]
    # per micro-batch: the activation, and the value Python read (a scalar)
    assert timelines[-1].messages[(0, 1)] == 4


@pytest.mark.timeout(120)
def test_a_body_that_reads_gradients_before_it_returns_runs_on_the_reference_runtime():
    @smpart.step
    def reads_grads(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        norm = sum(p.grad.norm() for p in model.parameters() if p.grad is not None)
        return loss, norm

    model = Chain().double()
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60, pin=chain_pins(2))
    dm = smpart.DistributedModel(model)
    for step in range(3):
        loss, _ = reads_grads(dm, *batch(step))
    assert loss.timeline.runtime == "reference"
    assert "reads gradients" in loss.timeline.reason


@pytest.mark.timeout(120)
def test_the_switch_turns_programs_off():
    _, timelines = train_both(
        Chain(), 3, 2, pipeline_parallel_degree=2, pin=chain_pins(2), step_programs=False
    )
    assert runtimes(timelines) == ["reference"] * 3
    assert "off" in timelines[-1].reason
    with pytest.raises(smpart.SmpartError, match="no step program"):
        smpart.program_of(smpart.DistributedModel(Chain()))


# ==================================================================== modules every rank computes
class Scales(nn.Module):
    """No parameters, one derived buffer (as a rotary embedding's frequencies): what it returns
    depends on its argument's shape alone."""

    def __init__(self, width: int = 8, counts_calls: bool = False) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width, dtype=torch.float64), persistent=False)
        self.counts_calls = counts_calls
        if counts_calls:
            self.register_buffer("calls", torch.zeros((), dtype=torch.float64), persistent=False)

    def forward(self, x):
        if self.counts_calls:
            self.calls += 1  # state: copies on several ranks would count differently
        return self.scale.expand(x.shape[0], -1) * (1.0 + self.calls if self.counts_calls else 1.0)


class ScaledChain(nn.Module):
    """Every layer adds what ``scales`` returns: with ``scales`` on stage 0 and a layer on stage 1,
    the reference runtime sends its output across; a program computes it on each stage."""

    def __init__(self, counts_calls: bool = False) -> None:
        super().__init__()
        self.scales = Scales(counts_calls=counts_calls)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        scale = self.scales(x)
        for layer in self.layers:
            x = torch.tanh(layer(x) + scale)
        return self.head(x)


SCALED_PINS = {"": 0, "scales": 0, "layers.0": 0, "layers.1": 1, "head": 1}


@pytest.mark.timeout(120)
def test_a_parameter_free_module_with_derived_buffers_is_computed_on_every_stage_not_sent(monkeypatch):
    microbatches = 4
    activation = 8 // microbatches * 8 * 8  # rows x width x float64
    _, timelines = train_both(ScaledChain(), 4, microbatches, pipeline_parallel_degree=2, pin=SCALED_PINS)
    assert runtimes(timelines) == ["reference", "program", "program", "program"]
    assert timelines[-1].bytes_sent == {(0, 1): microbatches * activation, (1, 0): microbatches * activation}
    smpart.shutdown()
    # computed on stage 0 alone, what it returns crosses with the activation
    monkeypatch.setattr("smpart.runtime.threads.recomputed_modules", lambda model, partition: set())
    _, timelines = train_both(ScaledChain(), 2, microbatches, pipeline_parallel_degree=2, pin=SCALED_PINS)
    assert timelines[-1].bytes_sent[(0, 1)] == 2 * microbatches * activation


@pytest.mark.timeout(120)
def test_a_device_named_another_way_is_the_same_device(monkeypatch):
    """``"cpu:0"`` names the device whose tensors say ``cpu``: stages given it share one device (the
    scales are computed on each), and no call's arguments are moved to it."""
    from smpart.distributed.launch import named_device
    from smpart.runtime.program import glue

    assert named_device("cpu:0") == named_device("cpu") == torch.device("cpu")
    moved = []
    monkeypatch.setattr(glue, "_moved_to", lambda value, device: moved.append(device) or value)
    microbatches = 4
    activation = 8 // microbatches * 8 * 8
    _, timelines = train_both(ScaledChain(), 3, microbatches, pipeline_parallel_degree=2, pin=SCALED_PINS,
                              devices=["cpu:0", "cpu:0"])
    assert timelines[-1].bytes_sent == {(0, 1): microbatches * activation, (1, 0): microbatches * activation}
    assert moved == []


@pytest.mark.timeout(120)
def test_a_module_computed_on_every_stage_that_changes_its_buffers_runs_on_the_reference_runtime():
    """Its copies (one per rank under torchrun; one, called by every stage, on threads) would no
    longer agree with the unsplit model's one: each such step runs on the reference runtime."""
    model = ScaledChain(counts_calls=True)
    reference = copy.deepcopy(model)
    dm, timelines = train_both(model, 4, 2, pipeline_parallel_degree=2, pin=SCALED_PINS)
    assert runtimes(timelines) == ["reference"] * 4
    assert "'scales'" in timelines[1].reason and "'calls'" in timelines[1].reason, timelines[1].reason
    for step in range(4):
        x, _ = batch(step)
        for xs in x.chunk(2):
            reference.scales(xs)
    assert dm.module.scales.calls.item() == reference.scales.calls.item() == 8


# ==================================================================== faults
class Boom(nn.Linear):
    """A linear layer that raises while ``fail`` is set."""

    fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("boom")
        return super().forward(x)


@pytest.mark.timeout(120)
def test_a_module_error_in_a_program_step_names_where_it_happened_and_the_next_step_runs():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Boom(8, 4)).double()
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=30, pin={"": 0, "0": 0, "1": 0, "2": 1})
    dm = smpart.DistributedModel(model)
    for step in range(3):
        classify(dm, *batch(step))
        dm.zero_grad()
    model[2].fail = True
    with pytest.raises(smpart.PipelineError) as caught:
        classify(dm, *batch(3))
    model[2].fail = False
    error = caught.value
    assert (error.stage, error.module, error.microbatch) == (1, "2", 0)
    assert "boom" in str(error) and "[F0]" in str(error)
    dm.zero_grad()
    out = classify(dm, *batch(4))
    assert out.timeline.runtime == "program"


def test_a_program_that_would_deadlock_is_refused():
    from smpart.runtime.program.actions import Program

    program = Program(
        "1f1b",
        1,
        2,
        [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]],
        [frozenset(), frozenset()],
        [[], []],
    )
    deps = {(1, "F0"): {(0, "F0")}, (1, "B0"): {(1, "F0")}, (0, "B0"): {(1, "B0")}}
    with pytest.raises(smpart.SmpartError, match="deadlock.*rank 1 at B0"):
        program.check(deps)


# ==================================================================== the zoo
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2", "t5", "resnet", "transgan", "albert"])
def test_every_zoo_model_runs_its_program_like_the_unsplit_model(name):
    """Tied embeddings (GPT-2), keyword arguments and dict outputs (T5), BatchNorm (ResNet), a
    layer reused on every stage (ALBERT): from the third step on, programs, equal to the unsplit model."""
    from tests.test_runtime import ZOO, train_side_by_side

    for stages in (2, 3):
        _, _, out, diff = train_side_by_side(ZOO[name], stages, 4, "interleaved", steps=3)
        diff.assert_within(1e-5, (name, stages))
        assert out.timeline.runtime == "program", (name, stages, out.timeline.reason)
        smpart.shutdown()


@pytest.mark.timeout(120)
def test_a_mixture_of_experts_held_whole_by_its_stage_routes_inside_its_program():
    """Which expert a token goes to changes every step; with each mixture-of-experts layer on one
    stage, that is the stage's own business, and the program holds."""
    from examples.models import ZOO

    example = ZOO["moe"](dtype=torch.float64)
    layers = len(example.model.transformer.h)
    pins = {"": 0, **{f"transformer.h.{i}": i * 2 // layers for i in range(layers)}}
    from tests.test_runtime import train_side_by_side

    smpart.shutdown()
    _, _, out, diff = train_side_by_side(ZOO["moe"], 2, 4, "interleaved", steps=4, pin=pins)
    diff.assert_within(1e-5, "moe")
    assert out.timeline.runtime == "program", out.timeline.reason


@pytest.mark.timeout(180)
def test_checkpointing_autocast_eval_and_accumulation_run_as_programs():
    """Activation checkpointing of the blocks, autocast around the step's call, an evaluation step
    under no_grad, and gradients accumulated over two step calls: programs, as the unsplit model."""
    from examples.models import gpt2

    example = gpt2(dtype=torch.float64)
    model, reference = example.model, copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60,
                activation_checkpointing=["transformer.h.*"])
    dm = smpart.DistributedModel(model)

    @smpart.step
    def train(model, ids, target):
        loss = example.loss(model(ids), target)
        model.backward(loss)
        return loss

    @smpart.step
    def evaluate(model, ids, target):
        return example.loss(model(ids), target)

    def unsplit(ids, target, backward=True):
        losses = []
        for i, t in zip(ids.chunk(2), target.chunk(2), strict=True):
            loss = example.loss(reference(i), t)
            if backward:
                (loss / 2).backward()
            losses.append(loss.detach())
        return torch.stack(losses)

    for step in range(4):  # two step calls accumulate before each comparison
        for half in range(2):
            (ids,), _, target = example.batch(4, seed=2 * step + half)
            out = train(dm, ids, target)
            assert (out.stack() - unsplit(ids, target)).abs().max() <= 1e-9
        for p, q in zip(dm.parameters(), reference.parameters(), strict=True):
            assert (p.grad - q.grad).abs().max() <= 1e-9
            p.grad = q.grad = None
        with torch.no_grad():
            seen = evaluate(dm, ids, target)
            assert (seen.stack() - unsplit(ids, target, backward=False)).abs().max() <= 1e-9
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = evaluate(dm, ids, target)
            expected = unsplit(ids, target, backward=False)
        assert low.stack().dtype == expected.dtype and (low.stack() - expected).abs().max() <= 1e-9
        for p in reference.parameters():
            p.grad = None
    assert out.timeline.runtime == "program", out.timeline.reason
    assert seen.timeline.runtime == "program" and low.timeline.runtime == "program", (
        seen.timeline.reason, low.timeline.reason)


class Noisy(nn.Module):
    """The root draws noise and gives it to modules on both stages: one draw, as unsplit."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x):
        noise = torch.randn_like(x)
        return self.second(torch.tanh(self.first(x + noise)) + noise)


@pytest.mark.timeout(120)
def test_random_numbers_the_glue_draws_are_drawn_once():
    model = Noisy().double()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60,
                pin={"": 0, "first": 0, "second": 1})
    dm = smpart.DistributedModel(model)
    for step in range(4):
        x, y = batch(step)
        torch.manual_seed(step)
        out = classify(dm, x, y)
        torch.manual_seed(step)
        expected = reference_step(reference, x, y, 2)
        assert (out.stack() - expected).abs().max() <= TOL, (step, out.timeline.runtime)
        for p, q in zip(dm.parameters(), reference.parameters(), strict=True):
            assert (p.grad - q.grad).abs().max() <= TOL
            p.grad = q.grad = None
    assert out.timeline.runtime == "program"


# ==================================================================== every stage on one thread
def current_program_threads() -> list:
    from smpart.runtime.runtime import current_runtime

    return current_runtime().program_threads


def _no_program_thread_started() -> bool:
    return current_program_threads() == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stages", "schedule"), [(2, "1f1b"), (4, "1f1b"), (4, "gpipe")])
def test_every_stage_on_one_thread_runs_its_list_like_the_unsplit_model(stages, schedule):
    """``stage_threads="one"``: the same lists, in the same order on each stage, the same results,
    and no stage thread started."""
    microbatches = 8
    dm, timelines = train_both(Chain(), 4, microbatches, pipeline_parallel_degree=stages, pipeline=schedule,
                               pin=chain_pins(stages), stage_threads="one")
    assert runtimes(timelines) == ["reference", "program", "program", "program"]
    program = smpart.program_of(dm)
    for timeline in timelines[2:]:
        assert timeline.started == {s: [str(a) for a in program.actions[s]] for s in range(stages)}
    if schedule == "1f1b":
        assert timelines[-1].started == {s: torch_1f1b(s, stages, microbatches) for s in range(stages)}
    assert _no_program_thread_started()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2", "t5", "albert"])
def test_zoo_models_on_one_thread_equal_the_unsplit_model(name, monkeypatch):
    """Tied embeddings, keyword arguments and dict outputs, a layer reused on every stage."""
    from tests.test_runtime import ZOO, train_side_by_side

    monkeypatch.setenv("SMPART_STAGE_THREADS", "one")
    _, _, out, diff = train_side_by_side(ZOO[name], 3, 4, "interleaved", steps=3)
    diff.assert_within(1e-5, name)
    assert out.timeline.runtime == "program", out.timeline.reason
    assert _no_program_thread_started()


@pytest.mark.timeout(120)
def test_a_module_error_on_one_thread_names_where_it_happened_and_the_next_step_runs(monkeypatch):
    monkeypatch.setenv("SMPART_STAGE_THREADS", "one")
    test_a_module_error_in_a_program_step_names_where_it_happened_and_the_next_step_runs()
    assert _no_program_thread_started()


@pytest.mark.timeout(30)
def test_stages_on_one_thread_that_wait_for_each_other_all_fail_naming_what_each_waited_for():
    from smpart.runtime.program.executor import Aborted, ThreadWire
    from smpart.runtime.program.one_thread import OneThread

    wire = ThreadWire(2, timeout_s=30)
    failures = {}

    def stage(me: int, other: int):
        def job():
            try:
                wire.at(me).receive(("F", 0, me), other)
            except Aborted as err:
                failures[me] = str(err)
        return job

    OneThread(wire).run([stage(0, 1), stage(1, 0)])
    assert set(failures) == {0, 1}
    assert "stage 0 for activation 0 of micro-batch 0 from stage 1" in failures[0]
    assert "stage 1 for activation 1 of micro-batch 0 from stage 0" in failures[1]


@pytest.mark.timeout(120)
def test_a_thread_per_stage_is_the_default_whatever_the_cores(monkeypatch):
    """Stages computing outside the GIL (CPU compute, CUDA launches, the backward) must run side by
    side: one thread only when asked for, even with more stages than cores."""
    monkeypatch.delenv("SMPART_STAGE_THREADS", raising=False)
    assert smpart.Config().stage_threads == "per-stage"
    train_both(Chain(), 3, 4, pipeline_parallel_degree=4, pin=chain_pins(4))
    assert len(current_program_threads()) == 3  # stage 0 runs on the caller's thread
    with pytest.raises(smpart.ConfigError, match="stage_threads"):
        smpart.Config(stage_threads="auto")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", ["per-stage", "one"])
def test_a_program_step_frees_its_tensors_and_bookkeeping_as_it_ends(threads):
    """A step's activations and its micro-batches' bookkeeping are freed as it ends (by reference
    counts, as an unsplit step's are), not held in cycles until the collector's next pass: on a
    GPU those would be activations kept alive, and freeing them costs the next step's time."""
    import gc
    import weakref

    from smpart.runtime.reference.calls import current_frame

    dm, timelines = train_both(Chain(), 3, 4, pipeline_parallel_degree=2, pin=chain_pins(2),
                               stage_threads=threads)
    assert runtimes(timelines)[-1] == "program"
    made: list[weakref.ref] = []

    def keep_track(module, inputs, output):
        if type(output) is torch.Tensor:  # on the rank that ran it (the others hold placeholders,
            made.append(weakref.ref(output))  # kept from step to step)
            made.append(weakref.ref(current_frame().endpoint))  # the micro-batch's run on this rank

    hooks = [layer.register_forward_hook(keep_track) for layer in dm.module.layers]
    gc.disable()
    try:
        out = classify(dm, *batch(9))
        assert out.timeline.runtime == "program"
        del out
        alive = [type(ref()).__name__ for ref in made if ref() is not None]
    finally:
        gc.enable()
        for hook in hooks:
            hook.remove()
    assert len(made) == 2 * 4 * 4  # a layer's output and its run, for every micro-batch
    assert alive == []
