"""Gradient-norm clipping over the whole model, whichever way its gradients are held.

The norm that clipping needs is the norm of the *global* gradient: the one a single process training the same
batch would clip. Replicas hold it whole after the step's gradient sum; sharded state (FSDP2) holds it as DTensor
shards, whose norm is reduced over the mesh (``full_tensor``); a pipeline stage holds only its own layers, so the
squared norms of the stages are summed. Every rank of a stage holds the same stage norm, so the sum takes one value
per stage, in stage order: the result is the same on every rank and does not depend on the pool's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm"]


def clip_grad_norm(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    *,
    device: torch.device | None = None,
    stage_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / norm)`` where ``norm`` is the global gradient's 2-norm.

    Args:
        parameters: This rank's parameters (a stage's, under a pipeline); those without a gradient are skipped.
        max_norm: The largest norm kept.
        device: Device of the norm (the strategy's root device, so that a rank without gradients still hands
            ``stage_sum`` a tensor its backend takes); default: the first parameter's.
        stage_sum: Sum over the pipeline's stages of a float32 scalar every rank of a stage holds alike (``None``:
            one stage). Called on every rank, also one whose parameters have no gradient.

    Returns:
        The global norm before clipping (float32, on the gradients' device).
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    with torch.no_grad():
        squared = torch.zeros((), dtype=torch.float32, device=device)
        sharded: dict[tuple, list[torch.Tensor]] = {}  # squared local sums, by the mesh dims that shard them
        for grad in grads:
            if isinstance(grad, DTensor):
                # sharded mesh dims: Shard, and FSDP's _StridedShard over a TP shard (whose is_shard() is False)
                dims = tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate())
                key = (id(grad.device_mesh), dims)
                sharded.setdefault(key, [grad.device_mesh]).append(_squared(grad.to_local()))
            else:
                squared = squared + _squared(grad)
        for (_, dims), (mesh, *parts) in sharded.items():
            local = torch.stack(parts).sum()
            for dim in dims:  # one reduction per sharded mesh dimension (replicated dimensions hold copies)
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
            squared = squared + local
        if stage_sum is not None:
            squared = stage_sum(squared)
        total = squared.sqrt()
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(scale.to(local.dtype))
    return total


def _squared(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()
