"""The degree sets a ``hydra`` candidate draws its group sizes from, and the per-sequence cost tables of one set.

Shared by the formation (:mod:`~lightning_hydra.planner.formation`: levels and degrees) and the placement
(:mod:`~lightning_hydra.planner.placement`: the groups a multi-rank sequence joins), so that neither imports the
other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_hydra.planner.degrees import DegreeRules, shard_tokens
from lightning_hydra.planner.request import PlanRequest

__all__ = ["DEGREE_SETS", "RAISE_BUDGET", "RAISE_SHARE", "RAISE_SHARE_LARGE", "DegreeSet", "Tables"]

DEGREE_SETS = ("pow2", "fine", "node")
"""Named degree sets: ``pow2`` (Megatron's powers of two), ``fine`` (every size up to 8, then eight per octave),
``node`` (the powers of two below the largest Ulysses degree ``U``, then ``U`` times a ring of every length up to 8
and eight per octave above: full Ulysses inside a node, rings of whole Ulysses blocks across nodes, the fewest ring
bytes per rank of any factorisation of a size)."""


@dataclass(frozen=True)
class DegreeSet:
    """Allowed group sizes (ascending) and their Ulysses x ring factorization."""

    sizes: np.ndarray
    """Group sizes (int64, ascending)."""
    ulysses: np.ndarray
    """Ulysses degree of each size."""
    ring: np.ndarray
    """Ring degree of each size."""
    name: str
    """Which set (one of :data:`DEGREE_SETS`)."""

    @classmethod
    def build(cls, rules: DegreeRules, name: str) -> DegreeSet:
        """The sizes of set ``name`` that the pool allows (see :data:`DEGREE_SETS`)."""
        if name == "fine":
            sizes = rules.degrees(fine=True)
        elif name == "pow2":
            sizes = rules.degrees()
        elif name == "node":
            top = rules.ulysses_options()[-1]
            rings = DegreeRules(world_size=rules.world_size // top, ranks_per_node=1).degrees(fine=True)
            sizes = [d for d in rules.degrees() if d < top] + [top * r for r in rings]
            sizes = [d for d in sizes if rules.factor(d) is not None]
        else:
            raise ValueError(f"unknown degree set {name!r}; choose one of {DEGREE_SETS}")
        factors = [rules.factor(d) for d in sizes]
        return cls(
            sizes=np.asarray(sizes, dtype=np.int64),
            ulysses=np.asarray([f[0] for f in factors if f], dtype=np.int64),
            ring=np.asarray([f[1] for f in factors if f], dtype=np.int64),
            name=name,
        )


RAISE_SHARE = 0.25
"""A single-rank sequence whose work is above this share of a rank's mean work per microbatch may be raised to more
ranks (a column of :class:`Tables`' multi-rank tables), within :data:`RAISE_BUDGET`. A formation is made heaviest
first, and the multi-rank groups of its middle microbatches can take every rank: long single-rank sequences then
wait until the last microbatch, the lightest, where on one or two ranks each they set its maximum. At 0.5
(:data:`RAISE_SHARE_LARGE`; 512 ranks x 256K standard-library lengths, ``bw0.5`` truth, calibrated, the fine
formation) 124 sequences of 10,000-12,200 tokens could not be raised and made the last microbatch 1.05 s against a
mean of 0.45; at 0.25 they take groups of 4 ranks there, its maximum is 0.59 s and the formation 2.6% faster under
the truth. Hydra gained up to 2.3% in 15 of the robustness grid's 168 cells, lost in none, and +0.16% on average
over 96 cells of drawn truths (at most -0.56%; ``bench.robust``, ``bench.robust --truths --random-truths 16
--seed-offset 5000 --world-sizes 64 512 --contexts 256K``)."""
RAISE_SHARE_LARGE = 0.5
"""The share of :data:`RAISE_SHARE` above :data:`RAISE_BUDGET`: more columns cost every formation's tables time."""
RAISE_BUDGET = 131072
"""Largest ``sequences * sqrt(ranks)`` for which :data:`RAISE_SHARE` applies (the same bound as
:data:`~lightning_hydra.planner.hydra.LIFT_BUDGET`: off 2,048-rank batches of more than about 2,900 sequences)."""


class Tables:
    """Per-sequence costs the formation needs, computed once per degree set."""

    def __init__(self, req: PlanRequest, ds: DegreeSet) -> None:
        cost, lens, cap = req.cost, req.lengths, req.capacity
        sizes = ds.sizes
        k = len(sizes)
        j0 = np.minimum(np.searchsorted(sizes, lens / cap, side="left"), k - 1)
        for _ in range(k):  # zigzag padding can push a shard over capacity: step up where it does
            over = shard_tokens(lens, sizes[j0]) > cap
            if not over.any():
                break
            j0 = np.minimum(j0 + over, k - 1)
        self.min_class = j0
        if ds.ulysses[0] == ds.ring[0] == 1:  # one rank: shared by the degree sets; the rest computed here
            base, net = (x.copy() for x in req.one_rank_parts)
            wide = np.flatnonzero(j0)
            base[wide], net[wide] = cost.pair_parts(lens[wide], ds.ulysses[j0[wide]], ds.ring[j0[wide]])
        else:
            base, net = cost.pair_parts(lens, ds.ulysses[j0], ds.ring[j0])
        self.base_min, self.net_min = base, net  # the parts at the memory minimum (of the single-rank dealing)
        self.shard_min = shard_tokens(lens, sizes[j0])
        fixed = cost.fixed(ds.ulysses, ds.ring)
        alone = base + cost.ring_exposure * np.maximum(net, 0.0)
        self.cost_min = alone + fixed[j0]
        # the work a sequence adds to its ranks: without the microbatch's fixed cost, which a busy rank pays once
        # however many sequences it holds (:attr:`fixed_min` adds it to the level once per rank)
        self.work_min = alone * sizes[j0]
        self.fixed_min = float(fixed.min())
        """The least fixed cost a busy rank pays per microbatch (``CostModel.fixed`` of the cheapest class)."""
        self.tokens_min = self.shard_min * sizes[j0]
        # sequences that may need several ranks: above one rank of memory, or heavy enough to be raised (their work
        # above RAISE_SHARE of a rank's mean share; the fixed cost, the same at any class a rank holds, decides no
        # raise)
        share = RAISE_SHARE if req.within(RAISE_BUDGET) else RAISE_SHARE_LARGE
        low = share * float(self.work_min.sum()) / (req.world_size * req.num_microbatches)
        self.multi = np.flatnonzero((j0 > 0) | (alone > low))
        self.column = np.full(lens.size, -1, dtype=np.int64)
        self.column[self.multi] = np.arange(self.multi.size)
        lm = lens[self.multi]
        b, nt = cost.parts(lm, ds.ulysses, ds.ring)
        self.base = b  # [classes, multi]
        self.net = nt
        self.fixed = fixed
        self.quad, self.per_token = cost.length_quadratic(ds.ulysses, ds.ring)  # per class, for the single-rank deal
        self.cost = np.maximum(nt, 0.0)  # b + ring_exposure * max(nt, 0) + fixed, in one buffer
        self.cost *= cost.ring_exposure
        self.cost += b
        self.cost += fixed[:, None]
        self.shards = shard_tokens(lm[None, :], sizes[:, None])
        # per sequence, the cheapest cost of the classes up to each, counting only those from its memory minimum on
        # (``inf`` before it), row by row (``accumulate`` on axis 0 is slower). A shard only shrinks as the degree
        # grows, so every class from the memory minimum on has token room and none below it has
        j0m = j0[self.multi]
        masked = np.empty_like(self.cost)
        masked[0] = np.where(j0m <= 0, self.cost[0], np.inf)
        for i in range(1, k):
            np.minimum(masked[i - 1], np.where(j0m <= i, self.cost[i], np.inf), out=masked[i])
        none = self.shards[-1] > cap  # no class has room (capacity is checked before planning)
        if none.any():
            masked[:, none] = np.inf
        self.runmin = masked
        # the first class at the cheapest cost (``argmin``): the rows before the running minimum reaches its last value
        self.cheapest = (masked > masked[-1]).sum(axis=0)

    def cost_at(self, classes: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``cost[classes, cols]`` by flat positions (faster than two index arrays)."""
        return self.cost.ravel().take(classes * self.cost.shape[1] + cols)

    def classes_at(self, target: float, raise_degrees: bool, cols: np.ndarray) -> np.ndarray:
        """Class at ``target`` of the multi-rank candidates in columns ``cols``."""
        if not raise_degrees:
            return self.min_class[self.multi[cols]]
        classes, width = self.runmin.shape
        # the first class whose running minimum is within ``target`` (``classes`` if none): the running minimum only
        # falls down the classes, so a bisection over the classes for all columns at once (log2(classes) gathers)
        flat = self.runmin.ravel()
        lo = np.zeros(cols.size, dtype=np.int64)
        hi = np.full(cols.size, classes, dtype=np.int64)
        for _ in range(classes.bit_length()):
            mid = (lo + hi) >> 1
            within = flat[np.minimum(mid, classes - 1) * width + cols] <= target
            hi = np.where(within, mid, hi)
            lo = np.where(within, lo, np.minimum(mid + 1, hi))
        return np.where(hi < classes, hi, self.cheapest[cols])
