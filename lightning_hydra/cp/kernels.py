"""Attention kernels behind one small interface: variable-length forward returning the log-sum-exp, and the
backward that takes the final output and log-sum-exp (so that per-block gradients of a ring are exact).

- ``cpu``: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, one call per
  sequence (natural-log LSE in float32, top-left causal alignment, GQA supported natively).
- ``flash``: ``flash_attn``'s varlen functions on CUDA (optional extra ``lightning-hydra[cuda]``).

A query row with no visible key must carry ``lse = -inf`` (not 0, as the CPU op returns) or the log-sum-exp merge
is wrong; the CPU kernel never calls the op with an empty key set and returns ``-inf`` rows for one.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = [
    "KERNEL_NAMES",
    "AttentionKernel",
    "CpuFlashKernel",
    "FlashAttnKernel",
    "available_kernels",
    "select_kernel",
]

KERNEL_NAMES = ("auto", "cpu", "flash")
"""The kernel preferences :func:`select_kernel` accepts."""

log = logging.getLogger(__name__)

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class AttentionKernel(Protocol):
    """Variable-length attention over packed *head-major* ``[heads, tokens, dim]`` tensors with per-sequence
    boundaries (head-major is what the CPU op reads fastest; the flash kernel transposes)."""

    name: str

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``TypeError`` for a dtype this kernel cannot take."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: Sequence[int],
        cu_k: Sequence[int],
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out [H, tq, D] float32, lse [H, tq] float32)``; sequence ``i`` is ``q[:, cu_q[i]:cu_q[i+1]]``
        against ``k[:, cu_k[i]:cu_k[i+1]]``; causal masks are top-left aligned and only used with equal lengths."""

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        cu_q: Sequence[int],
        cu_k: Sequence[int],
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(dq, dk, dv)`` in float32 given the *final* ``out`` and ``lse`` of the rows in ``q``."""


class CpuFlashKernel:
    """The CPU flash-attention op, one call per sequence."""

    name = "cpu"

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``TypeError`` unless the CPU op supports ``dtype``."""
        if dtype not in _CPU_DTYPES:
            raise TypeError(f"the cpu attention kernel takes {_CPU_DTYPES}, not {dtype}")

    def forward(self, q, k, v, cu_q, cu_k, causal, scale):
        """See :meth:`AttentionKernel.forward`."""
        heads, tq = q.shape[0], q.shape[1]
        if len(cu_q) == 2 and cu_q[1] == tq and cu_k[1] == k.shape[1] and tq and k.shape[1]:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, scale=scale
            )
            return o[0].float(), lse[0]
        out = torch.zeros((heads, tq, v.shape[-1]), dtype=torch.float32, device=q.device)
        lse = torch.full((heads, tq), float("-inf"), dtype=torch.float32, device=q.device)
        for i in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            if q1 == q0 or k1 == k0:
                continue  # no visible key: out 0, lse -inf (the op would return lse 0 here)
            o, lse_i = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, q0:q1].unsqueeze(0), k[:, k0:k1].unsqueeze(0), v[:, k0:k1].unsqueeze(0), 0.0, causal, scale=scale
            )
            out[:, q0:q1] = o[0]
            lse[:, q0:q1] = lse_i[0]
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
        """See :meth:`AttentionKernel.backward`."""
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        if len(cu_q) == 2 and cu_q[1] == q.shape[1] and cu_k[1] == k.shape[1] and q.shape[1] and k.shape[1]:
            g = op(*(x.unsqueeze(0) for x in (dout, q, k, v, out, lse)), 0.0, causal, scale=scale)
            return g[0][0].float(), g[1][0].float(), g[2][0].float()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            if q1 == q0 or k1 == k0:
                continue
            g = op(
                dout[:, q0:q1].unsqueeze(0),
                q[:, q0:q1].unsqueeze(0),
                k[:, k0:k1].unsqueeze(0),
                v[:, k0:k1].unsqueeze(0),
                out[:, q0:q1].unsqueeze(0),
                lse[:, q0:q1].unsqueeze(0).contiguous(),
                0.0,
                causal,
                scale=scale,
            )
            dq[:, q0:q1] = g[0][0]
            dk[:, k0:k1] = g[1][0]
            dv[:, k0:k1] = g[2][0]
        return dq, dk, dv


class FlashAttnKernel:
    """flash-attn's varlen kernels (CUDA). Untested on this project's CPU-only machines: see the README."""

    name = "flash"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface

        self._api = flash_attn_interface

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``TypeError`` unless flash-attn supports ``dtype``."""
        if dtype not in _FLASH_DTYPES:
            raise TypeError(f"the flash attention kernel takes {_FLASH_DTYPES}, not {dtype}")

    @staticmethod
    def _cu(cu: Sequence[int], device: torch.device) -> tuple[torch.Tensor, int]:
        t = torch.as_tensor(list(cu), dtype=torch.int32, device=device)
        return t, int((t[1:] - t[:-1]).max().item()) if t.numel() > 1 else 0

    def forward(self, q, k, v, cu_q, cu_k, causal, scale):
        """See :meth:`AttentionKernel.forward`."""
        cq, mq = self._cu(cu_q, q.device)
        ck, mk = self._cu(cu_k, q.device)
        q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))  # flash-attn reads [tokens, heads, dim]
        out, lse, _ = self._api.flash_attn_varlen_func(
            q, k, v, cq, ck, mq, mk, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True
        )
        lse = lse.float()
        if lse.dim() == 3:  # older flash-attn: [batch, heads, max_seqlen] padded
            lse = torch.cat([lse[i, :, : cu_q[i + 1] - cu_q[i]] for i in range(len(cu_q) - 1)], dim=1)
        # sequences with no keys: flash-attn leaves lse at +inf/0 depending on version; force -inf
        empty = [i for i in range(len(cu_k) - 1) if cu_k[i + 1] == cu_k[i]]
        for i in empty:
            out[cu_q[i] : cu_q[i + 1]] = 0
            lse[:, cu_q[i] : cu_q[i + 1]] = float("-inf")
        return out.float().transpose(0, 1), lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
        """See :meth:`AttentionKernel.backward`."""
        cq, mq = self._cu(cu_q, q.device)
        ck, mk = self._cu(cu_k, q.device)
        dout, q, k, v, out = (x.transpose(0, 1).contiguous() for x in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._api._flash_attn_varlen_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out.to(q.dtype),
            lse.contiguous(),
            dq,
            dk,
            dv,
            cq,
            ck,
            mq,
            mk,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=None,
        )
        return dq.float().transpose(0, 1), dk.float().transpose(0, 1), dv.float().transpose(0, 1)


def available_kernels() -> list[str]:
    """Kernels usable in this process (``cpu`` always; ``flash`` with CUDA and flash-attn installed)."""
    names = ["cpu"]
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        names.append("flash")
    return names


def select_kernel(device: torch.device, preference: str = "auto") -> AttentionKernel:
    """Pick the kernel for tensors on ``device``: ``auto`` (flash-attn on CUDA, the CPU op on CPU), or a name.

    Raises:
        ValueError: An unknown name, or a kernel that cannot run on ``device``.
    """
    if preference not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {preference!r}; choose auto, cpu or flash")
    if preference == "auto":
        preference = "flash" if device.type == "cuda" else "cpu"
    if preference == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu attention kernel needs CPU tensors, got {device}")
        return CpuFlashKernel()
    if device.type != "cuda":
        raise ValueError(f"the flash attention kernel needs CUDA tensors, got {device}")
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError("flash-attn is not installed: pip install 'lightning-hydra[cuda]'")
    return FlashAttnKernel()
