"""pp x tp x dp on processes: every layout trains exactly like the unsplit model on the global batch.

For each layout (pipeline, tensor, data parallel degrees) and model (the zoo GPT, a Hugging Face
Llama with grouped KV heads, Hugging Face GPT-2 with its fused q/k/v ``Conv1D``), optimizer steps
in float64: each data-parallel replica steps on its slice of the global batch, and the full state
dict afterwards equals the unsplit model's trained on the whole batch with the mean loss.

SGD, not Adam: Llama's RMS norm computes in float32 even in a float64 model, so a gradient summed
in another order (across a stage boundary, over shards) differs in its last float32 bit, and
Adam's first step (about ``lr * sign(grad)``) turns a 1e-9 difference on a near-zero gradient into
one of ``lr``. Adam with tensor and data parallelism is covered on the zoo GPT in `test_processes`.
The layouts of one world size share a launch (``init`` -> ``shutdown`` -> ``init`` between them).
"""

from __future__ import annotations

import copy

import pytest
import torch

import smpart
from tests.launch import run_ranks, values
from tests.test_runtime import reference_step, train_step

TOL = 1e-6
MICROBATCHES = 2
PER_REPLICA = 4


class HuggingFaceExample:
    """A Hugging Face causal LM as built, fed token ids as its own labels (its loss is the output's)."""

    def __init__(self, name: str) -> None:
        import transformers

        torch.manual_seed(0)
        common = {"vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0}
        if name == "llama_gqa":
            config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                              num_key_value_heads=2, num_hidden_layers=2, **common)
            model = transformers.LlamaForCausalLM(config)
        else:
            config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=32, resid_pdrop=0.0,
                                             embd_pdrop=0.0, attn_pdrop=0.0, **common)
            model = transformers.GPT2LMHeadModel(config)
        self.model = model.to(torch.float64)

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


def _train(pp: int, tp: int, name: str, steps: int = 3) -> tuple[float, float, int]:
    example = _example(name)
    reference = copy.deepcopy(example.model)
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
        for case, loss_diff, state_diff, split in report:
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
