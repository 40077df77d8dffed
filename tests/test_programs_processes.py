"""Step programs under ``torchrun``: one process per rank, each running its list of actions on its
main thread; with data and tensor parallelism; failures named as on the reference runtime."""

from __future__ import annotations

import collections
import copy
import functools
import os
import time

import pytest
import torch
import torch.utils._pytree as pytree

import smpart
from examples.models import ZOO
from tests.launch import run_ranks, values
from tests.test_runtime import reference_step, train_step

TOL = 1e-6


def _state_difference(model, reference) -> float:
    """The largest difference between the split model's full state and the unsplit one's."""
    full = model.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def _train(rank, pp, tp, name, steps=4):
    """pp x tp x dp (dp from the world size), SGD, against the unsplit model on the global batch;
    which runtime ran each step, the worst difference of the final state, the last step's messages,
    and how many small exchanges of the gradient averaging each step made on this rank."""
    from smpart.runtime.processes.data_parallel import GradientReducer

    exchanges = []
    control_max = GradientReducer._control_max

    def counted(self, flags, phase):
        exchanges[-1] += 1
        return control_max(self, flags, phase)

    GradientReducer._control_max = counted
    dp = int(os.environ["WORLD_SIZE"]) // (pp * tp)
    torch.manual_seed(0)
    example = ZOO[name](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=pp, tensor_parallel_degree=tp, microbatches=2, timeout_s=60)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    runtimes, losses = [], []
    for step in range(steps):
        exchanges.append(0)
        args, kwargs, target = example.batch(4 * dp, seed=step)
        mine = slice(smpart.dp_rank() * 4, (smpart.dp_rank() + 1) * 4)
        out = train_step(model, example, [a[mine] for a in args], {k: v[mine] for k, v in kwargs.items()},
                         target[mine])
        expected = reference_step(reference, example, args, kwargs, target, 2 * dp)
        mine_expected = expected[2 * smpart.dp_rank():2 * smpart.dp_rank() + 2]
        losses.append((out.stack() - mine_expected).abs().max().item())
        runtimes.append(out.timeline.runtime)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    worst = _state_difference(model, reference)
    messages = dict(out.timeline.messages)
    return runtimes, max(losses), worst, messages, exchanges


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("pp", "tp", "world"), [(2, 1, 2), (2, 1, 4), (1, 2, 2), (2, 2, 4)],
                         ids=["pp2", "pp2xdp2", "tp2", "pp2xtp2"])
def test_programs_run_on_processes_with_data_and_tensor_parallelism(pp, tp, world):
    for runtimes, loss, worst, messages, exchanges in values(run_ranks(_train, world, pp, tp, "gpt2",
                                                                         timeout_s=280)):
        assert runtimes == ["reference", "program", "program", "program"], runtimes
        assert loss <= TOL and worst <= TOL, (loss, worst)
        if world // (pp * tp) > 1:  # a program step's replicas agree in one exchange (DDP's: none)
            assert exchanges == [3, 1, 1, 1], exchanges
        if pp == 2:  # tied embeddings: each micro-batch's activation goes there and back, so do
            # their gradients, one message each
            assert messages == {(0, 1): 4, (1, 0): 4}, messages


class _Boom(torch.nn.Linear):
    fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("boom on the second stage")
        return super().forward(x)


