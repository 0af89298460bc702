"""The ``mcore`` baseline: Megatron-Core's packing-aware Dynamic-CP scheduler, re-implemented.

This follows the algorithm of Megatron-LM's ``DefaultDynamicCPScheduler`` with ``next_hdp_group_packing_aware``
and ``dcp_gpus_needed`` (``megatron/core/datasets/data_schedule.py`` and ``data_schedule_utils.py``), written
here from its description; it is our baseline, so it is deliberately *not* improved:

- minimum degree ``max(1, 2**ceil(log2(L / capacity)))`` (memory-driven, powers of two);
- workload ``L**2 / d`` only (no linear term, no communication);
- sequences sorted longest first; each tries every power-of-two size from its minimum up, scanning every existing
  group of that size and every rank for the smallest projected maximum load, or a new group on the lowest free
  ranks; candidates above ``1.05 x tallest * capacity`` or over the per-rank token limit are rejected;
- what does not fit waits for the next microbatch (so the plan may have more microbatches than asked);
- ranks left empty are filled by doubling the first smallest group, shifting the groups after it; if that cannot
  fill them, the microbatch becomes one group of the whole pool (where caps on the ring or the heads leave the pool
  no group the engine can run, which Megatron never meets, the empty ranks idle instead).

The one liberty taken: the per-rank scans are numpy vectorised rather than Python generator loops. They remain
``O(N)`` per candidate, so the comparison with hydra's ``O(log N)`` heaps is the honest one, and our timings of
this baseline are faster than Megatron's own.
"""

from __future__ import annotations

import math

import numpy as np

from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.plan import Group, Plan, PlanError
from lightning_hydra.planner.request import PlanRequest

__all__ = ["CAP_DELTA", "MegatronMicrobatch", "finish_microbatch", "groups_of", "megatron_min_degree", "schedule_mcore"]

CAP_DELTA = 0.05
"""Megatron's workload cap: candidates may exceed the tallest sequence's per-rank load by 5%."""


def megatron_min_degree(length: int, capacity: int) -> int:
    """Megatron's ``dcp_gpus_needed``: ``max(1, 2**ceil(log2(ceil(L / capacity))))``."""
    need = max(1, math.ceil(length / capacity))
    return 1 << math.ceil(math.log2(need)) if need > 1 else 1


def _min_degree(length: int, capacity: int) -> int:
    """Megatron's minimum, doubled in the rare case (odd capacity) where the zigzag padding would not fit."""
    d = megatron_min_degree(length, capacity)
    while shard_tokens(length, d) > capacity:
        d *= 2
    return d


class MegatronMicrobatch:
    """State of one microbatch being formed (groups in creation order, per-rank workload)."""

    def __init__(self, world_size: int) -> None:
        self.exec = np.zeros(world_size)
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.packed: list[int] = []  # tokens per rank (zigzag shards, as Megatron's pre-padded lengths)
        self.seqs: list[list[tuple[int, int]]] = []
        self.next_free = 0  # groups take the lowest free ranks, so free ranks form the tail

    def add_group(self, size: int, seq: tuple[int, int]) -> None:
        self.starts.append(self.next_free)
        self.sizes.append(size)
        self.packed.append(shard_tokens(seq[1], size))
        self.seqs.append([seq])
        self.exec[self.next_free : self.next_free + size] += seq[1] * seq[1] / size
        self.next_free += size

    def add_to(self, g: int, seq: tuple[int, int]) -> None:
        size = self.sizes[g]
        self.packed[g] += shard_tokens(seq[1], size)
        self.seqs[g].append(seq)
        self.exec[self.starts[g] : self.starts[g] + size] += seq[1] * seq[1] / size


def _projected_max(exec_times: np.ndarray, start: int, size: int, cost: float) -> float:
    """Whole-pool scan: the maximum load over all ranks if ranks ``start..start+size`` take ``cost`` more."""
    trial = exec_times.copy()
    trial[start : start + size] += cost
    return float(trial.max())


def _fill_once(mb: MegatronMicrobatch, sizes: list[int], world_size: int) -> bool:
    """Double the first smallest group that can grow into the empty tail; shift the groups after it."""
    if not mb.sizes:
        return False
    smallest = min(mb.sizes)
    k = sizes.index(smallest)
    if k + 1 >= len(sizes):
        return False
    grow = sizes[k + 1] - smallest
    for g, size in enumerate(mb.sizes):
        if size != smallest:
            continue
        end = mb.starts[g] + size - 1
        # the groups after it shift by ``grow``: every one must stay inside the pool (only a pool that is not a
        # power of two can run out, and then the next candidate or the whole-pool group is taken)
        if end + 1 > mb.next_free or mb.next_free + grow > world_size:
            continue
        new_size = sizes[k + 1]
        shifted = mb.exec[end + 1 : mb.next_free].copy()
        mb.exec[end + 1 + grow : mb.next_free + grow] = shifted
        mb.exec[mb.starts[g] : mb.starts[g] + new_size] = sum(length * length / new_size for _, length in mb.seqs[g])
        for h in range(len(mb.starts)):
            if h != g and mb.starts[h] > end:
                mb.starts[h] += grow
        mb.sizes[g] = new_size
        mb.next_free += grow
        return True
    return False


