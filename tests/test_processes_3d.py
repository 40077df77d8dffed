"""pp x tp x dp on processes: every layout trains exactly like the unsplit model on the global batch.

For each layout (pipeline, tensor, data parallel degrees) and model (the zoo GPT, a Hugging Face
Llama with grouped KV heads, Hugging Face GPT-2 with its fused q/k/v ``Conv1D``), optimizer steps
in float64: each data-parallel replica steps on its slice of the global batch, and the full state
dict afterwards equals the unsplit model's trained on the whole batch with the mean loss, and
the global gradient norm each step clips by equals the unsplit model's.

SGD, not Adam: Llama's RMS norm computes in float32 even in a float64 model, so a gradient summed
in another order (across a stage boundary, over shards) differs in its last float32 bit, and
Adam's first step (about ``lr * sign(grad)``) turns a 1e-9 difference on a near-zero gradient into
one of ``lr``. Adam with tensor and data parallelism is covered on the zoo GPT in `test_processes`.
The layouts of one world size share a launch (``init`` -> ``shutdown`` -> ``init`` between them).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import smpart
from tests.launch import run_ranks, values
from tests.test_processes import error_of_a_step
from tests.test_runtime import cross_entropy_step, lm_step, reference_step, train_step
from tests.test_tensor_parallel import hf_causal_lm

TOL = 1e-6
CLIP = 0.5
MICROBATCHES = 2
PER_REPLICA = 4


class HuggingFaceExample:
    """A Hugging Face causal LM as built, fed token ids as its own labels (its loss is the output's)."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.model = hf_causal_lm(name)

    def batch(self, size: int, seed: int):
        ids = torch.randint(64, (size, 12), generator=torch.Generator().manual_seed(seed))
        return [], {"input_ids": ids, "labels": ids}, torch.zeros(size)

    @staticmethod
    def loss(output, target):
        return output.loss


def _example(name: str):
    if name == "zoo_gpt2":
        from examples.models import ZOO

        torch.manual_seed(0)
        return ZOO["gpt2"](dtype=torch.float64)
    return HuggingFaceExample(name)


def _train(pp: int, tp: int, name: str, steps: int = 3, differ: bool = False) -> tuple[float, float, int]:
    """``differ``: every rank but the first starts from other values, as when a script seeds each
    rank differently: smpart must start every copy from the first rank's (`replicas`)."""
    example = _example(name)
    reference = copy.deepcopy(example.model)
    if differ and int(os.environ["RANK"]) != 0:
        torch.manual_seed(int(os.environ["RANK"]))
        with torch.no_grad():
            for p in example.model.parameters():
                p.uniform_(-1, 1)
    smpart.init(pipeline_parallel_degree=pp, tensor_parallel_degree=tp, microbatches=MICROBATCHES,
                timeout_s=60)
    dp = smpart.dp_size()
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_diff = 0.0
    for step in range(steps):
        args, kwargs, target = example.batch(PER_REPLICA * dp, seed=step)
        mine = slice(smpart.dp_rank() * PER_REPLICA, (smpart.dp_rank() + 1) * PER_REPLICA)
        out = train_step(model, example, [a[mine] for a in args], {k: v[mine] for k, v in kwargs.items()},
                         target[mine])
        expected = reference_step(reference, example, args, kwargs, target, MICROBATCHES * dp)
        ours = expected[smpart.dp_rank() * MICROBATCHES:(smpart.dp_rank() + 1) * MICROBATCHES]
        loss_diff = max(loss_diff, (out.stack() - ours).abs().max().item())
        # global clipping: the norm over every stage, shard and replica (the same on every rank)
        norm = opt.clip_grad_norm_(CLIP).item()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP).item()
        loss_diff = max(loss_diff, abs(norm - expected_norm) / expected_norm)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    full = model.state_dict()
    state_diff = max((full[k] - v).abs().max().item() for k, v in reference.named_parameters())
    split = len(model.tensor_parallel_plan.styles()) if tp > 1 else 0
    smpart.shutdown()
    return loss_diff, state_diff, split


def _layouts(rank, cases):
    return [((pp, tp, name), *_train(pp, tp, name)) for pp, tp, name in cases]


MODELS = ("zoo_gpt2", "llama_gqa", "hf_gpt2")


