"""Selective activation checkpointing that never recomputes CP communication, and how a model's blocks are found.

Recomputing a block's attention in backward would repeat its all-to-alls and ring transfers. Selective
checkpointing recomputes only the norms and MLPs (in the reference decoder also the q/k/v and output
projections, see :class:`~lightning_hydra.models.decoder.Block`); the attention's output and log-sum-exp are kept.
For other models (Hugging Face Llama-family) every direct child of a transformer block whose class name ends in
``MLP`` or contains ``Norm`` runs under ``torch.utils.checkpoint``; the wrapping replaces the instance's ``forward``
and is undone by :func:`remove_selective_checkpointing` (module names and state-dict keys do not change).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "CHECKPOINTING_MODES",
    "apply_selective_checkpointing",
    "check_checkpointing_mode",
    "largest_module_list",
    "remove_selective_checkpointing",
    "selective_units",
]

CHECKPOINTING_MODES = ("none", "selective")
"""Values of ``HydraStrategy(activation_checkpointing=...)``."""

_WRAPPED = "_hydra_checkpointed"


def check_checkpointing_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`CHECKPOINTING_MODES`, else ``ValueError``."""
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing must be one of {list(CHECKPOINTING_MODES)}, got {mode!r}")
    return mode


def largest_module_list(module: nn.Module) -> list[nn.Module]:
    """The children of the ``nn.ModuleList`` holding the most parameters (a decoder's layers), or ``[]``."""
    best: nn.ModuleList | None = None
    best_size = 0
    for m in module.modules():
        if isinstance(m, nn.ModuleList) and len(m):
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = m, size
    return list(best) if best is not None else []


def selective_units(block: nn.Module) -> list[nn.Module]:
    """The children of ``block`` to recompute: MLPs and norms (never attention)."""
    out = []
    for child in block.children():
        name = type(child).__name__
        if "attention" in name.lower():
            continue
        if name.endswith("MLP") or "norm" in name.lower():
            out.append(child)
    return out


def _checkpointed_forward(module: nn.Module, *args, **kwargs):
    forward = type(module).forward
    if not module.training:
        return forward(module, *args, **kwargs)
    return checkpoint(forward, module, *args, use_reentrant=False, **kwargs)


def apply_selective_checkpointing(blocks: list[nn.Module]) -> int:
    """Recompute the :func:`selective_units` of every block in backward; returns how many units were wrapped."""
    count = 0
    for block in blocks:
        for unit in selective_units(block):
            if getattr(unit, _WRAPPED, False):
                continue
            unit.forward = functools.partial(_checkpointed_forward, unit)  # type: ignore[method-assign]
            object.__setattr__(unit, _WRAPPED, True)
            count += 1
    return count


def remove_selective_checkpointing(blocks: list[nn.Module]) -> int:
    """Undo :func:`apply_selective_checkpointing`; returns how many units were unwrapped."""
    count = 0
    for block in blocks:
        for unit in selective_units(block):
            if getattr(unit, _WRAPPED, False):
                del unit.forward
                object.__delattr__(unit, _WRAPPED)
                count += 1
    return count
