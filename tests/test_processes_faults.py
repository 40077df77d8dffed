"""Faults and bad input across processes: every rank gets a clear `SmpartError`, nothing hangs.

Each test launches real processes (`tests.launch`) with a hard deadline; a rank that would wait
forever fails the test by its exit code, not by hanging it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

import smpart
from examples.models import gpt2
from tests.launch import run_ranks, values


class Picky(nn.Linear):
    """Raises on a NaN input; with ``die`` set, ends its process instead (its own forward runs on its
    stage's rank; a module's hooks run where it is called from)."""

    die = False

    def forward(self, x):
        if self.die:
            os._exit(3)
        if torch.isnan(x).any():
            raise ValueError("a bad sample")
        return super().forward(x)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4, dtype=torch.float64)
        self.second = Picky(4, 4, dtype=torch.float64)

    def forward(self, x):
        return self.second(self.first(x).tanh())


PINS = {"": 0, "first": 0, "second": 1}


@smpart.step
def _step(model, x):
    loss = model(x).square().mean()
    model.backward(loss)
    return loss


def _module_raises(rank):
    torch.manual_seed(0)
    model = Chain()
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin=PINS, timeout_s=30)
    dm = smpart.DistributedModel(model)
    bad = torch.ones(4, 4, dtype=torch.float64)
    bad[2:, 0] = float("nan")  # micro-batch 1
    try:
        _step(dm, bad)
        return "no error"
    except smpart.PipelineError as err:
        caught = (err.stage, err.rank, err.module, err.microbatch, str(err))
    out = _step(dm, torch.ones(4, 4, dtype=torch.float64))  # the next step runs normally
    return caught, out.reduce_mean().item()


@pytest.mark.timeout(120)
def test_an_exception_in_a_module_reaches_every_rank_and_the_next_step_runs():
    results = run_ranks(_module_raises, 2, timeout_s=110)
    for result in results:
        assert result.error is None and result.exitcode == 0, result
        (stage, rank, module, microbatch, text), loss = result.value
        assert (stage, rank, module, microbatch) == (1, 1, "second", 1), text
        assert "a bad sample" in text
        assert loss == pytest.approx(results[0].value[1])


def _dies(rank, when):
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin=PINS, timeout_s=120)
    torch.manual_seed(0)
    dm = smpart.DistributedModel(Chain())
    x = torch.randn(4, 4, dtype=torch.float64)
    _step(dm, x)
    if rank == 1 and when == "between steps":
        os._exit(3)
    if rank == 1 and when == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1 and when == "raises":  # outside the step: the process ends as a script's would
        raise RuntimeError("rank 1 failed outside the step")
    if rank == 1 and when == "inside a module":
        dm.module.second.die = True
    start = time.monotonic()
    try:
        _step(dm, x)
    except smpart.SmpartError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.timeout(150)
@pytest.mark.parametrize("when", ["between steps", "inside a module", "killed", "raises"])
def test_a_rank_that_dies_makes_the_others_fail_naming_it(when):
    results = run_ranks(_dies, 2, when, timeout_s=140)
    assert results[1].exitcode == {"killed": -signal.SIGKILL, "raises": 1}.get(when, 3), results[1]
    if when == "raises":
        assert "rank 1 failed outside the step" in results[1].error
    text, waited = results[0].value
    assert any(f"rank 1 {what}" in text for what in ("was lost", "left the job", "has closed")), text
    assert waited < 60


def _state_asked_of_a_rank_gone(rank, how):
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin=PINS, timeout_s=60)
    torch.manual_seed(0)
    dm = smpart.DistributedModel(Chain())
    _step(dm, torch.randn(4, 4, dtype=torch.float64))
    if rank == 1 and how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:  # its script fails outside a step: smpart shuts down at once, answering nobody
        raise RuntimeError("rank 1 failed outside the step")
    time.sleep(1.0)
    start = time.monotonic()
    try:
        dm.state_dict()
    except smpart.SmpartError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raised", "killed"])
def test_the_state_dict_asked_of_a_rank_gone_is_a_clear_error(how):
    results = run_ranks(_state_asked_of_a_rank_gone, 2, how, timeout_s=110)
    text, waited = results[0].value
    expected = {"raised": "rank(s) [1] shut smpart down before sending their part",
                "killed": "rank 1 was lost"}[how]
    assert expected in text, text
    assert waited < 30


def _collective_called_by_one_rank(rank, which, directory):
    smpart.init(pipeline_parallel_degree=2, microbatches=2, pin=PINS, timeout_s=4)
    torch.manual_seed(0)
    dm = smpart.DistributedModel(Chain())
    _step(dm, torch.randn(4, 4, dtype=torch.float64))
    if rank != 0:
        time.sleep(7)  # somewhere else, while rank 0 runs what is under `if smpart.rank() == 0:`
        return None
    collective = {"save_checkpoint": lambda: smpart.save_checkpoint(directory, dm),
                  "barrier": smpart.barrier}[which]
    start = time.monotonic()
    try:
        collective()
    except smpart.SmpartError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["save_checkpoint", "barrier"])
def test_a_collective_called_by_one_rank_alone_is_a_clear_error(which, tmp_path):
    results = run_ranks(_collective_called_by_one_rank, 2, which, str(tmp_path / "ckpt"), timeout_s=110)
    text, waited = results[0].value
    expected = {"save_checkpoint": "save_checkpoint is collective", "barrier": "smpart.barrier(): not every"}
    assert expected[which] in text and "Ranks 1" in text, text
    if which == "save_checkpoint":
        assert "state_dict()" in text, text  # what to do instead
    assert waited < 30


class _Peerless:
    """What `RoutedTransport` needs of a `ProcessTransport`, without processes."""

    bytes_sent: dict = {}
    peers = [1]

    def check(self):
        pass

    def send(self, place, item):
        pass


def test_a_peer_that_left_fails_only_the_steps_it_did_not_take_part_in():
    from smpart.errors import PeerLost
    from smpart.runtime.wire.messages import MAIN, Leaving
    from smpart.runtime.wire.routed import RoutedTransport

    transport = RoutedTransport(lambda deliver: _Peerless(), rank=0)
    transport._arrived((MAIN, Leaving(rank=1, steps=3)))  # rank 1 shut down after steps 0, 1 and 2
    assert transport.receive((0, MAIN), 0) is None  # noted, not queued for the main thread
    for step in (None, 0, 2):  # between steps, or finishing a step rank 1 took part in
        transport.step = step
        transport.check()
    transport.step = 3
    with pytest.raises(PeerLost, match="rank 1 left the job: .*after 3 step.*in step 4.*same number of"):
        transport.check()


def _init_each(rank, configs_by_rank):
    """``smpart.init`` with each of this rank's configurations in turn, in one launch: what each
    raised, and how many process groups exist before and after them all."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.init_process_group("gloo")
    before = len(distributed_c10d._world.pg_map)
    errors = []
    for config in configs_by_rank[rank]:
        try:
            smpart.init(**config)
            errors.append("no error")
        except smpart.ConfigError as err:
            errors.append(str(err))
    return errors, before, len(distributed_c10d._world.pg_map)


