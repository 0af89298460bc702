"""Everything a microbatch's attention needs that follows from ``cu_seqlens``, the group shape and the rank's
position, computed once per microbatch and reused by every layer, forward and backward.

:class:`MicrobatchLayout` is host-only (numpy): the zigzag sizes, the Ulysses gather order and the segments of every
ring step. :class:`AttentionPlan` adds the device side for one kernel, device, mask type and head count: the
Ulysses order and its inverse as device tensors and each step's kernel plan (index tensors, ``cu_seqlens``,
maximum lengths). Nothing here runs inside the forward or backward, and nothing reads a device tensor back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_hydra.cp.blocks import Segments, ring_segments, to_device
from lightning_hydra.cp.kernels import AttentionKernel
from lightning_hydra.cp.layout import ZigzagMeta, ragged_arange

__all__ = ["AttentionPlan", "MicrobatchLayout", "gathered_order"]


def gathered_order(meta: ZigzagMeta, ulysses: int) -> np.ndarray:
    """Row order that turns the received ``[u, t]`` rows (member-major) into the gathered zigzag layout.

    Per sequence: first halves from members ``0..u-1``, then second halves from members ``u-1..0`` (so that the
    super-chunks are in ascending position order).
    """
    t, c, off = meta.shard_len, meta.shard_chunks, meta.offsets
    members = np.arange(ulysses, dtype=np.int64)
    first = off[:, None] + members[None, :] * t
    second = off[:, None] + c[:, None] + members[::-1][None, :] * t
    starts = np.concatenate([first, second], axis=1).reshape(-1)
    return ragged_arange(starts, np.repeat(c, 2 * ulysses))


class MicrobatchLayout:
    """Host-side geometry of one microbatch on one rank.

    Args:
        cu_seqlens: Unpadded sequence boundaries of the whole bin (host values).
        ulysses: Ulysses degree of the group.
        ring: Ring degree of the group.
        member: This rank's member index ``j = p * ulysses + i``.
    """

    def __init__(self, cu_seqlens: Sequence[int] | np.ndarray, ulysses: int, ring: int, member: int) -> None:
        self.ulysses, self.ring, self.member = int(ulysses), int(ring), int(member)
        self.meta = ZigzagMeta.from_cu_seqlens(cu_seqlens, self.ulysses * self.ring)
        self.pos = self.member // self.ulysses
        """Ring position."""
        self.ring_chunks = self.ulysses * self.meta.shard_chunks
        """Super-chunk size of every sequence at ring level (shard order)."""
        self.rows = self.ulysses * self.meta.shard_len
        """Local rows at ring level (after the Ulysses gather)."""
        self._segments: dict[tuple[int, bool, int], Segments | None] = {}
        self._order: np.ndarray | None = None

    def ring_sequences(self, gather_limit: int) -> int:
        """How many sequences (a prefix in shard order) go around the ring; the rest, whose padded length
        ``2 * ring * C`` is at most ``gather_limit``, are attended after gathering their keys (see
        :mod:`lightning_hydra.cp.ring`). Everything goes around the ring when ``ring == 1`` or the limit is 0."""
        n = self.meta.shard_lengths.size
        if self.ring == 1 or gather_limit <= 0:
            return n
        return int(np.count_nonzero(2 * self.ring * self.ring_chunks > gather_limit))

    def segments(self, step: int, causal: bool, sequences: int | None = None) -> Segments | None:
        """Segments of ring step ``step`` (this rank holds the KV block of position ``(pos - step) mod ring``) for
        the first ``sequences`` sequences in shard order (default all)."""
        n = self.meta.shard_lengths.size if sequences is None else sequences
        key = (step, causal, n)
        if key not in self._segments:
            src = (self.pos - step) % self.ring
            self._segments[key] = ring_segments(
                self.meta.shard_lengths[:n], self.ring_chunks[:n], self.ring, self.pos, src, causal
            )
        return self._segments[key]

    def gather_index(self, sequences: int) -> np.ndarray:
        """``[ring, t_s]``: where each block's rows of the gathered sequences (those after the first ``sequences``)
        go in the keys laid out sequence after sequence in position order (``2 * ring * C`` rows each)."""
        c = self.ring_chunks[sequences:]
        r = self.ring
        starts = np.cumsum(2 * r * c) - 2 * r * c
        rows = []
        for src in range(r):
            first = starts + src * c
            second = starts + (2 * r - 1 - src) * c
            rows.append(ragged_arange(np.stack([first, second], axis=1).reshape(-1), np.repeat(c, 2)))
        return np.stack(rows) if rows else np.zeros((r, 0), dtype=np.int64)

    def order(self) -> np.ndarray:
        """The Ulysses gather order (see :func:`gathered_order`)."""
        if self._order is None:
            self._order = gathered_order(self.meta, self.ulysses)
        return self._order


@dataclass
class AttentionPlan:
    """The device side of a microbatch's attention for one kernel, device, mask type and head count."""

    layout: MicrobatchLayout
    kernel: AttentionKernel
    causal: bool
    heads: int
    """Query heads at ring level (after the Ulysses scatter)."""
    kv_heads: int
    """KV heads at ring level."""
    order: torch.Tensor | None
    """Ulysses gather order on the device (``None`` without Ulysses)."""
    inverse: torch.Tensor | None
    """Its inverse permutation."""
    steps: list[Any]
    """Kernel plan of every ring step (``None``: nothing interacts)."""
    split: int = 0
    """First local row of the gathered sequences (``rows``: none)."""
    gathered: Any = None
    """The kernel's plan for the gathered sequences (``None``: none)."""
    gather_index: torch.Tensor | None = None
    """``[ring, t_s]`` device index of each block's gathered rows in the position-ordered keys."""

    @classmethod
    def build(
        cls,
        layout: MicrobatchLayout,
        kernel: AttentionKernel,
        device: torch.device,
        *,
        causal: bool,
        heads: int,
        kv_heads: int,
    ) -> AttentionPlan:
        """Build every step's kernel plan and the Ulysses permutations on ``device``."""
        order = inverse = None
        if layout.ulysses > 1:
            host = layout.order()
            inv = np.empty_like(host)
            inv[host] = np.arange(host.size, dtype=np.int64)
            order, inverse = to_device([host, inv], device)
        n_ring = layout.ring_sequences(getattr(kernel, "gather_limit", 0))
        steps = []
        for s in range(layout.ring):
            seg = layout.segments(s, causal, n_ring)
            steps.append(None if seg is None else kernel.prepare(seg, heads=heads, kv_heads=kv_heads, device=device))
        split = int(2 * layout.ring_chunks[:n_ring].sum())
        gathered = index = None
        if split < layout.rows:
            meta = layout.meta
            gathered = kernel.prepare_gathered(
                meta.shard_lengths[n_ring:],
                layout.ring_chunks[n_ring:],
                ring=layout.ring,
                pos=layout.pos,
                causal=causal,
                row0=split,
            )
            (index,) = to_device([layout.gather_index(n_ring)], device)
        return cls(layout, kernel, causal, heads, kv_heads, order, inverse, steps, split, gathered, index)

    @property
    def first_covers(self) -> bool:
        """The first ring step and the gathered sequences write every query row (causal attention always does):
        accumulators need no initialisation."""
        ring_rows = self.split == 0 or (self.steps[0] is not None and self.steps[0].covers_q)
        return ring_rows and (self.gathered is None or self.gathered.covers_q)

    @property
    def first_covers_k(self) -> bool:
        """The first ring step writes every key row of the ring sequences."""
        return self.split == 0 or (self.steps[0] is not None and self.steps[0].covers_k)
