"""The inner Ulysses step: an all-to-all inside a node that gathers the sequence and scatters the heads.

Member ``j = p * u + i`` holds zigzag chunks ``j`` and ``2d-1-j`` of every sequence. After the all-to-all, the
``u`` members of ring position ``p`` together hold, for ``H / u`` heads each, chunks ``p*u .. p*u+u-1`` (super-chunk
``p``) and ``2d-1-(p*u+u-1) .. 2d-1-p*u`` (super-chunk ``2r-1-p``): an ordinary zigzag layout of degree ``r`` over
``2r`` super-chunks. The second halves arrive from members ``i = 0..u-1`` in *descending* chunk order, so they
are reversed into ascending order here, and back before the return all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hydra.cp.groups import CommClock
from lightning_hydra.cp.layout import ZigzagMeta

__all__ = ["gathered_order", "ulysses_gather", "ulysses_scatter"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 split in equal parts; its adjoint is the same all-to-all."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, group: dist.ProcessGroup | None, clock: CommClock
    ) -> torch.Tensor:
        ctx.group, ctx.clock = group, clock
        x = x.contiguous()
        out = torch.empty_like(x)
        with clock.measure():
            dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        with ctx.clock.measure():
            dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None, None


def gathered_order(meta: ZigzagMeta, ulysses: int) -> torch.Tensor:
    """Row order that turns the received ``[u, t]`` rows (member-major) into the gathered zigzag layout.

    Per sequence: first halves from members ``0..u-1``, then second halves from members ``u-1..0``.
    """
    t = meta.shard_len
    order = []
    off = 0
    for c in meta.chunks:
        first = [torch.arange(i * t + off, i * t + off + c) for i in range(ulysses)]
        second = [torch.arange(i * t + off + c, i * t + off + 2 * c) for i in reversed(range(ulysses))]
        order.extend(first + second)
        off += 2 * c
    return torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)


def ulysses_gather(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    ulysses: int,
    order: torch.Tensor,
    clock: CommClock | None = None,
) -> torch.Tensor:
    """``[t, H, D]`` member shard -> ``[u * t, H / u, D]`` ring-level shard for this member's head slice."""
    t, heads, dim = x.shape
    parts = x.view(t, ulysses, heads // ulysses, dim).transpose(0, 1)  # [u, t, H/u, D]: part i goes to member i
    received = _AllToAll.apply(parts, group, clock or CommClock())  # [u, t, H/u, D]: part i came from member i
    return received.reshape(ulysses * t, heads // ulysses, dim).index_select(0, order.to(x.device))


def ulysses_scatter(
    y: torch.Tensor,
    group: dist.ProcessGroup | None,
    ulysses: int,
    order: torch.Tensor,
    clock: CommClock | None = None,
) -> torch.Tensor:
    """Inverse of :func:`ulysses_gather`: ``[u * t, H / u, D]`` -> ``[t, H, D]``."""
    rows, heads_part, dim = y.shape
    t = rows // ulysses
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), dtype=order.dtype)
    back = y.index_select(0, inverse.to(y.device))
    # part i: my tokens, heads slice i
    received = _AllToAll.apply(back.view(ulysses, t, heads_part, dim), group, clock or CommClock())
    return received.transpose(0, 1).reshape(t, ulysses * heads_part, dim)
