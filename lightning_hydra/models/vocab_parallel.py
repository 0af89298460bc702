"""The chunked cross-entropy of a vocabulary-parallel LM head: no rank ever holds a row of full logits.

Under tensor parallelism ``T`` the head's weight ``[V, h]`` is split by rows over the TP group (``ColwiseParallel``:
rank ``t`` holds vocabulary ids ``[t V / T, (t + 1) V / T)``). Per chunk of tokens each rank computes its
``[c, V / T]`` float32 logits and the group agrees, with two all-reduces, on each token's maximum and target logit
(held by one rank: one maximum of ``2 c`` values), then on its sum of exponentials (``c`` values), giving the
log-sum-exp and the loss (bitwise what three all-reduces, maximum, sum and target, gave: tested at 2 and 4 gloo
ranks). The forward keeps the hidden states, the weight shard and the per-token log-sum-exp (float32); the backward
recomputes each chunk's local logits, forms ``softmax - onehot`` on the shard, and all-reduces the hidden states'
gradient (a sum over the vocabulary shards). The result equals
:func:`~lightning_hydra.models.losses.chunked_cross_entropy` of the whole head up to float32 rounding of the
log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_hydra.models.logits import capped, compute_dtype, tokens_per_chunk

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        offset: int,
        group: dist.ProcessGroup,
        ignore_index: int,
        chunk: int,
        dtype: torch.dtype,
        softcap: float | None,
    ) -> torch.Tensor:
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = capped((hidden[start : start + chunk].to(dtype) @ w.t()).float(), softcap)[0]
            lab = labels[start : start + chunk]
            valid = lab != ignore_index
            local = lab - offset
            mine = valid & (local >= 0) & (local < w.shape[0])
            picked = logits.gather(1, torch.where(mine, local, 0)[:, None])[:, 0]
            # one maximum for both: [row maximum, target logit (-inf on the ranks without it)] per token; a maximum
            # is exact in any order, and the sum below reduces the same c values as alone (stacked into one sum with
            # the target logit, a ring's per-element order would change with the buffer: 1-ulp differences at T 4)
            both = torch.stack((logits.max(dim=-1).values, torch.where(mine, picked, -torch.inf)))
            top, picked = _all_reduce(both, dist.ReduceOp.MAX, group)
            sums = _all_reduce(torch.exp(logits - top[:, None]).sum(dim=-1), dist.ReduceOp.SUM, group)
            chunk_lse = top + torch.log(sums)
            lse[start : start + chunk] = chunk_lse
            total += torch.where(valid, chunk_lse - torch.where(valid, picked, 0.0), 0.0).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.args = (offset, group, ignore_index, chunk, dtype, softcap)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        hidden, weight, labels, lse = ctx.saved_tensors
        offset, group, ignore_index, chunk, dtype, softcap = ctx.args
        w = weight.to(dtype)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk].to(dtype)
            lab = labels[start : start + chunk]
            valid = lab != ignore_index
            local = lab - offset
            mine = valid & (local >= 0) & (local < w.shape[0])
            logits, slope = capped((h @ w.t()).float(), softcap)
            d_logits = torch.exp(logits - lse[start : start + chunk, None])
            rows = torch.arange(lab.numel(), device=lab.device)  # no boolean indexing: no host sync per chunk
            d_logits[rows, torch.where(mine, local, 0)] -= mine.to(d_logits.dtype)
            if slope is not None:
                d_logits *= slope
            d_logits = (d_logits * (valid[:, None] * grad)).to(dtype)
            partial = _all_reduce(d_logits @ w, dist.ReduceOp.SUM, group)  # a sum over the vocabulary's shards
            d_hidden[start : start + chunk] = partial.to(hidden.dtype)
            d_weight += (d_logits.t() @ h).float()
        return d_hidden, d_weight.to(weight.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: DTensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Sum of the token cross-entropies of ``hidden @ weight.T`` against ``labels``, ``weight`` a DTensor split by
    rows (the vocabulary) over a 1-D TP mesh; every rank of the mesh calls it with the same ``hidden`` and
    ``labels`` and gets the same sum.

    Args:
        hidden: ``[t, h]`` final hidden states (replicated over the TP group).
        weight: ``[V, h]`` LM head weight, ``Shard(0)`` over the TP mesh (``V`` a multiple of its size).
        labels: ``[t]`` target ids.
        ignore_index: Label of tokens that are not trained.
        chunk_tokens: Tokens per chunk (default: as many as ``LOGIT_BYTES`` of float32 logits of the shard allow).
        softcap: Logit soft-capping ``softcap * tanh(logits / softcap)`` (element-wise: applied to each shard's
            logits before the maximum and the sum); ``None``: none.

    Returns:
        A float32 scalar; its gradient reaches the weight's shard (as a DTensor gradient) and ``hidden``.
    """
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0) or weight.shape[0] % mesh.size():
        raise ValueError(
            f"a vocabulary-parallel head is Shard(0) over a 1-D mesh dividing its {weight.shape[0]} rows, got "
            f"{weight.placements} over {mesh.ndim} dims"
        )
    local = weight.to_local()  # differentiable: the shard's gradient becomes the DTensor's
    offset = mesh.get_local_rank() * local.shape[0]
    chunk = tokens_per_chunk(local.shape[0], chunk_tokens)
    return _VocabParallelCrossEntropy.apply(
        hidden, local, labels, offset, mesh.get_group(), ignore_index, chunk, compute_dtype(hidden), softcap
    )
