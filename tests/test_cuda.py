"""Stages on CUDA: the thread runtime with stages sharing one GPU or split between CPU and GPU,
and one process per stage over gloo with each stage on a GPU (tensors cross through the CPU), and,
with two GPUs or more, over NCCL (tensors cross on the GPU). Each trains like the unsplit model on
the CPU. Skipped where torch sees no GPU (CI has none); run them on a GPU machine with
``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import smpart
from examples.models import ZOO
from tests.launch import run_ranks, values
from tests.test_runtime import Differences, train_side_by_side

TOL = 1e-6
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="NCCL needs a GPU per process: two GPUs")


def _train(name: str, stages: int, microbatches: int, schedule: str, steps: int = 2, **init) -> Differences:
    """Train the zoo model pipelined as configured and unsplit on the CPU; the worst differences."""
    *_, diff = train_side_by_side(ZOO[name], stages, microbatches, schedule, steps, **init)
    smpart.shutdown()
    return diff


@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(ZOO))
def test_stages_sharing_one_gpu_on_threads(name):
    for schedule in ("gpipe", "1f1b"):
        diff = _train(name, 2, 4, schedule, devices=["cuda:0", "cuda:0"])
        diff.assert_within(TOL, (name, schedule))
        assert diff.devices == diff.output_devices == ["cuda:0"]


@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2", "moe", "t5", "resnet"])
def test_stages_split_between_cpu_and_gpu_on_threads(name):
    diff = _train(name, 3, 4, "1f1b", devices=["cpu", "cuda:0", "cpu"])
    diff.assert_within(TOL, name)
    assert diff.devices == ["cpu", "cuda:0"]


def _train_on_ranks(rank, configs, init):
    return [(config, _train(*config, **init)) for config in configs]


def _assert_ranks(results) -> None:
    for report in values(results):
        for config, diff in report:
            diff.assert_within(TOL, config)


@needs_gpu
@pytest.mark.timeout(600)
def test_one_process_per_stage_on_one_shared_gpu_over_gloo():
    configs = [(name, 2, 4, "1f1b") for name in ZOO] + [("gpt2", 2, 2, "gpipe")]
    results = run_ranks(_train_on_ranks, 2, configs, {"backend": "gloo", "devices": ["cuda:0", "cuda:0"]},
                        timeout_s=580)
    _assert_ranks(results)
    for report in values(results):
        assert all(diff.devices == ["cuda:0"] and diff.bytes_sent > 0 for _, diff in report)
    # The driver's rank got the model's outputs on its device, as NCCL would bring them (gloo
    # brings CUDA tensors to the CPU); the other rank runs the step body only in a program step
    # (every rank runs it there), and gets them on its device too.
    driver, other = values(results)
    assert all(diff.output_devices == ["cuda:0"] for _, diff in driver), driver
    assert all(diff.output_devices in ([], ["cuda:0"]) for _, diff in other), other


@needs_two_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, min(GPUS, 4)])
def test_one_process_per_gpu_over_nccl(world):
    configs = [(name, world, 4, "1f1b") for name in ZOO] + [("gpt2", world, 2, "gpipe")]
    results = run_ranks(_train_on_ranks, world, configs, {"backend": "nccl"}, timeout_s=580)
    _assert_ranks(results)
    for rank, report in enumerate(values(results)):
        assert all(diff.devices == [f"cuda:{rank}"] for _, diff in report)


def _auto_backend(rank):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    backend = torch.distributed.get_backend()
    said = [str(w.message) for w in caught if "smpart" in str(w.message)]
    smpart.shutdown()
    return backend, said, os.environ["LOCAL_WORLD_SIZE"]


@needs_gpu
@pytest.mark.skipif(GPUS >= 2, reason="checks the fallback when the GPUs are fewer than the processes")
@pytest.mark.timeout(120)
def test_auto_backend_falls_back_to_gloo_with_fewer_gpus_than_processes():
    for backend, said, local in values(run_ranks(_auto_backend, 2, timeout_s=100)):
        assert backend == "gloo"
        assert said and "NCCL needs a GPU per process" in said[0], said
        assert local == "2"


def _synchronising_calls(fn) -> list[str]:
    """Where ``fn`` made the host wait for the GPU (``torch.cuda.set_sync_debug_mode``), as
    ``file:line: message``; warnings from every thread are recorded."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]


@needs_gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipelined_step_makes_the_host_wait_for_the_gpu_no_more_than_the_unsplit_model(schedule):
    # A step that waits for the GPU stalls the kernel queue: the host's overhead then adds to the
    # GPU's time instead of hiding behind it.
    example = ZOO["gpt2"](dtype=torch.float32)
    reference = copy.deepcopy(example.model).cuda()
    args, kwargs, target = example.batch(8, seed=0)
    args, target = [a.cuda() for a in args], target.cuda()

    def unsplit():
        for i in range(4):
            loss = example.loss(reference(*[a.chunk(4)[i] for a in args]), target.chunk(4)[i])
            (loss / 4).backward()

    smpart.init(pipeline_parallel_degree=2, microbatches=4, pipeline=schedule, devices=["cuda:0", "cuda:0"])
    model = smpart.DistributedModel(example.model)

    @smpart.step
    def step(model, args, target):
        loss = example.loss(model(*args), target)
        model.backward(loss)
        return loss

    unsplit()
    step(model, args, target)  # the first step traces and places the model
    expected = _synchronising_calls(unsplit)
    found = _synchronising_calls(lambda: step(model, args, target))
    assert len(found) <= len(expected), "\n".join(found)


@needs_gpu
def test_a_gpu_is_recognised_as_its_preset_type_and_not_as_others():
    """``init``'s check of a plan's device types reads a rank's GPU by name and memory: the local
    GPU matches the preset of its family (and memory), and no preset of another family."""
    from smpart.devices import PRESETS
    from smpart.distributed.device_check import observed_device

    name = torch.cuda.get_device_properties(0).name.upper()
    own = [p for p in PRESETS.values() if p.name.split("-")[0] in name]
    if not own:
        pytest.skip(f"no preset for {name}")
    matches = {p.name for p in PRESETS.values() if observed_device(p, torch.device("cuda", 0))[1]}
    assert matches and matches <= {p.name for p in own}, (name, matches)