@pytest.mark.timeout(90)
def test_bad_launches_are_clear_errors_on_every_rank():
    three = {"pipeline_parallel_degree": 3}  # the world does not fit the configuration
    asked = {"pipeline_parallel_degree": 1, "data_parallel_degree": 4}  # dp x pp is not the world
    disagree = [{"pipeline_parallel_degree": 2, "microbatches": m} for m in (2, 4)]  # per rank
    configs = {rank: [three, asked, disagree[rank]] for rank in (0, 1)}
    for result in run_ranks(_init_each, 2, configs, timeout_s=60):
        assert result.error is None, result.error
        (fits, processes, differ), before, after = result.value
        assert "not a multiple of" in fits, fits
        assert "= 4 processes" in processes, processes
        assert "different configurations" in differ and "microbatches" in differ, differ
        assert after == before, f"a refused init left {after - before} process group(s) behind"


def _nccl_without_gpu(rank):
    try:
        smpart.init(pipeline_parallel_degree=2, backend="nccl")
    except smpart.ConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the error seen without a GPU per process")
def test_nccl_asked_for_without_a_gpu_per_process():
    for result in run_ranks(_nccl_without_gpu, 2, timeout_s=50):
        assert "runs 2 processes and sees" in result.value and "backend='gloo'" in result.value, result


def _resident(rank):
    torch.manual_seed(0)
    example = gpt2()
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    dm = smpart.DistributedModel(example.model)

    @smpart.step
    def step(model, x, y):
        loss = example.loss(model(x), y)
        model.backward(loss)
        return loss

    step(dm, example.args[0], example.target)
    held = sum(p.numel() * p.element_size() for p in dm.parameters() if p.device.type != "meta")
    partition = smpart.partition_of(dm)
    return held, partition.stage_loads()[smpart.pp_rank()].param_bytes, smpart.pp_rank(), smpart.pp_size()


@pytest.mark.timeout(120)
def test_each_rank_holds_only_its_stages_parameters():
    results = run_ranks(_resident, 2, timeout_s=110)
    for result in results:
        assert result.error is None, result.error
        held, planned, stage, stages = result.value
        assert stages == 2 and stage == result.rank
        assert held == planned, (held, planned)
    total = sum(p.numel() * p.element_size() for p in gpt2().model.parameters())
    assert sum(r.value[0] for r in results) == total


