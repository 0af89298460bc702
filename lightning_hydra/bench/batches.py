"""Global batches for benchmarks: long-tailed length distributions filled to a share of pool capacity."""

from __future__ import annotations

import numpy as np

from lightning_hydra.data.corpus import stdlib_lengths

__all__ = ["DISTRIBUTIONS", "make_batch"]


def _lognormal_mixture(rng: np.random.Generator, n: int, context: int) -> np.ndarray:
    """90% short documents and 10% long ones, medians scaled to the context (a 256K tail at 256K context)."""
    scale = context / 262144
    short = rng.lognormal(np.log(1800 * scale), 1.2, n)
    long = rng.lognormal(np.log(60000 * scale), 0.8, n)
    mixed = np.where(rng.random(n) < 0.9, short, long)
    return np.clip(mixed, 16, context).astype(np.int64)


def _stdlib(rng: np.random.Generator, n: int, context: int) -> np.ndarray:
    """Document lengths of this interpreter's standard-library sources (bytes), truncated to the context."""
    pool = stdlib_lengths()
    return np.minimum(rng.choice(pool, size=n, replace=True), context).astype(np.int64)


def _pareto(rng: np.random.Generator, n: int, context: int) -> np.ndarray:
    """Power-law document lengths (Pareto, tail index 1.1, from 1024 tokens at 256K context, scaled with it): the
    tail is heavier than the lognormal mixture's (more documents near the context limit)."""
    scale = 1024 * context / 262144
    return np.clip(scale * (1.0 + rng.pareto(1.1, n)), 16, context).astype(np.int64)


DISTRIBUTIONS = {"lognormal": _lognormal_mixture, "stdlib": _stdlib, "pareto": _pareto}
"""Length distributions by name: each ``(rng, n, context) -> lengths``."""


def make_batch(
    distribution: str, *, world_size: int, capacity: int, num_microbatches: int, fill: float, context: int, seed: int
) -> np.ndarray:
    """Draw documents until they fill ``fill`` of the pool's tokens over ``num_microbatches`` microbatches."""
    rng = np.random.default_rng(seed)
    budget = int(fill * world_size * capacity * num_microbatches)
    draw = DISTRIBUTIONS[distribution]
    out: list[np.ndarray] = []
    total = 0
    while total < budget:
        chunk = draw(rng, 4096, context)
        out.append(chunk)
        total += int(chunk.sum())
    lengths = np.concatenate(out)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), budget, side="right"))]
