"""``import smpart.smp as smp``: SMP v1's PyTorch API, by scripts written from SMP's documentation
(`tests/smp_scripts`), against the unsplit model trained by hand on the same global batches."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import smpart
import smpart.smp as smp
from smpart.errors import ConfigError, SmpartError
from tests.smp_scripts import mnist

transformers = pytest.importorskip("transformers")
from tests.smp_scripts import gpt2_simple  # noqa: E402 - needs transformers


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """On threads, a script that asks for a process group starts torch.distributed over this one
    process (`smpart.smp.groups`); it goes with the test, not on to the next ones."""
    yield
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1:
        torch.distributed.destroy_process_group()


def mnist_reference(steps: int, batch: int, dp: int, lr: float = 0.5) -> tuple[list[float], dict]:
    """The unsplit Net on one process, on the global batch every step (``batch`` x ``dp``)."""
    torch.manual_seed(1)
    model = mnist.Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=lr)
    images, labels = mnist.dataset(0, batch * dp * steps)
    losses = []
    for step in range(steps):
        first = step * dp * batch
        optimizer.zero_grad()
        loss = F.nll_loss(model(images[first:first + dp * batch]), labels[first:first + dp * batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def gpt2_reference(steps: int, batch: int, dp: int,
                   accumulation: int = 1) -> tuple[list[float], list[float], dict]:
    transformers.set_seed(12345)
    model = transformers.GPT2LMHeadModel(gpt2_simple.model_config())
    groups = gpt2_simple.get_param_groups_by_weight_decay(model)
    optimizer = torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / math.sqrt(step + 1))
    train = gpt2_simple.sequences(0, batch * dp * steps * accumulation)
    validation = gpt2_simple.sequences(1, 8 * dp)
    losses, val_losses = [], []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulation):
            first = (step * accumulation + micro) * dp * batch
            ids = train[first:first + dp * batch]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % 3 == 0:
            with torch.no_grad():
                per_replica = []
                for r in range(dp):
                    shard = validation[r::dp]
                    means = [model(input_ids=shard[i:i + 4], labels=shard[i:i + 4]).loss
                             for i in range(0, 8, 4)]
                    per_replica.append(sum(means) / len(means))
                val_losses.append((sum(per_replica) / dp).item())
    return losses, val_losses, model.state_dict()


def by_value(state: dict | None) -> dict | None:
    """A state dict as numpy arrays: a rank's tensors travel to the test by reference (shared
    memory), which is gone once the rank exits, and the test may read them later."""
    return None if state is None else {k: v.detach().numpy() for k, v in state.items()}


def assert_state_close(got: dict, expected: dict, tol: float = 1e-4) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.allclose(torch.as_tensor(got[key]).float(), value.float(), atol=tol, rtol=tol), key


def test_the_mnist_script_on_threads_matches_the_unsplit_model():
    out = mnist.main(["--smp", json.dumps({"partitions": 2, "microbatches": 2, "pipeline": "simple"})])
    losses, state = mnist_reference(4, 8, 1)
    assert [r[0] for r in out["losses"]] == pytest.approx(losses, abs=1e-5)
    assert_state_close(out["state"], state)


def test_the_gpt2_script_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path):
    config = json.dumps({"partitions": 2, "microbatches": 2})
    whole = gpt2_simple.main(["--smp", config, "--gradient_accumulation", "2"])
    losses, val_losses, state = gpt2_reference(6, 4, 1, accumulation=2)
    assert [r[0] for r in whole["losses"]] == pytest.approx(losses, abs=1e-4)
    assert whole["val_losses"] == pytest.approx(val_losses, abs=1e-4)
    assert_state_close(whole["state"], state)
    smpart.shutdown()
    # 4 steps with a checkpoint at steps 2 and 4 (2 kept), then resume from the newest in a new "job"
    first = gpt2_simple.main(["--smp", config, "--gradient_accumulation", "2", "--max_steps", "4",
                              "--checkpoint_freq", "2", "--checkpoint-dir", str(tmp_path)])
    assert (tmp_path / "newest").read_text() == "total_steps4"
    smpart.shutdown()
    resumed = gpt2_simple.main(["--smp", json.dumps({"partitions": 1}), "--gradient_accumulation", "2",
                                "--checkpoint-dir", str(tmp_path), "--load_partial", "1"])
    flat = [r[0] for r in first["losses"] + resumed["losses"]]
    assert flat == pytest.approx([r[0] for r in whole["losses"]], abs=1e-4)
    assert_state_close(resumed["state"], state)


def test_init_reads_the_configuration_where_sagemaker_put_it(monkeypatch):
    config = {"partitions": 2, "microbatches": 4, "optimize": "speed", "pipeline": "simple", "ddp": True}
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps(config))
    cfg = smp.init()
    assert (cfg.pipeline_parallel_degree, cfg.partitions, smp.state.cfg.microbatches) == (2, 2, 4)
    running = smpart.runtime.runtime.current_runtime().config
    assert (running.schedule, running.memory_weight, running.microbatches) == ("gpipe", 0.2, 4)
    assert smp.is_initialized() and (smp.pp_size(), smp.mp_size(), smp.dp_size(), smp.rank()) == (2, 2, 1, 0)
    monkeypatch.delenv("SM_HP_MP_PARAMETERS")
    with pytest.raises(ConfigError, match="SM_HP_MP_PARAMETERS"):
        smp.init()


@pytest.mark.parametrize(("config", "match"), [
    ({"partitions": 2, "pipeline_parallel_degree": 4}, "same setting"),
    ({"partitions": 2, "no_such_key": 1}, "unknown SMP configuration"),
    ({"partitions": 2, "sharded_data_parallel_degree": 2}, "shard_optimizer_state"),
    ({"partitions": 2, "ddp_dist_backend": "smddp"}, "nccl"),
    ({"partitions": 2, "fp16": True, "bf16": True}, "fp16 and bf16"),
    ({"partitions": 2, "placement_strategy": "XYZ"}, "permutation"),
])
def test_bad_or_sagemaker_only_configuration_is_refused_with_the_replacement(config, match):
    with pytest.raises(ConfigError, match=match):
        smp.init(config)


def test_settings_and_arguments_without_effect_are_said_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp.init({"partitions": 2, "offload_activations": True, "placement_strategy": "PDT"})
        smp.DistributedModel(torch.nn.Linear(2, 2), trace_device="cpu", bucket_cap_mb=50)
        smp.DistributedModel(torch.nn.Linear(2, 2), trace_device="cpu")
    said = [str(w.message) for w in caught]
    assert sum("offload_activations" in s for s in said) == 1
    assert sum("trace_device" in s for s in said) == 1 and any("bucket_cap_mb" in s for s in said)
    assert any("'spread'" in s for s in said)
    with pytest.raises(SmpartError, match="unknown keyword"):
        smp.DistributedModel(torch.nn.Linear(2, 2), no_such_argument=1)


def test_names_that_need_sagemaker_are_refused_with_the_replacement():
    for name, match in (("tp_register", "register_attention_adapter"),
                        ("checkpoint", "set_activation_checkpointing")):
        with pytest.raises(SmpartError, match=match):
            getattr(smp, name)
    with pytest.raises(SmpartError, match="apex"):
        smp.optimizers.FusedLamb  # noqa: B018
    with pytest.raises(SmpartError, match="plain torch"):
        smp.nn.DistributedTransformerLayer  # noqa: B018
    smp.init({"partitions": 1})
    with pytest.raises(SmpartError, match="DistributedSampler"):
        smp.DistributedModel(torch.nn.Linear(2, 2)).join()


class Halves:
    """A custom batch SMP split with its ``smp_slice``."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> Halves:
        size = self.data.shape[axis] // num_mb
        return Halves(self.data.narrow(axis, mb * size, size))


