"""SMP's GPT-2 example (``train_gpt_simple.py``) in miniature, written against SMP v1's API with
``import smpart.smp as smp``: SMP's configuration dictionary, ``smp.model_creation``, a Hugging Face
``GPT2LMHeadModel``, ``smp.DistributedModel(model, trace_device=..., backward_passes_per_step=...)``,
parameter groups by weight decay, ``smp.DistributedOptimizer``, gradient accumulation, evaluation
whose loss is all-reduced over ``smp.get_dp_process_group()``, and ``smp.save_checkpoint`` /
``smp.resume_from_checkpoint`` with the learning-rate scheduler and the step in ``user_content``.

The data are token sequences made from a seed, sharded by ``smp.dp_rank()`` (or ``rdp_rank()`` with
``prescaled_batch``), as the example's loader did. ``main(argv)`` returns, on every rank, the loss
of each step (every data-parallel rank's), the validation losses and the final full state dict.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import transformers

import smpart.smp as smp

VOCAB, SEQ = 64, 16


def model_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def sequences(seed: int, count: int) -> torch.Tensor:
    """Sequences that count up from a random start (something to learn)."""
    start = torch.randint(VOCAB, (count, 1), generator=torch.Generator().manual_seed(seed))
    return (start + torch.arange(SEQ)) % VOCAB


def get_param_groups_by_weight_decay(module: torch.nn.Module) -> tuple[dict, dict]:
    decay, no_decay = {"params": []}, {"params": [], "weight_decay": 0.0}
    seen = set()
    for module_ in module.modules():
        for name, p in module_._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module_, torch.nn.LayerNorm) or name == "bias":
                no_decay["params"].append(p)
            else:
                decay["params"].append(p)
    return decay, no_decay


@smp.step
def train_step(model, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


@smp.step
def test_step(model, input_ids, attention_mask):
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]


def eval_model(model, data: torch.Tensor, batch_size: int) -> float:
    model.eval()
    loss, batches = torch.zeros(()), 0
    with torch.no_grad():
        for first in range(0, len(data), batch_size):
            ids = data[first:first + batch_size]
            loss += test_step(model, ids, torch.ones_like(ids)).reduce_mean()
            batches += 1
    torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
    model.train()
    return (loss / smp.dp_size() / batches).item()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smp", default=None,
                        help="SMP's configuration (JSON); default: SM_HP_MP_PARAMETERS")
    parser.add_argument("--train_batch_size", type=int, default=4, help="per dp rank")
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--gradient_accumulation", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--validation_freq", type=int, default=3)
    parser.add_argument("--checkpoint_freq", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--load_partial", type=int, default=0)
    args = parser.parse_args(argv)

    smp.init(json.loads(args.smp) if args.smp else None)
    prescaled = smp.state.cfg.prescaled_batch
    dp_rank = smp.rdp_rank() if prescaled else smp.dp_rank()
    dp_size = smp.rdp_size() if prescaled else smp.dp_size()

    transformers.set_seed(12345)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.get_default_dtype()):
        model = transformers.GPT2LMHeadModel(model_config())
    model = smp.DistributedModel(model, trace_device="gpu",
                                 backward_passes_per_step=args.gradient_accumulation)
    optimizer = torch.optim.AdamW(get_param_groups_by_weight_decay(model.get_module()), lr=args.lr,
                                  weight_decay=0.01)
    optimizer = smp.DistributedOptimizer(optimizer)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / math.sqrt(step + 1))

    total_steps = 0
    if args.load_partial:
        user_content = smp.resume_from_checkpoint(args.checkpoint_dir, partial=True)
        total_steps = user_content["total_steps"]
        lr_scheduler.load_state_dict(user_content["lr_scheduler"])
        assert isinstance(user_content["model_config"], transformers.GPT2Config)

    train = sequences(0, args.train_batch_size * dp_size * args.max_steps * args.gradient_accumulation)
    validation = sequences(1, 8 * dp_size)[dp_rank::dp_size]
    losses, val_losses = [], []
    model.train()
    batch_idx = total_steps * args.gradient_accumulation
    while total_steps < args.max_steps:
        first = (batch_idx * dp_size + dp_rank) * args.train_batch_size
        input_ids = train[first:first + args.train_batch_size]
        if batch_idx % args.gradient_accumulation == 0:
            optimizer.zero_grad(set_to_none=True)
        loss_mb = train_step(model, input_ids, torch.ones_like(input_ids), args)
        loss = loss_mb.reduce_mean()
        batch_idx += 1
        if batch_idx % args.gradient_accumulation:
            continue
        optimizer.step()
        lr_scheduler.step()
        total_steps += 1
        losses.append(smp.allgather(loss.item(), smp.DP_GROUP))
        if args.validation_freq and total_steps % args.validation_freq == 0:
            val_losses.append(eval_model(model, validation, 4))
        if args.checkpoint_freq and total_steps % args.checkpoint_freq == 0:
            user_content = {"total_steps": total_steps, "model_config": model_config(),
                            "lr_scheduler": lr_scheduler.state_dict()}
            smp.save_checkpoint(args.checkpoint_dir, tag=f"total_steps{total_steps}", partial=True,
                                model=model, optimizer=optimizer, user_content=user_content,
                                num_kept_partial_checkpoints=2)
    state = model.state_dict()
    smp.barrier()
    return {"losses": losses, "val_losses": val_losses, "state": state}


if __name__ == "__main__":
    out = main()
    if smp.rank() == 0:
        print(json.dumps({"losses": out["losses"], "val_losses": out["val_losses"]}))
