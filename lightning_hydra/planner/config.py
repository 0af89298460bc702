"""The planner settings a run uses, in one keyword-only object shared by the strategy and the DataModule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.plan import Plan
from lightning_hydra.planner.policies import schedule

__all__ = ["BatchPlanner", "PlannerConfig"]


@dataclass(kw_only=True)
class PlannerConfig:
    """How global batches are planned onto the pool."""

    policy: str = "hydra"
    """``"hydra"`` (load-driven), ``"mcore"`` (Megatron-Core Dynamic-CP) or ``"static"`` (one fixed degree)."""
    max_tokens_per_rank: int = 4096
    """Capacity: tokens one rank may hold in one microbatch (zigzag padding included)."""
    num_microbatches: int = 1
    """Microbatches (gradient-accumulation passes) per optimizer step; ``mcore`` and spills may use more."""
    ranks_per_node: int = 8
    """Ranks per node; Ulysses groups stay inside one."""
    max_ulysses: int | None = None
    """Cap on the Ulysses degree (``None``: the node size)."""
    max_ring: int | None = None
    """Cap on the ring degree (``None``: no cap)."""
    max_seq_len: int | None = None
    """Longest sequence the run allows (sizes the ``static`` degree); ``None``: each batch's longest."""
    cost: CostModel | None = None
    """Cost model of the loads (``None``: an analytic default from the model shape)."""
    pipeline_stages: int = 1
    """Pipeline stages the plan's microbatches flow through: with more than one, ``hydra`` scores a plan by its
    1F1B step time (the sum of microbatch maxima plus ``P - 1`` times the largest), so it favours equal microbatch
    maxima and at least as many microbatches as asked."""
    mcore_budget: float | None = None
    """Largest ``sequences * sqrt(ranks)`` for which ``hydra`` also forms Megatron's placement as a candidate (and
    is then never predicted worse than it); ``None``: the defaults (``hydra.MCORE_BUDGET``, small batches; where
    hydra's choice would otherwise be its memory-driven formation or within ``hydra.MCORE_REACH`` of it up to
    ``hydra.MCORE_BUDGET_MEMORY``, where forming it whole takes up to 3.3x hydra's plan without it, 2,048 ranks x
    74,000 sequences, less where a bound stops it), ``0``: never."""

    def schedule(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        world_size: int,
        cost: CostModel,
        num_heads: int | None,
        num_kv_heads: int | None,
        seed: int,
    ) -> Plan:
        """Plan one global batch with these settings (see :func:`lightning_hydra.planner.schedule`)."""
        return schedule(
            lengths,
            world_size=world_size,
            num_microbatches=self.num_microbatches,
            max_tokens_per_rank=self.max_tokens_per_rank,
            cost=cost,
            policy=self.policy,
            ranks_per_node=self.ranks_per_node,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            seed=seed,
            max_ulysses=self.max_ulysses,
            max_ring=self.max_ring,
            max_seq_len=self.max_seq_len,
            pipeline_stages=self.pipeline_stages,
            mcore_budget=self.mcore_budget,
        )


@dataclass(frozen=True, kw_only=True)
class BatchPlanner:
    """A :class:`PlannerConfig` bound to a pool: everything a global batch's plan depends on but its lengths, seed
    and cost model. Pure and picklable, so a planning thread or a planning process
    (:mod:`lightning_hydra.planner.worker`) computes the plan a runtime would."""

    config: PlannerConfig
    """The planner settings."""
    world_size: int
    """Ranks of the CP pool (one pipeline stage's)."""
    num_heads: int | None = None
    """Attention heads of the model (they bound the Ulysses degree; ``None``: unknown)."""
    num_kv_heads: int | None = None
    """Key/value heads of the model (``None``: as many as ``num_heads``)."""
    whole_batch: bool = False
    """Plan the whole batch into one microbatch on one rank (its capacity raised to the batch's tokens): a run
    without the strategy."""

    def plan(self, lengths: Sequence[int] | np.ndarray, *, seed: int, cost: CostModel) -> Plan:
        """The plan of one global batch of ``lengths`` (the same on every rank and in any process)."""
        config = self.config
        if self.whole_batch:
            capacity = sum(shard_tokens(int(n), 1) for n in lengths)
            config = replace(config, max_tokens_per_rank=max(capacity, 1))
        return config.schedule(
            lengths,
            world_size=self.world_size,
            cost=cost,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            seed=seed,
        )
