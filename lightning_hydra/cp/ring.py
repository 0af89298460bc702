"""The outer ring: KV blocks travel around ``ring`` ranks by batched P2P, overlapped with attention.

The local tensors are a zigzag shard of degree ``r`` over ``2r`` (super-)chunks of ``C_i`` tokens per sequence:
ring position ``p`` holds chunks ``p`` and ``2r-1-p`` of every sequence. At step ``s`` a rank holds the KV block of
ring position ``src = (p - s) mod r``. With causal attention (positions only increase along a shard):

- ``src == p``: the causal diagonal over the rank's own ``2 C_i`` tokens;
- ``src < p``: all local queries see the block's first half (chunk ``src``), the second half not at all;
- ``src > p``: only the second half of the local queries (chunk ``2r-1-p``) sees the block, all of it.

Padding is a suffix of each sequence, so with causal attention no real query sees a padded key. Without the causal
mask every query sees every block, minus its padded keys, which always form a suffix of the block.

Partial results merge by log-sum-exp in float32. The backward runs the ring again: each step's ``dK``/``dV`` are
added to an accumulator that travels with its block and returns to the owner after the last step; ``dQ``
accumulates locally in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_hydra.cp.groups import BufferPool, CommClock
from lightning_hydra.cp.kernels import AttentionKernel

__all__ = ["RingLayout", "ring_attention"]


@dataclass(frozen=True)
class _Step:
    """Rows of one step: query rows (``None``: all), key rows of the block (``None``: all), and boundaries."""

    q_rows: torch.Tensor | None
    k_rows: torch.Tensor | None
    cu_q: list[int]
    cu_k: list[int]
    causal: bool


def _cumsum(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def _rows(starts: list[int], sizes: list[int]) -> torch.Tensor:
    if not starts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, a + n, dtype=torch.int64) for a, n in zip(starts, sizes, strict=True)])


@dataclass(frozen=True)
class RingLayout:
    """Per-sequence sizes of a ring-level zigzag shard and the rank's ring position."""

    lengths: tuple[int, ...]
    """Unpadded sequence lengths."""
    chunks: tuple[int, ...]
    """Chunk (super-chunk) size ``C_i`` of every sequence; each sequence holds ``2 C_i`` local tokens."""
    ring: int
    """Ring degree ``r``."""
    pos: int
    """This rank's ring position ``p``."""

    def step(self, src: int, causal: bool) -> _Step | None:
        """The rows that interact when this rank holds the KV block of ring position ``src`` (``None``: none)."""
        offsets = _cumsum([2 * c for c in self.chunks])[:-1]
        full = [2 * c for c in self.chunks]
        half = list(self.chunks)
        if causal:
            if src == self.pos:
                return _Step(None, None, _cumsum(full), _cumsum(full), True)
            if src < self.pos:
                return _Step(None, _rows(offsets, half), _cumsum(full), _cumsum(half), False)
            second = [o + c for o, c in zip(offsets, self.chunks, strict=True)]
            return _Step(_rows(second, half), None, _cumsum(half), _cumsum(full), False)
        # without the causal mask: every query, the block's unpadded keys (a prefix of each sequence's block)
        valid = [
            min(c, max(0, n - src * c)) + min(c, max(0, n - (2 * self.ring - 1 - src) * c))
            for n, c in zip(self.lengths, self.chunks, strict=True)
        ]
        if not any(valid):
            return None
        return _Step(None, _rows(offsets, valid), _cumsum(full), _cumsum(valid), False)


