"""The validated input every policy receives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import DegreeRules
from lightning_hydra.planner.order import stable_argsort
from lightning_hydra.planner.plan import Group, Plan, PlanError

__all__ = ["PlanRequest"]


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One global batch to schedule, checked once by :func:`lightning_hydra.planner.schedule`."""

    lengths: np.ndarray
    """Sequence lengths (int64, all positive)."""
    num_microbatches: int
    """Microbatches asked for."""
    capacity: int
    """Tokens one rank may hold in one microbatch."""
    cost: CostModel
    """Cost model used to predict loads."""
    rules: DegreeRules
    """Allowed degrees and their factorization."""
    seed: int = 0
    """Seed for any tie-breaking randomness (policies here are deterministic without it)."""
    max_seq_len: int | None = None
    """Longest sequence the run allows (sizes the static degree); ``None`` means the batch's longest."""
    pipeline_stages: int = 1
    """Pipeline stages the microbatches flow through (1: data-parallel accumulation)."""
    mcore_budget: float | None = None
    """Largest ``sequences * sqrt(ranks)`` for which ``hydra`` also forms Megatron's placement as a candidate
    (``None``: :data:`lightning_hydra.planner.hydra.MCORE_BUDGET`, and ``MCORE_BUDGET_MEMORY`` where hydra's choice
    would otherwise be its memory-driven formation or within ``MCORE_REACH`` of it; ``0``: never)."""

    @property
    def world_size(self) -> int:
        """Ranks in the pool."""
        return self.rules.world_size

    def within(self, budget: float) -> bool:
        """Whether the batch's ``sequences * sqrt(ranks)``, the size every planning budget counts (``hydra``'s
        ``*_BUDGET``, :data:`~lightning_hydra.planner.tables.RAISE_BUDGET`), is at most ``budget``."""
        return self.lengths.size * math.sqrt(self.world_size) <= budget

    @cached_property
    def longest_first(self) -> np.ndarray:
        """Indices of the sequences, longest first (ties in index order): ``np.argsort(-lengths, kind="stable")``,
        computed once per request in linear time."""
        order = stable_argsort(self.lengths.max() - self.lengths) if self.lengths.size else np.zeros(0, np.int64)
        order.setflags(write=False)  # shared by every policy and candidate of the request
        return order

    @cached_property
    def one_rank_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`CostModel.pair_parts` of every sequence on one rank, computed once per request (every degree set
        starts at one rank; read-only)."""
        ones = np.ones(self.lengths.size, dtype=np.int64)
        base, net = self.cost.pair_parts(self.lengths, ones, ones)
        base.setflags(write=False)
        net.setflags(write=False)
        return base, net

    def group(self, start: int, size: int, seq_ids: list[int] | tuple[int, ...] = ()) -> Group:
        """A contiguous group of ``size`` ranks from ``start``, factored into Ulysses x ring."""
        factors = self.rules.factor(size, start)
        if factors is None:
            raise PlanError(
                f"degree {size} at rank {start} cannot be split into ulysses x ring "
                f"(heads={self.rules.num_heads}, ranks_per_node={self.rules.ranks_per_node}, "
                f"max_ring={self.rules.max_ring})"
            )
        return Group._of(tuple(range(start, start + size)), factors[0], factors[1], tuple(int(i) for i in seq_ids))

    def plan(self, microbatches: list[list[Group]], policy: str, **stats: float | str) -> Plan:
        """Wrap groups into a :class:`Plan` with groups sorted by first rank."""
        ordered = [sorted(groups, key=lambda g: g.ranks[0]) for groups in microbatches]
        return Plan(
            lengths=tuple(np.asarray(self.lengths, dtype=np.int64).tolist()),
            world_size=self.world_size,
            ranks_per_node=self.rules.ranks_per_node,
            microbatches=ordered,
            policy=policy,
            stats=dict(stats),
        )

    def fill_idle(self, groups: list[Group]) -> list[Group]:
        """Add idle groups (no sequences) for ranks not covered, as aligned power-of-two blocks."""
        n = self.world_size + 1
        starts = np.bincount(np.asarray([g.ranks[0] for g in groups], dtype=np.int64), minlength=n)
        ends = np.bincount(np.asarray([g.ranks[-1] + 1 for g in groups], dtype=np.int64), minlength=n)
        covered = (np.cumsum(starts[:n] - ends[:n]) > 0).astype(np.int8)  # ranks inside some group
        covered[-1] = 1  # a sentinel that ends the last run
        # runs of uncovered ranks: [start, end)
        edges = np.flatnonzero(np.diff(np.concatenate([[1], covered])))
        out = list(groups)
        for start, end in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=False):
            out += self.idle_groups(start, end)
        return out

    def idle_groups(self, start: int, end: int) -> list[Group]:
        """Idle groups (no sequences) covering ranks ``start`` to ``end - 1``: from ``start`` on, each the largest
        power-of-two block that is aligned to its size, stays below ``end`` and factors."""
        out = []
        rank = start
        while rank < end:
            size = 1
            while rank % (size * 2) == 0 and rank + size * 2 <= end and self.rules.factor(size * 2, rank):
                size *= 2
            out.append(self.group(rank, size))
            rank += size
        return out