def _fails_then_runs(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), _Boom(8, 4)).double()
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=30, pin={"": 0, "0": 0, "1": 0, "2": 1})
    dm = smpart.DistributedModel(model)

    @smpart.step
    def step(model, x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    x, y = torch.randn(4, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        messages = dict(step(dm, x, y).timeline.messages)
        dm.zero_grad()
    model[2].fail = True
    started = time.monotonic()
    try:
        step(dm, x, y)
        caught = None
    except smpart.PipelineError as err:
        caught = (err.stage, err.module, err.microbatch, str(err))
    took = time.monotonic() - started
    model[2].fail = False
    dm.zero_grad()
    after = step(dm, x, y).timeline.runtime
    return caught, took, after, messages


@pytest.mark.timeout(180)
def test_a_module_error_in_a_program_step_is_named_on_every_rank_and_the_next_step_runs():
    for caught, took, after, messages in values(run_ranks(_fails_then_runs, 2, timeout_s=170)):
        # before it: one message per micro-batch each way, the labels (from the first rank, whose
        # arguments the step runs on) riding with the activation to the loss on the second
        assert messages == {(0, 1): 2, (1, 0): 2}, messages
        assert caught is not None
        stage, module, microbatch, text = caught
        assert (stage, module, microbatch) == (1, "2", 0), caught
        assert "boom on the second stage" in text and "[F0]" in text
        assert took < 30
        assert after == "program"


def _one_dies(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=300,
                pin={"": 0, "0": 0, "1": 0, "2": 1})
    dm = smpart.DistributedModel(model)

    @smpart.step
    def step(model, x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if smpart.rank() == 1 and os.environ.get("SMPART_TEST_DIE") == "now":
            os._exit(3)  # the second rank's process dies in the middle of a program step
        model.backward(loss)
        return loss

    x, y = torch.randn(4, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        step(dm, x, y)
        dm.zero_grad()
    os.environ["SMPART_TEST_DIE"] = "now"
    started = time.monotonic()
    try:
        step(dm, x, y)
    except smpart.SmpartError as err:
        return time.monotonic() - started, str(err)
    return None


@pytest.mark.timeout(180)
def test_a_rank_that_dies_during_a_program_step_is_named_by_the_others_within_a_minute():
    results = run_ranks(_one_dies, 2, timeout_s=170)
    first = results[0]
    assert results[1].exitcode == 3
    assert first.error is None and first.value is not None, first
    took, text = first.value
    assert took < 60, took
    assert "rank 1" in text, text


class _Branch(torch.nn.Module):
    """The root takes a detour through ``extra`` (on the other stage) for a rare input: the
    program recorded without it cannot run a micro-batch that takes it."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if x[0, 0].item() > 5.0:
            h = self.extra(h)
        return self.head(h)


def _two_replicas_train(model, steps, batch_of, pp=1, pin=None):
    """``model`` trained on 2 data-parallel replicas of ``pp`` stages, 2 micro-batches each, SGD,
    against the unsplit model on the global batch: ``batch_of(step, replica)`` gives the global
    batch and the rows this replica takes. Each step's runtime and reason (or the `SmpartError`
    it raised, with no update), and the worst difference of the losses and the final state."""
    from tests.test_programs import classify

    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=pp, microbatches=2, timeout_s=60, pin=pin or {})
    dm = smpart.DistributedModel(model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    replica = smpart.dp_rank()
    seen, worst = [], 0.0
    for i in range(steps):
        x, y, mine = batch_of(i, replica)
        try:
            out = classify(dm, x[mine], y[mine])
        except smpart.SmpartError as err:
            seen.append(("error", str(err)))
            opt.zero_grad()
            continue
        losses = []
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            loss = torch.nn.functional.cross_entropy(reference(xs), ys)
            (loss / 4).backward()
            losses.append(loss.detach())
        worst = max(worst, (out.stack() - torch.stack(losses)[2 * replica:][:2]).abs().max().item())
        seen.append((out.timeline.runtime, out.timeline.reason))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return seen, max(worst, _state_difference(dm, reference))


def _one_replica_diverges(rank):
    def batch_of(i, replica):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randint(4, (8,), generator=g)
        if i == 3:
            x[4, 0] = 9.0  # the first micro-batch of replica 1 takes the detour
        return x, y, slice(4 * replica, 4 * replica + 4)

    torch.manual_seed(0)
    return _two_replicas_train(_Branch().double(), 6, batch_of, pp=2,
                               pin={"": 0, "first": 0, "extra": 1, "head": 1})


@pytest.mark.timeout(240)
def test_a_program_that_diverges_on_one_replica_runs_again_on_the_reference_runtime_on_all():
    for seen, worst in values(run_ranks(_one_replica_diverges, 4, timeout_s=230)):
        assert worst <= TOL, worst
        runtimes = [runtime for runtime, _ in seen]
        assert runtimes == ["reference", "program", "program", "reference", "program", "program"], seen
        assert "diverged" in seen[3][1], seen[3]


def _replicas_apart(rank, apart):
    """pp 1 x dp 2 (DDP's shape), where a program step asks for the replicas' check only before
    its backward: replica 1 decides to run every step on the reference runtime (``reference
    runtime``), or feeds a batch of another shape at step 3 (``other shape``, a program step on
    replica 0)."""
    from smpart.runtime.program import guards
    from tests.test_programs import Chain, batch

    def batch_of(i, replica):
        rows = 2 if apart == "other shape" and i == 3 and replica == 1 else 4
        return (*batch(i), slice(4 * replica, 4 * replica + rows))

    decide = guards.ModelPrograms.decide
    if apart == "reference runtime" and rank == 1:  # as a replica whose first step failed would
        guards.ModelPrograms.decide = lambda self, key, on: guards.Decision(key, "replica 1's own reasons")
    try:
        torch.manual_seed(0)
        return (rank, *_two_replicas_train(Chain().double(), 5, batch_of))
    finally:
        guards.ModelPrograms.decide = decide


@pytest.mark.timeout(200)
def test_a_replica_on_the_reference_runtime_takes_the_others_there_from_before_their_backward():
    """Replica 0 starts each step's program and learns from the check, before its backward, that
    replica 1 runs the step on the reference runtime: it gives its forward up and runs the step
    there too; both equal the unsplit model on the global batch."""
    for rank, seen, worst in values(run_ranks(_replicas_apart, 2, "reference runtime", timeout_s=190)):
        assert worst <= TOL, worst
        assert [runtime for runtime, _ in seen] == ["reference"] * 5, seen
        if rank == 0:
            assert all("another data-parallel replica" in why for _, why in seen[2:]), seen


@pytest.mark.timeout(200)
def test_replicas_fed_batches_of_other_shapes_at_a_program_step_are_told_so_and_train_on():
    """At a program step the check's answer comes before the backward: both replicas raise (as at
    a first step), no gradient is averaged, and the next step runs its program again."""
    for _, seen, worst in values(run_ranks(_replicas_apart, 2, "other shape", timeout_s=190)):
        assert worst <= TOL, worst
        assert seen[3][0] == "error" and "different shapes" in seen[3][1], seen
        assert [runtime for runtime, _ in seen[:3]] == ["reference", "program", "program"], seen
        assert seen[4][0] == "program", seen


def _unsplittable_batch(rank):
    """pp 2 x dp 2: at step 3 replica 1 is fed 3 rows, which do not split into 2 micro-batches."""
    from tests.test_programs import Chain, batch, chain_pins

    def batch_of(i, replica):
        return (*batch(i), slice(4 * replica, 4 * replica + (3 if i == 3 and replica == 1 else 4)))

    torch.manual_seed(0)
    seen, worst = _two_replicas_train(Chain().double(), 5, batch_of, pp=2, pin=chain_pins(2))
    return smpart.dp_rank(), seen, worst


@pytest.mark.timeout(200)
def test_a_replica_whose_batch_does_not_split_fails_the_step_on_every_replica_which_train_on():
    """Every rank of the replica raises why, every rank of the other raises that a replica could
    not split its batch (none waits for the other to time out), and the next step finds them in
    step: its program runs, and both equal the unsplit model, which skipped the failed step."""
    for replica, seen, worst in values(run_ranks(_unsplittable_batch, 4, timeout_s=190)):
        assert worst <= TOL, worst
        assert seen[3][0] == "error", seen
        why = "does not split into 2 equal micro-batches" if replica == 1 else "could not split its batch"
        assert why in seen[3][1], (replica, seen[3])
        assert [runtime for runtime, _ in seen[:3]] == ["reference", "program", "program"], seen
        assert seen[4][0] == "program", seen


Batch = collections.namedtuple("Batch", "x y")
Hidden = collections.namedtuple("Hidden", "h gate")


class _Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return Hidden(torch.tanh(h), torch.sigmoid(h))


class _NamedTuples(torch.nn.Module):
    """Namedtuples where a user has them: a module's output that crosses the cut (``Hidden``)."""

    def __init__(self):
        super().__init__()
        self.encoder = _Encoder()
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        hidden = self.encoder(x)
        return self.head(hidden.h * hidden.gate)


def _two_stages_against_unsplit(model, pins, steps, batch_of, step, loss_of, expect=lambda losses: [losses],
                                seen=lambda timeline: timeline.runtime, before=lambda i, models: None,
                                **config):
    """``model`` on 2 stages of 2 micro-batches, SGD, against an unsplit copy fed the same micro-batches:
    step ``i`` is ``step(dm, *batch_of(i))``, ``loss_of(copy, *micro_batch)`` a micro-batch's loss on the
    copy, and the step's outputs (one, or a tuple) equal ``expect(losses)``; ``before(i, (model, copy))``
    runs before step ``i``. What ``seen`` reads from each step's timeline (its runtime), and the worst
    difference of the outputs and of the final state."""
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60, pin=pins, **config)
    dm = smpart.DistributedModel(model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    runtimes, worst = [], 0.0
    for i in range(steps):
        before(i, (model, reference))
        args = batch_of(i)
        outputs = step(dm, *args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        losses = []
        for j in range(2):
            loss = loss_of(reference, *pytree.tree_map(functools.partial(_micro_batch, j=j), args))
            (loss / 2).backward()
            losses.append(loss.detach())
        for out, expected in zip(outputs, expect(torch.stack(losses)), strict=True):
            worst = max(worst, (out.stack() - expected).abs().max().item())
        runtimes.append(seen(outputs[0].timeline))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return runtimes, max(worst, _state_difference(dm, reference))


def _micro_batch(value, j):
    return value.chunk(2)[j] if isinstance(value, torch.Tensor) else value


def _namedtuples(rank):
    """2 stages, a batch that is a namedtuple and a step that returns one, 4 steps, against the
    unsplit model."""
    from tests.test_programs import batch

    @smpart.step
    def step(model, batch):
        loss = torch.nn.functional.cross_entropy(model(batch.x), batch.y)
        model.backward(loss)
        return Batch(loss, loss.detach() * 2)  # a tuple (a namedtuple too): a StepOutput per field

    def batch_of(i):
        return (Batch(*batch(i, size=4)),)

    torch.manual_seed(0)
    return _two_stages_against_unsplit(
        _NamedTuples().double(), {"": 0, "encoder": 0, "head": 1}, 4, batch_of, step,
        lambda model, batch: torch.nn.functional.cross_entropy(model(batch.x), batch.y),
        expect=lambda losses: [losses, 2 * losses])


@pytest.mark.timeout(200)
def test_namedtuples_in_the_batch_a_module_output_and_the_result_cross_processes():
    """Torch's serialised pytree form refuses a namedtuple not registered by name: every step after
    the first failed under torchrun with a batch of one."""
    for runtimes, worst in values(run_ranks(_namedtuples, 2, timeout_s=190)):
        assert runtimes == ["reference", "program", "program", "program"], runtimes
        assert worst <= TOL, worst


def _two_lengths(rank):
    """GPT-2 (zoo) on 2 stages, fed sequences of 8 and 6 tokens in turn (dynamic padding): which
    runtime ran each step, and the worst difference of the losses and the final state from the
    unsplit model's."""
    torch.manual_seed(0)
    example = ZOO["gpt2"](dtype=torch.float64)
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    runtimes, worst = [], 0.0
    for step, length in enumerate([8, 6, 8, 6, 8, 6]):
        (tokens,), kwargs, target = example.batch(4, seed=step)
        args, target = (tokens[:, :length],), target[:, :length]
        out = train_step(model, example, args, kwargs, target)
        expected = reference_step(reference, example, args, kwargs, target, 2)
        worst = max(worst, (out.stack() - expected).abs().max().item())
        runtimes.append(out.timeline.runtime)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return runtimes, max(worst, _state_difference(model, reference))


@pytest.mark.timeout(200)
def test_batches_of_two_sequence_lengths_in_turn_each_run_their_own_program():
    """Each length records its program once and keeps it; the first rank sends the other the
    inputs of a length once, and a later step of that length reuses them."""
    for runtimes, worst in values(run_ranks(_two_lengths, 2, timeout_s=190)):
        assert runtimes[2:] == ["program"] * 4, runtimes
        assert worst <= TOL, worst


class _Tempered(torch.nn.Module):
    """Logits divided by a temperature in the root's own code, where the head's output is: on the
    second rank."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, temperature):
        return self.head(torch.tanh(self.body(x))) / temperature


def _changing_temperature(rank):
    """2 stages, a temperature that changes every step, used by the glue on the second rank: that
    rank must use the first rank's value of the step (`BeginProgram`)."""
    from tests.test_programs import batch

    @smpart.step
    def step(model, x, y, temperature):
        loss = torch.nn.functional.cross_entropy(model(x, temperature), y)
        model.backward(loss)
        return loss

    def batch_of(i):
        return (*batch(i, size=4), 1.0 + 0.5 * i)

    torch.manual_seed(0)
    return _two_stages_against_unsplit(
        _Tempered().double(), {"": 0, "body": 0, "head": 1}, 5, batch_of, step,
        lambda model, x, y, temperature: torch.nn.functional.cross_entropy(model(x, temperature), y))


@pytest.mark.timeout(200)
def test_a_number_that_changes_every_step_keeps_the_program_and_every_rank_uses_its_value():
    for runtimes, worst in values(run_ranks(_changing_temperature, 2, timeout_s=190)):
        assert runtimes == ["reference", "program", "program", "program", "program"], runtimes
        assert worst <= TOL, worst


def _llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=8, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


LLAMA_PINS = {"": 0, "model": 0, "model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
              "model.layers.1": 1, "model.norm": 1, "lm_head": 1}


def _rotary_on_every_rank(rank):
    """HF Llama, untied head, 2 stages: 3 steps against the unsplit model; the last step's bytes."""
    model = _llama()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60, pin=LLAMA_PINS)
    dm = smpart.DistributedModel(model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    @smpart.step
    def step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    runtimes, worst = [], 0.0
    for i in range(3):
        ids = torch.randint(64, (4, 8), generator=torch.Generator().manual_seed(i))
        out = step(dm, ids)
        losses = []
        for chunk in ids.chunk(2):
            loss = reference(input_ids=chunk, labels=chunk).loss
            (loss / 2).backward()
            losses.append(loss.detach())
        worst = max(worst, (out.stack() - torch.stack(losses)).abs().max().item())
        runtimes.append(out.timeline.runtime)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    worst = max(worst, _state_difference(dm, reference))
    llama = runtimes, worst, dict(out.timeline.bytes_sent), str(dm.module.model.rotary_emb.inv_freq.device)
    smpart.shutdown()
    return llama, _counting_scales()


def _counting_scales():
    """A module every rank would compute for itself that counts its calls in a buffer: only the
    first stage's rank sees its copy change, and every rank runs each step on the reference runtime."""
    from tests.test_programs import SCALED_PINS, ScaledChain, batch, classify, reference_step

    model = ScaledChain(counts_calls=True).double()
    reference = copy.deepcopy(model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60, pin=SCALED_PINS)
    dm = smpart.DistributedModel(model)
    seen, worst = [], 0.0
    for step in range(3):
        x, y = batch(step)
        out = classify(dm, x, y)
        worst = max(worst, (out.stack() - reference_step(reference, x, y, 2)).abs().max().item())
        seen.append((out.timeline.runtime, out.timeline.reason))
    calls = dm.module.scales.calls.item() if smpart.pp_rank() == 0 else None
    return seen, worst, calls, reference.scales.calls.item()


@pytest.mark.timeout(200)
def test_a_rotary_embedding_is_computed_on_every_rank_and_only_the_hidden_state_crosses():
    """torch's traffic for an LM with an untied head: per micro-batch the hidden state forward with
    the labels (read on the first stage's rank), its gradient back; never the rotary cos and sin.
    And the guard: such a module whose buffers change sends every step to the reference runtime."""
    pytest.importorskip("transformers")
    hidden, labels = 2 * 8 * 16 * 8, 2 * 8 * 8  # micro-batch rows x sequence x width (float64); int64 ids
    for llama, counting in values(run_ranks(_rotary_on_every_rank, 2, timeout_s=190)):
        runtimes, worst, sent, rotary_device = llama
        assert runtimes == ["reference", "program", "program"], runtimes
        assert worst <= TOL, worst
        assert sent == {(0, 1): 2 * (hidden + labels), (1, 0): 2 * hidden}, sent
        assert rotary_device == "cpu"  # kept on the rank that does not hold it, not released to meta
        seen, worst, calls, expected_calls = counting
        assert [runtime for runtime, _ in seen] == ["reference"] * 3, seen
        assert "'calls'" in seen[1][1], seen
        assert worst <= TOL and calls in (None, expected_calls), (worst, calls, expected_calls)
