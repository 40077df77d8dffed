"""SMP-style scripts (`tests/smp_scripts`) under ``torchrun``: one process per rank, against the
unsplit model trained by hand on the same global batches (`tests.test_smp`)."""

from __future__ import annotations

import json

import pytest

from tests.launch import run_ranks, values

pytest.importorskip("transformers")
from tests.test_smp import assert_state_close, by_value, gpt2_reference, mnist_reference  # noqa: E402


def _mnist(rank: int, config: dict) -> dict:
    from tests.smp_scripts import mnist

    out = mnist.main(["--smp", json.dumps(config)])
    return {"losses": out["losses"], "state": by_value(out["state"]) if rank == 0 else None,
            "groups": _groups(rank)}


def _groups(rank: int) -> dict:
    """What SMP's rank helpers, groups and object collectives say on this rank (after smp.init)."""
    import torch
    import torch.distributed as dist

    import smpart.smp as smp

    if smp.pp_rank() == 0:
        smp.broadcast(f"from {rank}", smp.PP_GROUP)
        got = None
    else:
        got = smp.recv_from(0, smp.PP_RANK)
    if smp.dp_rank() == 0:
        smp.send({"to": "dp 1"}, 1, smp.DP_RANK)
    else:
        got = (got, smp.recv_from(0, smp.RankType.DP_RANK))
    total = torch.tensor(float(rank))
    dist.all_reduce(total, group=smp.get_mp_process_group())
    return {"ranks": (smp.pp_rank(), smp.dp_rank(), smp.rdp_rank(), smp.mp_rank(), smp.tp_rank()),
            "groups": (smp.get_pp_group(), smp.get_dp_group(), smp.get_mp_group(), smp.get_tp_group()),
            "got": got, "mp_sum": total.item(), "all": smp.allgather(rank, smp.WORLD)}


def _gpt2(rank: int, config: dict, argv: list[str]) -> dict:
    from tests.smp_scripts import gpt2_simple

    out = gpt2_simple.main(["--smp", json.dumps(config), *argv])
    return {"losses": out["losses"], "val_losses": out["val_losses"],
            "state": by_value(out["state"]) if rank == 0 else None}


@pytest.mark.timeout(200)
def test_the_mnist_script_on_two_stages_times_two_replicas_matches_the_unsplit_model():
    results = values(run_ranks(_mnist, 4, {"partitions": 2, "microbatches": 2, "ddp": True}, timeout_s=180))
    losses, state = mnist_reference(4, 8, 2)
    # the cluster placement: ranks 0, 1 hold stage 0 of replicas 0, 1; ranks 2, 3 stage 1
    seen = [r["groups"] for r in results]
    assert [s["ranks"] for s in seen] == [(0, 0, 0, 0, 0), (0, 1, 1, 0, 0), (1, 0, 0, 1, 0), (1, 1, 1, 1, 0)]
    assert [s["groups"] for s in seen][0] == ([0, 2], [0, 1], [0, 2], [0])
    assert [s["got"] for s in seen] == [None, (None, {"to": "dp 1"}), "from 0", ("from 1", {"to": "dp 1"})]
    assert [s["mp_sum"] for s in seen] == [2.0, 4.0, 2.0, 4.0] and seen[3]["all"] == [0, 1, 2, 3]
    for step, loss in enumerate(losses):  # each replica's loss is the mean over its half
        assert sum(results[0]["losses"][step]) / 2 == pytest.approx(loss, abs=1e-5)
    assert_state_close(results[0]["state"], state)


def _mnist_from_the_environment(rank: int) -> list:
    from tests.smp_scripts import mnist

    return mnist.main([])["losses"]


@pytest.mark.timeout(200)
def test_the_mnist_script_reads_its_configuration_where_sagemaker_put_it():
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2})}
    results = values(run_ranks(_mnist_from_the_environment, 2, env=env, timeout_s=180))
    losses, _ = mnist_reference(4, 8, 1)
    assert results[0] == results[1]
    assert [r[0] for r in results[0]] == pytest.approx(losses, abs=1e-5)


@pytest.mark.timeout(300)
def test_the_gpt2_script_with_tensor_parallelism_gathers_the_groups_batches(tmp_path):
    """tp 2 without prescaled_batch: each tp rank reads its own examples (dp_rank counts them) and
    the step trains on both ranks' together, as SMP's distributed layers did; a checkpoint saved
    there resumes on threads, one stage, unsplit."""
    argv = ["--max_steps", "4", "--checkpoint_freq", "2", "--checkpoint-dir", str(tmp_path)]
    results = values(run_ranks(_gpt2, 2, {"tensor_parallel_degree": 2, "ddp": True}, argv, timeout_s=280))
    losses, val_losses, state = gpt2_reference(4, 4, 2)
    assert results[0]["losses"] == results[1]["losses"]
    assert [r[0] for r in results[0]["losses"]] == pytest.approx(losses, abs=1e-4)
    assert results[0]["val_losses"] == pytest.approx(val_losses, abs=1e-4)
    assert_state_close(results[0]["state"], state)


@pytest.mark.timeout(300)
def test_the_gpt2_script_on_two_stages_times_two_replicas_resumes_under_another_layout(tmp_path):
    """3 steps on pp 2 x dp 2 with a checkpoint at the third; a new job on pp 2 x dp 1, with another
    schedule and micro-batch count and the replicas' batches in one (the same global batches),
    resumes from the newest checkpoint: the 6 steps equal the unsplit model's."""
    config = {"partitions": 2, "microbatches": 2, "ddp": True}
    argv = ["--max_steps", "3", "--checkpoint_freq", "3", "--checkpoint-dir", str(tmp_path)]
    first = values(run_ranks(_gpt2, 4, config, argv, timeout_s=280))
    resumed = values(run_ranks(_gpt2, 2, {**config, "microbatches": 4, "pipeline": "simple"},
                               ["--checkpoint-dir", str(tmp_path), "--load_partial", "1",
                                "--train_batch_size", "8", "--validation_freq", "0"], timeout_s=280))
    losses, val_losses, state = gpt2_reference(6, 4, 2)
    both = [sum(r) / len(r) for r in first[0]["losses"] + resumed[0]["losses"]]
    assert both == pytest.approx(losses, abs=1e-4)
    assert first[0]["val_losses"] == pytest.approx(val_losses[:1], abs=1e-4)
    assert_state_close(resumed[0]["state"], state)
