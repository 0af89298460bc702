"""The zigzag layout: how a packed bin of variable-length sequences is split over the members of a CP group.

Each sequence of length ``L`` is padded to a multiple of ``2 * degree`` and cut into ``2 * degree`` chunks of
``c = shard_tokens(L, degree) / 2`` tokens (:func:`lightning_hydra.planner.degrees.shard_tokens` is the one
definition of the shard size); member ``j`` holds chunks ``j`` and ``2 * degree - 1 - j``, so that causal work is
equal on every member. A member's shard is, sequence after sequence, ``[chunk j, chunk 2d-1-j]``. Padding is a
suffix of each sequence (positions ``L .. 2 * degree * c - 1``), filled with zeros.

Sequences appear in the shard in order of *decreasing chunk size* (ties keep the bin order): sequences of equal
chunk size are then adjacent on every member and at every ring step, so a kernel that is not variable-length (the
CPU op) reads each run of them as one strided view, without gathering rows. The order is a pure function of the
lengths and the degree, the same on every member; packed data, positions and labels follow it through
:func:`zigzag_source_index`.

Index construction is vectorised with numpy (no Python loop over sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from lightning_hydra.planner.degrees import shard_tokens

__all__ = [
    "ZigzagMeta",
    "ragged_arange",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_source_index",
    "zigzag_unshard",
]


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for every ``(s, n)`` pair, as one int64 array (no Python loop)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


def _cu_array(cu_seqlens: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()  # host data by contract; a device tensor syncs here
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    if cu.size == 0 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8].tolist()}...")
    return cu


@dataclass(frozen=True)
class ZigzagMeta:
    """Per-sequence sizes of a bin in the zigzag layout of one degree."""

    lengths: tuple[int, ...]
    """Unpadded sequence lengths."""
    degree: int
    """CP degree the bin is split over."""

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Sequence[int] | torch.Tensor | np.ndarray, degree: int) -> ZigzagMeta:
        """Build from packed boundaries of the unpadded bin (host values)."""
        if degree < 1:
            raise ValueError(f"degree must be positive, got {degree}")
        return cls(tuple(int(n) for n in np.diff(_cu_array(cu_seqlens))), int(degree))

    @cached_property
    def length_array(self) -> np.ndarray:
        """:attr:`lengths` as an int64 array."""
        return np.asarray(self.lengths, dtype=np.int64)

    @cached_property
    def chunk_array(self) -> np.ndarray:
        """Chunk size of every sequence as an int64 array (half of :func:`shard_tokens`)."""
        lengths = self.length_array
        if lengths.size == 0:
            return np.zeros(0, dtype=np.int64)
        distinct, inverse = np.unique(lengths, return_inverse=True)
        per_length = np.asarray([shard_tokens(int(n), self.degree) // 2 for n in distinct], dtype=np.int64)
        return per_length[inverse]

    @property
    def chunks(self) -> tuple[int, ...]:
        """Chunk size ``ceil(L / (2 * degree))`` of every sequence (bin order)."""
        return tuple(int(c) for c in self.chunk_array)

    @cached_property
    def order(self) -> np.ndarray:
        """The sequences (bin indices) in shard order: decreasing chunk size, ties in bin order."""
        return np.argsort(-self.chunk_array, kind="stable")

    @cached_property
    def shard_lengths(self) -> np.ndarray:
        """Unpadded lengths in shard order."""
        return self.length_array[self.order]

    @cached_property
    def shard_chunks(self) -> np.ndarray:
        """Chunk sizes in shard order (non-increasing)."""
        return self.chunk_array[self.order]

    @cached_property
    def shard_len(self) -> int:
        """Tokens in each member's shard (padding included)."""
        return int(2 * self.chunk_array.sum())

    @cached_property
    def total(self) -> int:
        """Unpadded tokens of the bin."""
        return int(self.length_array.sum())

    @cached_property
    def offsets(self) -> np.ndarray:
        """Start of every sequence's ``2 c`` tokens inside a member's shard (shard order)."""
        c2 = 2 * self.shard_chunks
        return np.cumsum(c2) - c2

    def source_index(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Numpy form of :func:`zigzag_source_index`."""
        if not 0 <= index < self.degree:
            raise ValueError(f"member index {index} is outside a group of degree {self.degree}")
        lengths, c = self.shard_lengths, self.shard_chunks
        n = lengths.size
        starts = (np.cumsum(self.length_array) - self.length_array)[self.order]
        chunk_ids = np.array([index, 2 * self.degree - 1 - index], dtype=np.int64)
        seg_start = (c[:, None] * chunk_ids[None, :]).reshape(-1)  # position of each chunk's first token
        seg_len = np.repeat(c, 2)
        positions = ragged_arange(seg_start, seg_len)
        seq_of = np.repeat(np.arange(n, dtype=np.int64), 2 * c)
        source = np.where(positions < lengths[seq_of], positions + starts[seq_of], -1)
        return positions, source


def zigzag_source_index(meta: ZigzagMeta, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For member ``index``: the position of every shard token inside its own sequence, and its packed index.

    Returns:
        ``(positions, source)``: CPU int64 tensors of length ``shard_len``; ``source`` is the index into the
        unpadded packed bin, or ``-1`` for padding.
    """
    positions, source = meta.source_index(index)
    return torch.from_numpy(positions), torch.from_numpy(source)


def zigzag_shard(x: torch.Tensor, cu_seqlens: Sequence[int] | torch.Tensor, degree: int, index: int) -> torch.Tensor:
    """Member ``index``'s share of the packed tensor ``x`` (tokens on dim 0), zero-padded.

    Args:
        x: Packed, unpadded bin ``[total_tokens, ...]``.
        cu_seqlens: Sequence boundaries of ``x`` (``len(sequences) + 1`` entries, starting at 0).
        degree: CP degree of the group.
        index: Member index ``0 <= index < degree``.

    Returns:
        The shard ``[shard_len, ...]`` on ``x``'s device.
    """
    meta = ZigzagMeta.from_cu_seqlens(cu_seqlens, degree)
    if x.shape[0] != meta.total:
        raise ValueError(f"x has {x.shape[0]} tokens but cu_seqlens describe {meta.total}")
    _, source = meta.source_index(index)
    keep = np.flatnonzero(source >= 0)
    out = x.new_zeros((meta.shard_len, *x.shape[1:]))
    out[torch.from_numpy(keep).to(x.device)] = x[torch.from_numpy(source[keep]).to(x.device)]
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
        _, source = meta.source_index(index)
        keep = np.flatnonzero(source >= 0)
        out[torch.from_numpy(source[keep]).to(out.device)] = shard[torch.from_numpy(keep).to(shard.device)]
    return out


def zigzag_positions(cu_seqlens: Sequence[int] | torch.Tensor, degree: int, index: int) -> torch.Tensor:
    """Position of every token of member ``index``'s shard inside its own sequence (true positions; padding
    continues past the sequence's end), for RoPE. A CPU int64 tensor."""
    positions, _ = zigzag_source_index(ZigzagMeta.from_cu_seqlens(cu_seqlens, degree), index)
    return positions
