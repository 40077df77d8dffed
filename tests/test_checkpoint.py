"""Checkpoints: exact round trips, exact resumption, bad inputs, other layouts, plain weights."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.models import gpt2
from smpart.checkpoint import MARKER, CheckpointError, load_checkpoint, load_weights, save_checkpoint
from tests.launch import run_ranks, values


def gpt(seed: int = 0, dropout: float = 0.0, **sizes):
    example = gpt2(dtype=torch.float64, seed=seed, **sizes)
    if dropout:  # the zoo models have no dropout; resumption must replay the same masks
        for block in example.model.transformer.h:
            block.mlp.register_forward_hook(lambda _m, _a, out: F.dropout(out, dropout, training=True))
    return example


def train_step(example, optimizer, batch_seed: int) -> float:
    args, kwargs, target = example.batch(4, seed=batch_seed)
    loss = example.loss(example.model(*args, **kwargs), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, state in sa["state"].items():
        assert state.keys() == sb["state"][index].keys()
        for key, value in state.items():
            other = sb["state"][index][key]
            assert torch.equal(value, other) and value.dtype == other.dtype and value.device == other.device


# ---------------------------------------------------------------------------- round trips
def test_model_and_adamw_round_trip_bit_exactly(tmp_path):
    example = gpt()
    optimizer = torch.optim.AdamW(example.model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for step in range(2):
        train_step(example, optimizer, step)
    save_checkpoint(tmp_path / "ckpt", example.model, optimizer)

    fresh = gpt(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.model.parameters(), lr=0.5)
    assert load_checkpoint(tmp_path / "ckpt", fresh.model, fresh_optimizer) is None
    assert_same_model(example.model, fresh.model)
    assert_same_optimizer(optimizer, fresh_optimizer)
    assert fresh.model.lm_head.weight is fresh.model.transformer.wte.weight  # still tied
    step_count = fresh_optimizer.state[fresh.model.lm_head.weight]["step"]
    assert step_count.item() == 2
    marker = json.loads((tmp_path / "ckpt" / MARKER).read_text())
    assert marker["optimizer"] and marker["world_size"] == 1 and marker["extra"] is None


def untied(example):
    model = example.model
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    return example


def test_a_tied_weight_is_written_once_and_loads_into_a_model_that_does_not_tie_it(tmp_path):
    from smpart.checkpoint import iter_checkpoint_keys

    tied = gpt(seed=2)
    save_checkpoint(tmp_path / "tied", tied.model)
    keys = dict(iter_checkpoint_keys(tmp_path / "tied"))
    assert "model.transformer.wte.weight" in keys and "model.lm_head.weight" not in keys
    loose = untied(gpt())
    load_checkpoint(tmp_path / "tied", loose.model)
    assert_same_model(tied.model, loose.model)
    assert loose.model.lm_head.weight is not loose.model.transformer.wte.weight
    loose = untied(gpt())
    load_weights(loose.model, tmp_path / "tied")
    assert_same_model(tied.model, loose.model)
    # and back: an untied model's checkpoint has both; a tied model takes the first
    save_checkpoint(tmp_path / "loose", loose.model)
    again = gpt(seed=5)
    load_checkpoint(tmp_path / "loose", again.model)
    assert_same_model(tied.model, again.model)


def test_sgd_momentum_and_a_parameter_without_state(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[2].requires_grad_(False)  # in the optimizer, never stepped: no state
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, model, optimizer)
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.3, momentum=0.5)
    load_checkpoint(tmp_path, other, other_optimizer)
    assert_same_model(model, other)
    assert_same_optimizer(optimizer, other_optimizer)


def test_resuming_equals_training_without_interruption(tmp_path):
    """N steps in one go == k steps, save, a new model and optimizer, load, N - k steps: bit-exact,
    with dropout (torch RNG) and a data loader drawing from Python's and NumPy's RNGs."""
    total, k = 5, 2

    def loader_seed() -> int:
        return random.randrange(1000) + int(np.random.randint(1000))

    def run(example, optimizer, steps):
        return [train_step(example, optimizer, loader_seed()) for _ in range(steps)]

    def seed_everything():
        torch.manual_seed(0), random.seed(0), np.random.seed(0)

    seed_everything()
    straight = gpt(dropout=0.3)
    straight_optimizer = torch.optim.AdamW(straight.model.parameters(), lr=1e-2)
    expected = run(straight, straight_optimizer, total)

    seed_everything()
    first = gpt(dropout=0.3)
    first_optimizer = torch.optim.AdamW(first.model.parameters(), lr=1e-2)
    losses = run(first, first_optimizer, k)
    save_checkpoint(tmp_path / "ckpt", first.model, first_optimizer, extra={"step": k, "loader_pos": (k, 4)})
    torch.rand(10), random.random(), np.random.rand()  # the RNGs move on after the save

    second = gpt(seed=7, dropout=0.3)
    second_optimizer = torch.optim.AdamW(second.model.parameters(), lr=1e-2)
    extra = load_checkpoint(tmp_path / "ckpt", second.model, second_optimizer)
    assert extra == {"step": k, "loader_pos": (k, 4)}
    losses += run(second, second_optimizer, total - extra["step"])
    assert losses == expected
    assert_same_model(straight.model, second.model)
    assert_same_optimizer(straight_optimizer, second_optimizer)


def test_extra_that_json_cannot_hold_goes_through_weights_only_torch_load(tmp_path):
    model = nn.Linear(2, 2)
    extra = {"ids": {3: "three"}, "mask": torch.tensor([True, False]), "step": 4}
    save_checkpoint(tmp_path / "a", model, extra=extra)
    assert json.loads((tmp_path / "a" / MARKER).read_text())["extra"] == "torch"
    got = load_checkpoint(tmp_path / "a", nn.Linear(2, 2))
    assert got["ids"] == {3: "three"} and torch.equal(got["mask"], extra["mask"]) and got["step"] == 4
    with pytest.raises(CheckpointError, match="extra .*weights_only.*Keep extra to"):
        save_checkpoint(tmp_path / "b", model, extra={"thing": Custom()})
    with pytest.raises(CheckpointError, match="extra .*weights_only.*Keep extra to"):
        save_checkpoint(tmp_path / "c", model, extra={"thing": lambda: 0})  # not even picklable


class Custom:
    """Picklable, but not something weights_only loading accepts."""


def test_saving_again_replaces_a_checkpoint(tmp_path):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    save_checkpoint(tmp_path, a)
    save_checkpoint(tmp_path, b)
    c = nn.Linear(2, 2)
    load_checkpoint(tmp_path, c)
    assert_same_model(b, c)


# ---------------------------------------------------------------------------- bad inputs
def test_a_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint: no such directory"):
        load_checkpoint(tmp_path / "nothing", nn.Linear(2, 2))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(tmp_path / "file", nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="neither .smpart_complete nor DCP's .metadata"):
        load_checkpoint(tmp_path, nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="holds other files"):
        save_checkpoint(tmp_path, nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="it is a file"):
        save_checkpoint(tmp_path / "file", nn.Linear(2, 2))


def test_a_partially_written_checkpoint_is_refused(tmp_path):
    save_checkpoint(tmp_path, nn.Linear(2, 2))
    (tmp_path / MARKER).unlink()  # as if the save had died before its last write
    with pytest.raises(CheckpointError, match="partially written checkpoint.*Use an earlier checkpoint"):
        load_checkpoint(tmp_path, nn.Linear(2, 2))


def test_a_checkpoint_of_another_model_names_every_problem(tmp_path):
    save_checkpoint(tmp_path, gpt(n_layer=2, n_embd=32).model)
    other = gpt(n_layer=3, n_embd=16).model
    with pytest.raises(CheckpointError) as failure:
        load_checkpoint(tmp_path, other)
    message = str(failure.value)
    assert "holds another model than GPT" in message
    assert "missing from the checkpoint: transformer.h.2.ln_1.weight" in message
    assert "shape mismatch: transformer.wte.weight: checkpoint (64, 32), model (64, 16)" in message
    before = {k: v.clone() for k, v in other.state_dict().items()}
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())  # nothing loaded

    save_checkpoint(tmp_path / "big", gpt(n_layer=3).model)
    with pytest.raises(CheckpointError, match=r"not in the model: model\.transformer\.h\.2|not in the model: "
                                              r"transformer\.h\.2"):
        load_checkpoint(tmp_path / "big", gpt(n_layer=2).model)


def test_optimizer_requested_from_a_checkpoint_without_one(tmp_path):
    model = nn.Linear(2, 2)
    save_checkpoint(tmp_path, model)
    with pytest.raises(CheckpointError, match="no optimizer state.*optimizer=None"):
        load_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()))


def test_an_optimizer_over_other_parameters(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="not the model's"):
        save_checkpoint(tmp_path, model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_metadata_with_foreign_pickled_code_is_refused(tmp_path):
    save_checkpoint(tmp_path, nn.Linear(2, 2))
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo should-not-run",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(tmp_path, nn.Linear(2, 2))


# ---------------------------------------------------------------------------- plain weights
def test_load_weights_from_a_state_dict_a_file_and_a_checkpoint(tmp_path):
    from safetensors.torch import save_model

    source = gpt(seed=3).model
    state = source.state_dict()
    target = gpt().model
    assert "lm_head.weight" in load_weights(target, state)
    assert_same_model(source, target)

    save_model(source, str(tmp_path / "model.safetensors"))  # drops the tied duplicate
    target = gpt().model
    load_weights(target, tmp_path)  # a Hugging Face-style directory
    assert_same_model(source, target)

    torch.save(state, tmp_path / "weights.pt")
    target = gpt().model
    load_weights(target, tmp_path / "weights.pt")
    assert_same_model(source, target)

    save_checkpoint(tmp_path / "ckpt", source)
    target = gpt().model
    load_weights(target, tmp_path / "ckpt")  # an smpart checkpoint: its "model." keys
    assert_same_model(source, target)


def test_load_weights_from_sharded_safetensors_with_a_prefix(tmp_path):
    from safetensors.torch import save_file

    source = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    state = {f"backbone.{k}": v.contiguous() for k, v in source.state_dict().items()}
    keys = list(state)
    save_file({k: state[k] for k in keys[:2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 + (i >= 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    load_weights(target, tmp_path, prefix="backbone.")
    assert_same_model(source, target)


def test_load_weights_names_every_problem_unless_not_strict():
    source = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).state_dict()
    source["extra.weight"] = torch.zeros(1)
    source["1.weight"] = torch.zeros(5, 5)
    del source["1.bias"]
    target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with pytest.raises(CheckpointError) as failure:
        load_weights(target, source)
    message = str(failure.value)
    assert "missing from the source: 1.bias" in message and "not in the model: extra.weight" in message
    assert "shape mismatch: 1.weight: source (5, 5), model (2, 4)" in message
    assert load_weights(target, source, strict=False) == ["0.bias", "0.weight"]
    assert torch.equal(target[0].weight, source["0.weight"])
    with pytest.raises(CheckpointError, match="no such file"):
        load_weights(target, "/nonexistent/weights.safetensors")


def test_weights_loaded_into_a_model_built_on_meta_reach_it_at_its_placement_on_threads():
    """They went into the meta tensors, nowhere: the stages started from their initial values."""
    import smpart

    torch.manual_seed(0)

    def make():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    plain = make()
    with torch.device("meta"):
        model = smpart.DistributedModel(make())
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        assert load_weights(model, plain.state_dict()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        x = torch.randn(4, 4)
        assert torch.equal(smpart.step(lambda model, x: model(x))(model, x).concat(), plain(x))
    finally:
        smpart.shutdown()


def test_a_model_built_on_meta_loads_a_checkpoint_at_its_placement_on_threads(tmp_path):
    """The load waits for the placement, which makes each stage's tensors (it wrote nothing into
    the meta tensors and left the initial values: 0.91 off the saved model's outputs)."""
    import smpart

    torch.manual_seed(0)

    def make():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    plain = make()
    save_checkpoint(tmp_path / "plain", plain)
    with torch.device("meta"):
        model = smpart.DistributedModel(make())
    with pytest.raises(CheckpointError, match="call smpart.init"):  # nothing would ever place it
        load_checkpoint(tmp_path / "plain", model)
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        load_checkpoint(tmp_path / "plain", model)

        @smpart.step
        def predict(model, x):
            return model(x)

        x = torch.randn(4, 4)
        assert torch.equal(predict(model, x).concat(), plain(x))
    finally:
        smpart.shutdown()


