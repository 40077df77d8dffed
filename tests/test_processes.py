"""One process per stage (gloo on the CPU) trains exactly like the unsplit model.

Each test launches real processes as ``torchrun`` would (`tests.launch`), every one running the
same function (SPMD). The biggest matrix (every zoo model x micro-batches x schedules) runs once
per world size inside one launch, re-initialising smpart between configurations, which also
checks ``init`` -> ``shutdown`` -> ``init`` within one job.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import time

import pytest
import torch
import torch.nn.functional as F

import smpart
from examples.models import ZOO
from smpart.runtime.wire.messages import StepResult
from tests.launch import run_ranks, values
from tests.test_runtime import cross_entropy_step, lm_step, reference_step, train_side_by_side, train_step
from tests.test_runtime_placement import Nested, SharedUse, TiedEncoderDecoder

TOL = 1e-6


def _train_zoo(rank, configs, steps=3):
    """Every configuration: pipelined and unsplit training side by side; the worst differences."""
    world = int(os.environ["WORLD_SIZE"])
    report = []
    for name, microbatches, schedule in configs:
        *_, diff = train_side_by_side(ZOO[name], world, microbatches, schedule, steps)
        report.append(((name, microbatches, schedule), diff))
        smpart.shutdown()
    return report


def _assert_report(results):
    for report in values(results):
        for config, diff in report:
            diff.assert_within(TOL, config)


#: Three thirds of micro-batches x schedule, each holding both schedules: the zoo's models take
#: them in turn, so every model meets both schedules and every pair runs (two configurations a
#: model, not all six: the suite's time is near its bound).
THIRDS = [((1, "gpipe"), (2, "1f1b")), ((4, "gpipe"), (1, "1f1b")), ((2, "gpipe"), (4, "1f1b"))]


@pytest.mark.timeout(600)
def test_zoo_grid_on_two_processes():
    configs = [(name, mb, schedule) for i, name in enumerate(ZOO) for mb, schedule in THIRDS[i % 3]]
    _assert_report(run_ranks(_train_zoo, 2, configs, timeout_s=580))


@pytest.mark.timeout(600)
def test_zoo_grid_on_three_processes():
    configs = [(name, *((2, "gpipe"), (4, "1f1b"))[i % 2]) for i, name in enumerate(ZOO)]
    _assert_report(run_ranks(_train_zoo, 3, configs, timeout_s=580))


@pytest.mark.timeout(600)
def test_zoo_grid_on_four_processes():
    # One configuration per model: the suite's time is near its bound; the grids above vary the rest.
    configs = [(name, 4, "1f1b") for name in ZOO]
    _assert_report(run_ranks(_train_zoo, 4, configs, timeout_s=580))


# ---------------------------------------------------------------------------- placements
def _placements(rank):
    """Nested placement, a module shared by callers on two stages, tied weights across stages."""
    found = []
    cases = [(Nested, {"": 0, "pre": 0, "inner": 1, "inner.child": 0, "post": 0}),
             (SharedUse, {"": 0, "a": 0, "b": 1, "head": 1}),
             (TiedEncoderDecoder, {"enc": 0, "dec": 1, "head": 1})]
    for make, pins in cases:
        torch.manual_seed(0)  # every rank builds the same weights (SPMD), as a user's script would
        module = make().double()
        reference = copy.deepcopy(module)
        smpart.init(pipeline_parallel_degree=2, microbatches=4, pin=pins, timeout_s=60)
        dm = smpart.DistributedModel(module)
        opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

        @smpart.step
        def step(model, x, y):
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        worst = 0.0
        for seed in range(2):
            g = torch.Generator().manual_seed(seed)
            x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g,
                                                                                    dtype=torch.float64)
            out = step(dm, x, y)
            ref = [F.mse_loss(reference(a), b) for a, b in zip(x.chunk(4), y.chunk(4), strict=True)]
            (sum(ref) / 4).backward()
            worst = max(worst, (out.stack() - torch.stack(ref).detach()).abs().max().item())
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        full = dm.state_dict()
        worst = max([worst] + [(full[k] - v).abs().max().item() for k, v in reference.state_dict().items()])
        found.append((type(module).__name__, worst, smpart.partition_of(dm).num_stages))
        smpart.shutdown()
    return found


@pytest.mark.timeout(180)
def test_nested_shared_and_tied_placements_on_processes():
    for report in values(run_ranks(_placements, 2, timeout_s=170)):
        for name, worst, stages in report:
            assert stages == 2
            assert worst <= TOL, (name, worst)


# ---------------------------------------------------------------------------- the state dict
class _ThreeBlocks(torch.nn.Module):
    """A block per stage; the first has BatchNorm, whose running statistics are state too."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8))
        self.b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.c = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _train_three_blocks_side_by_side(dm, opt, reference, ref_opt, seed: int) -> None:
    """One step of `_ThreeBlocks` split (2 micro-batches) and of its unsplit copy, on ``seed``'s batch."""
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(8, n, generator=g, dtype=torch.float64) for n in (6, 1))
    _mse_step(dm, x, y)
    opt.step()
    opt.zero_grad()
    (sum(F.mse_loss(reference(a), b) for a, b in zip(x.chunk(2), y.chunk(2), strict=True)) / 2).backward()
    ref_opt.step()
    ref_opt.zero_grad()


