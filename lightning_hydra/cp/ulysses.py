"""The inner Ulysses step: an all-to-all inside a node that gathers the sequence and scatters the heads.

Member ``j = p * u + i`` holds zigzag chunks ``j`` and ``2d-1-j`` of every sequence. After the all-to-all, the
``u`` members of ring position ``p`` together hold, for ``H / u`` heads each, chunks ``p*u .. p*u+u-1`` (super-chunk
``p``) and ``2d-1-(p*u+u-1) .. 2d-1-p*u`` (super-chunk ``2r-1-p``): an ordinary zigzag layout of degree ``r`` over
``2r`` super-chunks. The second halves arrive from members ``i = 0..u-1`` in *descending* chunk order, so they
are reversed into ascending order here, and back before the return all-to-all. The order and its inverse are
device tensors of the microbatch's plan (:func:`lightning_hydra.cp.plan.gathered_order`), built once.

Queries, keys and values travel in one all-to-all; the reorder and the split into three contiguous tensors are one
gather, and the backward of a reorder is a gather by the inverse permutation (no scatter into zeros, which
autograd's ``index_select`` backward would do).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hydra.cp.groups import CommClock

__all__ = ["ulysses_gather", "ulysses_scatter"]


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


class _GatherSplit(torch.autograd.Function):
    """Rows of ``x [n, heads, D]`` in ``order``, split along heads into contiguous tensors."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, sizes: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        ctx.inverse = inverse
        return tuple(part.index_select(0, order) for part in x.split(list(sizes), dim=1))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        # a gather by the inverse permutation (measured faster than scattering into the slices with index_copy_)
        return torch.cat(grads, dim=1).index_select(0, ctx.inverse), None, None, None


class _PermuteRows(torch.autograd.Function):
    """``x.index_select(0, order)`` whose backward gathers by the inverse permutation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.inverse = inverse
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.index_select(0, ctx.inverse), None, None


def ulysses_gather(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    ulysses: int,
    order: torch.Tensor,
    inverse: torch.Tensor,
    clock: CommClock | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Member shards ``[t, H, D]`` / ``[t, Hkv, D]`` -> ring-level shards ``[u * t, H / u, D]`` / ``[u * t, Hkv / u,
    D]`` of this member's head slices, contiguous. ``order``/``inverse`` (on the inputs' device) are the plan's."""
    t, dim = q.shape[0], q.shape[2]
    sizes = tuple(x.shape[1] // ulysses for x in (q, k, v))
    # part i (head slice i of q, k and v) goes to member i; one copy builds the contiguous send buffer
    parts = torch.cat([x.view(t, ulysses, h, dim).transpose(0, 1) for x, h in zip((q, k, v), sizes, strict=True)], 2)
    received = _AllToAll.apply(parts, group, clock or CommClock())  # part i came from member i
    return _GatherSplit.apply(received.view(ulysses * t, sum(sizes), dim), order, inverse, sizes)


def ulysses_scatter(
    y: torch.Tensor,
    group: dist.ProcessGroup | None,
    ulysses: int,
    order: torch.Tensor,
    inverse: torch.Tensor,
    clock: CommClock | None = None,
) -> torch.Tensor:
    """Inverse of :func:`ulysses_gather` for the output: ``[u * t, H / u, D]`` -> ``[t, H, D]``."""
    rows, heads_part, dim = y.shape
    t = rows // ulysses
    back = _PermuteRows.apply(y, inverse, order)
    # part i: my tokens, heads slice i
    received = _AllToAll.apply(back.view(ulysses, t, heads_part, dim), group, clock or CommClock())
    return received.transpose(0, 1).reshape(t, ulysses * heads_part, dim)