# ---------------------------------------------------------------------------- other layouts
class StageModel:
    """What a ``DistributedModel`` under processes shows a checkpoint: the user's module, whose
    tensors of other stages are on the meta device, and ``local_state_dict()`` of its own."""

    def __init__(self, module: nn.Module, keep: list[str]) -> None:
        self.module = module
        for name, p in list(module.named_parameters(remove_duplicate=False)):  # both names of a tie
            if not any(name.startswith(k) for k in keep):
                owner, _, attr = name.rpartition(".")
                meta = nn.Parameter(torch.empty_like(p, device="meta"))
                module.get_submodule(owner)._parameters[attr] = meta
        self.keep = keep

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.module.state_dict().items() if v.device.type != "meta"}


STAGES = [["transformer.wte", "lm_head", "transformer.h.0"],
          ["transformer.wpe", "transformer.h.1", "transformer.ln_f"]]


def _two_stage_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = Path(out)
        # save: each rank holds one stage after two steps on its own parameters
        model = StageModel(gpt(n_layer=2).model, STAGES[rank])
        params = [p for p in model.module.parameters() if p.device.type != "meta"]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        torch.manual_seed(rank)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer.step()
        names = {id(p): n for n, p in model.module.named_parameters()}
        torch.save({"model": model.local_state_dict(),
                    "optim": {names[id(p)]: s for p, s in optimizer.state.items()}}, out / f"rank{rank}.pt")
        save_checkpoint(out / "from_stages", model, optimizer, extra={"world": world})
        # load a one-process checkpoint into this rank's stage
        loaded = StageModel(gpt(n_layer=2, seed=9).model, STAGES[rank])
        local_params = [p for p in loaded.module.parameters() if p.device.type != "meta"]
        loaded_optimizer = torch.optim.AdamW(local_params, lr=0.5)
        load_checkpoint(out / "plain", loaded, loaded_optimizer, restore_rng=False)
        torch.save({"model": loaded.local_state_dict(),
                    "optim": {n: loaded_optimizer.state[p] for n, p in loaded.module.named_parameters()
                              if p.device.type != "meta"}}, out / f"loaded{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_any_layout_loads_into_any_other(tmp_path):
    """Two processes, one pipeline stage each, save; a plain model reads it. A plain model's
    checkpoint is read back by the two stages, each asking for its own tensors."""
    plain = gpt(n_layer=2, seed=5)
    plain_optimizer = torch.optim.AdamW(plain.model.parameters(), lr=1e-2)
    for step in range(2):
        train_step(plain, plain_optimizer, step)
    save_checkpoint(tmp_path / "plain", plain.model, plain_optimizer)

    values(run_ranks(_two_stage_worker, 2, 2, str(tmp_path)))

    # stages -> plain
    model = gpt(n_layer=2, seed=11).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    assert load_checkpoint(tmp_path / "from_stages", model, optimizer, restore_rng=False) == {"world": 2}
    state = model.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, tensor in saved["model"].items():
            assert torch.equal(state[name], tensor), name
        for name, expected in saved["optim"].items():
            param = next(p for p in model.parameters() if names[id(p)] == name)
            for key, value in expected.items():
                assert torch.equal(optimizer.state[param][key], value), (name, key)
    assert optimizer.param_groups[0]["lr"] == 1e-2
    # plain -> stages
    plain_state = plain.model.state_dict()
    plain_names = {id(p): n for n, p in plain.model.named_parameters()}
    plain_optim = {plain_names[id(p)]: s for p, s in plain_optimizer.state.items()}
    for rank in range(2):
        loaded = torch.load(tmp_path / f"loaded{rank}.pt", weights_only=True)
        assert loaded["model"] and all(torch.equal(v, plain_state[k]) for k, v in loaded["model"].items())
        for name, got in loaded["optim"].items():
            assert all(torch.equal(got[key], plain_optim[name][key]) for key in plain_optim[name])
    shutil.rmtree(tmp_path)


# ---------------------------------------------------------------------------- smpart's runtime
def test_a_pipelined_model_saves_and_loads_like_the_plain_one(tmp_path):
    """smpart's thread runtime, two stages: the checkpoint holds the user's names; the plain model
    reads it, and the pipelined model reads a plain model's checkpoint into its placed parameters."""
    import smpart

    @smpart.step
    def step(model, args, target, example):
        loss = example.loss(model(*args), target)
        model.backward(loss)
        return loss

    example = gpt(n_layer=2)
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        model = smpart.DistributedModel(example.model)
        optimizer = smpart.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        args, _, target = example.batch(4, seed=0)
        step(model, args, target, example)
        optimizer.step()
        optimizer.zero_grad()
        save_checkpoint(tmp_path / "pipelined", model, optimizer, extra={"step": 1})

        plain = gpt(n_layer=2, seed=4)
        plain_optimizer = torch.optim.AdamW(plain.model.parameters(), lr=0.1)
        assert load_checkpoint(tmp_path / "pipelined", plain.model, plain_optimizer) == {"step": 1}
        assert_same_model(example.model, plain.model)
        assert_same_optimizer(optimizer.optimizer, plain_optimizer)

        for p in plain.model.parameters():
            p.data.mul_(2)
        save_checkpoint(tmp_path / "plain", plain.model, plain_optimizer)
        load_checkpoint(tmp_path / "plain", model, optimizer)
        assert_same_model(plain.model, example.model)
        step(model, args, target, example)  # still trains where it was placed
    finally:
        smpart.shutdown()


# ---------------------------------------------------------------------------- tensor-parallel shards
class ShardedModel:
    """A tensor-parallel rank's view: DTensor parameters with their global shapes."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()


def _tensor_parallel_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = Path(out)
        mesh = init_device_mesh("cpu", (world,))
        full = torch.load(out / "full.pt", weights_only=True)

        def sharded() -> nn.Module:
            layer = nn.Linear(4, 6)
            layer.weight = nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]))
            layer.bias = nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Replicate()]))
            return layer

        # plain weights (a safetensors file) into shards: each rank reads its rows only
        layer = sharded()
        load_weights(layer, out / "full.safetensors")
        assert torch.equal(layer.weight.to_local(), full["weight"].chunk(world)[rank])
        assert torch.equal(layer.bias.full_tensor(), full["bias"])
        # train a step on the shards, save; the parent reads it into a plain layer
        optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
        for p in layer.parameters():
            p.grad = distribute_tensor(torch.ones(p.shape), mesh, p.placements)
        optimizer.step()
        save_checkpoint(out / "sharded", ShardedModel(layer), optimizer)
        # a plain checkpoint read back into shards, optimizer state included
        again = sharded()
        again_optimizer = torch.optim.AdamW(again.parameters(), lr=0.5)
        load_checkpoint(out / "plain", ShardedModel(again), again_optimizer, restore_rng=False)
        plain = torch.load(out / "plain_state.pt", weights_only=True)
        assert torch.equal(again.weight.full_tensor(), plain["weight"])
        state = again_optimizer.state[again.weight]
        assert torch.equal(state["exp_avg"].full_tensor(), plain["exp_avg"]) and state["step"].item() == 1
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_shards_save_and_load_with_their_global_shapes(tmp_path):
    from safetensors.torch import save_file

    full = nn.Linear(4, 6)
    torch.save(full.state_dict(), tmp_path / "full.pt")
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(tmp_path / "full.safetensors"))
    plain = nn.Linear(4, 6)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1)
    plain(torch.randn(3, 4)).sum().backward()
    plain_optimizer.step()
    save_checkpoint(tmp_path / "plain", plain, plain_optimizer)
    torch.save({"weight": plain.weight.detach(), "exp_avg": plain_optimizer.state[plain.weight]["exp_avg"]},
               tmp_path / "plain_state.pt")

    values(run_ranks(_tensor_parallel_worker, 2, 2, str(tmp_path)))

    reader = nn.Linear(4, 6)
    reader_optimizer = torch.optim.AdamW(reader.parameters(), lr=0.5)
    load_checkpoint(tmp_path / "sharded", reader, reader_optimizer, restore_rng=False)
    expected = nn.Linear(4, 6)
    expected.load_state_dict(full.state_dict())
    expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=0.1)
    for p in expected.parameters():
        p.grad = torch.ones_like(p)
    expected_optimizer.step()
    assert_same_model(expected, reader)
    assert_same_optimizer(expected_optimizer, reader_optimizer)
