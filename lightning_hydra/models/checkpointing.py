"""Selective activation checkpointing that never recomputes CP communication, and how a model's blocks are found.

Recomputing a block's attention in backward would repeat its all-to-alls and ring transfers. Selective
checkpointing recomputes only the norms and MLPs (in the reference decoder also the q/k/v and output
projections, see :class:`~lightning_hydra.models.decoder.Block`); the attention's output and log-sum-exp are kept.
For other models (Hugging Face Llama-family) every direct child of a transformer block whose class name ends in
``MLP`` or contains ``Norm`` runs under ``torch.utils.checkpoint``; the wrapping replaces the instance's ``forward``
and is undone by :func:`remove_selective_checkpointing` (module names and state-dict keys do not change).

**Tensor parallelism's collectives in the recompute** (counted per block by ``tests/test_tp_communication.py``). A
recomputed piece repeats the TP collectives inside it, except a trailing one whose output backward does not need
(torch's non-reentrant checkpoint stops recomputing after the last tensor backward needs). Per block and backward:

- Hugging Face layers (units): none. A sequence-parallel norm's all-gather runs in a forward hook, outside the
  recomputed ``forward``, and the MLP's last operation is down's reduce-scatter (or all-reduce), which the
  recompute never reaches.
- The reference decoder's ``Block`` (``DecoderLM(selective_checkpointing="block")``, the default): under sequence
  parallelism both norms' all-gathers and o's reduce-scatter (three), without it o's all-reduce (one). Keeping them
  costs per token and block ``2 A h`` (the gathered norm outputs) plus ``A h / T`` (the residual after attention):
  a Llama-3-70B shape's selective bytes per block at ``T = 8`` grow 6.2x, and its capacity on 80 GB (zero3) falls
  from 79,360 to 15,616 tokens per rank, which is why this stays the default.
- ``DecoderLM(selective_checkpointing="block_tp")``: none. o and its collective run once, outside the recomputed
  pieces (the residual after it, a token shard under sequence parallelism, is what the MLP's piece starts from),
  and the norms' all-gathers' outputs are kept by the selective policy :func:`keep_gathers`
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, as torchtitan keeps its reduce-scatters').
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "CHECKPOINTING_MODES",
    "KEPT_COLLECTIVES",
    "apply_selective_checkpointing",
    "check_checkpointing_mode",
    "checkpoint_keeping_gathers",
    "keep_gathers",
    "keep_gathers_policy",
    "largest_module_list",
    "remove_selective_checkpointing",
    "selective_units",
]

CHECKPOINTING_MODES = ("none", "selective")
"""Values of ``HydraStrategy(activation_checkpointing=...)``."""

_WRAPPED = "_hydra_checkpointed"

KEPT_COLLECTIVES = frozenset({"all_gather_into_tensor", "all_gather_into_tensor_coalesced"})
"""The functional collectives (``torch.ops._c10d_functional``) whose outputs :func:`keep_gathers_policy` keeps."""


def keep_gathers_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective checkpoint policy: keep the outputs of functional all-gathers (:data:`KEPT_COLLECTIVES`: DTensor's
    gathers, a sequence-parallel norm's tokens), recompute everything else. The recompute then returns the kept
    tensor and issues no collective; waiting on it is a no-op (its work is done and unregistered)."""
    namespace, _, rest = str(func).partition(".")  # "_c10d_functional.all_gather_into_tensor.default"
    if namespace == "_c10d_functional" and rest.partition(".")[0] in KEPT_COLLECTIVES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_gathers() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` applying :func:`keep_gathers_policy` (a new pair of contexts per
    checkpointed call, as the API requires)."""
    return create_selective_checkpoint_contexts(keep_gathers_policy)


def checkpoint_keeping_gathers(function: Any, *args: Any) -> Any:
    """``function(*args)`` under non-reentrant checkpointing whose recompute keeps the all-gathers' outputs."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=keep_gathers)


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
