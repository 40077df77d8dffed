"""Checkpoints move between the process runtime's layouts, and training resumes across them.

One launch trains the zoo GPT for K steps with (pp, tp, dp) = (2, 2, 1) on 4 processes, saves,
and trains on to N steps uninterrupted. Then the checkpoint is loaded into other layouts, (4, 1, 1)
and (1, 2, 2) on 4 processes and (1, 1, 1) on threads, and into the plain ``nn.Module`` with no
``smpart.init``; each layout saves it again and trains the remaining N - K steps from it.

- Round trip: every re-saved checkpoint, read into a plain model and optimizer, is bit-exact with
  the original one read the same way (model and optimizer state).
- Resume: every resumed run ends where the uninterrupted one did (<= 1e-6; the layouts sum their
  gradients in different orders), with the step count and ``extra`` restored.

The global batch is the same in every layout: each data-parallel replica takes its slice, and the
micro-batches per replica make two chunks of the global batch in all (so the mean loss is the same).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import smpart
from examples.models import ZOO
from smpart.checkpoint import load_checkpoint
from tests.launch import run_ranks, values
from tests.test_runtime import train_step

K, N, GLOBAL_BATCH, CHUNKS = 2, 4, 4, 2


def _example():
    torch.manual_seed(0)
    return ZOO["gpt2"](dtype=torch.float64)


def _steps(model, opt, first: int, last: int) -> None:
    dp, rank = smpart.dp_size(), smpart.dp_rank()
    per = GLOBAL_BATCH // dp
    example = _example()
    for step in range(first, last):
        args, kwargs, target = example.batch(GLOBAL_BATCH, seed=step)
        mine = slice(rank * per, (rank + 1) * per)
        train_step(model, example, [a[mine] for a in args], {k: v[mine] for k, v in kwargs.items()},
                   target[mine])
        opt.step()
        opt.zero_grad()


def _distributed(pp: int, tp: int):
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (pp * tp)
    smpart.init(pipeline_parallel_degree=pp, tensor_parallel_degree=tp, microbatches=CHUNKS // dp,
                timeout_s=60)
    model = smpart.DistributedModel(_example().model)
    opt = smpart.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    return model, opt


def _first_run(rank, directory):
    """(2, 2, 1): K steps, save, N - K more; the full state after N steps."""
    model, opt = _distributed(2, 2)
    _steps(model, opt, 0, K)
    smpart.save_checkpoint(Path(directory) / "original", model, opt, extra={"step": K})
    _steps(model, opt, K, N)
    _keep(model, Path(directory) / "uninterrupted.pt")
    smpart.shutdown()


def _keep(model, file: Path) -> None:
    """The full state dict, written by rank 0 (tensors do not pass back through the result queue)."""
    full = model.state_dict()
    if smpart.rank() == 0:
        torch.save(full, file)


def _resume(rank, directory, pp, tp):
    """Load into (pp, tp, dp), save again, train the rest; the full state after N steps."""
    model, opt = _distributed(pp, tp)
    extra = smpart.load_checkpoint(Path(directory) / "original", model, opt)  # read once placed
    with pytest.raises(smpart.SmpartError, match="waiting for its placement"):
        smpart.save_checkpoint(Path(directory) / "too_early", model, opt)
    _place_by_evaluating(model)
    smpart.save_checkpoint(Path(directory) / f"resaved_{pp}{tp}", model, opt, extra=extra)
    _steps(model, opt, extra["step"], N)
    _keep(model, Path(directory) / f"resumed_{pp}{tp}.pt")
    smpart.shutdown()
    return extra


def _place_by_evaluating(model) -> None:
    """A forward-only step: the model is placed (and the load done) without changing it."""
    example = _example()
    args, kwargs, _ = example.batch(GLOBAL_BATCH // smpart.dp_size(), seed=0)

    @smpart.step
    def evaluate(model, args, kwargs):
        return model(*args, **kwargs)

    with torch.no_grad():
        evaluate(model, args, kwargs)


def _plain(path: Path):
    """The checkpoint read into the plain model and an AdamW over it, no smpart.init."""
    model = _example().model
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    extra = load_checkpoint(path, model, opt, restore_rng=False)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: s for p, s in opt.state.items()}
    return model, opt, extra, model.state_dict(), state


def _assert_bit_exact(a: Path, b: Path) -> None:
    _, opt_a, _, model_a, state_a = _plain(a)
    _, opt_b, _, model_b, state_b = _plain(b)
    assert model_a.keys() == model_b.keys()
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    assert state_a.keys() == state_b.keys() and state_a
    for name, entries in state_a.items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[name][key])), (name, key)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] == 0.01


def _assert_close(full: dict, expected: dict, what: str) -> None:
    worst = max((full[k].double() - v.double()).abs().max().item() for k, v in expected.items())
    assert worst <= 1e-6, (what, worst)


@pytest.mark.timeout(500)
def test_a_checkpoint_moves_between_layouts_and_training_resumes(tmp_path):
    values(run_ranks(_first_run, 4, str(tmp_path), timeout_s=150))
    uninterrupted = torch.load(tmp_path / "uninterrupted.pt", weights_only=True)
    original = tmp_path / "original"

    # the plain module, no smpart.init: it reads everything, and resumes like the others
    model, opt, extra, _, _ = _plain(original)
    assert extra == {"step": K}
    for group in opt.param_groups:
        group["lr"] = 0.01  # (the loader keeps the saved hyperparameters; _plain set 0.5 first)
    smpart.init(pipeline_parallel_degree=1, microbatches=CHUNKS)
    threads = smpart.DistributedModel(model)
    _steps(threads, smpart.DistributedOptimizer(opt), K, N)
    _assert_close(threads.state_dict(), uninterrupted, "plain module resumed on threads")
    smpart.shutdown()

    # (1, 1, 1) on threads: load, save again, resume
    threaded, threaded_opt = _distributed(1, 1)
    assert smpart.load_checkpoint(original, threaded, threaded_opt) == {"step": K}
    smpart.save_checkpoint(tmp_path / "resaved_threads", threaded, threaded_opt, extra={"step": K})
    _steps(threaded, threaded_opt, K, N)
    _assert_close(threaded.state_dict(), uninterrupted, "(1, 1, 1) on threads")
    smpart.shutdown()
    _assert_bit_exact(original, tmp_path / "resaved_threads")

    for pp, tp in ((4, 1), (1, 2)):
        for extra in values(run_ranks(_resume, 4, str(tmp_path), pp, tp, timeout_s=150)):
            assert extra == {"step": K}
        full = torch.load(tmp_path / f"resumed_{pp}{tp}.pt", weights_only=True)
        _assert_close(full, uninterrupted, f"({pp}, {tp}) resumed")
        _assert_bit_exact(original, tmp_path / f"resaved_{pp}{tp}")
