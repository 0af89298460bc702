"""Stable orderings of integer keys in linear time (the planner sorts tens of thousands of lengths per plan)."""

from __future__ import annotations

import numpy as np

__all__ = ["stable_argsort"]


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for non-negative integer keys, by 16-bit radix passes.

    NumPy sorts 16-bit keys by radix (linear) but 64-bit ones by a comparison sort; a long random array of
    lengths or group numbers sorts about 3-10x faster as one or two 16-bit passes (least significant first, each
    stable). Keys of 2**32 and above, negative keys and non-integers take NumPy's comparison sort.

    Args:
        keys: One-dimensional integer array.
    """
    keys = np.asarray(keys)
    if keys.size == 0 or keys.dtype.kind not in "iu" or keys.dtype.itemsize <= 2:  # NumPy's own radix already
        return np.argsort(keys, kind="stable")
    lo, hi = int(keys.min()), int(keys.max())
    if lo < 0 or hi >= 1 << 32:
        return np.argsort(keys, kind="stable")
    order = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    if hi >= 1 << 16:
        order = order[np.argsort((keys[order] >> 16).astype(np.uint16), kind="stable")]
    return order