def _one_microbatch(
    seqs: list[tuple[int, int]], sizes: list[int], world_size: int, capacity: int, whole: bool = True
) -> tuple[list[tuple[int, int, list[int]]], list[tuple[int, int]]]:
    """Form one microbatch from ``seqs`` (``(id, length)``); return its groups and the leftovers (``whole``: see
    :func:`finish_microbatch`)."""
    seqs = sorted(seqs, key=lambda s: -s[1])
    cap = float(seqs[0][1]) * float(capacity) * (1.0 + CAP_DELTA)
    mb = MegatronMicrobatch(world_size)
    first = seqs[0]
    mb.add_group(max(_min_degree(first[1], capacity), sizes[0]), first)
    leftovers: list[tuple[int, int]] = []
    for seq in seqs[1:]:
        length = seq[1]
        need = _min_degree(length, capacity)
        best: tuple[float, int, int] | None = None  # (projected max, size, group index or -1 for a new group)
        for size in sizes:
            if size < need:
                continue
            cost = length * length / size
            for g in range(len(mb.sizes)):
                if mb.sizes[g] != size or mb.packed[g] + shard_tokens(length, size) > capacity:
                    continue
                proj = _projected_max(mb.exec, mb.starts[g], size, cost)
                if proj <= cap and (best is None or proj < best[0]):
                    best = (proj, size, g)
            if world_size - mb.next_free >= size:
                proj = _projected_max(mb.exec, mb.next_free, size, cost)
                if proj <= cap and (best is None or proj < best[0]):
                    best = (proj, size, -1)
        if best is None:
            leftovers.append(seq)
        elif best[2] < 0:
            mb.add_group(best[1], seq)
        else:
            mb.add_to(best[2], seq)

    return finish_microbatch(mb, seqs, leftovers, sizes, world_size, capacity, whole)


def finish_microbatch(
    mb: MegatronMicrobatch, seqs: list[tuple[int, int]], leftovers: list[tuple[int, int]], sizes: list[int],
    world_size: int, capacity: int, whole: bool = True,
) -> tuple[list[tuple[int, int, list[int]]], list[tuple[int, int]]]:  # fmt: skip
    """Fill the microbatch's empty ranks as Megatron does and return its groups ``(start, size, sequence ids)`` and
    the sequences that wait; if no fill works, one group of the whole pool packed from all of ``seqs``, or, where
    the pool is no group (``whole`` false: ``max_ring`` or the heads rule its factoring out), the groups as they
    are, the empty ranks idle (:func:`groups_of` covers them)."""
    while mb.next_free < world_size:
        if not _fill_once(mb, sizes, world_size):
            if not whole:
                break
            chosen, rest, packed = [], [], 0
            for seq in seqs:
                if packed + shard_tokens(seq[1], world_size) <= capacity:
                    chosen.append(seq)
                    packed += shard_tokens(seq[1], world_size)
                else:
                    rest.append(seq)
            if not chosen:
                raise PlanError("mcore: not even one sequence fits the whole pool")
            return [(0, world_size, [i for i, _ in chosen])], rest
    groups = [(s, z, [i for i, _ in q]) for s, z, q in zip(mb.starts, mb.sizes, mb.seqs, strict=True)]
    return groups, leftovers


def groups_of(req: PlanRequest, groups: list[tuple[int, int, list[int]]]) -> list[Group]:
    """The :class:`Group` of every ``(start, size, sequence ids)`` of a microbatch, and idle groups on the ranks none
    covers (only where the pool is no group: :func:`finish_microbatch`)."""
    out = [req.group(start, size, ids) for start, size, ids in groups]
    return out if sum(size for _, size, _ in groups) == req.world_size else req.fill_idle(out)


def schedule_mcore(req: PlanRequest) -> Plan:
    """Megatron-Core Dynamic-CP placement; makes as many microbatches as its packing needs."""
    sizes = req.rules.degrees()
    whole = req.rules.factor(req.world_size) is not None
    pending = [(i, int(length)) for i, length in enumerate(req.lengths)]
    microbatches: list[list[Group]] = []
    while pending:
        groups, pending = _one_microbatch(pending, sizes, req.world_size, req.capacity, whole)
        microbatches.append(groups_of(req, groups))
    return req.plan(microbatches, "mcore")