def test_a_step_returns_step_outputs_inside_its_structures_and_splits_custom_objects():
    smp.init({"partitions": 2, "microbatches": 2})
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model = smp.DistributedModel(net)

    @smp.step(non_split_inputs=["weight"])
    def step(model, batch, weight):
        out = model(batch.data)
        return {"out": out, "scaled": [out * weight], "rows": out.shape[0], "tag": "x"}

    x = torch.randn(6, 4)
    got = step(model, Halves(x), torch.tensor([1.0, 2.0, 3.0]))
    assert isinstance(got["out"], smp.StepOutput) and len(got["out"].outputs) == 2
    assert torch.allclose(got["out"].concat(), model.module(x), atol=1e-6)
    weighted = model.module(x) * torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(got["scaled"][0].concat(), weighted, atol=1e-6)
    assert got["rows"] == [3, 3] and got["tag"] == ["x", "x"]


def test_manual_partitions_from_smp_partition_blocks_and_set_partition():
    smp.init({"partitions": 2, "auto_partition": False, "default_partition": 1})

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with smp.partition(0):
                self.a = torch.nn.Linear(4, 4)
                with smp.partition(1):
                    self.b = torch.nn.Linear(4, 4)
                self.c = torch.nn.Linear(4, 4)
            self.d = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.d(self.c(self.b(self.a(x))))

    model = smp.DistributedModel(Model())
    smp.set_partition(model.get_module().d, 0)

    @smp.step
    def forward(model, x):
        return model(x)

    forward(model, torch.randn(2, 4))
    assert model.partitioned
    assert [model.partition.stage_of(n) for n in "abcd"] == [0, 1, 0, 0]


