"""Tensor parallelism: split a model's layers Megatron-style over a tensor-parallel group.

The steps, each its own file:

- `plan_tensor_parallel(model, degree, tree=None)` (`plan`, running the `planner`) decides, per
  Linear / Conv1D / Embedding, "column", "row", "vocab", "dim" or "none" (a `Decision`, in
  `decisions`), pairing each column split with its row partner so nothing is communicated between
  them; it knows attention classes through adapters (`attention`), reads a Hugging Face model's
  own plan (`published`), checks an MLP's forward with torch.fx (`elementwise`), honours
  `set_tensor_parallelism` and `tensor_parallelism` (`marks`), and warns about what stays whole.
- `apply_tensor_parallel(model, plan, group)` (`swap`) replaces those modules in place by
  `DistributedLinear` / `DistributedEmbedding` (`layers`) holding this rank's shards, and
  localises the attention heads.
- `record_split_shares(tree, model)` (`pricing`) writes what each degree's split divides onto a
  traced tree, so the planner prices what the swap-in will do.
- `full_state_dict(model)` / `dcp_state_dict(model)` (`layers`) give whole tensors, or tensors
  ``torch.distributed.checkpoint`` can store and reshard.

The collectives with autograd live in `collectives`; the random stream of each rank for what a
split region holds (Megatron's second generator), in `streams`.
"""

from smpart.tensor_parallel.attention import AttentionAdapter, AttentionLayout, register_attention_adapter
from smpart.tensor_parallel.collectives import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from smpart.tensor_parallel.decisions import Decision, TensorParallelPlan, TensorParallelWarning
from smpart.tensor_parallel.layers import (
    DistributedEmbedding,
    DistributedLinear,
    TensorParallelError,
    clip_grad_norm_,
    dcp_state_dict,
    distributed_modules,
    from_checkpoint_layout,
    full_state_dict,
    full_tensor,
    grad_norm,
    load_dcp_state_dict,
    local_state_dict,
    to_checkpoint_layout,
    tp_mesh,
)
from smpart.tensor_parallel.marks import set_tensor_parallelism, tensor_parallelism
from smpart.tensor_parallel.plan import plan_tensor_parallel
from smpart.tensor_parallel.pricing import SplitShare, record_split_shares, split_totals, splittable_fraction
from smpart.tensor_parallel.swap import SwapReport, apply_tensor_parallel

__all__ = [
    "AttentionAdapter",
    "AttentionLayout",
    "Decision",
    "DistributedEmbedding",
    "DistributedLinear",
    "SplitShare",
    "SwapReport",
    "TensorParallelError",
    "TensorParallelPlan",
    "TensorParallelWarning",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "copy_to_tp",
    "dcp_state_dict",
    "distributed_modules",
    "from_checkpoint_layout",
    "full_state_dict",
    "full_tensor",
    "gather_from_tp",
    "grad_norm",
    "load_dcp_state_dict",
    "local_state_dict",
    "plan_tensor_parallel",
    "record_split_shares",
    "reduce_from_tp",
    "register_attention_adapter",
    "scatter_to_tp",
    "set_tensor_parallelism",
    "split_totals",
    "splittable_fraction",
    "tensor_parallelism",
    "to_checkpoint_layout",
    "tp_mesh",
]
