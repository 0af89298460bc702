"""A cross-entropy over the LM head that never materialises ``[tokens, vocab]`` float32 logits.

``chunked_cross_entropy(hidden, weight, labels)`` equals
``F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="sum")`` (the logits rounded to
the compute dtype first, as an unchunked LM head would produce them), computed over chunks of tokens: the forward
keeps only ``hidden`` and ``weight``; the backward recomputes each chunk's logits. At Llama-3's vocabulary of
128K, 8K tokens of float32 logits are 4 GB; a chunk holds at most :data:`LOGIT_BYTES`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from lightning_hydra.models.logits import LOGIT_BYTES, capped, compute_dtype, tokens_per_chunk

__all__ = ["LOGIT_BYTES", "chunked_cross_entropy"]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        chunk: int,
        dtype: torch.dtype,
        softcap: float | None,
    ) -> torch.Tensor:
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk].to(dtype)
            lab = labels[start : start + chunk]
            logits = capped((h @ w.t()).float(), softcap)[0]
            valid = lab != ignore_index
            picked = logits.gather(1, torch.where(valid, lab, 0)[:, None])[:, 0]
            total += torch.where(valid, torch.logsumexp(logits, dim=-1) - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, labels)
        ctx.args = (ignore_index, chunk, dtype, softcap)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        hidden, weight, labels = ctx.saved_tensors
        ignore_index, chunk, dtype, softcap = ctx.args
        w = weight.to(dtype)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk].to(dtype)
            lab = labels[start : start + chunk]
            valid = lab != ignore_index
            logits, slope = capped((h @ w.t()).float(), softcap)
            d_logits = torch.softmax(logits, dim=-1)
            rows = torch.arange(lab.numel(), device=lab.device)
            d_logits[rows, torch.where(valid, lab, 0)] -= 1.0
            if slope is not None:
                d_logits *= slope
            d_logits = (d_logits * (valid[:, None] * grad)).to(dtype)
            d_hidden[start : start + chunk] = (d_logits @ w).to(hidden.dtype)
            d_weight += (d_logits.t() @ h).float()
        return d_hidden, d_weight.to(weight.dtype), None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Sum of the token cross-entropies of ``hidden @ weight.T`` against ``labels`` (``ignore_index`` skipped).

    Args:
        hidden: ``[t, h]`` final hidden states.
        weight: ``[V, h]`` LM head weight (a DTensor split by rows over a TP mesh: see
            :func:`~lightning_hydra.models.vocab_parallel.vocab_parallel_cross_entropy`).
        labels: ``[t]`` target ids.
        ignore_index: Label of tokens that are not trained.
        chunk_tokens: Tokens per chunk (default: as many as :data:`LOGIT_BYTES` of float32 logits allow).
        softcap: Logit soft-capping ``softcap * tanh(logits / softcap)`` (Gemma 2's ``final_logit_softcapping``),
            applied to the float32 logits; ``None``: none.

    Returns:
        A float32 scalar (0 for no tokens).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [t, h] and weight [V, h] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if isinstance(weight, DTensor):  # a vocabulary-parallel head (tensor parallelism): never gathered
        from lightning_hydra.models.vocab_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(
            hidden, weight, labels, ignore_index=ignore_index, chunk_tokens=chunk_tokens, softcap=softcap
        )
    chunk = tokens_per_chunk(weight.shape[0], chunk_tokens)
    return _ChunkedCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk, compute_dtype(hidden), softcap)
