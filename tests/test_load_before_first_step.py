"""A checkpoint loaded before a model's first step is what the model holds, at once.

Under ``torchrun`` a model is placed (split into stages and shards) at its first step. A load
before it used to wait for the placement, silently: ``model.state_dict()`` (and a
``torch.save`` of it) showed the weights from before the load, on every rank. Now, on threads and
on processes alike:

1. a materialised model is loaded at once (the optimizer's state, under torchrun, at placement);
2. a model built on the meta device is loaded at its placement, and ``state_dict()`` serves the
   checkpoint's values until then;
3. a model built on meta that no load covers has no values before its first step: asking for its
   state dict is an `SmpartError` that says so.

Each case then steps like the model that was saved, which checks that what waited (the
optimizer's state, a meta-built model's tensors) arrived too.
"""

from __future__ import annotations

import io

import pytest
import torch

import smpart
from examples.models import gpt2
from smpart.errors import SmpartError
from tests.launch import run_ranks, values
from tests.test_runtime import train_step

LAYERS = 2


def _example(seed: int, device: str = "cpu"):
    return gpt2(dtype=torch.float64, seed=seed, n_layer=LAYERS, device=device)


def _step(model, optimizer, seed: int) -> float:
    example = _example(0)
    args, kwargs, target = example.batch(4, seed=seed)
    loss = train_step(model, example, args, kwargs, target).reduce_mean().item()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _off(state: dict, saved: dict) -> float:
    """Largest difference between two state dicts (inf when their keys differ)."""
    if list(state) != list(saved):
        return float("inf")
    return max((state[k] - saved[k]).abs().max().item() for k in saved)


def _adamw(model):
    return smpart.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _three_cases(path, rank: int = 0) -> dict:
    """Save a trained model; load it into one built anew with another seed and into one built on
    meta; step all three once more. Every rank reports what its state dicts showed."""
    model = smpart.DistributedModel(_example(0).model)
    optimizer = _adamw(model)
    for seed in range(2):
        _step(model, optimizer, seed)
    smpart.save_checkpoint(path, model, optimizer)
    saved = model.state_dict()

    report = {}
    anew = smpart.DistributedModel(_example(100 + rank).model)  # another seed on every rank
    anew_optimizer = _adamw(anew)
    report["anew_before"] = _off(anew.state_dict(), saved)
    smpart.load_checkpoint(path, anew, anew_optimizer)
    report["anew"] = _off(anew.state_dict(), saved)
    buffer = io.BytesIO()
    torch.save(anew.state_dict(), buffer)
    report["anew_saved"] = _off(torch.load(io.BytesIO(buffer.getvalue())), saved)

    lazy = smpart.DistributedModel(_example(0, device="meta").model)
    lazy_optimizer = _adamw(lazy)
    try:
        lazy.state_dict()
        report["no_values"] = ""
    except SmpartError as err:
        report["no_values"] = str(err)
    smpart.load_checkpoint(path, lazy, lazy_optimizer)
    report["lazy"] = _off(lazy.state_dict(), saved)
    report["lazy_is_meta"] = all(p.is_meta for p in lazy.parameters())  # nothing made before placement

    trained = ((model, optimizer), (anew, anew_optimizer), (lazy, lazy_optimizer))
    report["losses"] = [_step(m, o, seed=2) for m, o in trained]
    after = model.state_dict()
    report["anew_after"] = _off(anew.state_dict(), after)
    report["lazy_after"] = _off(lazy.state_dict(), after)
    return report


def _check(report: dict) -> None:
    assert report["anew_before"] > 1e-3  # the fresh model really differs before the load
    assert report["anew"] == 0.0 and report["anew_saved"] == 0.0
    assert "built on the meta device and is not placed yet" in report["no_values"]
    assert "first step" in report["no_values"]
    assert report["lazy"] == 0.0 and report["lazy_is_meta"]
    first, *loaded = report["losses"]
    assert all(loss == first for loss in loaded), report["losses"]
    # the optimizer's state arrived too (to rounding: a meta-built model's parameters are new
    # objects, which AdamW may visit in another order)
    assert report["anew_after"] < 1e-12 and report["lazy_after"] < 1e-12, report


def _on_processes(rank: int, path) -> dict:
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    try:
        return _three_cases(path, rank)
    finally:
        smpart.shutdown()


@pytest.mark.timeout(150)
def test_a_checkpoint_loaded_before_the_first_step_is_what_every_rank_reads_under_torchrun(tmp_path):
    """The 2-process pp 2 run: save, build anew with another seed, load, compare on every rank."""
    for report in values(run_ranks(_on_processes, 2, tmp_path / "ckpt", timeout_s=130)):
        _check(report)


def test_a_checkpoint_loaded_before_the_first_step_is_what_the_model_reads_on_threads(tmp_path):
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        _check(_three_cases(tmp_path / "ckpt"))
    finally:
        smpart.shutdown()


def test_weights_loaded_into_a_model_built_on_meta_are_served_until_its_placement():
    """``load_weights`` and ``load_state_dict`` wait for the placement too, and are served until then;
    the latest load wins."""
    plain = _example(0).model
    other = _example(1).model.state_dict()
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        lazy = smpart.DistributedModel(_example(0, device="meta").model)
        smpart.load_weights(lazy, other)
        assert _off(lazy.state_dict(), other) == 0.0
        lazy.load_state_dict(plain.state_dict())
        assert _off(lazy.state_dict(), plain.state_dict()) == 0.0
        example = _example(0)
        args, kwargs, _ = example.batch(4, seed=0)

        @smpart.step
        def predict(model, *args, **kwargs):
            return model(*args, **kwargs)

        with torch.no_grad():
            assert torch.equal(predict(lazy, *args, **kwargs).concat(), plain(*args, **kwargs))
        assert _off(lazy.state_dict(), plain.state_dict()) == 0.0
    finally:
        smpart.shutdown()
