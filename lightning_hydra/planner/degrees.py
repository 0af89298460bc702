"""Degree arithmetic shared by every policy: shard sizes, memory minimums and the Ulysses x ring factorization."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DegreeRules", "pow2_ceil", "shard_tokens"]

ArrayLike = np.ndarray | int


def shard_tokens(length: ArrayLike, degree: ArrayLike) -> Any:
    """Tokens one member holds of a sequence split over ``degree`` ranks in the zigzag layout.

    The sequence is padded to a multiple of ``2 * degree`` and every member holds two of the ``2 * degree`` chunks
    of ``ceil(length / (2 * degree))`` tokens. This is the one definition of the shard size: the policies, the plan's
    checks and the engine's layout all use it.

    Args:
        length: Sequence length(s); a Python int or a numpy integer array.
        degree: CP degree(s), broadcast against ``length``.

    Returns:
        A Python ``int`` for scalar inputs, else an int64 array of the broadcast shape.
    """
    if isinstance(length, np.ndarray) or isinstance(degree, np.ndarray):
        lengths = np.asarray(length, dtype=np.int64)
        degrees = np.asarray(degree, dtype=np.int64)
        if lengths.ndim == 2 and lengths.shape[0] == 1 and degrees.shape[1:] == (1,) and degrees.ndim == 2:
            # a table, one degree per row: divide each row by a scalar (NumPy's fast division by a constant)
            out = np.empty((degrees.shape[0], lengths.shape[1]), dtype=np.int64)
            negative = -lengths[0]
            for row, chunk in enumerate((2 * degrees[:, 0]).tolist()):
                np.floor_divide(negative, chunk, out=out[row])
            out *= -2
            return out
        return 2 * -(-lengths // (2 * degrees))
    return 2 * -(-int(length) // (2 * int(degree)))


def pow2_ceil(x: float) -> int:
    """Smallest power of two ``>= x`` (and ``>= 1``)."""
    return 1 if x <= 1 else 1 << math.ceil(math.log2(x))


@dataclass(frozen=True, kw_only=True)
class DegreeRules:
    """Which CP degrees a pool allows and how each factors into ``ulysses * ring``.

    Degrees are powers of two up to the pool size. The Ulysses degree ``u`` divides the attention heads, divides
    ``ranks_per_node`` (so a Ulysses block never crosses a node) and is at most ``max_ulysses``; the ring degree is
    the rest and at most ``max_ring``.
    """

    world_size: int
    """Ranks in the pool."""
    ranks_per_node: int
    """Ranks that share a node (fast all-to-all)."""
    num_heads: int | None = None
    """Attention (query) heads; ``None`` means any Ulysses degree up to the node size is fine."""
    max_ulysses: int | None = None
    """Cap on the Ulysses degree (``None``: the node size)."""
    max_ring: int | None = None
    """Cap on the ring degree (``None``: no cap)."""

    def ulysses_options(self) -> list[int]:
        """Allowed Ulysses degrees, ascending (always includes 1)."""
        cap = self.ranks_per_node if self.max_ulysses is None else min(self.max_ulysses, self.ranks_per_node)
        out = []
        u = 1
        while u <= cap:
            if self.ranks_per_node % u == 0 and (self.num_heads is None or self.num_heads % u == 0):
                out.append(u)
            u *= 2
        return out

    def factor(self, degree: int, start: int = 0) -> tuple[int, int] | None:
        """Split ``degree`` into ``(ulysses, ring)`` for a contiguous group starting at rank ``start``.

        Picks the largest allowed Ulysses degree that divides ``degree`` and keeps every Ulysses block inside a
        node; returns ``None`` when no factorization respects ``max_ring``.
        """
        for u in reversed(self.ulysses_options()):
            if degree % u == 0 and start % u == 0:
                r = degree // u
                if self.max_ring is None or r <= self.max_ring:
                    return u, r
                return None
        return None

    def degrees(self, fine: bool = False) -> list[int]:
        """Allowed degrees up to the pool size that factor, ascending.

        Args:
            fine: ``False`` gives powers of two (Megatron's rule). ``True`` gives every degree up to 8 and then
                eight steps per octave (9, 10, ..., 15, 16, 18, 20, ..., 30, 32, 36, ...), so that a group can be
                sized to its load within 12.5%; degrees that are not powers of two use a smaller Ulysses degree or
                a ring whose length is not a power of two.
        """
        cands = set(range(1, min(self.world_size, 8) + 1)) if fine else set()
        p = 1
        while p <= self.world_size:
            cands.add(p)
            if fine and p >= 8:
                cands.update(p + j * (p // 8) for j in range(1, 8))
            p *= 2
        return sorted(d for d in cands if d <= self.world_size and self.factor(d) is not None)

    def memory_min(self, length: int, capacity: int, fine: bool = False) -> int | None:
        """Smallest allowed degree whose zigzag shard of ``length`` fits ``capacity`` tokens, or ``None``."""
        for d in self.degrees(fine):
            if shard_tokens(length, d) <= capacity:
                return d
        return None
