"""Dense, load-driven formation of microbatches: the placement every ``hydra`` candidate uses.

Microbatches are formed one after the other from the sequences still to place, heaviest first, as Megatron's
Dynamic-CP forms them, but with a closed-form load level, load-driven degrees and O(log N) placement:

1. **Level.** Microbatch ``m`` aims at ``T_m = max(dense, even)``: ``dense`` is the work per rank of the heaviest
   remaining sequences that fill the pool's tokens (:data:`DENSE_FILL`), ``even`` the remaining work spread over
   the remaining microbatches (work at the memory minimum, overheads and communication included). Packing a
   microbatch densely with the heaviest sequences keeps their degrees low; ``even`` guarantees that the asked
   number of microbatches holds the batch.
2. **Degrees.** With ``raise_degrees`` every sequence takes the smallest class of the degree set whose per-rank
   cost is at most ``T_m`` (never below its memory minimum): long sequences get more ranks than memory needs.
   Without it every sequence stays at its memory minimum (Megatron's degrees). The level then rises to the
   tallest sequence's cost if that is still above it.
3. **Placement of multi-rank sequences**, heaviest first: the most loaded group with token room of the sequence's
   own class, or of a slightly larger class (at most :data:`REACH` classes up), that stays within the level (best
   fit: groups fill up one after the other, whole groups stay free for heavier sequences); else a new group of its
   own class on free ranks. Groups sit in one
   lazy min-heap per class (stale entries dropped when they surface), so a placement costs ``O(log N)``; what does
   not fit waits for the next microbatch.
4. **Placement of single-rank sequences**, vectorised: every free rank becomes a group, then rounds of
   longest-processing-time-first deal the sequences, heaviest first, to the least loaded groups that stay within
   the level, have token room and split the sequence no finer than a kernel tile per rank; what does not fit
   waits for the next microbatch.

The last asked microbatch takes everything left (above the level if it must); only sequences no group can hold
(tokens) open further microbatches.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import DegreeRules, shard_tokens
from lightning_hydra.planner.plan import Group, Plan
from lightning_hydra.planner.request import PlanRequest

__all__ = ["DEGREE_SETS", "DENSE_FILL", "REACH", "DegreeSet", "Formation", "form"]

DEGREE_SETS = ("pow2", "fine", "node")
"""Named degree sets: ``pow2`` (Megatron's powers of two), ``fine`` (every size up to 8, then eight per octave),
``node`` (1, 2, 4, then multiples of the largest Ulysses degree: full Ulysses inside a node, rings across)."""
DENSE_FILL = 0.88
"""Share of the pool's tokens the dense level assumes a microbatch can hold."""
REACH = 2
"""Classes above its own a multi-rank sequence may join (a larger group with room within the level)."""
_FIT_SCAN = 16
"""Groups looked at below the best fit for one with token room."""
_ROUNDS = 64
"""Most rounds of one pass of the single-rank dealing (a round gives one sequence to each open group)."""
_GIVE_UP = 64
"""Consecutive multi-rank sequences that find no place before the rest waits for the next microbatch."""


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
            sizes = [d for d in rules.degrees() if d < top] + list(range(top, rules.world_size + 1, top))
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


@dataclass
class Formation:
    """A candidate plan as flat arrays (cheap to score under many cost models; :meth:`plan` builds the groups)."""

    degrees: DegreeSet
    """The degree set of its groups."""
    group_mb: np.ndarray
    """Microbatch of every group."""
    group_class: np.ndarray
    """Class (index into ``degrees``) of every group."""
    seq: np.ndarray
    """Every placed sequence, grouped by group."""
    gid: np.ndarray
    """Group of each entry of ``seq``."""
    num_microbatches: int
    """Microbatches formed."""
    name: str
    """Which candidate this is."""

    def loads(self, cost: CostModel, lengths: np.ndarray) -> np.ndarray:
        """Predicted load of every group under ``cost``."""
        k = self.group_class
        return cost.group_loads(lengths[self.seq], self.gid, self.degrees.ulysses[k], self.degrees.ring[k])

    def span(self, cost: CostModel, lengths: np.ndarray) -> float:
        """Sum over microbatches of the largest group load under ``cost``."""
        per_mb = np.zeros(self.num_microbatches)
        np.maximum.at(per_mb, self.group_mb, self.loads(cost, lengths))
        return float(per_mb.sum())

    def plan(self, req: PlanRequest, **stats: float | str) -> Plan:
        """The :class:`Plan`: groups laid out largest Ulysses degree first, then largest size, so that every group
        is contiguous and every Ulysses block stays inside a node; idle ranks fill the rest."""
        ds = self.degrees
        order = np.lexsort((self.gid,))
        seq = self.seq[order]
        counts = np.bincount(self.gid, minlength=self.group_mb.size)
        bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
        seq_list = seq.tolist()
        sizes, ulysses, ring = ds.sizes.tolist(), ds.ulysses.tolist(), ds.ring.tolist()
        per_mb: list[list[int]] = [[] for _ in range(self.num_microbatches)]
        for g, m in enumerate(self.group_mb.tolist()):
            per_mb[m].append(g)
        cls = self.group_class.tolist()
        microbatches = []
        for groups in per_mb:
            out, start = [], 0
            for g in sorted(groups, key=lambda g: (-ulysses[cls[g]], -sizes[cls[g]], g)):
                j = cls[g]
                d = sizes[j]
                out.append(
                    Group(
                        tuple(range(start, start + d)), ulysses[j], ring[j], tuple(seq_list[bounds[g] : bounds[g + 1]])
                    )
                )
                start += d
            microbatches.append(req.fill_idle(out))
        return req.plan(microbatches, "hydra", **stats)


class _Tables:
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
        base, net = cost.pair_parts(lens, ds.ulysses[j0], ds.ring[j0])
        fixed = cost.fixed(ds.ulysses, ds.ring)
        self.cost_min = base + cost.ring_exposure * np.maximum(net, 0.0) + fixed[j0]
        self.work_min = self.cost_min * sizes[j0]
        self.tokens_min = shard_tokens(lens, sizes[j0]) * sizes[j0]
        # sequences that may need several ranks: above one rank of memory, or heavy enough to be raised
        low = 0.5 * float(self.work_min.sum()) / (req.world_size * req.num_microbatches)
        self.multi = np.flatnonzero((j0 > 0) | (self.cost_min > low))
        self.column = np.full(lens.size, -1, dtype=np.int64)
        self.column[self.multi] = np.arange(self.multi.size)
        lm = lens[self.multi]
        b, nt = cost.parts(lm, ds.ulysses, ds.ring)
        self.base = b  # [classes, multi]
        self.net = nt
        self.fixed = fixed
        self.cost = b + cost.ring_exposure * np.maximum(nt, 0.0) + fixed[:, None]
        self.shards = shard_tokens(lm[None, :], sizes[:, None])
        rows = np.arange(k)[:, None]
        masked = np.where((rows >= j0[self.multi][None, :]) & (self.shards <= cap), self.cost, np.inf)
        self.runmin = np.minimum.accumulate(masked, axis=0)
        self.cheapest = np.argmin(masked, axis=0)

    def classes_at(self, target: float, raise_degrees: bool) -> np.ndarray:
        """Class of every multi-rank candidate at ``target``."""
        if not raise_degrees:
            return self.min_class[self.multi]
        count = (self.runmin > target).sum(axis=0)
        return np.where(count < self.runmin.shape[0], count, self.cheapest)


class _Microbatch:
    """Groups of the microbatch being formed: Python lists (fast scalar updates) and one lazy heap per class."""

    def __init__(self, tab: _Tables, ds: DegreeSet, cost: CostModel, world_size: int, capacity: int) -> None:
        self.tab, self.ds, self.cap = tab, ds, capacity
        self.exposure = cost.ring_exposure
        self.sizes = ds.sizes.tolist()
        self.free = world_size
        self.gk: list[int] = []
        self.load: list[float] = []
        self.bsum: list[float] = []
        self.nsum: list[float] = []
        self.held: list[int] = []
        self.members: list[list[int]] = []
        self.heaps: dict[int, list[tuple[float, int]]] = {}
        self.parked: dict[int, list[tuple[int, int]]] = {}
        self.classes = np.zeros(0, dtype=np.int64)  # every group's class and load, after the single-rank deal
        self.loads = np.zeros(0)
        self.single_seq = np.zeros(0, dtype=np.int64)  # single-rank deal: sequence and group of each placement
        self.single_gid = np.zeros(0, dtype=np.int64)
        self.ordered: dict[int, list[tuple[float, int]]] = {}  # per class, (load, group) ascending

    def new(self, j: int) -> int:
        g = len(self.gk)
        self.gk.append(j)
        self.load.append(0.0)
        self.bsum.append(0.0)
        self.nsum.append(0.0)
        self.held.append(0)
        self.members.append([])
        self.free -= self.sizes[j]
        heapq.heappush(self.heaps.setdefault(j, []), (0.0, g))
        bisect.insort(self.ordered.setdefault(j, []), (0.0, g))
        return g

    def fullest(self, j: int, need: int, room: float) -> int | None:
        """Most loaded group of class ``j`` whose load is at most ``room`` and that has room for ``need`` tokens per
        rank (best fit: groups fill up one after the other and whole groups stay free for heavier sequences)."""
        order = self.ordered.get(j)
        if not order:
            return None
        pos = bisect.bisect_right(order, (room, 1 << 62))
        cap = self.cap
        for k in range(pos - 1, max(pos - 1 - _FIT_SCAN, -1), -1):
            g = order[k][1]
            if self.held[g] + need <= cap:
                return g
        return None

    def least(self, j: int, need: int) -> int | None:
        """Least loaded group of class ``j`` with room for ``need`` tokens per rank.

        Groups without room for the sequence at hand are parked (a max-heap on their room) and come back when a
        sequence small enough for them asks: sequences arrive heaviest first, so parking is rare and cheap.
        """
        heap = self.heaps.get(j)
        if heap is None:
            return None
        parked = self.parked.setdefault(j, [])
        while parked and -parked[0][0] >= need:
            _, g = heapq.heappop(parked)
            heapq.heappush(heap, (self.load[g], g))
        cap = self.cap
        while heap:
            lo, g = heap[0]
            if lo != self.load[g]:
                heapq.heappop(heap)  # stale
            elif self.held[g] + need > cap:
                heapq.heappop(heap)
                heapq.heappush(parked, (self.held[g] - cap, g))
            else:
                return g
        return None

    def put(self, g: int, seq: int, base: float, net: float, shard: int, fixed: float) -> None:
        order = self.ordered[self.gk[g]]
        del order[bisect.bisect_left(order, (self.load[g], g))]
        self.bsum[g] += base
        self.nsum[g] += net
        n = self.nsum[g]
        self.load[g] = self.bsum[g] + (self.exposure * n if n > 0 else 0.0) + fixed
        self.held[g] += shard
        self.members[g].append(seq)
        heapq.heappush(self.heaps[self.gk[g]], (self.load[g], g))
        bisect.insort(order, (self.load[g], g))


def _place_multi(mb: _Microbatch, seqs: np.ndarray, kdeg: np.ndarray, target: float, last: bool) -> list[int]:
    """Place multi-rank sequences (columns of the tables, heaviest first); return the ones that wait."""
    tab = mb.tab
    base, net, shards, cost, fixed = tab.base, tab.net, tab.shards, tab.cost, tab.fixed.tolist()
    sizes, cap, top = mb.sizes, mb.cap, len(mb.sizes) - 1
    exposure = mb.exposure
    wait: list[int] = []
    misses = 0
    for c in seqs.tolist():
        if misses >= _GIVE_UP and not last and mb.free < mb.sizes[int(kdeg[c])]:
            wait.append(c)
            continue
        k = int(kdeg[c])
        choice = -1
        cls = k
        for j in range(k, min(k + REACH, top) + 1):
            need = int(shards[j, c])
            if need > cap:
                continue
            g = mb.fullest(j, need, target - base[j, c] - fixed[j])
            if g is not None:
                n = mb.nsum[g] + net[j, c]
                after = mb.bsum[g] + base[j, c] + (exposure * n if n > 0 else 0.0) + fixed[j]
                if after <= target:
                    choice, cls = g, j
                    break
        if choice == -1 and mb.free >= sizes[k] and int(shards[k, c]) <= cap:
            choice = -2  # a new group of its own class on free ranks
        if choice == -1 and last:
            best = None
            for j in range(k, top + 1):
                need = int(shards[j, c])
                g = mb.least(j, need) if need <= cap else None
                if g is not None and (best is None or mb.load[g] + cost[j, c] < best[0]):
                    best = (mb.load[g] + float(cost[j, c]), g, j)
            if best is not None:
                choice, cls = best[1], best[2]
        if choice == -1:
            wait.append(c)
            misses += 1
            continue
        misses = 0
        g = mb.new(cls) if choice == -2 else choice
        mb.put(g, int(tab.multi[c]), float(base[cls, c]), float(net[cls, c]), int(shards[cls, c]), fixed[cls])
    return wait


def _place_single(
    mb: _Microbatch, cost: CostModel, lens: np.ndarray, seqs: np.ndarray, target: float, last: bool
) -> np.ndarray:
    """Deal single-rank-class sequences (heaviest first) in LPT rounds over every group; return those that wait."""
    ds = mb.ds
    free = mb.free
    mb.free = 0
    gk = np.concatenate([np.asarray(mb.gk, dtype=np.int64), np.zeros(free, dtype=np.int64)])
    g_all = np.arange(gk.size)
    load = np.concatenate([np.asarray(mb.load), np.zeros(free)])
    mb.classes, mb.loads = gk, load
    if g_all.size == 0 or seqs.size == 0:
        return seqs
    bsum = np.concatenate([np.asarray(mb.bsum), np.zeros(free)])
    nsum = np.concatenate([np.asarray(mb.nsum), np.zeros(free)])
    held = np.concatenate([np.asarray(mb.held, dtype=np.int64), np.zeros(free, dtype=np.int64)])
    # the sequences' parts at every class present, computed once: a round only gathers
    present, row = np.unique(gk, return_inverse=True)
    tab_base, tab_net = cost.parts(lens[seqs], ds.ulysses[present], ds.ring[present])
    tab_shard = shard_tokens(lens[seqs][None, :], ds.sizes[present][:, None])
    fixed = cost.fixed(ds.ulysses, ds.ring)[gk]
    exposure = cost.ring_exposure
    assign = np.full(seqs.size, -1, dtype=np.int64)
    single_cost = mb.tab.cost_min[seqs]
    size = ds.sizes[gk]
    # no finer than a kernel tile per rank, except in the last microbatch, which must take everything
    reach = np.inf if last else np.maximum(1.0, lens[seqs] / max(cost.min_chunk_tokens, 1.0))
    limit = np.inf if last else target
    todo = np.arange(seqs.size)
    for _ in range(3 if last else 1):  # the last microbatch deals what found no room again, to what is left
        todo = todo[np.argsort(-single_cost[todo], kind="stable")]
        missed = []
        pos = 0
        lightest = float(single_cost[todo].min()) if todo.size else 0.0
        for _ in range(_ROUNDS):
            if pos >= todo.size:
                break
            open_ = np.flatnonzero(load + lightest <= limit) if np.isfinite(limit) else g_all
            if open_.size == 0:
                break
            if np.isfinite(limit):  # heavier than any open group's slack even split over its ranks: no try
                slack = limit - load[open_].min()
                lower = single_cost[todo[pos:]] / size[open_].max()
                skip = int(np.searchsorted(-lower, -slack, "left"))
                if skip:
                    missed.append(todo[pos : pos + skip])
                    pos += skip
                    if pos >= todo.size:
                        break
            take = min(todo.size - pos, open_.size)
            batch = todo[pos : pos + take]
            pos += take
            g = open_[np.argpartition(load[open_], take - 1)[:take]] if take < open_.size else open_
            g = g[np.argsort(load[g], kind="stable")]
            rg = row[g]
            b, n, shard = tab_base[rg, batch], tab_net[rg, batch], tab_shard[rg, batch]
            after = bsum[g] + b + exposure * np.maximum(nsum[g] + n, 0.0) + fixed[g]
            ok = (after <= limit) & (held[g] + shard <= mb.cap) & (size[g] <= (reach if last else reach[batch]))
            g, b, n, shard, after = g[ok], b[ok], n[ok], shard[ok], after[ok]
            bsum[g] += b
            nsum[g] += n
            held[g] += shard
            load[g] = after
            assign[batch[ok]] = g
            missed.append(batch[~ok])
        missed.append(todo[pos:])
        todo = np.concatenate(missed)
        if todo.size == 0:
            break
    placed = np.flatnonzero(assign >= 0)
    mb.single_seq, mb.single_gid = seqs[placed], assign[placed]
    return seqs[todo]


@dataclass
class _Formed:
    """One formed microbatch: class of every group, its sequences with their group, and the largest load."""

    classes: np.ndarray
    seq: np.ndarray
    gid: np.ndarray
    top: float


def _microbatch(
    tab: _Tables, ds: DegreeSet, req: PlanRequest, remaining: np.ndarray, left: int, last: bool, raise_degrees: bool,
    even: bool = False,
) -> tuple[_Formed, np.ndarray]:  # fmt: skip
    """Form one microbatch from ``remaining`` (heaviest first) with ``left`` microbatches still to come (this one
    included); return it and the sequences that wait. ``even``: the level is the remaining work spread evenly
    (no dense term), so that every microbatch aims at the same maximum."""
    cost, n_ranks, cap = req.cost, req.world_size, req.capacity
    work = tab.work_min[remaining]
    level = float(work.sum()) / n_ranks / max(left, 1)
    if not last and not even:
        fill = int(np.searchsorted(np.cumsum(tab.tokens_min[remaining]), DENSE_FILL * n_ranks * cap, "right"))
        level = max(level, float(work[:fill].sum()) / n_ranks)
    kdeg = tab.classes_at(level, raise_degrees)
    col = tab.column[remaining]
    multi_cols = col[col >= 0]
    multi_cols = multi_cols[kdeg[multi_cols] > 0]
    tallest = float(tab.cost[kdeg[multi_cols], multi_cols].max()) if multi_cols.size else 0.0
    single = remaining[~np.isin(remaining, tab.multi[multi_cols])] if multi_cols.size else remaining
    tallest = max(tallest, float(tab.cost_min[single].max()) if single.size else 0.0)
    if raise_degrees and tallest > level * (1 + 1e-9):
        kdeg = tab.classes_at(tallest, raise_degrees)
    level = max(level, tallest)
    multi_cols = multi_cols[np.argsort(-tab.cost[kdeg[multi_cols], multi_cols], kind="stable")]  # heaviest first
    mb = _Microbatch(tab, ds, cost, n_ranks, cap)
    wait_multi = _place_multi(mb, multi_cols, kdeg, level, last)
    wait_single = _place_single(mb, cost, req.lengths, single, level, last)
    if not mb.classes.size:  # nothing was dealt: the groups of the multi-rank phase as they are
        mb.classes, mb.loads = np.asarray(mb.gk, dtype=np.int64), np.asarray(mb.load)
    counts = np.fromiter((len(m) for m in mb.members), dtype=np.int64, count=len(mb.members))
    seq = np.concatenate([np.fromiter((i for m in mb.members for i in m), dtype=np.int64, count=int(counts.sum())),
                          mb.single_seq])  # fmt: skip
    gid = np.concatenate([np.repeat(np.arange(counts.size), counts), mb.single_gid])
    used, gid = np.unique(gid, return_inverse=True)  # groups without sequences are dropped (their ranks idle)
    top = float(mb.loads[used].max()) if used.size else 0.0
    waiting = np.concatenate([tab.multi[np.asarray(wait_multi, dtype=np.int64)], wait_single])
    return _Formed(mb.classes[used], seq, gid.reshape(-1), top), waiting[
        np.argsort(-tab.cost_min[waiting], kind="stable")
    ]


def form(
    req: PlanRequest, ds: DegreeSet, *, raise_degrees: bool, tables: _Tables | None = None, even: bool = False
) -> Formation:
    """Form the microbatches of one candidate (see the module docstring).

    After the last microbatch, the last two are formed again as one (everything must go in) when that lowers
    their summed maximum: a light tail of sequences that waited too long joins the microbatch before it.

    Args:
        req: The validated request.
        ds: The degree set of the groups.
        raise_degrees: Let long sequences take more ranks than memory needs.
        tables: Costs already computed for this degree set (shared between candidates).
        even: Shape the microbatches for a pipeline: every microbatch aims at the remaining work spread evenly
            over the remaining microbatches (no dense level), and the last two are never merged (fewer
            microbatches raise a pipeline's warm-up and cool-down share).

    Returns:
        The candidate as flat arrays.
    """
    tab = tables if tables is not None else _Tables(req, ds)
    asked = req.num_microbatches
    remaining = np.argsort(-tab.cost_min, kind="stable")
    formed: list[_Formed] = []
    while remaining.size:
        m = len(formed)
        mb, waiting = _microbatch(tab, ds, req, remaining, asked - m, m >= asked - 1, raise_degrees, even)
        if m >= asked - 1 and waiting.size == remaining.size:
            raise RuntimeError("formation made no progress")  # pragma: no cover - capacity was checked upstream
        formed.append(mb)
        remaining = waiting
    if len(formed) >= 2 and not even:
        both = np.concatenate([formed[-2].seq, formed[-1].seq])
        both = both[np.argsort(-tab.cost_min[both], kind="stable")]
        mb, waiting = _microbatch(tab, ds, req, both, 1, True, raise_degrees)
        if waiting.size == 0 and mb.top < formed[-2].top + formed[-1].top:
            formed[-2:] = [mb]
    offsets = np.cumsum([0] + [f.classes.size for f in formed])
    return Formation(
        degrees=ds,
        group_mb=np.repeat(np.arange(len(formed)), [f.classes.size for f in formed]).astype(np.int64),
        group_class=np.concatenate([f.classes for f in formed]).astype(np.int64),
        seq=np.concatenate([f.seq for f in formed]).astype(np.int64),
        gid=np.concatenate([f.gid + o for f, o in zip(formed, offsets, strict=False)]).astype(np.int64),
        num_microbatches=max(len(formed), asked),
        name=f"{ds.name}/{'load' if raise_degrees else 'memory'}" + ("/even" if even else ""),
    )
