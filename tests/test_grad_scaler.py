"""`smpart.amp.GradScaler`: loss scaling trains as torch's scaler does on the unsplit model, and under
``torchrun`` every rank keeps the same scale and skips a step together when any stage overflowed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smpart
from tests.launch import run_ranks, values

MICROBATCHES = 2
INIT_SCALE = 2.0**10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(4)],
                         nn.Linear(8, 3)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def _reference_step(model, scaler, x, y) -> None:
    for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
        scaler.scale(F.cross_entropy(model(xs), ys) / MICROBATCHES).backward()


def _train(overflow_at: int | None, steps: int = 4) -> dict:
    """Train pipelined and, beside it, the unsplit model with torch's own scaler; on step
    ``overflow_at`` the last stage's first gradient (on the rank holding it) becomes inf, and the
    reference gets the same inf. Returns what this rank saw."""
    net, reference = _model(), _model()
    smpart.init(pipeline_parallel_degree=2, microbatches=MICROBATCHES, timeout_s=60)
    try:
        model = smpart.DistributedModel(net)
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        scaler = smpart.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)

        @smpart.step
        def train_step(model, x, y):
            loss = F.cross_entropy(model(x), y)
            model.backward(scaler.scale(loss))
            return loss

        skipped, injected = [], False
        for step in range(steps):
            x, y = _batch(step)
            train_step(model, x, y)
            _reference_step(reference, ref_scaler, x, y)
            if step == overflow_at:
                for params in (model.module[4].weight, reference[4].weight):
                    if params.grad is not None and params.device.type != "meta":
                        params.grad[0, 0] = math.inf
                        injected = injected or params is model.module[4].weight
            before = [p.detach().clone() for p in model.parameters() if p.device.type != "meta"]
            for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
                s.step(o)
                s.update()
                o.zero_grad()
            after = [p for p in model.parameters() if p.device.type != "meta"]
            skipped.append(all(torch.equal(b, a) for b, a in zip(before, after, strict=True)))
        mine = {name: p for name, p in model.named_parameters() if p.device.type != "meta"}
        expected = dict(reference.named_parameters())
        worst = max((p.detach() - expected[name].detach()).abs().max().item() for name, p in mine.items())
        return {"worst": worst, "skipped": skipped, "scale": scaler.get_scale(),
                "reference_scale": ref_scaler.get_scale(), "held": len(mine), "injected": injected}
    finally:
        smpart.shutdown()


def _on_rank(rank: int, overflow_at: int | None) -> dict:
    return _train(overflow_at)


@pytest.mark.timeout(60)
def test_on_threads_it_trains_as_torchs_scaler_on_the_unsplit_model():
    seen = _train(overflow_at=2)
    assert seen["worst"] <= 1e-10, seen
    assert seen["skipped"] == [False, False, True, False], seen
    assert seen["scale"] == seen["reference_scale"] == INIT_SCALE / 2, seen


@pytest.mark.timeout(120)
def test_under_torchrun_every_rank_keeps_the_scale_and_skips_together():
    """Only rank 1 holds the overflowing gradient: rank 0 skips the step too (torch's scaler on
    rank 1 would not even run: it never scaled a loss, so it has no scale)."""
    ranks = values(run_ranks(_on_rank, 2, 2, timeout_s=110))
    assert [seen["injected"] for seen in ranks] == [False, True], ranks
    for rank, seen in enumerate(ranks):
        assert seen["held"] > 0, (rank, seen)
        assert seen["worst"] <= 1e-10, (rank, seen)
        assert seen["skipped"] == [False, False, True, False], (rank, seen)
        assert seen["scale"] == seen["reference_scale"] == INIT_SCALE / 2, (rank, seen)


@pytest.mark.timeout(120)
def test_under_torchrun_without_overflow_it_trains_as_the_unsplit_model():
    for rank, seen in enumerate(values(run_ranks(_on_rank, 2, None, timeout_s=110))):
        assert seen["worst"] <= 1e-10 and not any(seen["skipped"]), (rank, seen)
        assert seen["scale"] == seen["reference_scale"] == INIT_SCALE, (rank, seen)
