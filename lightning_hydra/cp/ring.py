"""The outer ring: KV blocks travel around ``ring`` ranks by batched P2P, overlapped with attention.

The local tensors are a zigzag shard of degree ``r`` over ``2r`` (super-)chunks per sequence; which rows interact at
each step is in the microbatch's :class:`~lightning_hydra.cp.plan.AttentionPlan` (see
:func:`~lightning_hydra.cp.blocks.ring_segments`). Partial results merge by log-sum-exp in float32.

Short sequences (padded length at most the kernel's ``gather_limit``; the CPU kernel sets one) are not attended
block by block: a ring step costs a kernel a fixed amount per query row and call, and a ring of ``r`` ranks visits
every query row about ``1 + 0.75 (r - 1)`` times. Their rows (a suffix of every shard, which lists sequences by
decreasing size) are copied out of each KV block as it passes, into keys ordered by position; after the last step
each local query chunk attends to its whole causal prefix in one call. In the backward their key gradients are
computed first and added to each block's travelling dK/dV accumulator as it passes: no extra collective.

Forward: at every step the transfer of the next KV block is posted before the current block is computed, and
waited for after. Backward (as ring-flash-attention does): the next KV transfer *and* the transfer of the dK/dV
accumulator of the previous step are both in flight while the current block is computed; the accumulator of a
block travels with it, and after the last step reaches the block's owner. dQ accumulates locally. Accumulators are
float32, and dK/dV travel in float32 (4 bytes per element, as the cost model charges) so that the sum over ring
steps is exact to float32 whatever the activations' dtype.

With one ring rank nothing is merged: the kernel writes the output (and the gradients) directly in the inputs'
dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hydra.cp.blocks import Accumulator
from lightning_hydra.cp.groups import BufferPool, CommClock
from lightning_hydra.cp.plan import AttentionPlan

__all__ = ["ring_attention"]


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group: dist.ProcessGroup | None) -> list:
    """Post a batched send to the next ring rank and a receive from the previous one (global ranks, on ``group``)."""
    ops = [dist.P2POp(dist.isend, send, nxt, group=group), dist.P2POp(dist.irecv, recv, prv, group=group)]
    return dist.batch_isend_irecv(ops)


def _wait(works: list, clock: CommClock) -> None:
    if works:
        with clock.measure():
            for work in works:
                work.wait()


def _flat(rows: int, dim: int, dtype: torch.dtype, like: torch.Tensor, zero: bool) -> torch.Tensor:
    """A flat ``[rows + 1, dim]`` accumulator (last row: the sink) on ``like``'s device."""
    if zero:
        return torch.zeros((rows + 1, dim), dtype=dtype, device=like.device)
    return torch.empty((rows + 1, dim), dtype=dtype, device=like.device)