def _state_dict_asked_by_one_rank(rank):
    """``if smpart.rank() == 0: torch.save({"model": model.state_dict(), "optimizer":
    optimizer.state_dict()}, ...)`` between steps and after the other ranks ended their script,
    and every rank asking: the state of the unsplit model and of its optimizer. Then an optimizer
    loads the unsplit one's state and trains on alike."""
    torch.manual_seed(0)
    module = _ThreeBlocks().double()
    reference = copy.deepcopy(module)
    smpart.init(pipeline_parallel_degree=3, microbatches=2, pin={"": 0, "a": 0, "b": 1, "c": 2}, timeout_s=60)
    dm = smpart.DistributedModel(module)
    opts = [smpart.DistributedOptimizer(torch.optim.Adam(dm.parameters(), lr=0.01))]
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    got = {}

    def train(seed):
        _train_three_blocks_side_by_side(dm, opts[-1], reference, ref_opt, seed)

    def compare(name):
        full, want = dm.state_dict(), reference.state_dict()
        assert list(full) == list(want), (name, list(full))
        worst = max((full[k] - v).abs().max().item() for k, v in want.items())
        state, want_state = opts[-1].state_dict(), ref_opt.state_dict()
        assert state["param_groups"] == want_state["param_groups"], name
        assert state["state"].keys() == want_state["state"].keys(), (name, state["state"].keys())
        for index, entry in want_state["state"].items():
            assert entry.keys() == state["state"][index].keys(), name
            mine = state["state"][index]
            worst = max([worst] + [(mine[k] - v).abs().max().item() for k, v in entry.items()])
        got[name] = worst

    train(0)
    if rank == 0:
        compare("rank 0 alone, between steps")
    train(1)
    compare("every rank")
    # A new optimizer takes the unsplit one's state: each rank keeps its own parameters' part.
    opts.append(smpart.DistributedOptimizer(torch.optim.Adam(dm.parameters(), lr=0.01)))
    opts[-1].load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # as from a file: no shared tensors
    train(2)
    if rank == 0:
        time.sleep(1.0)  # the other ranks reach smpart.shutdown() first
        compare("rank 0 alone, after the others shut down, and after loading the unsplit optimizer's state")
    else:
        smpart.shutdown()  # the end of their script
    return got


@pytest.mark.timeout(180)
def test_model_and_optimizer_state_dicts_asked_by_the_first_rank_alone_or_by_every_rank():
    results = values(run_ranks(_state_dict_asked_by_one_rank, 3, timeout_s=170))
    assert len(results[0]) == 3
    assert set(results[1]) == set(results[2]) == {"every rank"}
    for got in results:
        for name, worst in got.items():
            assert worst <= TOL, (name, worst)


def _hear_of_the_step_end_last(transport, step):
    """``transport`` hands over the driver's `StepResult` for ``step`` after the next message on
    the same address: another rank's request, sent once that rank heard of the end and stepped its
    optimizer, overtakes it, as it may when this rank's receiver thread is slow."""
    receive = transport.receive
    later = []

    def receive_late(address, timeout):
        if later:
            return later.pop(0)
        message = receive(address, timeout)
        if isinstance(message, StepResult) and message.step == step:
            deadline = time.monotonic() + 10.0
            overtaking = None
            while overtaking is None and time.monotonic() < deadline:
                overtaking = receive(address, 0.05)
            if overtaking is not None:
                later.append(message)
                return overtaking
        return message

    transport.receive = receive_late


def _state_asked_before_the_step_end_is_heard(rank):
    from smpart.runtime.runtime import current_runtime

    torch.manual_seed(0)
    module = _ThreeBlocks().double()
    reference = copy.deepcopy(module)
    smpart.init(pipeline_parallel_degree=3, microbatches=2, pin={"": 0, "a": 0, "b": 1, "c": 2}, timeout_s=60)
    dm = smpart.DistributedModel(module)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    if rank == 1:
        _hear_of_the_step_end_last(current_runtime().transport, step=1)
    for seed in range(2):  # the second step runs as a step program
        _train_three_blocks_side_by_side(dm, opt, reference, ref_opt, seed)
    full, want = dm.state_dict(), reference.state_dict()
    smpart.shutdown()
    return max((full[k] - v).abs().max().item() for k, v in want.items())


@pytest.mark.timeout(120)
def test_a_rank_asked_for_its_state_before_it_hears_that_the_step_ended_answers_after_its_optimizer_step():
    for worst in values(run_ranks(_state_asked_before_the_step_end_is_heard, 3, timeout_s=110)):
        assert worst <= TOL


def _resumed_before_the_first_step(rank):
    """A resumed job loads the model's and the optimizer's full state dicts before its first step:
    it trains on like the unsplit model, and each rank keeps only its own stage's optimizer state."""
    def data(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g,
                                                                                dtype=torch.float64)

    torch.manual_seed(0)
    reference = _ThreeBlocks().double()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    for seed in range(2):
        x, y = data(seed)
        if seed == 1:  # as saved to a file after the first step
            saved = copy.deepcopy({"model": reference.state_dict(), "optimizer": ref_opt.state_dict()})
        (sum(F.mse_loss(reference(a), b) for a, b in zip(x.chunk(2), y.chunk(2), strict=True)) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin={"": 0, "a": 0, "b": 1, "c": 1}, timeout_s=60)
    torch.manual_seed(rank)  # weights that the load replaces
    dm = smpart.DistributedModel(_ThreeBlocks().double())
    opt = smpart.DistributedOptimizer(torch.optim.Adam(dm.parameters(), lr=0.01))
    dm.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    _mse_step(dm, *data(1))
    opt.step()
    full = dm.state_dict()
    worst = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return worst, sum(p.is_meta for p in opt.optimizer.state), len(opt.optimizer.state)


@pytest.mark.timeout(120)
def test_a_job_resumed_before_its_first_step_keeps_only_its_stages_optimizer_state():
    (worst0, released0, kept0), (worst1, released1, kept1) = values(
        run_ranks(_resumed_before_the_first_step, 2, timeout_s=110))
    assert max(worst0, worst1) <= TOL
    assert released0 == released1 == 0  # the state of the other stage's parameters was dropped
    assert kept0 + kept1 == len(list(_ThreeBlocks().parameters()))


