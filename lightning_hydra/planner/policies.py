"""The planner's entry point: check a batch and the pool, then run one scheduling policy on them.

:func:`schedule` validates its arguments (one clear error per malformed one), builds the
:class:`~lightning_hydra.planner.request.PlanRequest` every policy reads and checks the plan the policy returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import DegreeRules
from lightning_hydra.planner.hydra import schedule_hydra
from lightning_hydra.planner.mcore import schedule_mcore
from lightning_hydra.planner.plan import Plan, PlanError
from lightning_hydra.planner.request import PlanRequest
from lightning_hydra.planner.static import schedule_static

__all__ = ["POLICIES", "schedule"]

POLICIES = {"hydra": schedule_hydra, "mcore": schedule_mcore, "static": schedule_static}
"""Scheduling policies by name."""


def schedule(
    lengths: Sequence[int] | np.ndarray,
    *,
    world_size: int,
    num_microbatches: int,
    max_tokens_per_rank: int,
    cost: CostModel,
    policy: str = "hydra",
    ranks_per_node: int = 8,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    seed: int = 0,
    max_ulysses: int | None = None,
    max_ring: int | None = None,
    max_seq_len: int | None = None,
    pipeline_stages: int = 1,
    mcore_budget: float | None = None,
) -> Plan:
    """Plan one global batch: every sequence's CP degree, group and microbatch.

    Args:
        lengths: Token count of every sequence of the global batch.
        world_size: Ranks in the dynamic-CP pool.
        num_microbatches: Microbatches (gradient-accumulation passes) asked for; ``mcore`` and a spill may use more.
        max_tokens_per_rank: Capacity: tokens one rank may hold in one microbatch (zigzag padding included).
        cost: The cost model that predicts loads.
        policy: ``"hydra"``, ``"mcore"`` or ``"static"``.
        ranks_per_node: Ranks per node; Ulysses groups stay inside one.
        num_heads: Query heads, which the Ulysses degree must divide (``None``: no constraint).
        num_kv_heads: Key/value heads (must divide ``num_heads``); KV heads are replicated when Ulysses exceeds them.
        seed: Seed for tie-breaking (kept in the signature so that every policy is a function of it).
        max_ulysses: Cap on the Ulysses degree.
        max_ring: Cap on the ring degree.
        max_seq_len: Longest sequence the run allows (sizes the ``static`` degree); default the batch's longest.
        pipeline_stages: Stages the microbatches flow through (1F1B); ``hydra`` then scores plans by the pipeline's
            step time, not the sum of microbatch maxima alone.
        mcore_budget: Largest ``sequences * sqrt(world_size)`` for which ``hydra`` also forms Megatron's placement
            as a candidate (never predicted worse than it then; formed whole, 1.8-3.3x hydra's plan without it);
            ``None``: the defaults (:data:`lightning_hydra.planner.hydra.MCORE_BUDGET`, and ``MCORE_BUDGET_MEMORY``
            where hydra's choice would otherwise be its memory-driven formation or within ``MCORE_REACH`` of it),
            ``0``: never.

    Returns:
        The plan; it has passed :meth:`Plan.check`.

    Raises:
        ValueError: On malformed arguments (unknown policy, non-positive sizes, an empty batch, a sequence longer
            than ``max_seq_len``).
        PlanError: When no valid plan exists (a sequence larger than the pool, heads no degree can split, too few
            microbatches for the batch's tokens).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
    world_size, num_microbatches, max_tokens_per_rank, ranks_per_node, pipeline_stages = (
        _count(name, value)
        for name, value in (
            ("world_size", world_size), ("num_microbatches", num_microbatches),
            ("max_tokens_per_rank", max_tokens_per_rank), ("ranks_per_node", ranks_per_node),
            ("pipeline_stages", pipeline_stages),
        )
    )  # fmt: skip
    num_heads, num_kv_heads, max_ulysses, max_ring, max_seq_len = (
        None if value is None else _count(name, value)
        for name, value in (
            ("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("max_ulysses", max_ulysses),
            ("max_ring", max_ring), ("max_seq_len", max_seq_len),
        )
    )  # fmt: skip
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("the batch is empty: schedule needs at least one sequence length")
    if not np.issubdtype(arr.dtype, np.integer) and not np.all(np.equal(np.mod(arr, 1), 0)):
        raise ValueError("sequence lengths must be integers")
    arr = arr.astype(np.int64)
    if (arr <= 0).any():
        bad = int(np.flatnonzero(arr <= 0)[0])
        raise ValueError(f"sequence lengths must be positive; sequence {bad} has length {int(arr[bad])}")
    if world_size < 1 or ranks_per_node < 1 or max_tokens_per_rank < 1:
        raise ValueError("world_size, ranks_per_node and max_tokens_per_rank must be positive")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    if pipeline_stages < 1:
        raise ValueError(f"pipeline_stages must be at least 1, got {pipeline_stages}")
    if mcore_budget is not None and not mcore_budget >= 0:
        raise ValueError(f"mcore_budget must be a non-negative number or None, got {mcore_budget}")
    if world_size < ranks_per_node:
        if ranks_per_node % world_size:
            raise ValueError(
                f"a pool of {world_size} ranks smaller than one node must divide ranks_per_node={ranks_per_node}"
            )
        ranks_per_node = world_size
    elif world_size % ranks_per_node:
        raise ValueError(f"world_size {world_size} is not a multiple of ranks_per_node {ranks_per_node}")
    if num_heads is not None and num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    for name, cap in (("max_ulysses", max_ulysses), ("max_ring", max_ring)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be at least 1 (None: no cap), got {cap}")
    if num_kv_heads is not None and (num_heads is None or num_kv_heads < 1 or num_heads % num_kv_heads):
        raise ValueError(f"num_kv_heads={num_kv_heads} must be positive and divide num_heads={num_heads}")

    rules = DegreeRules(
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        num_heads=num_heads,
        max_ulysses=max_ulysses,
        max_ring=max_ring,
    )
    degrees = rules.degrees()
    if not degrees:
        raise PlanError(f"no degree of the pool can be factored as ulysses x ring for {num_heads} heads")
    longest = int(arr.max())
    if max_seq_len is not None and not longest <= max_seq_len:
        bad = int(np.argmax(arr))
        raise ValueError(
            f"sequence {bad} has {longest} tokens, over max_seq_len={max_seq_len}: the longest sequence the run "
            "allows must hold every sequence of the batch (cut or drop longer ones before planning)"
        )
    if rules.memory_min(longest, max_tokens_per_rank) is None:
        pool = degrees[-1] * max_tokens_per_rank
        raise PlanError(
            f"a sequence of {longest} tokens cannot fit: the largest degree the pool allows ({degrees[-1]}, for "
            f"heads={num_heads}, max_ring={max_ring}) holds {pool} tokens at {max_tokens_per_rank} per rank"
        )
    total = int(arr.sum())
    if total > num_microbatches * world_size * max_tokens_per_rank:
        raise PlanError(
            f"infeasible num_microbatches={num_microbatches}: the batch holds {total} tokens but the pool holds "
            f"{num_microbatches * world_size * max_tokens_per_rank} over {num_microbatches} microbatches"
        )
    req = PlanRequest(
        lengths=arr,
        num_microbatches=num_microbatches,
        capacity=max_tokens_per_rank,
        cost=cost,
        rules=rules,
        seed=seed,
        max_seq_len=max_seq_len,
        pipeline_stages=pipeline_stages,
        mcore_budget=mcore_budget,
    )
    plan = POLICIES[policy](req)
    plan.check(arr.tolist(), max_tokens_per_rank)
    return plan


def _count(name: str, value: object) -> int:
    """``value`` as an int: an int, a numpy integer or an integral float (``ValueError`` otherwise: a NaN number of
    microbatches made the planner loop for ever, found by fuzzing). Not :func:`lightning_hydra.errors.check_int`:
    ``schedule`` has always taken whole floats and documents ``ValueError`` for malformed arguments."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer | float | np.floating):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float | np.floating) and not (math.isfinite(value) and value == int(value)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)
