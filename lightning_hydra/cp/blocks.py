"""What one ring step computes, kernel-independent: the segments that interact, the accumulators the partial
results go to, and the log-sum-exp merge.

Tensors are token-major (``[tokens, heads, dim]``). Accumulators are *flat* (``[tokens * heads + 1, dim]``): the
extra last row is a sink that padded slots of a batched kernel call are scattered to, so that no scatter needs a
mask. The sink of a log-sum-exp accumulator is set to ``+inf`` before the backward: a padded query slot then has
zero attention probability and contributes nothing to any gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Accumulator", "Segments", "lse_merge", "merge_rows", "ring_segments", "to_device", "write_rows"]


@dataclass(frozen=True)
class Segments:
    """The query/key segments of one ring step: one entry per sequence, in shard order (host arrays).

    Sequence ``i`` occupies rows ``[start[i], start[i] + block[i])`` of the local tensors and of the KV block; at
    this step its queries ``[q_start[i], q_start[i] + q_len[i])`` attend to the keys ``[k_start[i], k_start[i] +
    k_len[i])``. A sequence with ``q_len == 0`` or ``k_len == 0`` has no work: kernels must leave its rows at
    ``out = 0``, ``lse = -inf`` (a kernel never sees a query without keys).
    """

    start: np.ndarray
    """First local row of every sequence."""
    block: np.ndarray
    """Local rows of every sequence (``2 C``; equal blocks are adjacent since the shard is sorted)."""
    q_start: np.ndarray
    """First query row of every segment."""
    q_len: np.ndarray
    """Query rows of every segment."""
    k_start: np.ndarray
    """First key row of every segment (a prefix of the sequence's or of its second half)."""
    k_len: np.ndarray
    """Key rows of every segment."""
    causal: bool
    """Top-left causal mask inside each segment (only with ``q_len == k_len``)."""
    q_rows: int
    """Rows of the local query tensor."""
    k_rows: int
    """Rows of the KV block."""

    @property
    def keep(self) -> np.ndarray:
        """Segments with work."""
        return (self.q_len > 0) & (self.k_len > 0)

    @property
    def covers_q(self) -> bool:
        """Every query row is in a segment with work."""
        return int(self.q_len[self.keep].sum()) == self.q_rows

    @property
    def covers_k(self) -> bool:
        """Every key row is in a segment with work."""
        return int(self.k_len[self.keep].sum()) == self.k_rows


def ring_segments(
    lengths: np.ndarray, chunks: np.ndarray, ring: int, pos: int, src: int, causal: bool
) -> Segments | None:
    """The segments of the step where ring position ``pos`` holds the KV block of position ``src``.

    The local tensors are a zigzag shard of degree ``ring`` over ``2 * ring`` chunks of ``chunks[i]`` tokens per
    sequence (position ``p`` holds chunks ``p`` and ``2r-1-p``). With causal attention:

    - ``src == pos``: the causal diagonal over the rank's own ``2 C`` tokens of each sequence;
    - ``src < pos``: every local query sees the block's first half (chunk ``src``), the second half not at all;
    - ``src > pos``: only the second half of the queries (chunk ``2r-1-p``) sees the block, all of it.

    Padding is a suffix of each sequence, so no real query sees a padded key. Without the causal mask every query
    sees the block's unpadded keys, which form a prefix of each sequence's block.

    Returns:
        The segments, or ``None`` when nothing interacts.
    """
    c = np.asarray(chunks, dtype=np.int64)
    n = np.asarray(lengths, dtype=np.int64)
    full = 2 * c
    off = np.cumsum(full) - full
    rows = int(full.sum())
    if causal:
        if src == pos:
            qs, ql, ks, kl = off, full, off, full
        elif src < pos:
            qs, ql, ks, kl = off, full, off, c
        else:
            qs, ql, ks, kl = off + c, c, off, full
    else:
        valid = np.minimum(c, np.maximum(0, n - src * c)) + np.minimum(c, np.maximum(0, n - (2 * ring - 1 - src) * c))
        qs, ql, ks, kl = off, full, off, valid
    seg = Segments(off, full, qs, ql, ks, kl, causal and src == pos, rows, rows)
    return seg if seg.keep.any() else None


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 device tensors of host ``arrays`` with one host-to-device copy (views of one buffer)."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
    sizes = [int(np.asarray(a).size) for a in arrays]
    flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    buf = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.int64)).to(device, non_blocking=True)
    return list(torch.split(buf, sizes))