class _DropoutLast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 8)
        self.last = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


@smpart.step
def _predict(model, x):
    return model(x)


def _eval_on_the_first_rank_alone(rank):
    """``if smpart.rank() == 0: model.eval()``: the other stages' ranks take the driver's modes as
    each step begins (their Dropout was still on)."""
    torch.manual_seed(0)
    module = _DropoutLast().double()
    reference = copy.deepcopy(module).eval()
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin={"": 0, "first": 0, "last": 1}, timeout_s=60)
    dm = smpart.DistributedModel(module)
    x = torch.randn(4, 4, dtype=torch.float64)
    _predict(dm, x)  # placed, in training mode: the Dropout on stage 1 is on
    if rank == 0:
        dm.eval()
    with torch.no_grad():
        evaluated = (_predict(dm, x).concat() - reference(x)).abs().max().item()
    dropout_training = [module.last[0].training]
    if rank == 0:
        dm.train()
    _predict(dm, x)
    dropout_training.append(module.last[0].training)
    return evaluated, dropout_training


@pytest.mark.timeout(120)
def test_eval_mode_set_on_the_first_rank_alone_holds_on_every_stage():
    for evaluated, dropout_training in values(run_ranks(_eval_on_the_first_rank_alone, 2, timeout_s=110)):
        assert evaluated <= 1e-12
        assert dropout_training == [False, True]


# ---------------------------------------------------------------------------- one model, several inits
def _one_model_under_three_inits(rank):
    """The same model and Adam optimizer trained under pp=2, then pp=1 x dp=2, then pp=2 again
    (``init`` -> ``shutdown`` -> ``init`` between them), against the unsplit model and Adam."""
    torch.manual_seed(0)
    built = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()
    reference = copy.deepcopy(built)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    model = smpart.DistributedModel(built)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randint(4, (4,), generator=g))
               for _ in range(6)]
    opt = None
    loss_diff = 0.0
    for pp, steps in ((2, batches[:2]), (1, batches[2:4]), (2, batches[4:])):
        smpart.init(pipeline_parallel_degree=pp, microbatches=2, timeout_s=60)
        if opt is None:
            opt = smpart.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
        per_replica = 4 // smpart.dp_size()
        mine = slice(smpart.dp_rank() * per_replica, (smpart.dp_rank() + 1) * per_replica)
        for x, y in steps:
            loss = cross_entropy_step(model, x[mine], y[mine]).reduce_mean().item()
            expected = F.cross_entropy(reference(x[mine]), y[mine]).item()
            F.cross_entropy(reference(x), y).backward()
            loss_diff = max(loss_diff, abs(loss - expected))
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.zero_grad()
        full = model.state_dict()
        smpart.shutdown()
    state_diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return loss_diff, state_diff


@pytest.mark.timeout(120)
def test_one_model_and_optimizer_go_on_training_under_another_init():
    """Each rank kept only its stage of the model and of the optimizer's state; under the next
    init every rank takes the rest from the ranks that kept it, as on threads, where nothing was
    released: the model trains on as the unsplit one (a stage had started afresh, silently)."""
    for loss_diff, state_diff in values(run_ranks(_one_model_under_three_inits, 2, timeout_s=110)):
        assert loss_diff <= TOL and state_diff <= TOL, (loss_diff, state_diff)


def _takes_back_its_own(rank):
    """Eight layers and Adam trained on 4 stages, then on 2 stages x 2 replicas: which tensors each
    rank held before, which it holds after, which it took back under the second init, and the
    trained model against the unsplit one."""
    import smpart.runtime.processes.replicas as replicas

    taken: list[str] = []
    real_fill = replicas.fill_released

    def counting_fill(module, values):
        taken.extend(values)
        real_fill(module, values)

    replicas.fill_released = counting_fill
    torch.manual_seed(0)
    built = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(8)]).double()
    reference = copy.deepcopy(built)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    model = smpart.DistributedModel(built)
    opt = smpart.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randint(8, (8,), generator=g)
    held = []
    for pp, dp in ((4, 1), (2, 2)):
        smpart.init(pipeline_parallel_degree=pp, data_parallel_degree=dp, microbatches=2, timeout_s=60)
        per_replica = 8 // smpart.dp_size()
        mine = slice(smpart.dp_rank() * per_replica, (smpart.dp_rank() + 1) * per_replica)
        cross_entropy_step(model, x[mine], y[mine])
        opt.step()
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        held.append(set(model.local_state_dict()))
        states = {name: p for name, p in model.named_parameters() if p in opt.state}
        full = model.state_dict()
        smpart.shutdown()
    state_diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return held, taken, set(states), state_diff


@pytest.mark.timeout(120)
def test_under_another_init_each_rank_takes_back_only_what_it_will_hold():
    """Every rank used to take back the whole model and the whole optimizer state (the peak of a
    re-init was the whole model on every rank); it takes back only the tensors of its new stage
    it did not keep, and trains on exactly as the unsplit model."""
    for (before, after), taken, with_state, state_diff in values(run_ranks(_takes_back_its_own, 4,
                                                                           timeout_s=110)):
        assert state_diff <= TOL
        assert sorted(taken) == sorted(after - before), (before, after, taken)
        assert with_state == {name for name in after if name.endswith(("weight", "bias"))}


def _tensor_parallel_then_pipeline(rank):
    smpart.init(tensor_parallel_degree=2, microbatches=1, timeout_s=30)
    model = smpart.DistributedModel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)))
    error_of_a_step(model, torch.ones(2, 4))
    smpart.shutdown()
    smpart.init(pipeline_parallel_degree=2, microbatches=1, timeout_s=30)
    return error_of_a_step(model, torch.ones(2, 4))


