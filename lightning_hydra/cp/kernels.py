"""Attention kernels behind one small interface, and the choice between them.

A kernel prepares, once per microbatch and ring step, whatever it needs from the step's :class:`Segments` (index
tensors, boundaries, maximum lengths: :meth:`AttentionKernel.prepare`); the forward then computes the step's
partial attention and writes or merges it into the output accumulators, and the backward computes the step's
gradients given the *final* output and log-sum-exp (so that per-block gradients of a ring are exact).

Kernels (``KERNEL_NAMES`` are the valid preferences):

- ``cpu``: the CPU flash-attention op on runs of equal-sized sequences (:mod:`lightning_hydra.cp.cpu_kernel`);
- ``torch``: PyTorch's packed variable-length flash attention on CUDA, nothing to install (the default on CUDA);
- ``flash``: the flash-attn package on CUDA (optional extra ``lightning-hydra[cuda]``).

A query row with no visible key must carry ``lse = -inf``; plans drop segments without keys, so no kernel is asked
for one (the CPU op would return ``lse = 0``, flash kernels ``+inf``).

Optional: a kernel with a positive ``gather_limit`` attribute also implements ``prepare_gathered``,
``gathered_forward`` and ``gathered_backward`` (see :class:`~lightning_hydra.cp.cpu_kernel.CpuKernel`): sequences
whose padded length is at most the limit are attended once with their whole keys instead of block by block
(:mod:`lightning_hydra.cp.ring`). The CUDA kernels do not (one varlen call per step already serves every sequence).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_hydra.cp.blocks import Accumulator, Segments
from lightning_hydra.cp.cpu_kernel import CpuKernel
from lightning_hydra.cp.cuda_kernels import AtenSchemaError, FlashAttnKernel, TorchFlashKernel

__all__ = [
    "KERNEL_NAMES",
    "AttentionKernel",
    "CpuKernel",
    "FlashAttnKernel",
    "TorchFlashKernel",
    "available_kernels",
    "select_kernel",
]

log = logging.getLogger(__name__)

KERNEL_NAMES = ("auto", "cpu", "torch", "flash")
"""Valid kernel preferences: ``auto`` (``torch`` on CUDA, falling back to ``flash`` where torch has no flash
attention or its aten flash ops' schemas are not those the ``torch`` kernel calls; ``cpu`` on CPU) or a name."""


class AttentionKernel(Protocol):
    """Attention of the segments of one ring step over token-major ``[tokens, heads, dim]`` tensors."""

    name: str

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``TypeError`` for a dtype this kernel cannot take."""

    def prepare(self, seg: Segments, *, heads: int, kv_heads: int, device: torch.device) -> Any:
        """Everything the step needs that follows from its segments, on ``device`` (built once per microbatch)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Any, scale: float, acc: Accumulator, first: bool
    ) -> None:
        """Partial attention of the step: written into ``acc`` when ``first`` (the step covers every query row),
        merged by log-sum-exp otherwise."""

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        step: Any,
        scale: float,
        dq: torch.Tensor,
        dq_add: bool,
    ) -> Callable[[torch.Tensor, torch.Tensor, bool], None]:
        """Gradients of the step given the final ``out`` and flat ``lse`` (sink ``+inf``): query gradients go to the
        flat ``dq`` now; the returned function writes (or adds) key/value gradients into flat targets later."""


def _torch_flash_available() -> bool:
    check = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")) and (
        check is None or bool(check())
    )


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def available_kernels() -> list[str]:
    """Kernels usable in this process: ``cpu`` always; ``torch`` with CUDA torch; ``flash`` with flash-attn."""
    names = ["cpu"]
    if _torch_flash_available():
        names.append("torch")
    if torch.cuda.is_available() and _flash_attn_installed():
        names.append("flash")
    return names


def _torch_or_flash() -> AttentionKernel:
    """``auto`` on CUDA with torch's flash attention: the ``torch`` kernel, or ``flash`` (one log line, rank zero
    where a process group is up) when the aten ops' schemas differ from those the ``torch`` kernel calls."""
    try:
        return TorchFlashKernel()
    except AtenSchemaError as error:
        if not _flash_attn_installed():
            raise ValueError(f"{error}; no other CUDA attention kernel: pip install 'lightning-hydra[cuda]'") from None
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("%s; kernel='auto' falls back to the 'flash' kernel (flash-attn)", error)
        return FlashAttnKernel()


def select_kernel(device: torch.device | str, preference: str = "auto") -> AttentionKernel:
    """Pick the kernel for tensors on ``device`` (see :data:`KERNEL_NAMES`).

    Raises:
        ValueError: An unknown name, a kernel that cannot run on ``device`` or is not installed, or ``auto`` on
            CUDA with neither a usable ``torch`` kernel nor flash-attn.
        AtenSchemaError: ``torch`` chosen explicitly where the aten flash ops' schemas are not those it calls.
    """
    device = torch.device(device)
    if preference not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {preference!r}; choose one of {', '.join(KERNEL_NAMES)}")
    if preference == "auto":
        if device.type != "cuda":
            preference = "cpu"
        elif _torch_flash_available():
            return _torch_or_flash()
        elif _flash_attn_installed():
            preference = "flash"
        else:
            raise ValueError(f"torch {torch.__version__} has no flash attention and flash-attn is not installed")
    if preference == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu attention kernel needs CPU tensors, got {device}")
        return CpuKernel()
    if device.type != "cuda":
        raise ValueError(f"the {preference} attention kernel needs CUDA tensors, got {device}")
    if preference == "torch":
        if not _torch_flash_available():
            raise ValueError(f"torch {torch.__version__} was built without flash attention: use kernel='flash'")
        return TorchFlashKernel()
    if not _flash_attn_installed():
        raise ValueError("flash-attn is not installed: pip install 'lightning-hydra[cuda]'")
    return FlashAttnKernel()