def _check(results):
    for report in values(results):
        for case, loss_diff, state_diff, split in report:  # loss_diff: losses and clipping norms
            assert loss_diff <= TOL and state_diff <= TOL, (case, loss_diff, state_diff)
            assert split > 0 or case[1] == 1, f"{case}: the tensor-parallel plan split nothing"


@pytest.mark.timeout(300)
def test_two_processes_tp2_and_dp2():
    cases = [(1, tp, name) for tp in (2, 1) for name in MODELS]
    _check(run_ranks(_layouts, 2, cases, timeout_s=290))


@pytest.mark.timeout(400)
def test_four_processes_pp2_with_tp2_or_dp2():
    cases = [(2, tp, name) for tp in (2, 1) for name in MODELS]
    _check(run_ranks(_layouts, 4, cases, timeout_s=390))


@pytest.mark.timeout(400)
def test_eight_processes_pp2_tp2_dp2():
    _check(run_ranks(_layouts, 8, [(2, 2, name) for name in MODELS], timeout_s=390))


def _differently_built(rank, cases):
    return [((pp, tp, "differ"), *_train(pp, tp, "zoo_gpt2", steps=2, differ=True)) for pp, tp in cases]


@pytest.mark.timeout(300)
def test_every_rank_starts_from_the_first_ranks_values_when_ranks_build_different_ones():
    """Data-parallel replicas, tensor-parallel ranks' shards and replicated tensors, and the
    stages of a pipeline all take rank 0's values before the first step, as DDP does: training
    equals the unsplit model that rank 0 built."""
    _check(run_ranks(_differently_built, 2, [(2, 1)], timeout_s=100))
    _check(run_ranks(_differently_built, 4, [(2, 1), (1, 2), (2, 2)], timeout_s=190))


def _meta_replicas(rank):
    torch.manual_seed(rank)  # each rank its own seed: the replicas must still agree
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    model = smpart.DistributedModel(model)
    smpart.step(lambda model, x: model(x))(model, torch.ones(4, 8))
    replica, full = smpart.dp_rank(), {k: v.tolist() for k, v in model.state_dict().items()}
    smpart.shutdown()
    return replica, full


@pytest.mark.timeout(120)
def test_replicas_of_a_model_built_on_meta_initialise_alike():
    by_replica = dict(values(run_ranks(_meta_replicas, 4, timeout_s=110)))
    first, second = by_replica[0], by_replica[1]
    assert first == second
    assert first["0.weight"] != first["2.weight"]  # the layers still differ


def _dropout_training(rank, own_seed):
    """Two SGD steps of a Hugging Face GPT-2 with its default dropout on 2 tensor-parallel ranks,
    each rank seeded with ``own_seed(rank)`` after the model is built: the losses, and each
    rank's copy of the replicated layer norms afterwards."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=32, vocab_size=64)
    built = transformers.GPT2LMHeadModel(config).to(torch.float64)
    torch.manual_seed(own_seed(rank))
    smpart.init(tensor_parallel_degree=2, microbatches=2, timeout_s=60)
    model = smpart.DistributedModel(built)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(64, (4, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        losses.append(lm_step(model, ids).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    norms = {k: smpart.tensor_parallel.full_tensor(v).tolist()
             for k, v in model.local_state_dict().items() if ".ln_" in k}
    smpart.shutdown()
    return losses, norms


def _same_seed(rank):
    return 0


def _seed_per_rank(rank):
    return rank


@pytest.mark.timeout(120)
def test_tensor_parallel_ranks_draw_the_same_dropout_masks_whatever_each_ranks_seed():
    """A dropout after a row-parallel layer masks an activation both ranks hold whole: with masks
    that differed, the ranks' copies would differ, and so would the layer norms they train."""
    (losses, norms), other = values(run_ranks(_dropout_training, 2, _seed_per_rank, timeout_s=110))
    assert norms == other[1], "the tensor-parallel ranks' replicated layer norms differ"
    same_seed_losses = values(run_ranks(_dropout_training, 2, _same_seed, timeout_s=110))[0][0]
    assert losses == same_seed_losses  # rank 0's random state rules, whatever rank 1's seed