@pytest.mark.timeout(90)
def test_a_model_split_for_tensor_parallelism_under_an_earlier_init_says_to_use_a_checkpoint():
    for text in values(run_ranks(_tensor_parallel_then_pipeline, 2, timeout_s=80)):
        assert "split for tensor parallelism under an earlier smpart.init" in text, text


# ---------------------------------------------------------------------------- SMPART_DEBUG
@smpart.step
def _mse_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _debugged(rank):
    lines = _Lines()
    logging.getLogger("smpart.runtime").addHandler(lines)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin={"": 0, "0": 0, "1": 1}, timeout_s=60)
    model = smpart.DistributedModel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    started = _mse_step(model, torch.randn(4, 4), torch.randn(4, 1)).timeline.started
    return started, "\n".join(lines.lines)


@pytest.mark.timeout(90)
def test_smpart_debug_names_the_rank_on_processes(monkeypatch):
    monkeypatch.setenv("SMPART_DEBUG", "1")  # the ranks are launched in this environment
    (started, log0), (_, log1) = values(run_ranks(_debugged, 2, timeout_s=80))
    for stage, log in ((0, log0), (1, log1)):  # each rank logs its own stage's work, naming itself
        for action in started[stage]:
            line = rf"\[rank {stage} [\w<>-]+\] stage {stage} (runs|resumes) {action}\b"
            assert re.search(line, log), action
    assert re.search(r"\[rank 1 [\w<>-]+\] stage 1 receives Request\(step=0, mb=1", log1)


# ---------------------------------------------------------------------------- Hugging Face
def _unsplit_losses(reference, x: torch.Tensor, microbatches: int = 2) -> torch.Tensor:
    """Each micro-batch's loss of the unsplit model, its gradients accumulated as the pipeline's."""
    losses = []
    for piece in x.chunk(microbatches):
        loss = reference(piece, labels=piece).loss
        (loss / microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def _hf_gpt2(rank):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config).double().eval()  # its defaults: use_cache=True, a DynamicCache
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=int(os.environ["WORLD_SIZE"]), microbatches=2, timeout_s=60)
    dm = smpart.DistributedModel(model)

    report = []
    for seq in (8, 12, 5):  # the sequence length changes from step to step
        x = torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(seq))
        out = lm_step(dm, x)
        losses = _unsplit_losses(reference, x)
        grads = dict(dm.named_parameters())
        grad_diff = max((grads[n].grad - p.grad).abs().max().item() for n, p in reference.named_parameters()
                        if grads[n].grad is not None)
        owned = sum(p.grad is not None for p in dm.parameters())
        report.append((seq, (out.stack() - losses).abs().max().item(), grad_diff, owned,
                       out.timeline.bytes_sent))
        dm.zero_grad()
        reference.zero_grad()
    return report


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_hugging_face_gpt2_with_its_defaults_and_changing_sequence_length(world):
    reports = values(run_ranks(_hf_gpt2, world, timeout_s=170))
    total_params = 4 * 12 + 5  # every rank holds gradients for its own stage's parameters only
    for report in reports:
        for seq, loss_diff, grad_diff, _, bytes_sent in report:
            assert loss_diff <= 1e-10 and grad_diff <= 1e-10, (seq, loss_diff, grad_diff)
            assert bytes_sent, "tensors crossed between processes"
    owned = [report[0][3] for report in reports]
    assert sum(owned) <= total_params + 1 and all(n > 0 for n in owned[1:])


def _ambient_around_the_call(rank):
    """Per leaf module this rank ran: grad mode and CPU autocast as it saw them, in a step called
    under ``torch.autocast`` and in one called under ``torch.no_grad()`` (not set inside the body)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=4, n_head=2, vocab_size=64, n_positions=32)).eval()
    seen: dict[str, tuple[bool, bool]] = {}
    for name, module in model.named_modules():
        if not list(module.children()):
            module.register_forward_hook(lambda *_, name=name: seen.__setitem__(
                name, (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))))
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    dm = smpart.DistributedModel(model)

    @smpart.step
    def forward(model, ids):
        return model(ids).logits

    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    forward(dm, x)  # placed
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = forward(dm, x).concat()
    under_autocast = dict(seen)
    seen.clear()
    with torch.no_grad():
        forward(dm, x)
    return under_autocast, dict(seen), logits.dtype


@pytest.mark.timeout(120)
def test_autocast_and_no_grad_around_the_step_call_reach_every_stage():
    for under_autocast, under_no_grad, dtype in values(run_ranks(_ambient_around_the_call, 2, timeout_s=110)):
        assert under_autocast and all(autocast for _, autocast in under_autocast.values()), under_autocast
        assert under_no_grad and not any(grad for grad, _ in under_no_grad.values()), under_no_grad
        assert dtype == torch.bfloat16


def _generate(rank):
    """``generate`` inside a step, and outside one, where a rank holds only its own stage (once a
    call to the model split it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=4, n_head=2, vocab_size=64, n_positions=32)).eval()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    dm = smpart.DistributedModel(model)

    @smpart.step
    def generate(model, prompt):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)

    @smpart.step
    def forward(model, prompt):
        with torch.no_grad():
            return model(prompt).logits

    prompt = torch.randint(0, 64, (4, 4), generator=torch.Generator().manual_seed(0))
    forward(dm, prompt)
    produced = generate(dm, prompt).concat()
    expected = reference.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with pytest.raises(smpart.SmpartError, match="only inside a step") as outside:
        dm.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return torch.equal(produced, expected), str(outside.value)