class _RingAttention(torch.autograd.Function):
    """Ring attention on token-major tensors ``[t, H, D]`` (see :func:`ring_attention`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: AttentionPlan,
        peers: tuple[int, ...],
        scale: float,
        pool: BufferPool,
        clock: CommClock,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        kernel, r, p = plan.kernel, plan.layout.ring, plan.layout.pos
        t, heads, dim = q.shape
        acc = Accumulator(t, heads, dim, q.dtype if r == 1 else torch.float32, q.device, init=not plan.first_covers)
        kpos = None
        if r == 1:
            if plan.steps[0] is not None:
                kernel.forward(q, k, v, plan.steps[0], scale, acc, first=True)
        else:
            shape = (2, *k.shape)
            cur = pool.get("ring.kv.a", shape, k.dtype, k.device)
            nxt = pool.get("ring.kv.b", shape, k.dtype, k.device)
            cur[0].copy_(k)
            cur[1].copy_(v)
            split, index = plan.split, plan.gather_index
            if plan.gathered is not None:
                kpos = torch.empty((2, index.numel(), *k.shape[1:]), dtype=k.dtype, device=k.device)
            for s in range(r):
                pending = _exchange(cur, nxt, peers[(p + 1) % r], peers[(p - 1) % r], group) if s < r - 1 else []
                if plan.gathered is not None:
                    kpos.index_copy_(1, index[(p - s) % r], cur[:, split:])
                if plan.steps[s] is not None:
                    kernel.forward(q, cur[0], cur[1], plan.steps[s], scale, acc, first=s == 0)
                _wait(pending, clock)
                cur, nxt = nxt, cur
            if plan.gathered is not None:
                kernel.gathered_forward(q, kpos[0], kpos[1], plan.gathered, scale, acc)
        out = acc.out3() if r == 1 else acc.out3().to(q.dtype)
        if not (plan.causal and plan.first_covers):  # rows that saw no key: P = exp(s - inf) = 0 in the backward
            acc.lse.masked_fill_(acc.lse == float("-inf"), float("inf"))
        acc.lse[acc.sink] = float("inf")
        ctx.save_for_backward(q, k, v, out, acc.lse, kpos)
        ctx.args = (plan, peers, scale, pool, clock, group)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse, kpos = ctx.saved_tensors
        plan, peers, scale, pool, clock, group = ctx.args
        kernel, r, p = plan.kernel, plan.layout.ring, plan.layout.pos
        t, heads, dim = q.shape
        tk, kv_heads = k.shape[0], k.shape[1]
        dout = dout.contiguous()
        first = plan.steps[0]
        if r == 1:
            covers_k = first is not None and first.covers_k
            dq = _flat(t * heads, dim, q.dtype, q, zero=not plan.first_covers)
            dk = _flat(tk * kv_heads, dim, k.dtype, k, zero=not covers_k)
            dv = _flat(tk * kv_heads, dim, v.dtype, v, zero=not covers_k)
            if first is not None:
                kernel.backward(dout, q, k, v, out, lse, first, scale, dq, dq_add=False)(dk, dv, False)
            return (
                dq[: t * heads].view(q.shape),
                dk[: tk * kv_heads].view(k.shape),
                dv[: tk * kv_heads].view(v.shape),
                *(None,) * 6,
            )

        nxt_rank, prv_rank = peers[(p + 1) % r], peers[(p - 1) % r]
        dq = _flat(t * heads, dim, torch.float32, q, zero=not plan.first_covers)
        split, index = plan.split, plan.gather_index
        dgathered = None
        if plan.gathered is not None:  # the gathered sequences first: their dK/dV join each block as it passes
            dgathered = kernel.gathered_backward(dout, q, kpos[0], kpos[1], out, lse, plan.gathered, scale, dq)
        travel_kv = plan.split > 0  # the same on every member (a step's segments may be empty on one rank only)
        shape = (2, *k.shape)
        cur = pool.get("ring.bkv.a", shape, k.dtype, k.device)
        nxt = pool.get("ring.bkv.b", shape, k.dtype, k.device)
        acc_shape = (2, tk * kv_heads + 1, dim)
        held = pool.get("ring.dkv.a", acc_shape, torch.float32, k.device)
        spare = pool.get("ring.dkv.b", acc_shape, torch.float32, k.device)
        cur[0].copy_(k)
        cur[1].copy_(v)
        pending_dkv: list = []
        for s in range(r):
            pending_kv = _exchange(cur, nxt, nxt_rank, prv_rank, group) if s < r - 1 and travel_kv else []
            step = plan.steps[s]
            apply = None
            if step is not None:
                dq_add = not (s == 0 and step.covers_q)
                apply = kernel.backward(dout, q, cur[0], cur[1], out, lse, step, scale, dq, dq_add=dq_add)
            if s == 0:
                if not plan.first_covers_k:
                    held[:, : split * kv_heads].zero_()
                if apply is not None:
                    apply(held[0], held[1], not plan.first_covers_k)
            else:
                _wait(pending_dkv, clock)  # the accumulator of the block now held, from the previous rank
                held, spare = spare, held
                if apply is not None:
                    apply(held[0], held[1], True)
            if dgathered is not None:
                mine = held[:, split * kv_heads : tk * kv_heads].view(2, tk - split, kv_heads, dim)
                part = dgathered.index_select(1, index[(p - s) % r])
                if s == 0:
                    mine.copy_(part)
                else:
                    mine.add_(part)
            pending_dkv = _exchange(held, spare, nxt_rank, prv_rank, group)
            _wait(pending_kv, clock)
            cur, nxt = nxt, cur
        _wait(pending_dkv, clock)
        grads = spare[:, : tk * kv_heads].view(2, *k.shape)
        dk = grads[0].to(k.dtype, copy=True)
        dv = grads[1].to(v.dtype, copy=True)
        return dq[: t * heads].view(q.shape).to(q.dtype), dk, dv, *(None,) * 6


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    peers: tuple[int, ...],
    *,
    scale: float,
    pool: BufferPool,
    clock: CommClock | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Ring attention over ``peers`` (global ranks in ring order) on a ring-level zigzag shard.

    Args:
        q: ``[t, H, D]`` local queries (token-major, contiguous).
        k: ``[t, Hkv, D]`` local keys (``H`` a multiple of ``Hkv``).
        v: ``[t, Hkv, D]`` local values.
        plan: The microbatch's plan (kernel, ring position and every step's rows).
        peers: Global ranks of the ring, ``peers[plan.layout.pos]`` being this rank.
        scale: Softmax scale.
        pool: Communication buffers.
        clock: Accumulates the time spent waiting for transfers (default: a throw-away clock).
        group: The process group the transfers run on (default: the default group).

    Returns:
        ``[t, H, D]`` attention output for the local queries.
    """
    return _RingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), plan, peers, scale, pool, clock or CommClock(), group
    )
