"""The ``static`` baseline: one fixed CP degree for the whole run, bins packed by token count."""

from __future__ import annotations

import heapq

import numpy as np

from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.plan import Group, Plan, PlanError
from lightning_hydra.planner.request import PlanRequest

__all__ = ["schedule_static"]


def schedule_static(req: PlanRequest) -> Plan:
    """Static CP: degree = the memory minimum of the longest allowed sequence, for every sequence.

    The pool is cut into ``N / d`` aligned groups; each microbatch has one bin per group. Sequences, longest
    first, are dealt in rounds to the bins holding the fewest tokens (one each per round: a token-balancing
    longest-first fill of all bins of the asked microbatches, vectorised); a sequence whose bin has no room goes to
    the emptiest bin with room, and one no bin can take opens a further microbatch.
    """
    longest = int(req.max_seq_len or req.lengths.max())
    degree = req.rules.memory_min(longest, req.capacity)
    if degree is None:
        raise PlanError(f"the longest allowed sequence ({longest} tokens) fits no degree of the pool")
    groups_per_mb = req.world_size // degree
    order = np.argsort(-req.lengths, kind="stable")
    need = shard_tokens(req.lengths[order], np.asarray(degree))
    held = np.zeros(req.num_microbatches * groups_per_mb, dtype=np.int64)
    where = np.full(order.size, -1, dtype=np.int64)
    failed = []
    for start in range(0, order.size, held.size):
        take = min(held.size, order.size - start)
        bins = np.argsort(held, kind="stable")[:take]
        fits = held[bins] + need[start : start + take] <= req.capacity
        held[bins[fits]] += need[start : start + take][fits]
        where[start : start + take][fits] = bins[fits]
        failed += (start + np.flatnonzero(~fits)).tolist()
    heap = [(int(t), b) for b, t in enumerate(held.tolist())]
    heapq.heapify(heap)
    for k in failed:  # rare: the emptiest bin with room, or a further microbatch of empty bins
        if heap[0][0] + int(need[k]) > req.capacity:
            for b in range(held.size, held.size + groups_per_mb):
                heapq.heappush(heap, (0, b))
            held = np.concatenate([held, np.zeros(groups_per_mb, dtype=np.int64)])
        tokens, b = heapq.heappop(heap)
        where[k] = b
        heapq.heappush(heap, (tokens + int(need[k]), b))
    placed = np.argsort(where, kind="stable")
    cuts = np.searchsorted(where[placed], np.arange(held.size + 1))
    seqs = order[placed].tolist()
    microbatches: list[list[Group]] = []
    for m in range(held.size // groups_per_mb):
        groups = [
            req.group(k * degree, degree, seqs[cuts[m * groups_per_mb + k] : cuts[m * groups_per_mb + k + 1]])
            for k in range(groups_per_mb)
        ]
        microbatches.append(req.fill_idle(groups))
    return req.plan(microbatches, "static", degree=float(degree))