def _select(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Token rows of a head-major tensor (dim 1)."""
    return x if rows is None else x.index_select(1, rows)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None, o: torch.Tensor, lo: torch.Tensor) -> None:
    """Fold a partial ``(o, lo)`` into the accumulators at ``rows``: ``lse = max + log1p(exp(min - max))``.

    Head-major: ``out [H, t, D]``, ``lse [H, t]``.
    """
    old_o = _select(out, rows)
    old_l = _select(lse, rows)
    hi = torch.maximum(old_l, lo)
    finite = torch.isfinite(hi)
    hi_safe = torch.where(finite, hi, 0.0)
    new_l = torch.where(finite, hi_safe + torch.log1p(torch.exp(torch.minimum(old_l, lo) - hi_safe)), hi)
    base = torch.where(finite, new_l, 0.0)
    w_old = torch.where(finite, torch.exp(old_l - base), 0.0).unsqueeze(-1)
    w_new = torch.where(finite, torch.exp(lo - base), 0.0).unsqueeze(-1)
    new_o = old_o * w_old + o * w_new
    if rows is None:
        out.copy_(new_o)
        lse.copy_(new_l)
    else:
        out.index_copy_(1, rows, new_o)
        lse.index_copy_(1, rows, new_l)


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int) -> list:
    """Post a batched send to the next ring rank and a receive from the previous one."""
    ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
    return dist.batch_isend_irecv(ops)


def _add(acc: torch.Tensor, rows: torch.Tensor | None, part: torch.Tensor) -> None:
    if rows is None:
        acc += part
    else:
        acc.index_add_(1, rows, part)


class _RingAttention(torch.autograd.Function):
    """Ring attention on head-major tensors ``[H, t, D]`` (see :func:`ring_attention`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RingLayout,
        peers: tuple[int, ...],
        causal: bool,
        scale: float,
        kernel: AttentionKernel,
        pool: BufferPool,
        clock: CommClock,
    ) -> torch.Tensor:
        r, p = layout.ring, layout.pos
        hkv = k.shape[0]
        shape = (2 * hkv, k.shape[1], k.shape[2])
        cur = pool.get("ring.kv.a", shape, k.dtype, k.device)
        nxt = pool.get("ring.kv.b", shape, k.dtype, k.device)
        torch.cat([k, v], dim=0, out=cur)
        out: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        for s in range(r):
            pending = _exchange(cur, nxt, peers[(p + 1) % r], peers[(p - 1) % r]) if s < r - 1 else []
            step = layout.step((p - s) % r, causal)
            if step is not None:
                kb, vb = _select(cur[:hkv], step.k_rows), _select(cur[hkv:], step.k_rows)
                o, lo = kernel.forward(_select(q, step.q_rows), kb, vb, step.cu_q, step.cu_k, step.causal, scale)
                if out is None and step.q_rows is None:
                    out, lse = o, lo  # the first partial covering every row is the accumulator
                else:
                    if out is None:
                        out = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32, device=q.device)
                        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
                    _merge(out, lse, step.q_rows, o, lo)
            with clock.measure():
                for work in pending:
                    work.wait()
            cur, nxt = nxt, cur
        if out is None:  # nothing visible anywhere (cannot happen for real sequences)
            out = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32, device=q.device)
            lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, peers, causal, scale, kernel, pool, clock)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        layout, peers, causal, scale, kernel, pool, clock = ctx.args
        r, p = layout.ring, layout.pos
        hkv = k.shape[0]
        nxt_rank, prv_rank = peers[(p + 1) % r], peers[(p - 1) % r]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        shape = (2 * hkv, k.shape[1], k.shape[2])
        cur = pool.get("ring.bkv.a", shape, k.dtype, k.device)
        nxt = pool.get("ring.bkv.b", shape, k.dtype, k.device)
        dkv = pool.get("ring.dkv.a", shape, torch.float32, k.device).zero_()
        dkv_in = pool.get("ring.dkv.b", shape, torch.float32, k.device)
        torch.cat([k, v], dim=0, out=cur)
        for s in range(r):
            pending = _exchange(cur, nxt, nxt_rank, prv_rank) if s < r - 1 else []
            step = layout.step((p - s) % r, causal)
            if step is not None:
                rows = step.q_rows
                dq_s, dk_s, dv_s = kernel.backward(
                    _select(dout, rows),
                    _select(q, rows),
                    _select(cur[:hkv], step.k_rows),
                    _select(cur[hkv:], step.k_rows),
                    _select(out, rows),
                    _select(lse, rows).contiguous(),
                    step.cu_q,
                    step.cu_k,
                    step.causal,
                    scale,
                )
                _add(dq, rows, dq_s)
                _add(dkv[:hkv], step.k_rows, dk_s)
                _add(dkv[hkv:], step.k_rows, dv_s)
            if r > 1:
                # the accumulator travels with its block; after the last step it reaches the block's owner
                with clock.measure():
                    for work in _exchange(dkv, dkv_in, nxt_rank, prv_rank):
                        work.wait()
                dkv, dkv_in = dkv_in, dkv
            with clock.measure():
                for work in pending:
                    work.wait()
            cur, nxt = nxt, cur
        dk = dkv[:hkv].to(k.dtype, copy=True)
        dv = dkv[hkv:].to(v.dtype, copy=True)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: RingLayout,
    peers: tuple[int, ...],
    *,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    pool: BufferPool,
    clock: CommClock | None = None,
) -> torch.Tensor:
    """Ring attention over ``peers`` (global ranks in ring order) on a ring-level zigzag shard.

    Args:
        q: ``[t, H, D]`` local queries.
        k: ``[t, Hkv, D]`` local keys (``H`` a multiple of ``Hkv``).
        v: ``[t, Hkv, D]`` local values.
        layout: Sizes of the shard and this rank's ring position.
        peers: Global ranks of the ring, ``peers[layout.pos]`` being this rank.
        causal: Causal (decoder) attention.
        scale: Softmax scale.
        kernel: The attention kernel.
        pool: Communication buffers.
        clock: Accumulates the time spent waiting for transfers (default: a throw-away clock).

    Returns:
        ``[t, H, D]`` attention output for the local queries.
    """
    # work head-major inside: the CPU kernel reads [heads, tokens, dim] fastest
    heads_first = [x.transpose(0, 1).contiguous() for x in (q, k, v)]
    out = _RingAttention.apply(*heads_first, layout, peers, causal, scale, kernel, pool, clock or CommClock())
    return out.transpose(0, 1).contiguous()
