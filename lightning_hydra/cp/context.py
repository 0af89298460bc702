"""The CP context: which group and bin the current microbatch runs on, held on an object, not in globals.

The strategy owns one :class:`CPContext` and sets it for every microbatch; attention layers hold a reference to it
(given by :func:`apply_cp`, taken back by :func:`remove_cp`) and call :meth:`CPContext.attention`. Without a
strategy a layer uses a context of its own: degree 1 on the calling rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_hydra.cp.attention import hydra_attn_func
from lightning_hydra.cp.groups import CPGroup

__all__ = ["CPContext", "Microbatch", "apply_cp", "remove_cp"]


@dataclass(frozen=True)
class Microbatch:
    """What attention needs to know about the bin being processed."""

    group: CPGroup
    """The CP group of this rank in this microbatch."""
    cu_seqlens: tuple[int, ...]
    """Unpadded sequence boundaries of the whole bin."""


class CPContext:
    """The current microbatch's CP group and bin, set by its owner around each forward."""

    def __init__(self, kernel: str = "auto") -> None:
        """Args:
        kernel: Attention kernel name for :func:`hydra_attn_func` (``auto``, ``cpu``, ``flash``).
        """
        self.kernel = kernel
        self.current: Microbatch | None = None

    @contextmanager
    def use(self, group: CPGroup, cu_seqlens: Sequence[int]) -> Iterator[None]:
        """Make ``(group, cu_seqlens)`` current for the duration of the block."""
        previous = self.current
        self.current = Microbatch(group, tuple(int(x) for x in cu_seqlens))
        try:
            yield
        finally:
            self.current = previous

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
    ) -> torch.Tensor:
        """CP attention of this rank's shard ``[t, H, D]`` for the current microbatch."""
        if self.current is None:
            raise RuntimeError("no CP microbatch is active: run the forward inside CPContext.use(group, cu_seqlens)")
        return hydra_attn_func(
            q,
            k,
            v,
            self.current.cu_seqlens,
            group=self.current.group,
            causal=causal,
            softmax_scale=scale,
            kernel=self.kernel,
        )

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
