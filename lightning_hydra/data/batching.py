"""Global batches: a deterministic function of the dataset's lengths, the token budget, the seed and the epoch.

The world size plays no part, so runs at different world sizes train on exactly the same batches.
"""

from __future__ import annotations

import numpy as np

__all__ = ["global_batches"]


def global_batches(
    lengths: np.ndarray, global_batch_tokens: int, *, seed: int, epoch: int, shuffle: bool = True
) -> list[np.ndarray]:
    """Dataset indices of every global batch of an epoch.

    Sequences are visited in a seeded per-epoch order and packed greedily: a batch closes when the next sequence
    would exceed ``global_batch_tokens``. A sequence longer than the budget forms a batch of its own. Every sequence
    appears in exactly one batch.
    """
    if global_batch_tokens < 1:
        raise ValueError(f"global_batch_tokens must be positive, got {global_batch_tokens}")
    n = len(lengths)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    batches: list[np.ndarray] = []
    current: list[int] = []
    held = 0
    for i in order.tolist():
        size = int(lengths[i])
        if current and held + size > global_batch_tokens:
            batches.append(np.asarray(current, dtype=np.int64))
            current, held = [], 0
        current.append(i)
        held += size
    if current:
        batches.append(np.asarray(current, dtype=np.int64))
    return batches
