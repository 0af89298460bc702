"""The CP context: which group and bin the current microbatch runs on, held on an object, not in globals.

The strategy owns one :class:`CPContext` and sets it for every microbatch; attention layers hold a reference to it
(given by :func:`apply_cp`, taken back by :func:`remove_cp`) and call :meth:`CPContext.attention`. Without a
strategy a layer uses a context of its own: degree 1 on the calling rank.

Entering a microbatch (:meth:`CPContext.use`) computes its host-side layout once; the first attention call of the
microbatch builds the device-side plan (index tensors, kernel boundaries) and every later layer, forward and
backward, reuses it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hydra.cp.attention import attend, autocast_inputs, check_inputs, plan_for
from lightning_hydra.cp.groups import CPGroup
from lightning_hydra.cp.kernels import KERNEL_NAMES, AttentionKernel, select_kernel
from lightning_hydra.cp.plan import AttentionPlan, MicrobatchLayout

__all__ = ["CPContext", "Microbatch", "apply_cp", "remove_cp"]


@dataclass(frozen=True)
class Microbatch:
    """What attention needs to know about the bin being processed, and the plans built for it."""

    group: CPGroup
    """The CP group of this rank in this microbatch."""
    cu_seqlens: tuple[int, ...]
    """Unpadded sequence boundaries of the whole bin."""
    rank: int = 0
    """This process's global rank."""
    layout: MicrobatchLayout | None = field(default=None, compare=False)
    """Host-side geometry (computed when the microbatch is entered)."""
    plans: dict[tuple[Any, ...], AttentionPlan] = field(default_factory=dict, compare=False, repr=False)
    """Device-side plans by ``(kernel, device, causal, heads, kv_heads)``, built on first use."""


class CPContext:
    """The current microbatch's CP group and bin, set by its owner around each forward."""

    def __init__(self, kernel: str = "auto") -> None:
        """Args:
        kernel: Attention kernel preference, one of :data:`~lightning_hydra.cp.kernels.KERNEL_NAMES`.
        """
        if kernel not in KERNEL_NAMES:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNEL_NAMES)}")
        self.kernel = kernel
        self.current: Microbatch | None = None
        self._kernels: dict[torch.device, AttentionKernel] = {}

    def kernel_for(self, device: torch.device) -> AttentionKernel:
        """The kernel this context uses on ``device`` (chosen once per device)."""
        kern = self._kernels.get(device)
        if kern is None:
            kern = self._kernels[device] = select_kernel(device, self.kernel)
        return kern

    @contextmanager
    def use(self, group: CPGroup, cu_seqlens: Sequence[int]) -> Iterator[Microbatch]:
        """Make ``(group, cu_seqlens)`` current for the duration of the block (yields the :class:`Microbatch`).

        The microbatch's layout is computed here, once; its device plans on the first attention call.
        """
        rank = dist.get_rank() if dist.is_initialized() else 0
        cu = tuple(int(x) for x in cu_seqlens)
        layout = MicrobatchLayout(cu, group.ulysses, group.ring, group.member(rank))
        previous = self.current
        self.current = Microbatch(group, cu, rank, layout)
        try:
            yield self.current
        finally:
            self.current = previous

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
    ) -> torch.Tensor:
        """CP attention of this rank's shard ``[t, H, D]`` for the current microbatch (under ``torch.autocast`` in
        autocast's dtype, q, k and v cast to it first: :func:`~lightning_hydra.cp.attention.autocast_inputs`).

        Args:
            q: ``[t, H, D]`` queries.
            k: ``[t, Hkv, D]`` keys.
            v: ``[t, Hkv, D]`` values.
            causal: Causal attention within each sequence.
            scale: Softmax scale (default ``D ** -0.5``).
        """
        mb = self.current
        if mb is None or mb.layout is None:
            raise RuntimeError("no CP microbatch is active: run the forward inside CPContext.use(group, cu_seqlens)")
        q, k, v = autocast_inputs(q, k, v)
        check_inputs(q, k, v, mb.group, mb.layout)
        kern = self.kernel_for(q.device)
        kern.check_dtype(q.dtype)
        key = (kern.name, q.device, bool(causal), q.shape[1], k.shape[1])
        plan = mb.plans.get(key)
        if plan is None:
            plan = mb.plans[key] = plan_for(mb.layout, kern, q, k, bool(causal), mb.group.ulysses)
        softmax_scale = q.shape[2] ** -0.5 if scale is None else float(scale)
        return attend(q, k, v, group=mb.group, rank=mb.rank, plan=plan, scale=softmax_scale)

    @staticmethod
    def local_group() -> CPGroup:
        """A degree-1 group on the calling rank (no communication)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return CPGroup((rank,), 1, 1)


_ATTR = "hydra_cp"
_SAVED = "_hydra_cp_before"


def apply_cp(model: nn.Module, context: CPContext) -> int:
    """Point every CP-aware module of ``model`` (those with a ``hydra_cp`` attribute) at ``context``.

    Returns:
        How many modules were wrapped. Undo with :func:`remove_cp`.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, _ATTR):
            if not hasattr(module, _SAVED):
                object.__setattr__(module, _SAVED, getattr(module, _ATTR))
            object.__setattr__(module, _ATTR, context)
            count += 1
    return count


def remove_cp(model: nn.Module) -> int:
    """Undo :func:`apply_cp`: give every wrapped module its own context back."""
    count = 0
    for module in model.modules():
        if hasattr(module, _SAVED):
            object.__setattr__(module, _ATTR, getattr(module, _SAVED))
            object.__delattr__(module, _SAVED)
            count += 1
    return count
