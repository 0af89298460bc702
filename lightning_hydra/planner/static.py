"""The ``static`` baseline: one fixed CP degree for the whole run, bins packed by token count."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.order import stable_argsort
from lightning_hydra.planner.plan import Group, Plan, PlanError
from lightning_hydra.planner.request import PlanRequest

__all__ = ["StaticLayout", "schedule_static", "static_layout"]


@dataclass
class StaticLayout:
    """The static plan as flat arrays (what ``hydra`` scores; :meth:`plan` builds the groups)."""

    degree: int
    """The one CP degree."""
    ulysses: int
    """Its Ulysses degree."""
    ring: int
    """Its ring degree."""
    groups_per_mb: int
    """Groups of ``degree`` ranks per microbatch."""
    num_bins: int
    """Bins over all microbatches (``groups_per_mb`` per microbatch)."""
    seq: np.ndarray
    """Every sequence, ordered by bin."""
    bin: np.ndarray
    """Bin of each entry of ``seq``."""

    @property
    def num_microbatches(self) -> int:
        """Microbatches used."""
        return self.num_bins // self.groups_per_mb

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """What :func:`~lightning_hydra.planner.robust.span_of` scores (as :meth:`Formation.flat`): per bin its
        microbatch, Ulysses and ring degrees; per sequence its index and bin; the number of microbatches (idle
        groups cost nothing and are left out)."""
        mb = np.arange(self.num_bins, dtype=np.int64) // self.groups_per_mb
        u = np.full(self.num_bins, self.ulysses, dtype=np.int64)
        r = np.full(self.num_bins, self.ring, dtype=np.int64)
        return mb, u, r, self.seq, self.bin, self.num_microbatches

    def crosses(self, req: PlanRequest) -> np.ndarray:
        """Whether each bin's group spans nodes (:meth:`CostModel.crossing`), as :meth:`plan` lays it out."""
        k = np.arange(self.num_bins, dtype=np.int64) % self.groups_per_mb
        return req.cost.crossing(k * self.degree, np.full(self.num_bins, self.degree))

    def plan(self, req: PlanRequest) -> Plan:
        """The :class:`Plan`: bin ``k`` of a microbatch on ranks ``k * degree`` onwards; idle ranks fill the rest."""
        cuts = np.searchsorted(self.bin, np.arange(self.num_bins + 1)).tolist()
        seqs = self.seq.tolist()
        d, per = self.degree, self.groups_per_mb
        microbatches: list[list[Group]] = []
        for m in range(self.num_microbatches):
            groups = [req.group(k * d, d, seqs[cuts[m * per + k] : cuts[m * per + k + 1]]) for k in range(per)]
            microbatches.append(req.fill_idle(groups))
        return req.plan(microbatches, "static", degree=float(d))


def static_layout(req: PlanRequest) -> StaticLayout:
    """Static CP's bins: degree = the memory minimum of the longest allowed sequence, for every sequence.

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
    order = req.longest_first
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
    heap = [(t, b) for b, t in enumerate(held.tolist())]
    heapq.heapify(heap)
    num_bins = held.size
    spill = []
    for n in need[failed].tolist():  # the emptiest bin with room, or a further microbatch of empty bins
        if heap[0][0] + n > req.capacity:
            for b in range(num_bins, num_bins + groups_per_mb):
                heapq.heappush(heap, (0, b))
            num_bins += groups_per_mb
        tokens, b = heap[0]
        heapq.heapreplace(heap, (tokens + n, b))  # bins are unique: the same bins as a pop and a push
        spill.append(b)
    where[failed] = spill
    placed = stable_argsort(where)
    factors = req.rules.factor(degree)
    if factors is None:  # pragma: no cover - memory_min returns allowed (factored) degrees only
        raise PlanError(f"static degree {degree} cannot be split into ulysses x ring")
    ulysses, ring = factors
    return StaticLayout(
        degree=degree, ulysses=ulysses, ring=ring, groups_per_mb=groups_per_mb, num_bins=num_bins,
        seq=order[placed], bin=where[placed],
    )  # fmt: skip


def schedule_static(req: PlanRequest) -> Plan:
    """Static CP (see :func:`static_layout`): one degree for every sequence, bins balanced by tokens."""
    return static_layout(req).plan(req)
