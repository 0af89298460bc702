"""A rank's memory budget and the token capacity it leaves (``max_tokens_per_rank="auto"``), for the strategy.

The arithmetic is :mod:`lightning_hydra.planner.memory` (pure, shared with ``lightning-hydra plan --memory``); this
module supplies what only a running strategy knows: the model's shape and parameter count, the device's memory,
the Trainer's precision and how many communicators the rank belongs to.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_hydra.planner.memory import MemoryBreakdown, ModelMemoryShape, memory_capacity

__all__ = ["configure_cuda_allocator", "device_budget", "memory_shape", "pool_memory"]

NCCL_COMMUNICATOR_BYTES = 0.5e9
"""Bytes charged per NCCL communicator (about what one takes on A100s; gloo's are charged nothing)."""


def memory_shape(module: Any) -> ModelMemoryShape:
    """The memory model's view of a :class:`~lightning_hydra.HydraModule`: its shape and parameter count."""
    shape = getattr(module, "model_shape", None)
    if not callable(shape):
        raise TypeError(f"{type(module).__name__} has no model_shape(): subclass lightning_hydra.HydraModule")
    s = dict(shape())
    hidden, heads = int(s["hidden_size"]), int(s["num_heads"])
    return ModelMemoryShape(
        num_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
        hidden_size=hidden,
        num_layers=int(s["num_layers"]),
        num_heads=heads,
        num_kv_heads=int(s.get("num_kv_heads") or heads),
        ffn_hidden_size=int(s.get("ffn_hidden_size") or 4 * hidden),
        vocab_size=int(s.get("vocab_size") or 32000),
        selective=getattr(module, "selective_checkpointing", "units"),
    )


def device_budget(device: torch.device, *, memory_budget: int | None, local_ranks: int) -> float:
    """Bytes a rank may use: ``memory_budget`` when given, else the GPU's memory, else the host's RAM shared by the
    ranks on it.

    Args:
        device: The rank's device.
        memory_budget: The user's budget in bytes (``None``: the device's).
        local_ranks: Ranks on this host (CPU runs share its RAM).
    """
    if memory_budget is not None:
        return float(memory_budget)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(local_ranks, 1)


def pool_memory(
    module: Any,
    *,
    device: torch.device,
    budget: float,
    precision: str,
    sharding: str,
    checkpointing: str,
    pool: int,
    ranks_per_node: int,
    num_microbatches: int,
    pipeline_stages: int,
    ulysses_blocks: int,
    tensor_parallel: int = 1,
    sequence_parallel: bool = True,
) -> MemoryBreakdown:
    """The memory model for ``module`` on one rank of a pool (pure; see
    :func:`lightning_hydra.planner.memory.memory_capacity` for the terms).

    Args:
        module: The :class:`~lightning_hydra.HydraModule` (a stage's share of it is charged with ``1 / P``).
        device: The rank's device (NCCL communicators are charged on CUDA only).
        budget: Bytes of the rank (:func:`device_budget`).
        precision: The Trainer's precision.
        sharding: The strategy's sharding mode.
        checkpointing: The activation checkpointing mode.
        pool: Ranks of one pipeline stage's pool.
        ranks_per_node: Ranks per node.
        num_microbatches: Microbatches per step.
        pipeline_stages: Pipeline stages.
        ulysses_blocks: Ulysses communicators this rank belongs to.
        tensor_parallel: TP degree (``pool`` counts TP groups; state and activations per rank divide as
            :mod:`lightning_hydra.planner.memory` says).
        sequence_parallel: Sequence-parallel norms under TP (norm and residual-stream activations ``1 / T``; no
            effect at ``T = 1``).
    """
    return memory_capacity(
        memory_shape(module),
        budget=budget,
        sharding=sharding,
        precision=precision,
        checkpointing=checkpointing,
        world_size=pool,
        ranks_per_node=min(ranks_per_node, pool),
        num_microbatches=num_microbatches,
        optimizer=getattr(module, "optimizer_name", "adamw"),
        ulysses_blocks=ulysses_blocks,
        communicator_bytes=NCCL_COMMUNICATOR_BYTES if device.type == "cuda" else 0.0,
        pipeline_stages=pipeline_stages,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
    )


def configure_cuda_allocator(device: torch.device) -> bool:
    """On CUDA, turn on ``expandable_segments`` (shapes change every step; the caching allocator fragments) unless
    the user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``). Returns whether it
    did. Not yet run on a GPU."""
    if device.type != "cuda" or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return False
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return True
