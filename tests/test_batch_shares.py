"""Data-parallel replicas with batch shares train exactly like the unsplit model on the global batch.

Each replica is fed its share of every global batch by `smpart.ReplicaBatchSampler` (replica 1
of shares ``[1, 2]`` takes 8 of 12 samples, in two micro-batches of 4; replica 0 takes 4, in two
of 2); the unsplit model takes the whole global batch with the mean loss. After three optimizer
steps in float64 the full state dicts agree to 1e-6, on 2 and 4 processes, with 1 and 2
pipeline stages, tensor parallelism and ZeRO-1. Without the gradients' weighting by samples the
replicas would average to the mean of the two replicas' means, which weighs replica 0's samples
twice: the last case of `test_two_processes_shares_one_to_two` shows that this differs by far
more than the tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch

import smpart
from smpart.errors import ConfigError, SmpartError
from smpart.runtime.processes.shares import ReplicaBatchSampler, replica_batch_sizes, replica_weight
from tests.launch import run_ranks, values
from tests.test_processes_3d import _example
from tests.test_runtime import train_step

TOL = 1e-6
GLOBAL_BATCH = 12
MICROBATCHES = 2
STEPS = 3


def _train_with_shares(pp: int, tp: int, shares: list[float], zero: bool = False,
                       weighted: bool = True) -> float:
    """The worst parameter difference from the unsplit model after `STEPS` steps."""
    example = _example("zoo_gpt2")
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=pp, tensor_parallel_degree=tp, microbatches=MICROBATCHES,
                data_parallel_shares=shares, shard_optimizer_state=zero, timeout_s=60)
    if not weighted:  # what the replicas would do without the weighting: every weight 1
        import smpart.runtime.processes.runtime as processes

        processes.replica_weight = lambda shares, replica: 1.0
    model = smpart.DistributedModel(example.model)
    make = (lambda params: torch.optim.AdamW(params, lr=0.01)) if zero else (
        lambda params: torch.optim.SGD(params, lr=0.1))
    opt, ref_opt = smpart.DistributedOptimizer(make(model.parameters())), make(reference.parameters())
    sampler = ReplicaBatchSampler(GLOBAL_BATCH * STEPS, GLOBAL_BATCH)
    for step, indices in enumerate(sampler):
        args, _, target = example.batch(GLOBAL_BATCH, seed=step)
        mine = torch.tensor(indices) - step * GLOBAL_BATCH
        train_step(model, example, [a[mine] for a in args], {}, target[mine])
        example.loss(reference(*args), target).backward()  # the global batch, its mean loss
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    full = model.state_dict()
    smpart.shutdown()
    return max((full[k] - v).abs().max().item() for k, v in reference.named_parameters())


def _layouts(rank: int, cases: list[tuple]) -> list[tuple[tuple, float]]:
    return [(case, _train_with_shares(*case)) for case in cases]


def _check(results) -> None:
    for report in values(results):
        for case, worst in report:
            assert worst <= TOL, (case, worst)


@pytest.mark.timeout(200)
def test_two_processes_shares_one_to_two():
    """And the check can fail: with every replica weighted alike (the last case, which leaves the
    weighting off in these processes) the parameters drift far from the unsplit model's."""
    cases = [(1, 1, [1, 2]), (1, 1, [5, 1]), (1, 1, [1, 2], False, False)]
    for report in values(run_ranks(_layouts, 2, cases, timeout_s=190)):
        *weighted, (_, unweighted) = report
        assert all(worst <= TOL for _, worst in weighted), weighted
        assert unweighted > 100 * TOL, unweighted


@pytest.mark.timeout(300)
def test_four_processes_pp2_dp2_tp2_and_zero():
    cases = [(2, 1, [1, 2]), (1, 2, [1, 2]), (2, 1, [1, 2], True), (1, 1, [1, 2, 2, 1])]
    _check(run_ranks(_layouts, 4, cases, timeout_s=290))


def _fed_out_of_proportion(rank: int) -> str:
    example = _example("zoo_gpt2")
    smpart.init(microbatches=MICROBATCHES, data_parallel_shares=[1, 2], timeout_s=60)
    model = smpart.DistributedModel(example.model)
    args, _, target = example.batch(6, seed=0)  # both replicas fed 6: not 1:2
    try:
        train_step(model, example, list(args), {}, target)
    except SmpartError as err:
        return str(err)
    finally:
        smpart.shutdown()
    return "no error"


@pytest.mark.timeout(200)
def test_batches_out_of_the_shares_proportions_are_refused():
    for message in values(run_ranks(_fed_out_of_proportion, 2, timeout_s=190)):
        assert "[6, 6] samples" in message and "data_parallel_shares=[1, 2]" in message, message
        assert "ReplicaBatchSampler" in message


def _wrong_number_of_shares(rank: int) -> str:
    try:
        smpart.init(data_parallel_shares=[1, 2, 3])
    except ConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(120)
def test_shares_for_another_number_of_replicas_are_refused():
    for message in values(run_ranks(_wrong_number_of_shares, 2, timeout_s=110)):
        assert "3 share(s)" in message and "2 data-parallel replica(s)" in message, message


# ==================================================================== the sampler and the weights
def test_replica_batch_sizes_divide_the_global_batch_exactly():
    assert replica_batch_sizes(12, [1, 2], multiple_of=2) == [4, 8]
    assert replica_batch_sizes(12, None) == [12]
    assert replica_batch_sizes(9, [0.5, 1]) == [3, 6]
    with pytest.raises(SmpartError, match="use a multiple of 6, such as 6 or 12"):
        replica_batch_sizes(10, [1, 2], multiple_of=2)


def test_the_replicas_parts_side_by_side_are_the_global_batches():
    shares = [1, 2, 3]
    parts = [list(ReplicaBatchSampler(60, 12, shuffle=True, seed=3, replica=r, shares=shares, microbatches=1))
             for r in range(3)]
    assert [len(p[0]) for p in parts] == [2, 4, 6]
    for step in range(5):
        together = parts[0][step] + parts[1][step] + parts[2][step]
        assert len(set(together)) == 12
        assert together == list(ReplicaBatchSampler(60, 12, shuffle=True, seed=3, replica=0, shares=[1],
                                                    microbatches=1))[step]
    assert sorted(i for p in parts for batch in p for i in batch) == list(range(60))


def test_replica_weights_make_the_mean_the_global_mean():
    shares = [1, 2, 3]
    weights = [replica_weight(shares, r) for r in range(3)]
    # the all-reduce's mean of weighted replica means is the mean over every sample
    assert sum(w * s for w, s in zip(weights, [10.0, 20.0, 30.0], strict=True)) / 3 == pytest.approx(
        (1 * 10 + 2 * 20 + 3 * 30) / 6)
    assert replica_weight([2, 2], 1) == 1.0 and replica_weight(None, 0) == 1.0


def test_shares_on_threads_are_refused():
    with pytest.raises(ConfigError, match="on threads"):
        smpart.init(pipeline_parallel_degree=2, data_parallel_shares=[1, 2])
    smpart.shutdown()


def test_a_replica_out_of_range_is_refused():
    with pytest.raises(SmpartError, match="replica 2 does not exist"):
        ReplicaBatchSampler(24, 12, replica=2, shares=[1, 2])
