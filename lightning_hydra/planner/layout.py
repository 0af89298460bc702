"""Where a microbatch's groups sit on the pool's ranks: contiguous blocks, with small rings kept inside nodes.

A group of ``d`` ranks is a contiguous block whose Ulysses blocks each lie in one node (the Ulysses degree divides
the block's first rank). A ring's transfers run on the intra-node link only while the whole group fits one node, so
:func:`layout` places the groups of 2 to ``ranks_per_node`` ranks node by node and lets single ranks fill the gaps;
:meth:`~lightning_hydra.planner.cost.CostModel.crossing` of the result tells the cost model which rings cross.
"""

from __future__ import annotations

import numpy as np

__all__ = ["layout"]


def layout(
    size: np.ndarray, ulysses: np.ndarray, ring: np.ndarray, mb: np.ndarray, num_microbatches: int, world_size: int,
    node: int,
) -> np.ndarray:  # fmt: skip
    """First rank of every group, given microbatch by microbatch, largest Ulysses degree first, then largest size.

    In every microbatch, groups larger than a node take ranks from 0 on, one after the other (each Ulysses degree
    divides every earlier size, so every group starts at a multiple of its Ulysses degree). Then node by node, the
    largest group of 2 to ``node`` ranks that fits what is left of the node at a multiple of its Ulysses degree
    goes next; where none does, a single rank (or an idle one) fills the gap. So a group that fits a node stays
    inside one and its ring runs on the intra-node link (:meth:`CostModel.ring_bandwidth`). Only when no single or
    idle rank is left to fill a gap does a group that can start there cross a node (its Ulysses blocks stay inside
    nodes; its ring does not): the largest of those whose size does not divide the node (planning charged them as
    crossing already), else the largest; when none can start there, the microbatch is laid out contiguously in the
    given order (valid, but small rings may cross nodes). A microbatch without rings of 2 to ``node`` ranks is laid out
    contiguously in the given order, which keeps every Ulysses-only group inside a node. Where a ring crosses,
    :meth:`CostModel.crossing` of the layout tells the cost model.

    Args:
        size: Ranks of every group.
        ulysses: Ulysses degree of every group.
        ring: Ring degree of every group.
        mb: Microbatch of every group (sorted).
        num_microbatches: Microbatches.
        world_size: Ranks in the pool.
        node: Ranks per node (a multiple of every Ulysses degree; ``world_size`` is a multiple of it).
    """
    end = np.cumsum(size)
    first = np.r_[True, mb[1:] != mb[:-1]] if mb.size else np.zeros(0, dtype=bool)
    start = end - size - np.maximum.accumulate(np.where(first, end - size, 0))  # contiguous, from 0 per microbatch
    cuts = np.searchsorted(mb, np.arange(num_microbatches + 1)).tolist()
    for m in range(num_microbatches):
        a, b = cuts[m], cuts[m + 1]
        if ((size[a:b] <= node) & (ring[a:b] > 1)).any():
            placed = _in_nodes(size[a:b], ulysses[a:b], world_size, node)
            if placed is not None:
                start[a:b] = placed
    return start


def _in_nodes(size: np.ndarray, ulysses: np.ndarray, world_size: int, node: int) -> np.ndarray | None:
    """:func:`layout` of one microbatch; ``None`` where it must fall back to the contiguous layout."""
    out = np.empty(size.size, dtype=np.int64)
    big = np.flatnonzero(size > node)
    out[big] = np.cumsum(size[big]) - size[big]
    cursor = int(size[big].sum())
    single = np.flatnonzero(size == 1)
    spare_singles = single.size
    idle = world_size - int(size.sum())
    # the groups of 2 to ``node`` ranks by (size, Ulysses degree), largest size first
    small = np.flatnonzero((size > 1) & (size <= node))
    small = small[np.lexsort((-ulysses[small], -size[small]))]
    buckets: dict[int, list[tuple[int, list[int]]]] = {}
    for z, u, i in zip(size[small].tolist(), ulysses[small].tolist(), small.tolist(), strict=True):
        kinds = buckets.setdefault(z, [])
        if not kinds or kinds[-1][0] != u:
            kinds.append((u, []))
        kinds[-1][1].append(i)
    for kinds in buckets.values():
        for _, members in kinds:
            members.reverse()  # pop() takes them in the given order
    sizes_desc = sorted(buckets, reverse=True)
    left = small.size
    singles_at: list[int] = []
    while left:
        room = node - cursor % node
        pick = -1
        for z in sizes_desc:
            if z > room:
                continue
            for u, members in buckets[z]:
                if members and cursor % u == 0:
                    pick = members.pop()
                    break
            if pick >= 0:
                break
        if pick < 0 and room < node and (spare_singles or idle):
            if spare_singles:  # a single rank fills the gap
                singles_at.append(cursor)
                spare_singles -= 1
            else:
                idle -= 1
            cursor += 1
            continue
        if pick < 0:  # no gap filler left: a group that can start here crosses the node (its ring); the largest of
            # those planning already counted as crossing (a size that does not divide the node), else the largest
            startable = [(z, m) for z in sizes_desc for u, m in buckets[z] if m and cursor % u == 0]
            if not startable:
                return None
            pick = next((m for z, m in startable if node % z), startable[0][1]).pop()
        out[pick] = cursor
        cursor += int(size[pick])
        left -= 1
    if cursor + spare_singles > world_size:
        return None  # pragma: no cover - the groups' ranks fit the pool
    out[single] = np.r_[np.asarray(singles_at, dtype=np.int64), np.arange(cursor, cursor + spare_singles)]
    return out
