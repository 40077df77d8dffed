"""``Config.device_types``: a launch whose ranks are not on the plan's device types is refused.

Ranks declare their type with ``SMPART_DEVICE_TYPE`` (on the CPU nothing else can tell them
apart); a GPU's type is read from its name and memory (`test_cuda.py` runs that on a GPU).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import smpart
from smpart.devices import DeviceType
from smpart.distributed.device_check import observed_device
from smpart.errors import ConfigError
from tests.launch import run_ranks, values


def _launch(rank: int, declared: list[str | None], expected: list) -> str:
    if declared[rank] is not None:
        os.environ["SMPART_DEVICE_TYPE"] = declared[rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            smpart.init(data_parallel_degree=2, device_types=expected)
        except ConfigError as err:
            return f"refused: {err}"
        finally:
            smpart.shutdown()
    return "ok" + "".join(f" | {w.message}" for w in caught if "SMPART_DEVICE_TYPE" in str(w.message))


@pytest.mark.timeout(120)
def test_ranks_on_the_plans_types_start():
    assert values(run_ranks(_launch, 2, ["V100", "a100"], ["V100", "A100-80"], timeout_s=110)) == ["ok", "ok"]


@pytest.mark.timeout(120)
def test_ranks_on_other_types_are_refused_naming_them():
    for message in values(run_ranks(_launch, 2, ["A100-80", "V100"], ["V100", "A100-80"], timeout_s=110)):
        assert message.startswith("refused"), message
        assert "rank 0 (stage 0, replica 0) runs on A100-80 but the plan meant V100" in message
        assert "rank 1 (stage 0, replica 1) runs on V100 but the plan meant A100-80" in message
        assert "--node-rank" in message


@pytest.mark.timeout(120)
def test_ranks_that_cannot_tell_are_warned_about_once():
    custom = {"name": "slow", "tflops": 1.0, "memory_gib": 1}
    first, second = values(run_ranks(_launch, 2, [None, "slow"], ["V100", custom], timeout_s=110))
    assert first.startswith("ok | smpart: rank(s) [0] run on the CPU") and "['V100']" in first, first
    assert second == "ok"


def test_a_gpu_matches_its_type_by_family_and_memory():
    assert observed_device(DeviceType("V100", 125.0, 16 << 30), torch.device("cpu"))[1] is None
    os.environ["SMPART_DEVICE_TYPE"] = "a100"
    try:
        assert observed_device(DeviceType("A100-80", 312.0, 80 << 30), torch.device("cpu")) == ("a100", True)
        assert observed_device(DeviceType("A100-40", 312.0, 40 << 30), torch.device("cpu")) == ("a100", False)
    finally:
        del os.environ["SMPART_DEVICE_TYPE"]


def test_device_types_are_validated():
    with pytest.raises(ConfigError, match=r"device_types\[1\]: unknown device type 'B300'"):
        smpart.Config(device_types=["V100", "B300"])
    with pytest.raises(ConfigError, match="one per rank"):
        smpart.Config(device_types=["V100"], data_parallel_degree=2)


def test_stages_are_cut_for_the_device_types_on_threads():
    """On threads ``device_types`` names each stage's device: the partition balances time on them."""
    from tests.test_runtime import cross_entropy_step

    layers = [torch.nn.Linear(16, 16) for _ in range(8)]
    model = smpart.DistributedModel(torch.nn.Sequential(*layers))
    smpart.init(pipeline_parallel_degree=2, microbatches=2, memory_weight=0.0, device_types=["T4", "H100"])
    try:
        cross_entropy_step(model, torch.randn(4, 16), torch.randint(16, (4,)))
        part = smpart.partition_of(model)
    finally:
        smpart.shutdown()
    assert [d.name for d in part.devices] == ["T4", "H100"]
    assert [len([n for n in part.modules_on(s) if n]) for s in range(2)] == [1, 7]  # 65 vs 989 TFLOPS
