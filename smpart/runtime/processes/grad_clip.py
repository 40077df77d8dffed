"""Global gradient clipping: the norm of the whole model's gradient, however the model is split.

``torch.nn.utils.clip_grad_norm_`` sees the gradients of one process. Once a model is cut into
pipeline stages and tensor-parallel shards, each rank holds a piece of the gradient, and the
norm that clipping must use is that of the whole. The trick is that a p-norm is a sum in
disguise: ``‖g‖_p^p = Σ_ranks Σ_pieces ‖piece‖_p^p``, as long as every element is counted
exactly once. So each rank adds up ``‖·‖_p^p`` over what it *owns*, one all-reduce (a sum; a max
for the inf-norm) per process group adds the ranks up, and every rank scales its own gradients by
the same ``max_norm / total``.

Counting each element once is the whole difficulty:

- a **tensor-parallel shard** (a DTensor with a ``Shard`` placement) is owned by its rank: its
  local piece counts;
- a **replicated DTensor** (``Replicate`` on some mesh dimension) is the same on every rank of that
  dimension: only the rank at coordinate 0 counts it;
- a **plain tensor inside a tensor-parallel group** (a LayerNorm weight every tp rank holds whole)
  is replicated too, but carries no mesh to say so: ``replicated_over`` names the group whose
  ranks hold identical copies, and only its rank 0 counts them;
- a **tied or repeated parameter** (one tensor listed twice) is counted once per rank; smpart keeps
  tied parameters on one stage, so across stages nothing repeats;
- **data-parallel replicas** hold the same (averaged) gradients: leave their group out.

In one process, with no groups, this is exactly ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from smpart.errors import SmpartError


def clip_grad_norm_(parameters_or_model: Any, max_norm: float, norm_type: float = 2.0, *,
                    groups: Sequence[Any] | None = None, replicated_over: Any = None,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``parameters_or_model`` so their global ``norm_type``-norm is at most
    ``max_norm``; returns that norm (before clipping), the same on every rank.

    ``parameters_or_model``: a module, an ``smpart.DistributedModel``, parameters, or one tensor.
    ``groups``: the process groups across which ranks hold *different* parts of the gradient
    (pipeline, tensor-parallel), all-reduced in turn; none in one process. ``replicated_over``:
    the group whose ranks hold identical copies of every plain (non-DTensor) gradient (the
    tensor-parallel group), so they are counted on its rank 0 only. Every rank of ``groups`` must
    call it. ``norm_type``: any p > 0, or ``inf``.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise SmpartError(f"norm_type must be > 0 or inf, got {norm_type}")
    grads = _gradients(parameters_or_model)
    device = _device(grads, groups)
    local = _local_power_sum(grads, norm_type, replicated_over, device)
    for group in groups or ():
        dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM,
                        group=group)
    total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)  # float64 throughout
    if error_if_nonfinite and not torch.isfinite(total):
        raise SmpartError(f"the total norm of order {norm_type} of the gradients is {total.item()}; "
                          "clipping cannot fix it. Check for NaN or inf losses (or pass "
                          "error_if_nonfinite=False to scale by it anyway)")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local_grad = _local(g)
        local_grad.mul_(coefficient.to(local_grad.device, local_grad.dtype))
    return total.to(_local(grads[0]).dtype) if grads else total.float()


def model_parallel_groups(setup: Any) -> tuple[list[Any], Any]:
    """For `clip_grad_norm_` under a process runtime's ``setup`` (None on threads): the groups whose
    ranks hold different parts of a replica's gradient (pipeline, tensor-parallel; never the
    data-parallel replicas, whose averaged gradients are the same), and the group whose ranks hold
    identical copies of every plain gradient (tensor-parallel)."""
    if setup is None:
        return [], None
    return [g for g in (setup.pp_group, setup.tp_group) if g is not None], setup.tp_group


def _gradients(source: Any) -> list[torch.Tensor]:
    """The distinct gradients of ``source``'s parameters (a parameter listed twice counts once)."""
    if isinstance(source, torch.Tensor):
        params: Iterable[torch.Tensor] = [source]
    elif callable(getattr(source, "parameters", None)):
        params = source.parameters()
    else:
        params = source
    seen: set[int] = set()
    grads = []
    for p in params:
        if id(p) in seen or p.grad is None:
            continue
        seen.add(id(p))
        grads.append(p.grad)
    return grads


def _local_power_sum(grads: list[torch.Tensor], norm_type: float, replicated_over: Any,
                     device: torch.device) -> torch.Tensor:
    """Σ ‖piece‖_p^p (or the max of ‖piece‖_∞) over the gradient pieces this rank owns."""
    plain_owned = replicated_over is None or dist.get_rank(replicated_over) == 0
    norms = []
    for g in grads:
        if _is_dtensor(g):
            g = _without_partial(g)
            if not _owns(g):
                continue
            piece = g.to_local()
        elif plain_owned:
            piece = g
        else:
            continue
        norms.append(torch.linalg.vector_norm(piece, norm_type).to(device, torch.float64))
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    stacked = torch.stack(norms)
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def _owns(g: Any) -> bool:
    """Whether this rank counts its piece of DTensor ``g``: it is at coordinate 0 of every mesh
    dimension ``g`` is replicated over."""
    coordinate = g.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh
        return False
    return all(c == 0 for c, placement in zip(coordinate, g.placements, strict=True)
               if placement.is_replicate())


def _without_partial(g: Any) -> Any:
    """A gradient still holding partial sums is reduced first (a collective over its mesh)."""
    if not any(p.is_partial() for p in g.placements):
        return g
    from torch.distributed.tensor import Replicate

    return g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])


def _device(grads: list[torch.Tensor], groups: Sequence[Any] | None) -> torch.device:
    """Where the norm lives: with the gradients; on the GPU when a NCCL group must reduce it."""
    if groups and any(dist.get_backend(g) == "nccl" for g in groups):
        return torch.device("cuda", torch.cuda.current_device())
    return _local(grads[0]).device if grads else torch.device("cpu")


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if _is_dtensor(g) else g


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")