def _dropout_masks(rank, pp):
    """Two SGD steps of a Hugging Face GPT-2 (its own attention, dropout 0.5 everywhere) split over 2
    tensor-parallel ranks: the masks of the first step's first attention-probability dropout
    (inside the split region: this rank's heads), of its residual dropout and its MLP's dropout
    (on activations every rank holds whole), and the replicated layer norms after the steps."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=32, vocab_size=64,
                                     attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.5,
                                     reorder_and_upcast_attn=True)  # its attention calls attn_dropout
    config._attn_implementation = "eager"
    built = transformers.GPT2LMHeadModel(config)  # float32: that attention computes in it
    smpart.init(pipeline_parallel_degree=pp, tensor_parallel_degree=2, microbatches=2, timeout_s=60,
                pin={"lm_head": pp - 1, "transformer.h.1": pp - 1, "transformer.ln_f": pp - 1})
    masks: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, output):
            if not output.is_meta:  # the trace's calls are on meta
                # 1: dropped, 0: kept, -1: zero already (the causal mask's), no verdict
                masks.setdefault(name, torch.where(args[0] == 0, -1, (output == 0).to(torch.int8)))
        return hook

    block = built.transformer.h[pp - 1]  # on this rank's stage in both layouts
    block.attn.attn_dropout.register_forward_hook(keep("heads"))
    block.attn.resid_dropout.register_forward_hook(keep("attention output"))
    block.mlp.dropout.register_forward_hook(keep("mlp output"))
    model = smpart.DistributedModel(built)
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(64, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        lm_step(model, ids)
        opt.step()
        opt.zero_grad()
    norms = {k: smpart.tensor_parallel.full_tensor(v).tolist()
             for k, v in model.local_state_dict().items() if ".ln_" in k}
    at = (smpart.pp_rank(), smpart.tp_rank())
    smpart.shutdown()
    return at, {k: v.numpy() for k, v in masks.items()}, norms


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pp", [1, 2])
def test_dropout_inside_a_split_region_draws_per_rank_and_outside_it_alike(pp):
    """Megatron's two streams: the attention probabilities of the heads each rank holds are masked
    independently, as the unsplit model masks each head (one shared stream would mask rank 1's
    heads exactly as rank 0's), while the activations every rank holds whole are masked alike,
    so the replicated layer norms stay equal. With pp 2 the block runs on the second stage."""
    found = {at: (masks, norms) for at, masks, norms in values(run_ranks(_dropout_masks, 2 * pp, pp,
                                                                       timeout_s=170))}
    (first, first_norms), (second, second_norms) = found[(pp - 1, 0)], found[(pp - 1, 1)]
    def dropped(mask):
        return (mask == 1).sum() / (mask >= 0).sum()

    heads = first["heads"], second["heads"]
    assert heads[0].shape == heads[1].shape and heads[0].shape[1] == 2  # 4 heads, 2 on each rank
    assert 0.35 < dropped(heads[0]) < 0.65 and 0.35 < dropped(heads[1]) < 0.65  # p = 0.5
    for local in range(2):  # global head `local` on rank 0, `2 + local` on rank 1
        a, b = heads[0][:, local], heads[1][:, local]
        agree = (a == b)[a >= 0].mean()
        assert agree < 0.75, f"head {local} and head {2 + local} drew the same mask ({agree:.0%} alike)"
    for whole in ("attention output", "mlp output"):
        assert (first[whole] == second[whole]).all(), f"the {whole} dropout masked the ranks' copies apart"
        assert 0.35 < dropped(first[whole]) < 0.65
    assert first_norms == second_norms, "the tensor-parallel ranks' replicated layer norms differ"


def _shards_after_the_model_is_gone(rank):
    """A tensor-parallel run of the zoo GPT, then the script lets go of its model and optimizer:
    whether the shards tensor parallelism made (and the module) are still alive after a
    garbage collection, that is, whether smpart kept any of them."""
    import gc
    import weakref

    from examples.models import ZOO

    torch.manual_seed(0)
    smpart.init(tensor_parallel_degree=2, microbatches=2, timeout_s=60)
    example = ZOO["gpt2"](dtype=torch.float64)
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    train_step(model, example, *example.batch(4))
    opt.step()
    shards = [weakref.ref(p) for p in model.parameters() if smpart.tensor_parallel.layers.is_dtensor(p)]
    module = weakref.ref(model.module)
    smpart.shutdown()
    del model, opt, example
    gc.collect()
    return len(shards), sum(ref() is not None for ref in shards), module() is not None


@pytest.mark.timeout(120)
def test_a_model_let_go_after_a_tensor_parallel_run_is_freed():
    for split, alive, module_alive in values(run_ranks(_shards_after_the_model_is_gone, 2, timeout_s=110)):
        assert split > 0
        assert (alive, module_alive) == (0, False), f"{alive} of {split} shards outlived their model"


def _twins_alive_at_once(rank):
    """A model built on meta and split over 2 tensor-parallel ranks: each split layer is initialised
    from an unsplit twin of it (`placement._initialise`); the most twins alive at once."""
    import weakref

    from smpart.tensor_parallel.layers import _OnMesh

    twins: list[weakref.ref] = []
    most = [0]
    real_twin = _OnMesh.plain_twin

    def counting_twin(self, device):
        twin = real_twin(self, device)
        twins.append(weakref.ref(twin))
        most[0] = max(most[0], sum(ref() is not None for ref in twins))
        return twin

    _OnMesh.plain_twin = counting_twin
    smpart.init(tensor_parallel_degree=2, microbatches=2, timeout_s=60)
    with torch.device("meta"):
        built = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                                          torch.nn.Linear(32, 8)) for _ in range(3)])
    model = smpart.DistributedModel(built)
    cross_entropy_step(model, torch.randn(4, 8), torch.randint(8, (4,)))
    smpart.shutdown()
    return len(twins), most[0]


@pytest.mark.timeout(120)
def test_a_model_built_on_meta_and_split_holds_one_unsplit_layer_at_a_time():
    """Each split layer's first values come from an unsplit twin: the peak of a rank is what it
    holds plus one whole layer, not two (the last twin lived on while the next was made)."""
    for made, most in values(run_ranks(_twins_alive_at_once, 2, timeout_s=110)):
        assert made == 6 and most == 1, (made, most)


def _own_tensor_parallel_layers(rank):
    """A model whose author put ``smpart.nn.DistributedLinear`` layers in it (SMP's manual tensor
    parallelism), beside a plain layer, on 2 stages x 2 tensor-parallel ranks."""
    import torch.nn.functional as F
    from torch import nn

    smpart.init(pipeline_parallel_degree=2, tensor_parallel_degree=2, microbatches=2, timeout_s=60,
                pin={"0": 0, "1": 0, "2": 0, "3": 1})
    mesh = smpart.device_mesh()["tp"]

    def build(distributed: bool) -> nn.Module:
        torch.manual_seed(0)  # a DistributedLinear draws as nn.Linear would, then keeps its shard

        def linear(i, o, style):
            if distributed:
                return smpart.nn.DistributedLinear(i, o, style=style, group=mesh, dtype=torch.float64)
            return nn.Linear(i, o, dtype=torch.float64)

        return nn.Sequential(linear(8, 16, "column"), nn.GELU(), linear(16, 8, "row"),
                             nn.Linear(8, 4, dtype=torch.float64))

    reference, model = build(False), smpart.DistributedModel(build(True))
    opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    loss_diff = 0.0
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randint(4, (4,), generator=g)
        loss = cross_entropy_step(model, x, y).reduce_mean().item()
        pieces = zip(x.chunk(2), y.chunk(2), strict=True)
        expected = sum(F.cross_entropy(reference(a), b) for a, b in pieces) / 2
        expected.backward()
        loss_diff = max(loss_diff, abs(loss - expected.item()))
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    full = model.state_dict()
    state_diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    smpart.shutdown()
    return loss_diff, state_diff


@pytest.mark.timeout(120)
def test_a_model_with_its_authors_own_tensor_parallel_layers_trains_like_the_unsplit_model():
    for loss_diff, state_diff in values(run_ranks(_own_tensor_parallel_layers, 4, timeout_s=110)):
        assert loss_diff <= TOL and state_diff <= TOL, (loss_diff, state_diff)


def _gpt2_config(dropout: bool = True):
    import transformers

    off = {} if dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return transformers.GPT2Config(n_embd=32, n_layer=4, n_head=2, vocab_size=64, n_positions=32, **off)


def _meta_built_and_split(rank, checkpoint, pretrained):
    """A Hugging Face GPT-2 on 2 stages x 2 tensor-parallel ranks: built on meta from scratch (its
    split layers initialised by its own scheme, each rank keeping its shard), then filled by a
    checkpoint of a plain model, by that model's own weights (``save_pretrained``) before the
    first step, and, built for real, by those weights once placed; the losses, in eval mode, and
    the split weights' spread from scratch."""
    import warnings

    import transformers

    ids = torch.randint(64, (4, 12), generator=torch.Generator().manual_seed(0))
    smpart.init(pipeline_parallel_degree=2, tensor_parallel_degree=2, microbatches=2, timeout_s=60)

    @smpart.step
    def loss_of(model, ids):
        return model(input_ids=ids, labels=ids).loss

    losses, spread = [], None
    for how in ("scratch", "checkpoint", "weights before placement", "weights once placed"):
        torch.manual_seed(rank + 10)  # a real build differs from the saved model
        with torch.device("cpu" if how == "weights once placed" else "meta"):
            model = smpart.DistributedModel(transformers.GPT2LMHeadModel(_gpt2_config()).eval())
        if how == "checkpoint":
            smpart.load_checkpoint(checkpoint, model)
        elif how == "weights before placement":
            smpart.load_weights(model, pretrained)
        elif how == "weights once placed":
            loss_of(model, ids)
            smpart.load_weights(model, pretrained)  # a fused q/k/v shard is not one slice
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses.append(loss_of(model, ids).reduce_mean().item())
        assert not [w for w in caught if "uninitialised" in str(w.message)], [str(w.message) for w in caught]
        if how == "scratch":
            full = model.state_dict()  # gathers the shards
            spread = torch.cat([v.flatten() for k, v in full.items() if k.endswith("mlp.c_fc.weight")]).std()
    smpart.shutdown()
    return losses, spread.item()


@pytest.mark.timeout(120)
def test_a_hugging_face_model_built_on_meta_is_split_initialised_and_loaded(tmp_path):
    """Built on meta, a tensor-parallel layer used to stay a plain tensor on its rank (its forward
    failed) with no way to be initialised, and weights loaded with load_weights before the first
    step went nowhere; a fused q/k/v shard read them as one slice. Now each rank makes its
    shards, initialised as the unsplit layers would be by the model's own scheme, or filled."""
    import math

    import transformers

    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(_gpt2_config()).eval()
    smpart.save_checkpoint(tmp_path / "plain", plain)
    plain.save_pretrained(tmp_path / "pretrained")
    ids = torch.randint(64, (4, 12), generator=torch.Generator().manual_seed(0))
    expected = plain(input_ids=ids, labels=ids).loss.item()
    for (scratch, *loaded), spread in values(run_ranks(_meta_built_and_split, 4, tmp_path / "plain",
                                                       tmp_path / "pretrained", timeout_s=110)):
        assert abs(scratch - math.log(64)) < 0.1, scratch  # small random weights: a uniform guess
        assert 0.015 < spread < 0.025, spread  # GPT-2's initializer_range, 0.02, in the split layers
        assert all(abs(loss - expected) < 1e-5 for loss in loaded), (loaded, expected)


def _reads_its_own_keys(rank, pretrained, checkpoint):
    """A Hugging Face GPT-2 on 2 stages (uneven: 1 block and 3) x 2 tensor-parallel ranks, built for
    real and differently on every rank, then `load_weights` from the model's own safetensors and
    from an smpart (DCP) checkpoint before the first step: per source, the bytes this rank read
    from it, the bytes it received of rank 0's values before placement, the bytes of the tensors
    it holds, and the loss in eval mode."""
    import transformers

    import smpart.checkpoint.stores as ckpt
    import smpart.runtime.processes.replicas as replicas

    read, received = [0], [0]
    real_read, real_broadcast = ckpt._SafetensorsStore.read, replicas._broadcast

    def counting_read(self, key, index):
        tensor = real_read(self, key, index)
        read[0] += tensor.numel() * tensor.element_size()
        return tensor

    def counting_broadcast(bucket, group, src, timeout_s):
        flat = real_broadcast(bucket, group, src, timeout_s)
        received[0] += flat.numel() * flat.element_size()
        return flat

    ckpt._SafetensorsStore.read, replicas._broadcast = counting_read, counting_broadcast
    ids = torch.randint(64, (4, 12), generator=torch.Generator().manual_seed(0))
    smpart.init(pipeline_parallel_degree=2, tensor_parallel_degree=2, microbatches=2, timeout_s=30,
                pin={"transformer.h.0": 0, "transformer.h.1": 1, "transformer.h.2": 1, "transformer.h.3": 1})

    @smpart.step
    def loss_of(model, ids):
        return model(input_ids=ids, labels=ids).loss

    found = []
    for source in (pretrained, checkpoint):
        read[0] = received[0] = 0
        torch.manual_seed(rank + 10)  # every rank builds other values, none the saved ones
        model = smpart.DistributedModel(transformers.GPT2LMHeadModel(_gpt2_config()).eval())
        smpart.load_weights(model, source)
        loss = loss_of(model, ids).reduce_mean().item()
        held = {id(t): t for t in model.module.state_dict(keep_vars=True).values() if not t.is_meta}
        local = [t.to_local() if smpart.tensor_parallel.layers.is_dtensor(t) else t for t in held.values()]
        found.append((read[0], received[0], sum(t.numel() * t.element_size() for t in local), loss))
    smpart.shutdown()
    return found


@pytest.mark.timeout(150)
def test_load_weights_under_torchrun_reads_each_ranks_own_keys_only(tmp_path):
    """Each rank reads the bytes of what it holds (a fused q/k/v shard: its slice of each of q, k
    and v), receives none of rank 0's values for them first, and a DCP source is read by each rank
    alone (per key and together, it paired one rank's key with another's and hung on uneven stages)."""
    import transformers

    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(_gpt2_config()).eval()
    plain.save_pretrained(tmp_path / "pretrained")
    smpart.save_checkpoint(tmp_path / "plain", plain)
    ids = torch.randint(64, (4, 12), generator=torch.Generator().manual_seed(0))
    expected = plain(input_ids=ids, labels=ids).loss.item()
    model_bytes = sum(t.numel() * t.element_size() for t in plain.state_dict().values())
    for (safetensors, dcp) in values(run_ranks(_reads_its_own_keys, 4, tmp_path / "pretrained",
                                                tmp_path / "plain", timeout_s=140)):
        read, received, held, loss = safetensors
        assert abs(loss - expected) < 1e-5 and abs(dcp[3] - expected) < 1e-5, (loss, dcp[3], expected)
        assert read <= held < model_bytes / 2, (read, held, model_bytes)  # its own part, tied weight once
        assert received < model_bytes / 50 and dcp[1] < model_bytes / 50, (received, dcp[1], model_bytes)


class CountingLinear(torch.nn.Linear):
    """Counts its initialisations (``reset_parameters``)."""

    resets = 0

    def reset_parameters(self):
        CountingLinear.resets += 1
        super().reset_parameters()


def _two_counting_layers() -> torch.nn.Module:
    return torch.nn.Sequential(CountingLinear(8, 8), torch.nn.Tanh(), CountingLinear(8, 4))


def _loaded_at_placement(rank, weights):
    """A model built on meta on 2 stages, its weights loaded at placement: how many of its layers
    were initialised first, and the first step's loss."""
    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    with torch.device("meta"):
        model = smpart.DistributedModel(_two_counting_layers())
    CountingLinear.resets = 0  # built on meta, each layer already ran it once
    smpart.load_weights(model, weights)
    x, y = torch.ones(4, 8), torch.arange(4)
    loss = cross_entropy_step(model, x, y).reduce_mean().item()
    smpart.shutdown()
    return CountingLinear.resets, loss


@pytest.mark.timeout(120)
def test_weights_loaded_at_placement_are_not_initialised_first(tmp_path):
    """Each rank initialised its layers (a 1 B-parameter model: seconds of random draws per rank),
    then the load overwrote them: it initialises only what no load will write."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    plain = _two_counting_layers()
    save_file(plain.state_dict(), str(tmp_path / "model.safetensors"))
    x, y = torch.ones(4, 8), torch.arange(4)
    expected = sum(torch.nn.functional.cross_entropy(plain(a), b).item()
                   for a, b in zip(x.chunk(2), y.chunk(2), strict=True)) / 2
    for resets, loss in values(run_ranks(_loaded_at_placement, 2, tmp_path / "model.safetensors",
                                         timeout_s=110)):
        assert resets == 0
        assert loss == pytest.approx(expected, abs=1e-6)


def _a_whole_script(rank, pretrained, checkpoint):
    """A user's script under torchrun, end to end, on 2 stages x 2 replicas: a Hugging Face model
    built on meta (each rank seeded its own way) filled with pretrained weights, AdamW with a
    warm-up schedule, global clipping, an evaluation, a checkpoint."""
    import transformers

    smpart.init(pipeline_parallel_degree=2, microbatches=2, timeout_s=60)
    torch.manual_seed(100 + rank)
    with torch.device("meta"):
        model = smpart.DistributedModel(transformers.GPT2LMHeadModel(_gpt2_config(dropout=False)))
    smpart.load_weights(model, pretrained)
    opt = smpart.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))

    @smpart.step
    def evaluate(model, ids):
        return model(input_ids=ids, labels=ids).loss

    g = torch.Generator().manual_seed(smpart.dp_rank())
    losses = []
    for _ in range(4):
        losses.append(lm_step(model, torch.randint(64, (4, 12), generator=g)).reduce_mean().item())
        opt.clip_grad_norm_(1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        evaluated = evaluate(model, torch.arange(24).view(2, 12) % 64).reduce_mean().item()
    smpart.save_checkpoint(checkpoint, model, opt)
    replica = smpart.dp_rank()
    smpart.shutdown()
    return replica, losses, evaluated


@pytest.mark.timeout(120)
def test_a_whole_training_script_under_torchrun_matches_the_plain_model_step_for_step(tmp_path):
    import transformers

    from smpart.checkpoint import load_checkpoint

    torch.manual_seed(7)
    pretrained = transformers.GPT2LMHeadModel(_gpt2_config(dropout=False))
    pretrained.save_pretrained(tmp_path / "pretrained")
    results = values(run_ranks(_a_whole_script, 4, tmp_path / "pretrained", tmp_path / "ckpt", timeout_s=110))
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    generators = [torch.Generator().manual_seed(r) for r in range(2)]
    expected: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(4):
        batches = [torch.randint(64, (4, 12), generator=g) for g in generators]
        halves = [[reference(input_ids=c, labels=c).loss for c in b.chunk(2)] for b in batches]
        for replica, pair in enumerate(halves):
            expected[replica].append(sum(loss.item() for loss in pair) / 2)
        (sum(loss for pair in halves for loss in pair) / 4).backward()  # the replicas' average
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
    reference.eval()
    with torch.no_grad():
        ids = torch.arange(24).view(2, 12) % 64
        evaluated = reference(input_ids=ids, labels=ids).loss.item()
    for replica, losses, their_evaluation in results:
        assert max(abs(a - b) for a, b in zip(losses, expected[replica], strict=True)) < 1e-5, replica
        assert abs(their_evaluation - evaluated) < 1e-5
    saved = transformers.GPT2LMHeadModel(_gpt2_config(dropout=False))
    load_checkpoint(tmp_path / "ckpt", saved)
    assert max((a - b).abs().max().item() for a, b in
               zip(saved.state_dict().values(), reference.state_dict().values(), strict=True)) < 1e-5


def _sharded_optimizer_state(rank, pp, tp):
    """ZeRO-1: each replica keeps Adam state for its share of its stage's parameters only, and
    training still equals the unsplit model's on the global batch."""
    example = _example("zoo_gpt2")
    reference = copy.deepcopy(example.model)
    smpart.init(pipeline_parallel_degree=pp, tensor_parallel_degree=tp, microbatches=MICROBATCHES,
                shard_optimizer_state=True, timeout_s=60)
    dp = smpart.dp_size()
    model = smpart.DistributedModel(example.model)
    opt = smpart.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    norms = []
    for step in range(3):
        args, kwargs, target = example.batch(PER_REPLICA * dp, seed=step)
        mine = slice(smpart.dp_rank() * PER_REPLICA, (smpart.dp_rank() + 1) * PER_REPLICA)
        train_step(model, example, [a[mine] for a in args], {}, target[mine])
        reference_step(reference, example, args, kwargs, target, MICROBATCHES * dp)
        norms.append(abs(opt.clip_grad_norm_(1.0).item()
                         - torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()))
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    held = [p for p in model.module.parameters() if p.device.type != "meta"]
    with_state = sum(1 for p in held if p in opt.state)
    full = model.state_dict()
    worst = max((full[k] - v).abs().max().item() for k, v in reference.named_parameters())
    stage = smpart.pp_rank()
    smpart.shutdown()
    return worst, max(norms), with_state, len(held), stage


@pytest.mark.timeout(200)
def test_sharded_optimizer_state_trains_like_the_unsplit_model():
    results = values(run_ranks(_sharded_optimizer_state, 4, 2, 1, timeout_s=190))
    by_stage: dict[int, list] = {}
    for worst, norm_diff, with_state, held, stage in results:
        assert worst <= TOL and norm_diff <= 1e-9, (worst, norm_diff)
        assert 0 < with_state < held, (with_state, held)
        by_stage.setdefault(stage, []).append((with_state, held))
    # the two replicas of a stage split its parameters' state between them, each parameter once
    for stage, shares in by_stage.items():
        assert len(shares) == 2 and sum(s for s, _ in shares) == shares[0][1], (stage, shares)


def _plans_best_config(rank):
    """What the planner proposes for 4 devices runs as proposed: ``smpart.init(plan.config)``.
    Every rank plans (the same inputs give the same plans); the best plan and the best with tensor
    parallelism each train like the unsplit model on the global batch, and each rank holds the
    parameters the planner said it would."""
    from smpart.planner import Cluster, DeviceType, Node

    example = _example("zoo_gpt2")
    args, kwargs, target = example.batch(8, seed=0)
    tree = smpart.trace(example.model, tuple(args), kwargs)
    cpu = DeviceType("cpu", 0.05, 4 * 2**30)
    plans = smpart.plan(tree, Cluster([Node(cpu, 4, 10 * 2**30)]), global_batch=8, top=50)
    chosen = [plans.best, next(p for p in plans if p.tp > 1)]
    report = []
    for plan in chosen:
        config = plan.config
        smpart.init(config, timeout_s=60)
        dp, microbatches = smpart.dp_size(), config.microbatches
        example = _example("zoo_gpt2")
        reference = copy.deepcopy(example.model)
        model = smpart.DistributedModel(example.model)
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        per = 8 // dp
        for step in range(2):
            args, kwargs, target = example.batch(8, seed=step)
            mine = slice(smpart.dp_rank() * per, (smpart.dp_rank() + 1) * per)
            train_step(model, example, [a[mine] for a in args], {}, target[mine])
            reference_step(reference, example, args, kwargs, target, microbatches * dp)
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.zero_grad()
        full = model.state_dict()
        worst = max((full[k] - v).abs().max().item() for k, v in reference.named_parameters())
        predicted = plan.parameters_per_rank()[smpart.pp_rank()]
        held = _held_parameters(model)
        report.append(((plan.pp, plan.tp, plan.dp, microbatches), worst, (held, predicted)))
        smpart.shutdown()
    return report


def _held_parameters(model) -> int:
    """Parameter elements this rank holds: its stage's, and of split ones its shard."""
    from torch.distributed.tensor import DTensor

    held = [p.to_local() if isinstance(p, DTensor) else p for p in model.module.parameters()]
    return sum(p.numel() for p in held if p.device.type != "meta")


@pytest.mark.timeout(300)
def test_the_planners_best_plan_runs_on_four_processes():
    for report in values(run_ranks(_plans_best_config, 4, timeout_s=290)):
        for degrees, worst, (held, predicted) in report:
            assert worst <= TOL, (degrees, worst)
            # the planner priced the memory this rank really holds (the swap-in's own split)
            assert held == pytest.approx(predicted, rel=1e-9), (degrees, held, predicted)
        assert report[1][0][1] > 1, report


def _wrong_world_size(rank):
    from smpart.config import Config

    try:
        smpart.init(Config(pipeline_parallel_degree=2, tensor_parallel_degree=2, data_parallel_degree=2,
                           microbatches=2))
    except smpart.SmpartError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(90)
def test_a_plans_config_on_the_wrong_number_of_processes_says_how_many_it_needs():
    for text in values(run_ranks(_wrong_world_size, 2, timeout_s=80)):
        assert "8 processes" in text and "nproc-per-node 8" in text, text


def _too_many_shards(rank):
    smpart.init(pipeline_parallel_degree=1, tensor_parallel_degree=2, microbatches=1, timeout_s=30)
    model = smpart.DistributedModel(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1)))
    return error_of_a_step(model, torch.ones(2, 3))


@pytest.mark.timeout(90)
def test_a_tensor_parallel_degree_that_splits_nothing_is_refused():
    for text in values(run_ranks(_too_many_shards, 2, timeout_s=80)):
        assert "tensor-parallel degree 2 splits none of Sequential's modules" in text, text
