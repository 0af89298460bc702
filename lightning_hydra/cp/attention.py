"""``hydra_attn_func``: attention over a packed bin sharded in the zigzag layout, Ulysses nested in a ring."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from lightning_hydra.cp.groups import CPGroup
from lightning_hydra.cp.kernels import AttentionKernel, select_kernel
from lightning_hydra.cp.plan import AttentionPlan, MicrobatchLayout
from lightning_hydra.cp.ring import ring_attention
from lightning_hydra.cp.ulysses import ulysses_gather, ulysses_scatter

__all__ = ["attend", "autocast_inputs", "check_inputs", "hydra_attn_func", "kv_replication"]


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


def autocast_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k``, ``v`` as the engine takes them: in autocast's dtype when autocast is on for their device, as
    torch's ``scaled_dot_product_attention`` takes its inputs (a lower-precision op under autocast); unchanged
    otherwise.

    Under ``bf16-mixed`` without FSDP the residual stream is float32: RoPE's float32 cos/sin (or a model's own
    float32 rotation) promote q and k back to float32 while v leaves its projection in bf16. The cast is autograd's
    (``Tensor.to``): the engine's gradients come back in bf16 and reach float32 q and k as float32. Like autocast,
    it casts every floating dtype but float64 (left alone, for the kernel to refuse).

    Args:
        q: ``[t, H, D]`` queries.
        k: ``[t, Hkv, D]`` keys.
        v: ``[t, Hkv, D]`` values.
    """
    device_type = q.device.type
    if not (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
        return q, k, v  # no autocast on this device (``meta`` has none) or not enabled
    dtype = torch.get_autocast_dtype(device_type)

    def cast(x: torch.Tensor) -> torch.Tensor:
        eligible = x.is_floating_point() and x.dtype != torch.float64  # autocast's own rule (cached_cast)
        return x.to(dtype) if eligible and x.dtype != dtype else x

    return cast(q), cast(k), cast(v)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CPGroup, layout: MicrobatchLayout) -> None:
    """Raise ``ValueError`` for shapes that do not fit the group and the bin, ``TypeError`` for q, k, v of different
    dtypes (host checks only; after :func:`autocast_inputs`, which unifies them under autocast)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, heads, dim = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != dim:
        raise ValueError(f"k and v must be [{t}, Hkv, {dim}]; got {tuple(k.shape)} and {tuple(v.shape)}")
    if heads % k.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {k.shape[1]} KV heads")
    if heads % group.ulysses:
        raise ValueError(f"{heads} attention heads cannot be split over a Ulysses degree of {group.ulysses}")
    meta = layout.meta
    if t != meta.shard_len:
        raise ValueError(
            f"shard has {t} tokens but a degree-{group.degree} zigzag shard of sequences {list(meta.lengths)[:8]} "
            f"has {meta.shard_len}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype} (under torch.autocast the engine "
            "casts them to autocast's dtype, as scaled_dot_product_attention does; outside it, cast them yourself)"
        )


def plan_for(
    layout: MicrobatchLayout, kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, causal: bool, ulysses: int
) -> AttentionPlan:
    """A fresh plan for these inputs (callers with a microbatch cache it: see :class:`CPContext`)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    f = kv_replication(heads, kv_heads, ulysses)
    return AttentionPlan.build(
        layout, kernel, q.device, causal=causal, heads=heads // ulysses, kv_heads=kv_heads * f // ulysses
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: CPGroup,
    rank: int,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """The engine behind :func:`hydra_attn_func` with a ready plan (inputs already checked)."""
    if q.shape[0] == 0:
        # an empty bin (every member is empty): nothing to attend, no communication; q, k and v all stay in the
        # graph, so that the backward reaches the same modules as on a rank with tokens (FSDP hooks count on it)
        return q * 0.0 + (k.sum() + v.sum()) * 0.0
    peers = group.ring_peers(rank)
    u = group.ulysses
    if u == 1:
        return ring_attention(
            q, k, v, plan, peers, scale=scale, pool=group.buffers, clock=group.clock, group=group.ring_group
        )
    f = kv_replication(q.shape[1], k.shape[1], u)
    if f > 1:
        k = k.repeat_interleave(f, dim=1)
        v = v.repeat_interleave(f, dim=1)
    pg = group.ulysses_groups[group.ulysses_block(rank)]
    q2, k2, v2 = ulysses_gather(q, k, v, pg, u, plan.order, plan.inverse, group.clock)
    out2 = ring_attention(
        q2, k2, v2, plan, peers, scale=scale, pool=group.buffers, clock=group.clock, group=group.ring_group
    )
    return ulysses_scatter(out2, pg, u, plan.order, plan.inverse, group.clock)


def hydra_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    group: CPGroup,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
) -> torch.Tensor:
    """Attention of this rank's zigzag shard of a bin, with the rest of the bin held by the other members.

    Every sequence attends only to itself (document masking). Differentiable; gradients are exact. Under
    ``torch.autocast`` q, k and v are first cast to autocast's dtype (:func:`autocast_inputs`), as torch's SDPA
    casts its inputs; the output then has that dtype. This builds the microbatch's plan (index tensors,
    boundaries) on every call; inside :meth:`CPContext.use` the plan is built once per microbatch and shared by
    every layer.

    Args:
        q: ``[t, H, D]`` this rank's shard of the queries (zigzag layout of degree ``group.degree``).
        k: ``[t, Hkv, D]`` keys (``H`` a multiple of ``Hkv``).
        v: ``[t, Hkv, D]`` values.
        cu_seqlens: *Unpadded* sequence boundaries of the whole bin (``0, L_0, L_0 + L_1, ...``), host values.
        group: The CP group (from :meth:`GroupCache.get`); the calling rank must be a member.
        causal: Causal attention within each sequence.
        softmax_scale: Scale of the scores (default ``D ** -0.5``).
        kernel: One of :data:`~lightning_hydra.cp.kernels.KERNEL_NAMES` or a kernel object. A name is resolved on
            every call (on CUDA with grouped KV heads, torch's kernel then probes the op once per call): in a loop,
            pass ``select_kernel(device, name)`` once, as :class:`~lightning_hydra.cp.context.CPContext` does.

    Returns:
        ``[t, H, D]``: this rank's shard of the output.

    Raises:
        ValueError: The rank is not in ``group``, heads do not split over the Ulysses degree, or the shard
            length does not match ``cu_seqlens`` and the degree.
        TypeError: A dtype the kernel cannot take, or q, k, v of different dtypes outside autocast.
    """
    q, k, v = autocast_inputs(q, k, v)
    rank = dist.get_rank() if dist.is_initialized() else 0
    member = group.member(rank)
    layout = MicrobatchLayout(cu_seqlens, group.ulysses, group.ring, member)
    check_inputs(q, k, v, group, layout)
    kern = select_kernel(q.device, kernel) if isinstance(kernel, str) else kernel
    kern.check_dtype(q.dtype)
    scale = q.shape[2] ** -0.5 if softmax_scale is None else float(softmax_scale)
    plan = plan_for(layout, kern, q, k, causal, group.ulysses)
    return attend(q, k, v, group=group, rank=rank, plan=plan, scale=scale)