@pytest.mark.timeout(120)
def test_generate_runs_inside_a_step_and_outside_one_says_so_where_a_rank_holds_one_stage():
    for same, outside in values(run_ranks(_generate, 2, timeout_s=110)):
        assert same
        assert "meta device" in outside and "@smpart.step" in outside, outside


def _hf_gpt2_full_size(rank):
    """GPT-2 exactly as `GPT2Config()` builds it (124M parameters, float32), one training step;
    in eval mode, so that dropout draws no random numbers (their order differs between one
    process and two)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=120)
    dm = smpart.DistributedModel(model)

    x = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    out = lm_step(dm, x)
    losses = _unsplit_losses(reference, x)
    grads = dict(dm.named_parameters())
    worst = max(((grads[n].grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
                for n, p in reference.named_parameters() if grads[n].grad is not None)
    held = sum(p.numel() for p in dm.parameters() if p.device.type != "meta")
    planned = smpart.partition_of(dm).stage_loads()[smpart.pp_rank()].param_bytes // 4
    return (out.stack() - losses).abs().max().item(), worst, held, planned


@pytest.mark.timeout(240)
def test_hugging_face_gpt2_full_size_as_its_default_config_builds_it():
    reports = values(run_ranks(_hf_gpt2_full_size, 2, timeout_s=230))
    for loss_diff, worst_grad, held, planned in reports:
        assert loss_diff <= 1e-4 and worst_grad <= 1e-4, (loss_diff, worst_grad)
        assert held == planned
    # each rank holds its own stage's parameters: together the model once (tied weights counted once)
    assert sum(report[2] for report in reports) == 124_439_808


# ---------------------------------------------------------------------------- meta device, eval
def _meta_built(rank):
    """A model built on the meta device: each rank materialises only its own modules (to_empty and
    each module's reset_parameters); evaluation (forward-only) steps work."""
    from examples.models import GPT, GPTConfig, gpt2

    example = gpt2()
    with torch.device("meta"):  # built there: no weights anywhere until each rank makes its own
        model = GPT(GPTConfig())
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    dm = smpart.DistributedModel(model)

    @smpart.step
    def evaluate(model, x, y):
        with torch.no_grad():
            return example.loss(model(x), y)

    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.5))  # made before placement

    @smpart.step
    def train(model, x, y):
        loss = example.loss(model(x), y)
        model.backward(loss)
        return loss

    out = evaluate(dm, example.args[0], example.target)
    devices = {p.device.type for p in dm.parameters()}
    held = sum(p.numel() for p in dm.parameters() if p.device.type != "meta")
    before = {k: v.clone() for k, v in dm.local_state_dict().items()}
    train(dm, example.args[0], example.target)
    opt.step()
    after = dm.local_state_dict()
    moved = all(not torch.equal(before[k], v) for k, v in after.items() if k.endswith("weight"))
    total = sum(p.numel() for p in example.model.parameters())
    try:  # outside a step the rank has only its stage's weights: a clear error, not a meta-device one
        dm(example.args[0])
        outside = "ran"
    except smpart.SmpartError as err:
        outside = str(err)
    return float(out.reduce_mean()), sorted(devices), held, total, moved, outside


@pytest.mark.timeout(120)
def test_a_model_built_on_meta_is_materialised_per_rank_and_evaluates():
    results = values(run_ranks(_meta_built, 2, timeout_s=110))
    losses = [loss for loss, *_ in results]
    assert losses[0] == losses[1] and torch.isfinite(torch.tensor(losses[0]))
    for _, devices, held, _, moved, outside in results:
        assert devices == ["cpu", "meta"] and held > 0
        assert moved, "the optimizer made before placement trains the materialised parameters"
        assert "can run only inside a step" in outside, outside
    assert sum(r[2] for r in results) == results[0][3]


