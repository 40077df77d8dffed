"""Global gradient clipping: torch's result in one process, the same norm over ranks and shards."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from examples.models import gpt2
from smpart.errors import SmpartError
from smpart.runtime.processes.grad_clip import clip_grad_norm_
from tests.launch import run_ranks, values


def with_gradients(dtype: torch.dtype = torch.float64) -> nn.Module:
    example = gpt2(dtype=dtype)
    loss = example.loss(example.model(*example.args), example.target)
    loss.backward()
    return example.model


def copy_of(model: nn.Module) -> nn.Module:
    """A deep copy with the gradients (``deepcopy`` of a parameter drops its ``.grad``)."""
    other = copy.deepcopy(model)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    return other


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_one_process_equals_torch(norm_type, max_norm):
    model = with_gradients()
    reference = copy_of(model)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    total = clip_grad_norm_(model, max_norm, norm_type)
    assert total.dtype == expected.dtype
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, msg=name)


def test_float32_and_parameters_given_as_a_list():
    model = with_gradients(torch.float32)
    reference = copy_of(model)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    total = clip_grad_norm_(list(model.parameters()), 0.5)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)


def test_a_tied_parameter_listed_twice_counts_once():
    model = with_gradients()
    tied = model.lm_head.weight
    assert tied is model.transformer.wte.weight
    reference = copy_of(model)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)  # each parameter once
    total = clip_grad_norm_([*model.parameters(), tied], 0.1)
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(tied.grad, reference.lm_head.weight.grad, rtol=1e-12, atol=0)


def test_no_gradients_and_bad_arguments():
    model = nn.Linear(2, 2)
    assert clip_grad_norm_(model, 1.0).item() == 0.0
    with pytest.raises(SmpartError, match="norm_type must be > 0"):
        clip_grad_norm_(model, 1.0, norm_type=0)
    model.weight.grad = torch.full((2, 2), float("nan"))
    with pytest.raises(SmpartError, match="total norm .* is nan"):
        clip_grad_norm_(model, 1.0, error_if_nonfinite=True)


# ---------------------------------------------------------------------------- over ranks
def _worker(rank: int, world: int, norm_type: float) -> tuple:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # every rank draws the same full gradients
        full = {name: torch.randn(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
        mesh = init_device_mesh("cpu", (world,))

        # tensor parallel over both ranks: a sharded weight, a replicated DTensor, a plain LayerNorm
        params = []
        for name, placement in (("column", Shard(0)), ("row", Shard(1)), ("bias", Replicate())):
            zeros = torch.zeros(SHAPES[name], dtype=torch.float64)
            p = nn.Parameter(distribute_tensor(zeros, mesh, [placement]))
            p.grad = distribute_tensor(full[name].clone(), mesh, [placement])
            params.append(p)
        norm = nn.Parameter(torch.zeros(SHAPES["norm"], dtype=torch.float64))
        norm.grad = full["norm"].clone()
        total = clip_grad_norm_([*params, norm], 0.5, norm_type, groups=[dist.group.WORLD],
                                replicated_over=dist.group.WORLD)
        names = ("column", "row", "bias")
        clipped = {name: p.grad.full_tensor() for name, p in zip(names, params, strict=True)}
        clipped["norm"] = norm.grad

        # pipeline over both ranks: rank r holds its own stage's plain parameters
        stage = [name for i, name in enumerate(SHAPES) if i % world == rank]
        owned = [nn.Parameter(torch.zeros(SHAPES[n], dtype=torch.float64)) for n in stage]
        for p, name in zip(owned, stage, strict=True):
            p.grad = full[name].clone()
        pipeline_total = clip_grad_norm_(owned, 0.5, norm_type, groups=[dist.group.WORLD])
        return (rank, total.item(), {k: v.numpy() for k, v in clipped.items()}, pipeline_total.item(),
                {n: p.grad.numpy() for n, p in zip(stage, owned, strict=True)})
    finally:
        dist.destroy_process_group()


SHAPES = {"column": (6, 4), "row": (4, 6), "bias": (4,), "norm": (4,)}


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_shards_replicas_and_stages_count_each_element_once(norm_type):
    torch.manual_seed(0)
    full = {name: torch.randn(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    reference = {name: nn.Parameter(torch.zeros_like(t)) for name, t in full.items()}
    for name, p in reference.items():
        p.grad = full[name].clone()
    expected = torch.nn.utils.clip_grad_norm_(list(reference.values()), 0.5, norm_type).item()

    results = values(run_ranks(_worker, 2, 2, norm_type))
    stage_grads = {}
    for _, total, clipped, pipeline_total, owned in results:
        assert total == pytest.approx(expected, rel=1e-12)
        assert pipeline_total == pytest.approx(expected, rel=1e-12)
        for name, grad in clipped.items():
            assert torch.allclose(torch.from_numpy(grad), reference[name].grad, rtol=1e-12, atol=0), name
        stage_grads.update(owned)
    assert stage_grads.keys() == reference.keys()
    for name, grad in stage_grads.items():
        assert torch.allclose(torch.from_numpy(grad), reference[name].grad, rtol=1e-12, atol=0), name
