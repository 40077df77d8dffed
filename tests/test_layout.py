"""The layout of ranks: (pp, dp, tp) coordinates, SMP's "cluster" and "spread" placements, and the
errors for a job whose size does not fit the configuration (no processes needed); and, on 4
processes, the ``DeviceMesh`` and groups ``smpart.init`` builds from it."""

from __future__ import annotations

import itertools

import pytest

from smpart.config import Config
from smpart.distributed import launch
from smpart.distributed.launch import Layout, layout_for
from smpart.errors import ConfigError


@pytest.mark.parametrize("strategy", ["cluster", "spread"])
def test_every_rank_has_one_place_and_back(strategy):
    layout = Layout(pp=2, dp=3, tp=2, strategy=strategy)
    ranks = {layout.rank_of(p, d, t) for p, d, t in itertools.product(range(2), range(3), range(2))}
    assert ranks == set(range(12))
    for rank in range(12):
        assert layout.rank_of(*layout.coordinates(rank)) == rank


def test_cluster_keeps_tensor_parallel_ranks_adjacent_and_spread_does_not():
    cluster, spread = Layout(2, 2, 4, "cluster"), Layout(2, 2, 4, "spread")
    assert [cluster.rank_of(0, 0, t) for t in range(4)] == [0, 1, 2, 3]  # one node holds a tp group
    assert [spread.rank_of(p, 0, 0) for p in range(2)] == [0, 1]  # adjacent ranks: pipeline stages
    assert len({spread.rank_of(0, 0, t) // 4 for t in range(4)}) == 4  # tp group over 4 "nodes" of 4


def test_data_parallel_degree_is_derived_or_checked():
    assert layout_for(Config(pipeline_parallel_degree=2, tensor_parallel_degree=2), 8).dp == 2
    with pytest.raises(ConfigError, match="not a multiple of"):
        layout_for(Config(pipeline_parallel_degree=3), 4)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 12"):
        layout_for(Config(pipeline_parallel_degree=2, tensor_parallel_degree=2, data_parallel_degree=3), 8)


def _mesh_and_groups(rank, strategy):
    import torch.distributed as dist

    import smpart

    smpart.init(pipeline_parallel_degree=2, tensor_parallel_degree=2, microbatches=2,
                placement_strategy=strategy)
    mesh = smpart.device_mesh()
    groups = {name: sorted(dist.get_process_group_ranks(group))
              for name, group in (("pp", smpart.get_pp_group()), ("dp", smpart.get_dp_group()),
                                  ("tp", smpart.get_tp_group())) if group is not None}
    coordinates = (smpart.pp_rank(), smpart.dp_rank(), smpart.tp_rank())
    out = (mesh.mesh_dim_names, mesh.mesh.tolist(), mesh.get_coordinate(), coordinates, groups)
    smpart.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["cluster", "spread"])
def test_the_device_mesh_and_groups_match_the_rank_helpers(strategy):
    from tests.launch import run_ranks, values

    layout = Layout(2, 1, 2, strategy)
    for rank, (names, ranks, coordinate, coordinates, groups) in enumerate(
            values(run_ranks(_mesh_and_groups, 4, strategy, timeout_s=110))):
        assert names == ("pp", "dp", "tp")
        assert tuple(coordinate) == coordinates == layout.coordinates(rank)
        assert ranks[coordinates[0]][coordinates[1]][coordinates[2]] == rank
        pp, _, tp = coordinates
        assert groups == {"pp": sorted(layout.rank_of(s, 0, tp) for s in range(2)),
                          "tp": sorted(layout.rank_of(pp, 0, t) for t in range(2))}


# ---------------------------------------------------------------------------- backend and devices
def _machine(monkeypatch, gpus: int, local_processes: int) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_processes))


@pytest.mark.parametrize(("gpus", "local", "expected"), [(0, 2, "gloo"), (2, 2, "nccl"), (8, 4, "nccl"),
                                                         (1, 2, "gloo")])
def test_auto_backend_is_nccl_only_with_a_gpu_per_local_process(monkeypatch, gpus, local, expected):
    _machine(monkeypatch, gpus, local)
    if 0 < gpus < local:
        with pytest.warns(UserWarning, match="NCCL needs a GPU per process"):
            assert launch._backend(Config(pipeline_parallel_degree=2)) == expected
    else:
        assert launch._backend(Config(pipeline_parallel_degree=2)) == expected


@pytest.mark.parametrize(("gpus", "said"), [(0, "sees no GPU"), (1, "runs 2 processes and sees 1 GPU;")])
def test_nccl_without_a_gpu_per_process_is_refused_with_the_way_out(monkeypatch, gpus, said):
    _machine(monkeypatch, gpus, 2)
    with pytest.raises(ConfigError, match=said) as err:
        launch._backend(Config(pipeline_parallel_degree=2, backend="nccl"))
    assert "backend='gloo'" in str(err.value)


def test_a_rank_runs_on_its_stage_device_under_gloo_and_its_own_gpu_under_nccl(monkeypatch):
    devices = Config(pipeline_parallel_degree=3, devices=["cpu", "cpu", "cpu"])
    assert launch.rank_device(devices, False, 5, 2).type == "cpu"
    assert launch.rank_device(Config(pipeline_parallel_degree=2), False, 1, 1).type == "cpu"
    assert str(launch.rank_device(Config(pipeline_parallel_degree=2), True, 3, 1)) == "cuda:3"
    _machine(monkeypatch, 0, 2)
    with pytest.raises(ConfigError, match="stage 1 is to run on cuda:0, but this process sees no CUDA GPU"):
        launch.rank_device(Config(pipeline_parallel_degree=2, devices=["cpu", "cuda:0"]), False, 1, 1)
    with pytest.raises(ConfigError, match="devices: .*gpu0"):  # a name torch does not know
        launch.rank_device(Config(pipeline_parallel_degree=2, devices=["cpu", "gpu0"]), False, 1, 1)


@pytest.mark.parametrize("strategy", ["cluster", "spread"])
def test_message_pairs_are_the_stages_of_a_replica_and_the_shards_of_a_stage(strategy):
    layout = Layout(pp=3, dp=2, tp=2, strategy=strategy)
    pairs = set(launch.message_pairs(layout))
    for a, b in itertools.permutations(range(layout.world_size), 2):
        (pa, da, ta), (pb, db, tb) = layout.coordinates(a), layout.coordinates(b)
        talk = (da, ta) == (db, tb) or (pa, da) == (pb, db)
        assert ((a, b) in pairs) == talk, (a, b)