# ---------------------------------------------------------------------------- data parallelism
class _NoReset(torch.nn.Module):
    """Its own parameter, and no reset_parameters(): nothing can initialise it from meta."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.scale


def _meta_built_as_hugging_face_and_plainly(rank):
    """Built on meta, a Hugging Face model is initialised by its own scheme on each rank (its Conv1D
    has no reset_parameters: it held uninitialised memory, and the loss was NaN); a plain module with
    no way to initialise it is said to hold uninitialised memory."""
    import warnings

    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=2, vocab_size=64, n_positions=32)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    with torch.device("meta"):
        hugging_face = smpart.DistributedModel(transformers.GPT2LMHeadModel(config))
        plain = smpart.DistributedModel(torch.nn.Sequential(torch.nn.Linear(8, 8), _NoReset(),
                                                            torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))

    @smpart.step
    def loss_of(model, ids):
        return model(input_ids=ids, labels=ids).loss

    @smpart.step
    def run(model, x):
        return model(x)

    ids = torch.randint(64, (4, 16), generator=torch.Generator().manual_seed(0))
    loss = loss_of(hugging_face, ids).reduce_mean().item()
    weights = [p for n, p in hugging_face.named_parameters() if not p.is_meta and n.endswith("c_fc.weight")]
    std = torch.cat([w.flatten() for w in weights]).std().item()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(plain, torch.randn(4, 8))
    said = [str(w.message) for w in caught if "uninitialised memory" in str(w.message)]
    holds_no_reset = not plain.module[1].scale.is_meta
    return loss, std, said, holds_no_reset


@pytest.mark.timeout(120)
def test_a_model_built_on_meta_is_initialised_by_its_own_scheme_or_said_to_be_blank():
    results = values(run_ranks(_meta_built_as_hugging_face_and_plainly, 2, timeout_s=110))
    for loss, std, said, holds_no_reset in results:
        assert abs(loss - math.log(64)) < 0.1, loss  # a uniform guess from small random weights
        assert 0.01 < std < 0.03, std  # GPT-2's initializer_range, 0.02
        assert bool(said) == holds_no_reset, said  # said on the rank that holds it, only there
        if said:
            assert "1" in said[0] and "reset_parameters" in said[0]
    assert sum(holds for *_, holds in results) == 1


def _data_parallel(rank, pp, name, schedule):
    """pp x dp=2: each replica steps on its half of the global batch; the result equals the unsplit
    model trained on the whole batch with the mean loss."""
    microbatches, dp = 2, int(os.environ["WORLD_SIZE"]) // pp
    example = ZOO[name](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=pp, microbatches=microbatches, pipeline=schedule, timeout_s=60)
    assert (smpart.dp_size(), smpart.pp_size()) == (dp, pp)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    worst = 0.0
    for step in range(3):
        args, kwargs, target = example.batch(4 * dp, seed=step)
        mine = slice(smpart.dp_rank() * 4, (smpart.dp_rank() + 1) * 4)
        out = train_step(model, example, [a[mine] for a in args], {k: v[mine] for k, v in kwargs.items()},
                        target[mine])
        expected = reference_step(reference, example, args, kwargs, target, microbatches * dp)
        mine_mbs = expected[smpart.dp_rank() * microbatches:(smpart.dp_rank() + 1) * microbatches]
        worst = max(worst, (out.stack() - mine_mbs).abs().max().item())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    # Parameters must match; buffers (BatchNorm running statistics) are each replica's own, as with
    # DDP without buffer broadcast: a replica only sees its half of the batch.
    full = model.state_dict()
    diffs = {k: (full[k] - v).abs().max().item() for k, v in reference.named_parameters()}
    return max([worst, *diffs.values()]), sorted(k for k, d in diffs.items() if d > TOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("pp", "name", "schedule"), [(1, "gpt2", "1f1b"), (2, "moe", "gpipe"),
                                                      (2, "resnet", "1f1b")])
def test_data_parallel_replicas_train_like_the_unsplit_model_on_the_global_batch(pp, name, schedule):
    for worst, differing in values(run_ranks(_data_parallel, 2 * pp, pp, name, schedule, timeout_s=280)):
        assert worst <= TOL, (worst, differing)


def error_of_a_step(model, x) -> str:
    """The `SmpartError` one training step on ``x`` raises here, as text ("no error" if none)."""

    @smpart.step
    def step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    try:
        step(model, x)
    except smpart.SmpartError as err:
        return str(err)
    return "no error"


def _uneven_replicas(rank):
    smpart.init(pipeline_parallel_degree=1, microbatches=1, timeout_s=30)
    model = smpart.DistributedModel(torch.nn.Linear(4, 1))
    return error_of_a_step(model, torch.ones(4 + smpart.dp_rank(), 4))


def _built_differently(rank, how):
    smpart.init(pipeline_parallel_degree=2, microbatches=1, timeout_s=30)
    if how == "meta on one rank":  # weights loaded on the first rank alone would reach no one else
        with torch.device("meta" if rank == 1 else "cpu"):
            module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    else:
        module = torch.nn.Sequential(torch.nn.Linear(4, 4 + rank), torch.nn.Linear(4 + rank, 1))
    return error_of_a_step(smpart.DistributedModel(module), torch.ones(2, 4))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["meta on one rank", "other shapes"])
def test_ranks_that_build_different_models_are_told_so_before_anything_is_placed(how):
    for text in values(run_ranks(_built_differently, 2, how, timeout_s=80)):
        assert "the ranks hold different models (DistributedModel #" in text, text


def _batch_norm_replicas(rank, broadcast_buffers):
    """Replicas train a BatchNorm model on differently distributed data, then evaluate one input."""
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                 torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))
    model = smpart.DistributedModel(module, broadcast_buffers=broadcast_buffers)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smpart.step
    def evaluate(model, x):
        return model(x)

    g = torch.Generator().manual_seed(smpart.dp_rank())
    for _ in range(3):
        scale = 1 + smpart.dp_rank()  # each replica's data has its own spread
        cross_entropy_step(model, torch.randn(8, 8, generator=g) * scale, torch.randint(4, (8,), generator=g))
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        out = evaluate(model, torch.ones(4, 8)).concat()
    replica = smpart.dp_rank()
    smpart.shutdown()
    return replica, out.tolist()


@pytest.mark.timeout(120)
def test_replicas_take_the_first_replicas_buffers_at_each_step_as_ddp_does():
    """BatchNorm's running statistics: each replica's own data moved them apart, so the replicas
    evaluated the same input differently; with broadcast_buffers (the default) every step starts
    from the first replica's, and without it they stay apart."""
    by_replica = dict(values(run_ranks(_batch_norm_replicas, 4, True, timeout_s=110)))
    assert by_replica[0] == by_replica[1]
    apart = dict(values(run_ranks(_batch_norm_replicas, 4, False, timeout_s=110)))
    assert apart[0] == by_replica[0] and apart[1] != apart[0]


@pytest.mark.timeout(90)
def test_replicas_fed_batches_of_different_sizes_are_told_so():
    for text in values(run_ranks(_uneven_replicas, 2, timeout_s=80)):
        assert "different shapes" in text, text


def _clipped(rank, pp):
    """Global gradient clipping over pp x dp: the norm of the whole model, each replica counted once,
    by torch's own ``clip_grad_norm_`` called as training scripts call it, and by the optimizer's."""
    torch_clip = torch.nn.utils.clip_grad_norm_
    example = ZOO["gpt2"](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=pp, microbatches=2, timeout_s=60)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    dp = smpart.dp_size()
    args, kwargs, target = example.batch(4 * dp, seed=0)
    mine = slice(smpart.dp_rank() * 4, (smpart.dp_rank() + 1) * 4)
    train_step(model, example, [a[mine] for a in args], {}, target[mine])
    reference_step(reference, example, args, kwargs, target, 2 * dp)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    clipped = opt.clip_grad_norm_(math.inf)  # the norm of what torch's call left: 0.05 on every rank
    smpart.shutdown()
    assert torch.nn.utils.clip_grad_norm_ is torch_clip, "shutdown gives torch its function back"
    return total.item(), expected.item(), clipped.item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "pp"), [(2, 2), (4, 2)])
