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
        self._segments: dict[tuple[int, bool], Segments | None] = {}
        self._order: np.ndarray | None = None

    def segments(self, step: int, causal: bool) -> Segments | None:
        """Segments of ring step ``step`` (this rank holds the KV block of position ``(pos - step) mod ring``)."""
        key = (step, causal)
        if key not in self._segments:
            src = (self.pos - step) % self.ring
            self._segments[key] = ring_segments(
                self.meta.shard_lengths, self.ring_chunks, self.ring, self.pos, src, causal
            )
        return self._segments[key]

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
        steps = []
        for s in range(layout.ring):
            seg = layout.segments(s, causal)
            steps.append(None if seg is None else kernel.prepare(seg, heads=heads, kv_heads=kv_heads, device=device))
        return cls(layout, kernel, causal, heads, kv_heads, order, inverse, steps)

    @property
    def first_covers(self) -> bool:
        """The first step (the causal diagonal) covers every query row: accumulators need no initialisation."""
        return self.steps[0] is not None and self.steps[0].covers_q
