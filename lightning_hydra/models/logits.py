"""How the LM head's logits are chunked, and in which dtype: shared by the whole head's and the vocabulary-parallel
head's cross-entropy (:mod:`~lightning_hydra.models.losses`, :mod:`~lightning_hydra.models.vocab_parallel`)."""

from __future__ import annotations

import torch

__all__ = ["LOGIT_BYTES", "capped", "compute_dtype", "tokens_per_chunk"]

LOGIT_BYTES = 1 << 28
"""Bytes of float32 logits one chunk may hold (256 MiB)."""


def tokens_per_chunk(vocab: int, requested: int | None) -> int:
    """Tokens per chunk: ``requested`` if given, else as many as :data:`LOGIT_BYTES` of float32 logits allow.

    Args:
        vocab: Vocabulary ids this rank computes logits for (the whole head, or one TP shard of it).
        requested: The caller's chunk size (``None`` or 0: derived from :data:`LOGIT_BYTES`).
    """
    return requested if requested else max(16, LOGIT_BYTES // (4 * max(vocab, 1)))


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's GEMM runs in: autocast's dtype on ``hidden``'s device when enabled, else ``hidden``'s."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def capped(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Soft-capped float32 logits ``softcap * tanh(logits / softcap)`` and their slope ``1 - tanh^2`` (what a
    gradient on the capped logits is multiplied by); ``(logits, None)`` without a cap. Element-wise: a vocabulary
    shard of the logits is capped as the whole row would be."""
    if softcap is None:
        return logits, None
    t = torch.tanh(logits / softcap)
    return softcap * t, 1.0 - t * t
