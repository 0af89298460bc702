"""``hydra_attn_func``: attention over a packed bin sharded in the zigzag layout, Ulysses nested in a ring."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_hydra.cp.groups import CPGroup
from lightning_hydra.cp.kernels import AttentionKernel, select_kernel
from lightning_hydra.cp.layout import ZigzagMeta
from lightning_hydra.cp.ring import RingLayout, ring_attention
from lightning_hydra.cp.ulysses import gathered_order, ulysses_gather, ulysses_scatter

__all__ = ["hydra_attn_func", "kv_replication"]


def kv_replication(num_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """How many times to replicate each KV head so that ``ulysses`` ranks can split them.

    1 when ``ulysses`` divides the KV heads; otherwise the smallest factor ``f`` of the GQA group size with
    ``num_kv_heads * f`` divisible by ``ulysses`` (each rank then holds the KV heads its query heads use).
    """
    if num_kv_heads % ulysses == 0:
        return 1
    group = num_heads // num_kv_heads
    for f in range(2, group + 1):
        if group % f == 0 and (num_kv_heads * f) % ulysses == 0:
            return f
    raise ValueError(f"{num_kv_heads} KV heads cannot be spread over ulysses {ulysses} for {num_heads} heads")


def hydra_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    *,
    group: CPGroup,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
) -> torch.Tensor:
    """Attention of this rank's zigzag shard of a bin, with the rest of the bin held by the other members.

    Every sequence attends only to itself (document masking). Differentiable; gradients are exact.

    Args:
        q: ``[t, H, D]`` this rank's shard of the queries (zigzag layout of degree ``group.degree``).
        k: ``[t, Hkv, D]`` keys (``H`` a multiple of ``Hkv``).
        v: ``[t, Hkv, D]`` values.
        cu_seqlens: *Unpadded* sequence boundaries of the whole bin (``0, L_0, L_0 + L_1, ...``).
        group: The CP group (from :meth:`GroupCache.get`); the calling rank must be a member.
        causal: Causal attention within each sequence.
        softmax_scale: Scale of the scores (default ``D ** -0.5``).
        kernel: ``"auto"``, ``"cpu"``, ``"flash"`` or a kernel object.

    Returns:
        ``[t, H, D]``: this rank's shard of the output.

    Raises:
        ValueError: The rank is not in ``group``, heads do not split over the Ulysses degree, or the shard
            length does not match ``cu_seqlens`` and the degree.
        TypeError: A dtype the kernel cannot take.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    member = group.member(rank)
    u, r = group.ulysses, group.ring
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != dim:
        raise ValueError(f"k and v must be [{t}, Hkv, {dim}]; got {tuple(k.shape)} and {tuple(v.shape)}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if heads % u:
        raise ValueError(f"{heads} attention heads cannot be split over a Ulysses degree of {u}")
    meta = ZigzagMeta.from_cu_seqlens(cu_seqlens, group.degree)
    if t != meta.shard_len:
        raise ValueError(
            f"shard has {t} tokens but a degree-{group.degree} zigzag shard of sequences {list(meta.lengths)[:8]} "
            f"has {meta.shard_len}"
        )
    kern = select_kernel(q.device, kernel) if isinstance(kernel, str) else kernel
    kern.check_dtype(q.dtype)
    scale = dim**-0.5 if softmax_scale is None else float(softmax_scale)
    peers = group.ring_peers(rank)
    layout = RingLayout(meta.lengths, tuple(u * c for c in meta.chunks), r, member // u)
    if u == 1:
        return ring_attention(
            q, k, v, layout, peers, causal=causal, scale=scale, kernel=kern, pool=group.buffers, clock=group.clock
        )

    f = kv_replication(heads, kv_heads, u)
    if f > 1:
        k = k.repeat_interleave(f, dim=1)
        v = v.repeat_interleave(f, dim=1)
    hk = k.shape[1]
    pg = group.ulysses_groups[group.ulysses_block(rank)]
    order = gathered_order(meta, u)
    # one all-to-all for q, k and v: member i receives, for its head slices, the whole super-chunk
    packed = torch.cat(
        [q.view(t, u, heads // u, dim), k.view(t, u, hk // u, dim), v.view(t, u, hk // u, dim)], dim=2
    ).view(t, heads + 2 * hk, dim)
    gathered = ulysses_gather(packed, pg, u, order, group.clock)
    q2, k2, v2 = gathered.split([heads // u, hk // u, hk // u], dim=1)
    out2 = ring_attention(
        q2.contiguous(),
        k2.contiguous(),
        v2.contiguous(),
        layout,
        peers,
        causal=causal,
        scale=scale,
        kernel=kern,
        pool=group.buffers,
        clock=group.clock,
    )
    return ulysses_scatter(out2, pg, u, order, group.clock)
