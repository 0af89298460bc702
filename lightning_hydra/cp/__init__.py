"""The CP engine: Ulysses (inner, all-to-all over heads) nested in a ring (outer, P2P), for packed
variable-length bins in the zigzag layout, forward and backward."""

from lightning_hydra.cp.attention import hydra_attn_func, kv_replication
from lightning_hydra.cp.context import CPContext, Microbatch, apply_cp, remove_cp
from lightning_hydra.cp.groups import BufferPool, CommClock, CPGroup, GroupCache
from lightning_hydra.cp.kernels import KERNEL_NAMES, AttentionKernel, available_kernels, select_kernel
from lightning_hydra.cp.layout import (
    ZigzagMeta,
    zigzag_positions,
    zigzag_shard,
    zigzag_source_index,
    zigzag_unshard,
)
from lightning_hydra.cp.plan import AttentionPlan, MicrobatchLayout

__all__ = [
    "KERNEL_NAMES",
    "AttentionKernel",
    "AttentionPlan",
    "BufferPool",
    "CPContext",
    "CPGroup",
    "CommClock",
    "GroupCache",
    "Microbatch",
    "MicrobatchLayout",
    "ZigzagMeta",
    "apply_cp",
    "available_kernels",
    "hydra_attn_func",
    "kv_replication",
    "remove_cp",
    "select_kernel",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_source_index",
    "zigzag_unshard",
]