def _with_helpers(rank):
    smpart.init(pipeline_parallel_degree=2, microbatches=1, pin=PINS)
    smpart.barrier()
    return (smpart.rank(), smpart.size(), smpart.local_rank(), smpart.pp_rank(), smpart.pp_size(),
            smpart.dp_rank(), smpart.dp_size(), smpart.tp_rank(), smpart.tp_size())


@pytest.mark.timeout(60)
def test_rank_helpers():
    results = run_ranks(_with_helpers, 2, timeout_s=50)
    assert [r.value for r in results] == [(0, 2, 0, 0, 2, 0, 1, 0, 1), (1, 2, 1, 1, 2, 0, 1, 0, 1)]


def _os_threads() -> int:
    """Every thread of this process, torch's own included (Linux), else the Python threads."""
    tasks = "/proc/self/task"
    return len(os.listdir(tasks)) if os.path.isdir(tasks) else threading.active_count()


def _users_group(rank):
    """The user initialised the default group before smpart: smpart uses it and leaves it as it was.
    Nothing of an init outlives its ``shutdown`` (no process group, no thread) but the mesh."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.init_process_group("gloo")
    dist.barrier()
    mine = dist.group.WORLD
    before = (_os_threads(), len(distributed_c10d._world.pg_map))
    losses, after = [], []
    for microbatches in (1, 2, 1):  # init -> shutdown -> init with another configuration
        smpart.init(pipeline_parallel_degree=2, microbatches=microbatches, pin=PINS, timeout_s=60)
        torch.manual_seed(0)
        dm = smpart.DistributedModel(Chain())
        losses.append(_step(dm, torch.ones(4, 4, dtype=torch.float64)).reduce_mean().item())
        smpart.shutdown()
        after.append((_os_threads(), len(distributed_c10d._world.pg_map)))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # the user's group still works, as the user made it
    return dist.is_initialized() and dist.group.WORLD is mine, total.item(), losses, before, after


@pytest.mark.timeout(90)
def test_a_process_group_the_user_initialised_is_used_and_left_alone():
    results = run_ranks(_users_group, 2, timeout_s=80)
    for result in results:
        assert result.error is None, result.error
        same_group, total, losses, before, after = result.value
        assert same_group and total == 3.0
        assert losses == pytest.approx(results[0].value[2]) and losses[0] == pytest.approx(losses[1])
        # the first init makes the mesh's groups, which later inits with the layout reuse (DTensor
        # may refer to them); nothing else outlives a shutdown
        assert after == [after[0]] * 3, f"threads and process groups after each shutdown: {after}"
        assert after[0][1] - before[1] <= 2, (before, after)


def _one_replica_fails(rank, where):
    """pp 2 x dp 2: a step, then one that fails on replica 0 only (in stage 1's module, or in the
    step body after the backward), then two more. From the second step on, a replica starts its
    all-reduce during the backward (it knows the counts): the failed replica must pair with it.
    ``first step``: the job's first step fails on replica 0 in the body before its first model
    call (so replica 0 has placed nothing while replica 1 has), then three steps."""
    torch.manual_seed(0)
    smpart.init(pipeline_parallel_degree=2, data_parallel_degree=2, microbatches=2, pin=PINS, timeout_s=40)
    dm = smpart.DistributedModel(Chain())
    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
    replica = smpart.dp_rank()

    @smpart.step
    def step(model, x, fail):
        if fail == "before the model":
            raise RuntimeError("the step body failed before the model")
        loss = model(x).square().mean()
        model.backward(loss)
        if fail == "after the backward":
            raise RuntimeError("the step body failed after its backward")
        return loss

    x = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4) * (1 + replica)
    bad = x.clone()
    if where == "module":
        bad[2:, 0] = float("nan")  # micro-batch 1, on stage 1
    body_fails = {"body": "after the backward", "first step": "before the model"}.get(where)
    losses = []
    if where != "first step":
        losses.append(step(dm, x, None).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    errors = []
    try:
        step(dm, bad if replica == 0 else x, body_fails if replica == 0 else None)
        errors.append("no error")
    except smpart.SmpartError as err:
        errors.append(str(err))
    except RuntimeError as err:  # the step body's own exception, on the replica that raised it
        errors.append(f"{type(err).__name__}: {err}")
    opt.zero_grad()
    while len(losses) < 3:
        out = step(dm, x, None)
        opt.step()
        opt.zero_grad()
        losses.append(out.reduce_mean().item())
    # plain arrays: a tensor put in the result queue is shared memory, which a child's exit can pull away
    return replica, errors[0], losses, {name: value.numpy() for name, value in dm.state_dict().items()}


def _replicas_reference():
    """What the surviving steps give on one process: the failed step changes nothing."""
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4) * (1 + r) for r in range(2)]
    losses = []
    for _ in range(3):
        opt.zero_grad()
        per_replica = [model(x).square().mean() for x in xs]  # dp averages the replicas' gradients
        (sum(per_replica) / 2).backward()
        opt.step()
        losses.append([loss.item() for loss in per_replica])
    return losses, model.state_dict()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["module", "body", "first step"])
def test_a_step_that_fails_on_one_replica_fails_on_every_replica_and_training_goes_on(where):
    results = run_ranks(_one_replica_fails, 4, where, timeout_s=180)
    expected_losses, expected_state = _replicas_reference()
    for result in results:
        assert result.error is None and result.exitcode == 0, result
        replica, error, losses, state = result.value
        if replica == 0:
            expected = {"module": "a bad sample", "body": "failed after its backward",
                        "first step": "failed before the model"}[where]
            assert expected in error, error
        else:
            assert "data-parallel replica 0" in error, error
        assert losses == pytest.approx([step[replica] for step in expected_losses], abs=1e-9)
        for name, value in expected_state.items():
            torch.testing.assert_close(torch.from_numpy(state[name]), value, atol=1e-9, rtol=0)


class Hangs(torch.autograd.Function):
    """Its backward hangs for ``seconds`` (a kernel or a collective stuck on one rank), then raises."""

    seconds = 0.0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(Hangs.seconds)
        raise RuntimeError("the backward hung, then failed")


class HangingLinear(nn.Linear):
    hang = False

    def forward(self, x):
        y = super().forward(x)
        return Hangs.apply(y) if self.hang else y


class HangingChain(Chain):
    def __init__(self):
        super().__init__()
        self.first = HangingLinear(4, 4, dtype=torch.float64)


HANG_TIMEOUT_S = 6.0


def _a_replica_hangs(rank, where):
    """pp 2 x dp 2: a step, then replica 1's first stage hangs for twice timeout_s, then raises: in
    the backward of the next step (``backward``), or before the optimizer's step that broadcasts
    the parameters it owns (``optimizer``, sharded optimizer state). Every rank catches what it
    raised, and when. Then smpart.shutdown(), smpart.init() again and a step on every rank (of
    the same model; of a new one with sharded state, which a re-init does not carry over)."""
    torch.manual_seed(0)
    config = {"pipeline_parallel_degree": 2, "data_parallel_degree": 2, "microbatches": 2, "pin": PINS,
              "timeout_s": HANG_TIMEOUT_S, "shard_optimizer_state": where == "optimizer"}
    smpart.init(**config)
    dm = smpart.DistributedModel(HangingChain())
    opt = smpart.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
    x = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)
    _step(dm, x)  # the replicas learn their counts: the next step starts its all-reduces early
    opt.step()
    opt.zero_grad()
    at = (smpart.dp_rank(), smpart.pp_rank())
    Hangs.seconds = 2 * HANG_TIMEOUT_S
    dm.module.first.hang = where == "backward" and at == (1, 0)
    start = time.monotonic()
    try:
        _step(dm, x)
        if where == "optimizer" and at == (1, 0):
            time.sleep(Hangs.seconds)
        start = time.monotonic() if where == "optimizer" else start
        opt.step()
        caught = "no error"
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        caught = f"{type(err).__name__}: {err}"
    waited = time.monotonic() - start
    dm.module.first.hang = False
    opt.zero_grad()
    smpart.shutdown()
    smpart.init(**config)
    if where == "optimizer":
        dm = smpart.DistributedModel(HangingChain())
    loss = _step(dm, x).reduce_mean().item()
    return at, caught, waited, loss


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["backward", "optimizer"])
def test_a_replica_that_hangs_fails_every_other_rank_waiting_for_it_within_timeout_naming_it(where):
    """The other replica's ranks wait on collectives the hung replica never joins (the gradient
    averaging; the sharded optimizer's broadcast, on its stage only): each raises within
    timeout_s an SmpartError naming replica 1 (not after torch's 30 minutes, nor blaming a healthy
    rank), and after a re-init the job trains on."""
    results = values(run_ranks(_a_replica_hangs, 4, where, timeout_s=140))
    for (replica, stage), caught, waited, _ in results:
        if replica == 1 or (where == "optimizer" and stage == 1):
            continue  # the hung replica's own errors; in the optimizer, stage 1's broadcast pairs
        assert caught.startswith(("SmpartError", "PipelineError")), caught
        assert "replica 1" in caught, caught
        assert waited < HANG_TIMEOUT_S + 3, f"rank of replica 0, stage {stage}: {waited:.1f} s: {caught}"
    losses = {loss for *_, loss in results}  # the replicas step on the same batch
    assert len(losses) == 1 and losses.pop() > 0
