"""The ``static`` baseline: one fixed CP degree for the whole run, bins packed by token count."""

from __future__ import annotations

import heapq

from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.plan import Group, Plan, PlanError
from lightning_hydra.planner.request import PlanRequest

__all__ = ["schedule_static"]


def schedule_static(req: PlanRequest) -> Plan:
    """Static CP: degree = the memory minimum of the longest allowed sequence, for every sequence.

    The pool is cut into ``N / d`` aligned groups; each microbatch has one bin per group. Sequences, longest
    first, go to the bin holding the fewest tokens that still has room (a token-balancing heap over all bins of
    the asked microbatches). A sequence no bin can take opens a further microbatch.
    """
    longest = int(req.max_seq_len or req.lengths.max())
    degree = req.rules.memory_min(longest, req.capacity)
    if degree is None:
        raise PlanError(f"the longest allowed sequence ({longest} tokens) fits no degree of the pool")
    groups_per_mb = req.world_size // degree
    bins: list[list[int]] = []
    held: list[int] = []
    heap: list[tuple[int, int]] = []

    def open_microbatch() -> None:
        for _ in range(groups_per_mb):
            heapq.heappush(heap, (0, len(bins)))
            bins.append([])
            held.append(0)

    for _ in range(req.num_microbatches):
        open_microbatch()
    order = sorted(range(len(req.lengths)), key=lambda i: (-int(req.lengths[i]), i))
    for i in order:
        need = shard_tokens(int(req.lengths[i]), degree)
        if heap[0][0] + need > req.capacity:
            # The emptiest bin cannot take it, so none can: open a further microbatch of empty bins.
            open_microbatch()
        tokens, b = heapq.heappop(heap)
        bins[b].append(i)
        held[b] = tokens + need
        heapq.heappush(heap, (held[b], b))
    microbatches: list[list[Group]] = []
    for m in range(len(bins) // groups_per_mb):
        groups = [req.group(k * degree, degree, bins[m * groups_per_mb + k]) for k in range(groups_per_mb)]
        microbatches.append(req.fill_idle(groups))
    return req.plan(microbatches, "static", degree=float(degree))
