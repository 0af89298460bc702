"""The zigzag layout: how a packed bin of variable-length sequences is split over the members of a CP group.

Each sequence of length ``L`` is padded to a multiple of ``2 * degree`` and cut into ``2 * degree`` chunks of
``c = ceil(L / (2 * degree))`` tokens; member ``j`` holds chunks ``j`` and ``2 * degree - 1 - j``, so that causal
work is equal on every member. A member's shard is, sequence after sequence, ``[chunk j, chunk 2d-1-j]``.
Padding is a suffix of each sequence (positions ``L .. 2 * degree * c - 1``), filled with zeros.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ZigzagMeta", "zigzag_positions", "zigzag_shard", "zigzag_source_index", "zigzag_unshard"]


def _lengths(cu_seqlens: Sequence[int] | torch.Tensor) -> list[int]:
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if not cu or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
    return [b - a for a, b in itertools.pairwise(cu)]


@dataclass(frozen=True)
class ZigzagMeta:
    """Per-sequence sizes of a bin in the zigzag layout of one degree."""

    lengths: tuple[int, ...]
    """Unpadded sequence lengths."""
    degree: int
    """CP degree the bin is split over."""

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Sequence[int] | torch.Tensor, degree: int) -> ZigzagMeta:
        """Build from packed boundaries of the unpadded bin."""
        if degree < 1:
            raise ValueError(f"degree must be positive, got {degree}")
        return cls(tuple(_lengths(cu_seqlens)), int(degree))

    @property
    def chunks(self) -> tuple[int, ...]:
        """Chunk size ``ceil(L / (2 * degree))`` of every sequence."""
        return tuple(-(-n // (2 * self.degree)) for n in self.lengths)

    @property
    def shard_len(self) -> int:
        """Tokens in each member's shard (padding included)."""
        return 2 * sum(self.chunks)

    @property
    def total(self) -> int:
        """Unpadded tokens of the bin."""
        return sum(self.lengths)


def zigzag_source_index(meta: ZigzagMeta, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For member ``index``: the position of every shard token inside its own sequence, and its packed index.

    Returns:
        ``(positions, source)``: int64 tensors of length ``shard_len``; ``source`` is the index into the unpadded
        packed bin, or ``-1`` for padding.
    """
    if not 0 <= index < meta.degree:
        raise ValueError(f"member index {index} is outside a group of degree {meta.degree}")
    positions, sources = [], []
    start = 0
    for length, c in zip(meta.lengths, meta.chunks, strict=True):
        for chunk in (index, 2 * meta.degree - 1 - index):
            pos = torch.arange(chunk * c, (chunk + 1) * c, dtype=torch.int64)
            positions.append(pos)
            sources.append(torch.where(pos < length, pos + start, torch.full_like(pos, -1)))
        start += length
    if not positions:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    return torch.cat(positions), torch.cat(sources)


def zigzag_shard(x: torch.Tensor, cu_seqlens: Sequence[int] | torch.Tensor, degree: int, index: int) -> torch.Tensor:
    """Member ``index``'s share of the packed tensor ``x`` (tokens on dim 0), zero-padded.

    Args:
        x: Packed, unpadded bin ``[total_tokens, ...]``.
        cu_seqlens: Sequence boundaries of ``x`` (``len(sequences) + 1`` entries, starting at 0).
        degree: CP degree of the group.
        index: Member index ``0 <= index < degree``.

    Returns:
        The shard ``[shard_len, ...]``.
    """
    meta = ZigzagMeta.from_cu_seqlens(cu_seqlens, degree)
    if x.shape[0] != meta.total:
        raise ValueError(f"x has {x.shape[0]} tokens but cu_seqlens describe {meta.total}")
    _, source = zigzag_source_index(meta, index)
    out = x.new_zeros((meta.shard_len, *x.shape[1:]))
    keep = source >= 0
    out[keep] = x[source[keep]]
    return out


def zigzag_unshard(
    shards: Sequence[torch.Tensor], cu_seqlens: Sequence[int] | torch.Tensor, degree: int
) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: the packed, unpadded bin from all ``degree`` shards (padding dropped)."""
    meta = ZigzagMeta.from_cu_seqlens(cu_seqlens, degree)
    if len(shards) != degree:
        raise ValueError(f"expected {degree} shards, got {len(shards)}")
    first = shards[0]
    out = first.new_zeros((meta.total, *first.shape[1:]))
    for index, shard in enumerate(shards):
        if shard.shape[0] != meta.shard_len:
            raise ValueError(f"shard {index} has {shard.shape[0]} tokens, expected {meta.shard_len}")
        _, source = zigzag_source_index(meta, index)
        keep = source >= 0
        out[source[keep]] = shard[keep]
    return out


def zigzag_positions(cu_seqlens: Sequence[int] | torch.Tensor, degree: int, index: int) -> torch.Tensor:
    """Position of every token of member ``index``'s shard inside its own sequence (true positions; padding
    continues past the sequence's end), for RoPE."""
    positions, _ = zigzag_source_index(ZigzagMeta.from_cu_seqlens(cu_seqlens, degree), index)
    return positions