class Accumulator:
    """Output and log-sum-exp accumulators of the local queries, flat with a sink row.

    Args:
        tokens: Query rows.
        heads: Query heads.
        dim: Head dimension.
        dtype: dtype of the output accumulator (float32 when partials are merged).
        device: Where to allocate (the queries' device).
        init: Fill with ``out = 0``, ``lse = -inf`` (needed unless the first partial covers every row).
    """

    def __init__(self, tokens: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device, init: bool) -> None:
        n = tokens * heads
        self.tokens, self.heads, self.sink = tokens, heads, n
        if init:
            self.out = torch.zeros((n + 1, dim), dtype=dtype, device=device)
            self.lse = torch.full((n + 1,), float("-inf"), dtype=torch.float32, device=device)
        else:
            self.out = torch.empty((n + 1, dim), dtype=dtype, device=device)
            self.lse = torch.empty((n + 1,), dtype=torch.float32, device=device)

    def out3(self) -> torch.Tensor:
        """The output accumulator as ``[tokens, heads, dim]`` (a view)."""
        return self.out[: self.sink].view(self.tokens, self.heads, -1)

    def lse2(self) -> torch.Tensor:
        """The log-sum-exp accumulator as ``[tokens, heads]`` (a view)."""
        return self.lse[: self.sink].view(self.tokens, self.heads)


Rows = torch.Tensor | slice | None
"""Rows of an accumulator: an index tensor, a contiguous slice, or ``None`` for all rows."""


def write_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor, add: bool) -> None:
    """``dst[rows] = src`` (or ``+=``), along dim 0; ``src`` is cast to ``dst``'s dtype."""
    src = src.to(dst.dtype)
    if rows is None or isinstance(rows, slice):
        view = dst if rows is None else dst[rows]
        if add:
            view.add_(src)
        else:
            view.copy_(src)
    elif add:
        dst.index_add_(0, rows, src)
    else:
        dst.index_copy_(0, rows, src)


def lse_merge(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged log-sum-exp ``max + log1p(exp(min - max))`` and the weight of ``new`` (``exp(new - merged)``), in
    float32; ``-inf`` on both sides gives ``-inf`` and weight 0."""
    hi = torch.maximum(old, new)
    finite = torch.isfinite(hi)
    hi_safe = torch.where(finite, hi, 0.0)
    merged = torch.where(finite, hi_safe + torch.log1p(torch.exp(torch.minimum(old, new) - hi_safe)), hi)
    weight = torch.where(finite, torch.exp(new - torch.where(finite, merged, 0.0)), 0.0)
    return merged, weight


def merge_rows(out: torch.Tensor, lse: torch.Tensor, rows: Rows, o: torch.Tensor, lo: torch.Tensor) -> None:
    """Fold a partial ``(o, lo)`` into the accumulators at ``rows`` (dim 0), in float32.

    ``out [n, ..., D]`` and ``lse [n, ...]`` are float32; ``o`` has the rows' shape (any float dtype) and ``lo`` the
    matching log-sum-exp. The output update is one fused ``lerp`` (the two weights sum to one).
    """
    if rows is None or isinstance(rows, slice):
        old_o = out if rows is None else out[rows]
        old_l = lse if rows is None else lse[rows]
        merged, weight = lse_merge(old_l, lo)
        old_o.lerp_(o.to(out.dtype), weight.unsqueeze(-1))
        old_l.copy_(merged)
        return
    old_o = out.index_select(0, rows)
    old_l = lse.index_select(0, rows)
    merged, weight = lse_merge(old_l, lo)
    old_o.lerp_(o.to(out.dtype), weight.unsqueeze(-1))
    out.index_copy_(0, rows, old_o)
    lse.index_copy_(0, rows, merged)