def test_global_gradient_clipping_across_stages_and_replicas(world, pp):
    for total, expected, clipped in values(run_ranks(_clipped, world, pp, timeout_s=110)):
        assert abs(total - expected) <= 1e-9 * expected, (total, expected)
        assert abs(clipped - 0.05) <= 1e-6, clipped


# ---------------------------------------------------------------------------- tensor parallelism
def _tensor_parallel(rank, name, pp=1, schedule="1f1b"):
    """pp x tp=2 x dp: the automatic plan swaps in the tensor-parallel layers; training equals the
    unsplit model on the global batch (parameters, AdamW, clipping)."""
    dp = int(os.environ["WORLD_SIZE"]) // (2 * pp)
    torch.manual_seed(0)
    example = ZOO[name](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=pp, tensor_parallel_degree=2, microbatches=2, pipeline=schedule,
                timeout_s=60)
    assert (smpart.pp_size(), smpart.tp_size(), smpart.dp_size()) == (pp, 2, dp)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    norms = []
    for step in range(3):
        args, kwargs, target = example.batch(4 * dp, seed=step)
        mine = slice(smpart.dp_rank() * 4, (smpart.dp_rank() + 1) * 4)
        piece = {k: v[mine] for k, v in kwargs.items()}
        train_step(model, example, [a[mine] for a in args], piece, target[mine])
        reference_step(reference, example, args, kwargs, target, 2 * dp)
        if step == 0:
            total = opt.clip_grad_norm_(1.0)
        else:  # torch's own function, as training scripts call it
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append((total.item(), torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    split = sorted(model.tensor_parallel_plan.styles())
    _assert_partition_says_what_was_split(model)
    full = model.state_dict()
    worst = max((full[k] - v).abs().max().item() for k, v in reference.named_parameters())
    with pytest.raises(smpart.SmpartError, match="save_checkpoint"):  # its state is split in shards
        opt.state_dict()
    return worst, max(abs(a - b) for a, b in norms), len(split)


def _assert_partition_says_what_was_split(model):
    """The partition the model ran with names, per tree node, what its tensor-parallel plan split."""
    plan, ran = model.tensor_parallel_plan, smpart.partition_of(model)
    expected: dict[str, set[str]] = {}
    for name, style in [*plan.styles().items(), *((name, "heads") for name in plan.attention)]:
        expected.setdefault(ran.tree.node(name).name, set()).add(style)
    meta = ran.meta["tensor_parallel"]
    assert meta["degree"] == plan.degree == 2
    assert {name: set(style.split("+")) for name, style in meta["split"].items()} == expected
    assert "transformer.h.0.ln_1" not in meta["split"] and "transformer.h.0.mlp.c_fc" in meta["split"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("pp", "world"), [(1, 2), (1, 4)])
def test_tensor_parallel_replicas_train_like_the_unsplit_model(pp, world):
    """Adam and global clipping with tp = 2 (and dp = 2). pp x tp x dp = 2 x 2 x 2 on 8 processes,
    with clipping, is `test_processes_3d`'s, for three models in one launch."""
    for worst, norm_diff, split in values(run_ranks(_tensor_parallel, world, "gpt2", pp, timeout_s=190)):
        assert split > 0, "the plan split something"
        assert worst <= TOL and norm_diff <= 1e-9, (worst, norm_diff)


def _hf_tensor_parallel(rank, names):
    """Hugging Face models as built, tp = 2: two SGD steps, losses and the whole state dict against
    the unsplit model (each model's own adapter splits its attention heads)."""
    from tests import test_hf_models as hf

    report = {}
    for name in names:
        case, model, reference = hf.build(name, train=True)
        smpart.init(tensor_parallel_degree=2, microbatches=2, timeout_s=60)
        try:
            dm = smpart.DistributedModel(model)
            opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            losses = []
            for step in range(2):
                x, labels = case.inputs(step)
                out = hf.train_step(dm, x, labels)
                losses.append((out.stack() - hf.reference_losses(reference, x, labels)).abs().max().item())
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad()
            full = dm.state_dict()
            worst = max(((full[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
                        for k, v in reference.state_dict().items() if v.is_floating_point())
            report[name] = (max(losses), worst, len(dm.tensor_parallel_plan.attention), case.tol)
        finally:
            smpart.shutdown()
    return report


@pytest.mark.timeout(150)
def test_hugging_face_models_split_for_tensor_parallelism_train_like_the_unsplit_ones():
    for report in values(run_ranks(_hf_tensor_parallel, 2, ["bert", "llama", "opt"], timeout_s=140)):
        for name, (loss_diff, worst, attentions, tol) in report.items():
            assert attentions > 0, f"{name}: no attention's heads were split"
            assert loss_diff <= tol and worst <= tol, (name, loss_diff, worst)


def _plain_optimizer(rank):
    """tp = 2 with torch's own AdamW, made from ``model.parameters()`` before the first step split
    the layers into new (DTensor) parameters, as a script that never heard of DistributedOptimizer
    makes it."""
    torch.manual_seed(0)
    example = ZOO["gpt2"](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(tensor_parallel_degree=2, microbatches=2, timeout_s=60)
    model = smpart.DistributedModel(example.model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for step in range(2):
        args, kwargs, target = example.batch(4, seed=step)
        train_step(model, example, args, kwargs, target)
        reference_step(reference, example, args, kwargs, target, 2)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = model.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in reference.named_parameters())


@pytest.mark.timeout(120)
def test_a_plain_torch_optimizer_made_before_tensor_parallelism_split_the_layers_steps_the_shards():
    for worst in values(run_ranks(_plain_optimizer, 2, timeout_s=110)):
        assert worst <= TOL, worst


class _UnevenTiming(torch.nn.Module):
    """A root on stage 0 calling two MLP blocks on stage 1 one after the other, sleeping in between
    for a time that differs by tensor-parallel rank and micro-batch: each rank of stage 1 receives
    the micro-batches' calls in a different order."""

    def __init__(self, width=8):
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.a = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                     torch.nn.Linear(4 * width, width))
        self.b = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                     torch.nn.Linear(4 * width, width))
        self.head = torch.nn.Linear(width, 1)
        self.calls = 0

    def forward(self, x):
        h = self.a(self.inp(x))
        if torch.is_grad_enabled() and x.device.type != "meta":
            self.calls += 1
            if self.calls % 2 == smpart.tp_rank():
                time.sleep(0.2)
        return self.head(self.b(h))


def _uneven_timing(rank):
    torch.manual_seed(0)
    model = _UnevenTiming().double()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, tensor_parallel_degree=2, microbatches=4, pipeline="gpipe",
                timeout_s=60)
    smpart.set_partition(model.a, 1)
    smpart.set_partition(model.b, 1)
    dist_model = smpart.DistributedModel(model)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)

    @smpart.step
    def step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    out = step(dist_model, x, y)
    losses = [F.mse_loss(reference(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True)]
    (sum(losses) / 4).backward()
    grads = {k: p.grad for k, p in reference.named_parameters()}
    full = {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for k, p in dist_model.module.named_parameters() if p.grad is not None}
    mine = {k: (full[k] - grads[k]).abs().max().item() for k in full}
    split = sorted(dist_model.tensor_parallel_plan.styles())
    return max(mine.values()), (out.stack() - torch.stack(losses)).abs().max().item(), split


@pytest.mark.timeout(120)
def test_tensor_parallel_ranks_of_a_stage_work_in_one_order_whatever_the_arrival_order():
    """Without one order, the ranks' all-reduces would pair different micro-batches' tensors."""
    for grad_diff, loss_diff, split in values(run_ranks(_uneven_timing, 4, timeout_s=110)):
        assert any(name.startswith("a.") for name in split), split
        assert grad_diff <= TOL and loss_diff <= TOL, (grad_diff, loss_diff)


class _Routed(torch.nn.Module):
    """A layer only micro-batches of positive inputs use (``bonus``, registered last, so its
    gradient is in the first bucket): how often its gradient arrives changes with the data."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 1)
        self.bonus = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if x.sum() > 0:
            h = h + torch.tanh(self.bonus(h))
        return self.out(h)


#: Per step, the sign of each micro-batch's inputs on replica 0; replica 1's are always negative.
SIGNS = [(1, -1), (1, -1), (1, -1), (1, 1), (-1, -1)]


def _early_buckets(rank):
    """Buckets start during the backward once the last step's counts say a gradient is final; a
    gradient arriving after its bucket started (a count grown with the data), a bucket one replica
    started and the other has no gradient for, and a layer no replica used all still average
    exactly as one process on the global batch."""
    from smpart.runtime.processes import data_parallel
    from smpart.runtime.runtime import current_runtime

    data_parallel.BUCKET_BYTES = 100  # about a bucket per parameter
    torch.manual_seed(0)
    module = _Routed().double()
    reference = copy.deepcopy(module)
    smpart.init(pipeline_parallel_degree=1, microbatches=2, timeout_s=60)
    model = smpart.DistributedModel(module)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    worst, stats = 0.0, []
    for step, signs in enumerate(SIGNS):
        g = torch.Generator().manual_seed(step)
        xs = [torch.cat([torch.randn(2, 6, generator=g, dtype=torch.float64).abs() * sign
                         for sign in (signs if d == 0 else (-1, -1))]) for d in range(2)]
        ys = [torch.randn(4, 1, generator=g, dtype=torch.float64) for _ in range(2)]
        _mse_step(model, xs[smpart.dp_rank()], ys[smpart.dp_rank()])
        reducer = current_runtime()._reducer
        stats.append((reducer.started_early, reducer.corrected))
        # the unsplit model on the global batch: the mean of all four micro-batches' losses
        pairs = [pair for d in range(2) for pair in zip(xs[d].chunk(2), ys[d].chunk(2), strict=True)]
        losses = [F.mse_loss(reference(x), y) for x, y in pairs]
        (sum(losses) / 4).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), step
            if p.grad is not None:
                worst = max(worst, (p.grad - q.grad).abs().max().item())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    smpart.shutdown()
    return rank, worst, stats


@pytest.mark.timeout(120)
def test_gradient_buckets_start_during_the_backward_and_stay_exact_when_routing_changes():
    results = values(run_ranks(_early_buckets, 2, timeout_s=110))
    for _, worst, _ in results:
        assert worst <= 1e-12, worst
    (_, _, first), (_, _, second) = results
    # the first step has no counts to go by; from the second on, replica 0 starts its `bonus`
    # bucket once micro-batch 0's gradient is in
    assert [started for started, _ in first][:2] == [0, 0] and first[2][0] > 0, first
    # step 3: both of replica 0's micro-batches use `bonus`; the second's gradient (weight and bias)
    # arrives after the bucket started and is averaged by the correction, on both replicas
    assert first[3][1] == 2 and second[3][1] == 2, (first, second)