def test_summed_micro_batches_and_a_post_partition_hook():
    smp.init({"partitions": 2, "microbatches": 2})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    reference.load_state_dict(net.state_dict())
    model = smp.DistributedModel(net, average_grads_across_microbatches=False)
    called = []
    model.register_post_partition_hook(lambda m, opt: called.append((m.partitioned, opt)))

    @smp.step
    def train(model, x):
        loss = model(x).sum()  # a sum over the batch: micro-batch gradients must add up
        model.backward(loss)
        return loss

    x = torch.randn(6, 4)
    train(model, x)
    reference(x).sum().backward()
    assert called == [(True, None)]
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got.grad, expected.grad, atol=1e-5)


def test_groups_and_object_collectives_of_one_process():
    smp.init({"partitions": 2})
    assert smp.get_mp_group() == [0] and smp.get_dp_group() == [0] and smp.local_size() == 1
    assert smp.allgather({"a": 1}, smp.DP_GROUP) == [{"a": 1}]
    smp.send("hello", 0, smp.RankType.WORLD_RANK)
    assert smp.recv_from(0, smp.WORLD_RANK) == "hello"
    smp.barrier(smp.MP_GROUP)
    loss = torch.tensor(2.0)  # a script's evaluation all-reduce runs unchanged on one process
    torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
    assert loss.item() == 2.0


def test_partial_and_full_saves_load_under_another_pipeline_split(tmp_path):
    smp.init({"partitions": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))

    @smp.step
    def train(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    train(model, torch.randn(4, 4))
    optimizer.step()
    smp.save({"model": model.local_state_dict(), "optimizer": optimizer.local_state_dict()},
             str(tmp_path / "ckpt.pt"), partial=True)
    smp.save(model.state_dict(), str(tmp_path / "full.pt"), partial=False)
    expected = model.state_dict()
    loaded = smp.load(str(tmp_path / "ckpt.pt"), partial=True)
    assert set(loaded["model"]) == set(expected)
    fresh = smp.DistributedModel(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]))
    fresh.load_state_dict(loaded["model"])
    assert_state_close(fresh.state_dict(), expected, 0)
    assert_state_close(smp.load(str(tmp_path / "full.pt"), partial=False), expected, 0)
    with pytest.raises(SmpartError, match="another layout"):
        fresh.load_state_dict({"0.weight": expected["0.weight"]})


def test_fp16_scales_the_loss_and_skips_a_step_that_overflowed():
    smp.init({"partitions": 2, "microbatches": 2, "fp16": True})
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    assert next(net.parameters()).dtype == torch.float16
    model = smp.DistributedModel(net)
    assert next(model.parameters()).dtype == torch.float32  # the master weights
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=None,
                                         dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0 ** 20})

    @smp.step
    def train(model, x):
        out = model(x)
        loss = out.float().square().mean()
        model.backward(loss)
        return loss, out

    before = [p.detach().clone() for p in model.parameters()]
    loss, out = train(model, torch.randn(4, 4) * 1e4)  # overflows float16 in the backward
    assert out.outputs[0].dtype == torch.float16
    optimizer.step()
    assert optimizer.overflow and optimizer.loss_scaler.get_scale() < 2.0 ** 20
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_is_tracing_is_true_only_while_the_model_is_traced():
    smp.init({"partitions": 2})
    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(smp.is_tracing())
            return super().forward(x)

    model = smp.DistributedModel(torch.nn.Sequential(Probe(2, 2), Probe(2, 2)))

    @smp.step
    def forward(model, x):
        return model(x)

    forward(model, torch.randn(2, 2))
    assert True in seen and seen[-1] is False and not smp.is_tracing()


def test_flash_attention_layer_is_softmax_attention_over_packed_qkv():
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3, 4, 8)
    layer = smp.nn.FlashAttentionLayer(attention_dropout_prob=0.0, attention_head_size=8)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(layer(qkv, causal=True), scores.softmax(-1) @ v, atol=1e-5)
