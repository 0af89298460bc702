"""Placement of one microbatch's sequences into CP groups: the inner loops of :mod:`~lightning_hydra.planner.formation`.

Multi-rank sequences are placed heaviest first, each into the most loaded group within the level that has room
(best fit) or a new group of its own class; runs that can only open groups of their own are opened in bulk, with
exactly the groups the one-by-one placement would open, and runs that certainly find no place wait in bulk.
Single-rank sequences are then dealt to every group (:mod:`~lightning_hydra.planner.dealing`).
"""

from __future__ import annotations

import bisect
import heapq
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from lightning_hydra.planner import compiled
from lightning_hydra.planner.cost import CostModel

if TYPE_CHECKING:
    from lightning_hydra.planner.tables import DegreeSet, Tables

__all__ = ["REACH", "Microbatch", "place_multi"]

REACH = 2
"""Classes above its own a multi-rank sequence may join (a larger group with room within the level)."""
_FIT_SCAN = 16
"""Groups looked at below the best fit for one with token room."""
_GIVE_UP = 64
"""Consecutive multi-rank sequences that find no place before the rest waits for the next microbatch."""
_RUN = 256
"""Sequences looked at for one run of group openings (:func:`_opening_run`)."""
_COOLDOWN = 16
"""Scalar openings after a look for a run that found none, before the next look."""
_MISS_RUN = 64
"""Sequences looked at for runs of misses (:func:`_certain_misses`) at a time (0: never look)."""
_LOOK_AFTER = 2
"""Consecutive misses placed one by one before a look for runs of misses (a look costs about five of them)."""
_BIG = 1 << 62
"""A group number above any (the upper end of a bisection over ``(load, group)`` pairs)."""


class Microbatch:
    """Groups of the microbatch being formed: Python lists (fast scalar updates) and, per class, the groups
    ordered by ``(load, group)``."""

    def __init__(self, tab: Tables, ds: DegreeSet, cost: CostModel, world_size: int, capacity: int) -> None:
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
        self.flat_members: tuple[np.ndarray, np.ndarray] | None = None
        """Every group's sequences and group numbers, groups in order (:meth:`member_arrays`), where the compiled
        placement made them instead of ``members``."""
        self.classes = np.zeros(0, dtype=np.int64)  # every group's class and load, after the single-rank deal
        self.loads = np.zeros(0)
        self.single_seq = np.zeros(0, dtype=np.int64)  # single-rank deal: sequence and group of each placement
        self.single_gid = np.zeros(0, dtype=np.int64)
        self.ordered: dict[int, list[tuple[float, int]]] = {}  # per class, (load, group) ascending
        self.mins = np.full(len(self.sizes), np.inf)  # per class, the smallest load of its groups (``inf``: none)
        self.heaps: dict[int, list[tuple[float, int]]] = {}  # per class, built by the first :meth:`least`
        self.parked: dict[int, list[tuple[int, int]]] = {}

    def member_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The multi-rank groups' sequences, group after group in the order they joined, and each one's group."""
        if self.flat_members is not None:
            return self.flat_members
        counts = np.fromiter(map(len, self.members), dtype=np.int64, count=len(self.members))
        seq = np.fromiter(chain.from_iterable(self.members), dtype=np.int64, count=int(counts.sum()))
        return seq, np.repeat(np.arange(counts.size), counts)

    def open(self, j: int, seq: int, base: float, net: float, shard: int, load: float) -> None:
        """A new group of class ``j`` on free ranks, holding ``seq`` (its load computed by the caller)."""
        g = len(self.gk)
        self.gk.append(j)
        self.load.append(load)
        self.bsum.append(base)
        self.nsum.append(net)
        self.held.append(shard)
        self.members.append([seq])
        self.free -= self.sizes[j]
        order = self.ordered.setdefault(j, [])
        bisect.insort(order, (load, g))
        self.mins[j] = order[0][0]
        if j in self.heaps:
            heapq.heappush(self.heaps[j], (load, g))

    def open_many(
        self, classes: np.ndarray, seqs: list[int], base: list[float], net: list[float], shards: list[int],
        loads: np.ndarray,
    ) -> None:  # fmt: skip
        """New groups, one per sequence, numbered in order (what one :meth:`open` per sequence makes); ``classes``
        and ``loads`` as arrays, so that each class's new groups join its order at once."""
        g0, n = len(self.gk), classes.size
        self.gk.extend(classes.tolist())
        self.load.extend(loads.tolist())
        self.bsum.extend(base)
        self.nsum.extend(net)
        self.held.extend(shards)
        self.members.extend([[s] for s in seqs])
        self.free -= int(self.ds.sizes[classes].sum())
        by = np.argsort(classes, kind="stable")
        ks = classes[by]
        cuts = (np.flatnonzero(ks[1:] != ks[:-1]) + 1).tolist()
        lo, groups = loads[by].tolist(), (by + g0).tolist()
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):
            j = int(ks[a])
            new = list(zip(lo[a:b], groups[a:b], strict=True))
            order = self.ordered.setdefault(j, [])
            order.extend(new)
            order.sort()
            self.mins[j] = order[0][0]
            if (heap := self.heaps.get(j)) is not None:
                for entry in new:
                    heapq.heappush(heap, entry)

    def least(self, j: int, need: int) -> int | None:
        """Least loaded group of class ``j`` with room for ``need`` tokens per rank (only the last microbatch asks,
        for the sequences no group within the level took).

        A lazy min-heap per class, built at the first ask: groups without room for the sequence at hand are parked
        (a max-heap on their room) and come back when a sequence small enough for them asks; sequences arrive
        heaviest first, so parking is rare and cheap.
        """
        heap = self.heaps.get(j)
        if heap is None:
            if j not in self.ordered:
                return None
            heap = self.heaps[j] = list(self.ordered[j])  # sorted, hence a heap
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
        """Add ``seq`` to group ``g``."""
        order = self.ordered[self.gk[g]]
        del order[bisect.bisect_left(order, (self.load[g], g))]
        self.bsum[g] += base
        self.nsum[g] += net
        n = self.nsum[g]
        self.load[g] = self.bsum[g] + (self.exposure * n if n > 0 else 0.0) + fixed
        self.held[g] += shard
        self.members[g].append(seq)
        bisect.insort(order, (self.load[g], g))
        self.mins[self.gk[g]] = order[0][0]
        if (heap := self.heaps.get(self.gk[g])) is not None:
            heapq.heappush(heap, (self.load[g], g))


def _opening_run(
    mb: Microbatch, k: np.ndarray, size: np.ndarray, own: np.ndarray, base: np.ndarray, shards: np.ndarray,
    target: float,
) -> int:  # fmt: skip
    """How many of the next sequences (heaviest first; their class ``k`` and its size, load alone ``own``, and base
    and shard at the :data:`REACH` classes from theirs) each open a group of their own: the longest run in which no
    sequence could join a group (no group of a reachable class light enough, counting the groups the run opens
    before it) and every one fits the free ranks. The scalar placement would open exactly these groups. A group's
    load already holds its fixed cost, so a sequence may join one whose load is at most ``target`` less its base."""
    top, n = len(mb.sizes) - 1, k.size
    mins = mb.mins
    if not n:
        return 0
    # the first sequence alone, in Python (about half the looks end there): a group it may join, or no room to open
    first, sh, bs = int(k[0]), shards[0].tolist(), base[0].tolist()
    if size[0] > mb.free or sh[0] > mb.cap:
        return 0
    for o in range(min(REACH, top - first) + 1):
        if sh[o] <= mb.cap and mins[first + o] <= target - bs[o]:
            return 0
    # per class present in the run (a row each, then a row of inf for the others): the lightest group the run opens
    # before each sequence, an exclusive running minimum of the loads alone of the run's sequences of that class
    present = np.flatnonzero(np.bincount(k, minlength=top + 1))
    before = np.full((present.size + 1, n), np.inf)
    np.minimum.accumulate(np.where(k == present[:, None], own, np.inf)[:, :-1], axis=1, out=before[:-1, 1:])
    row = np.full(top + 1, present.size, dtype=np.int64)
    row[present] = np.arange(present.size)
    cols = np.arange(n)
    joinable = np.zeros(n, dtype=bool)
    for o in range(REACH + 1):
        j = k + o
        reach = (j <= top) & (shards[:, o] <= mb.cap)
        j = np.minimum(j, top)
        lightest = np.minimum(mins[j], before[row[j], cols])
        joinable |= reach & (lightest <= target - base[:, o])
    fits = (np.cumsum(size) <= mb.free) & (shards[:, 0] <= mb.cap)  # as the one-by-one opening
    stop = np.flatnonzero(joinable | ~fits)
    return int(stop[0]) if stop.size else int(k.size)


def _certain_misses(
    mb: Microbatch, rows: np.ndarray, bounds: np.ndarray, size: np.ndarray, alone: np.ndarray
) -> np.ndarray:
    """Which of the next sequences certainly find no place as the groups stand: in every class ``rows`` they may join,
    the lightest group is heavier than their ``bounds`` (the one-by-one best fit looks only at groups at or below
    it; ``-inf`` where they may not join), and they cannot open a group of their own (``size`` ranks are more than
    are free, or their shard alone exceeds the capacity). A miss stays one while no group opens or gets lighter:
    joins only fill groups and free ranks only shrink."""
    return (mb.mins[rows] > bounds).all(axis=1) & ((size > mb.free) | alone)


def place_multi(mb: Microbatch, seqs: np.ndarray, k_arr: np.ndarray, target: float, last: bool) -> list[int]:
    """Place multi-rank sequences (columns of the tables, heaviest first; ``k_arr`` their classes); return the ones
    that wait.

    After :data:`_GIVE_UP` consecutive misses (outside the last microbatch) only sequences whose own class still
    fits the free ranks are tried; the rest wait without a look (the free ranks only shrink until a placement).
    Runs of sequences that each open a group of their own are found and opened in bulk (:func:`_opening_run`).
    After :data:`_LOOK_AFTER` consecutive misses placed one by one, the certain misses among the next
    :data:`_MISS_RUN` sequences are found at once (:func:`_certain_misses`; again at such a miss once a group was
    joined, as joins only add misses); while no group opens or gets lighter, each run of them waits at once,
    counted as that many misses (the one-by-one placement would wait or skip each of them).
    """
    tab = mb.tab
    if seqs.size == 0:
        return []
    fixed_a = tab.fixed
    sizes, cap, top = mb.sizes, mb.cap, len(mb.sizes) - 1
    exposure = mb.exposure
    # each sequence's shard, base and net at its class and the REACH classes above
    rows = np.minimum(k_arr[:, None] + np.arange(REACH + 1), top)
    at = rows * tab.multi.size + seqs[:, None]  # flat positions in the [classes, multi] tables (``take`` is faster)
    shards_a = tab.shards.ravel().take(at)
    base_a = tab.base.ravel().take(at)
    net_a = tab.net.ravel().take(at)
    own_a = base_a[:, 0] + exposure * np.maximum(net_a[:, 0], 0.0) + fixed_a[k_arr]
    need_size = np.asarray(sizes, dtype=np.int64)[k_arr]
    if compiled.enabled():
        return _compiled_multi(mb, seqs, k_arr, shards_a, base_a, net_a, own_a, need_size, target, last)
    cost_tab, fixed = tab.cost, fixed_a.tolist()  # what the loop below reads (the compiled one reads the tables)
    multi_a = tab.multi[seqs]
    k_l, seqs_l = k_arr.tolist(), seqs.tolist()
    ordered, held, load, bsum, nsum = mb.ordered, mb.held, mb.load, mb.bsum, mb.nsum
    wait: list[int] = []
    misses = 0
    bulk = True  # look for a run of openings (at the start, and after an opening unless the last look found none)
    cooldown = 0  # openings to wait before the next look, after a look that found no run
    bounds = alone = None  # per sequence: the load a group may have to take it, at each class; whether it can open
    ahead: list[int] = []  # the next sequence that may find a place, from each that the last look for misses covers
    at = upto = 0  # the sequences it covers
    missed = 0  # consecutive misses placed one by one
    joined = False  # whether a group was joined since that look (sequences it found placeable may miss now)
    i, n = 0, len(seqs_l)
    while i < n:
        if misses >= _GIVE_UP and not last:  # skip what cannot open a group of its own
            fits = np.flatnonzero(need_size[i:] <= mb.free)
            nxt = i + int(fits[0]) if fits.size else n
            wait.extend(seqs_l[i:nxt])
            i = nxt
            if i >= n:
                break
        if bulk:
            end = min(n, i + _RUN)
            run = _opening_run(mb, k_arr[i:end], need_size[i:end], own_a[i:end], base_a[i:end], shards_a[i:end], target)
            if run:
                s = slice(i, i + run)
                mb.open_many(k_arr[s], multi_a[s].tolist(), base_a[s, 0].tolist(), net_a[s, 0].tolist(),
                             shards_a[s, 0].tolist(), own_a[s])  # fmt: skip
                misses = 0
                i += run
                upto = 0  # the new groups may take what missed
                continue
            bulk, cooldown = False, _COOLDOWN
        if missed >= _LOOK_AFTER and (i >= upto or joined) and not last and _MISS_RUN:
            if bounds is None:
                reach = (k_arr[:, None] + np.arange(REACH + 1) <= top) & (shards_a <= cap)
                bounds = np.where(reach, target - base_a, -np.inf)
                alone = shards_a[:, 0] > cap
            at, upto, joined = i, min(n, i + _MISS_RUN), False
            miss = _certain_misses(mb, rows[at:upto], bounds[at:upto], need_size[at:upto], alone[at:upto])
            ahead = np.minimum.accumulate(np.where(miss, upto, np.arange(at, upto))[::-1])[::-1].tolist()
        if i < upto and (nxt := ahead[i - at]) > i:  # a run of misses: each waits, as one by one
            wait.extend(seqs_l[i:nxt])
            misses += nxt - i
            i = nxt
            continue
        t, c = i, seqs_l[i]
        i += 1
        k = k_l[t]
        sh, bs, nt = shards_a[t].tolist(), base_a[t].tolist(), net_a[t].tolist()
        choice, cls, col = -1, k, 0
        for o in range(min(REACH, top - k) + 1):
            j, need = k + o, sh[o]
            order = ordered.get(j)
            if need > cap or not order:
                continue
            b = bs[o]
            pos = bisect.bisect_right(order, (target - b, _BIG))  # loads hold the fixed cost: only the base adds
            for q in range(pos - 1, max(pos - 1 - _FIT_SCAN, -1), -1):  # best fit: the most loaded with room
                g = order[q][1]
                if held[g] + need <= cap:
                    nn = nsum[g] + nt[o]
                    if bsum[g] + b + (exposure * nn if nn > 0 else 0.0) + fixed[j] <= target:
                        choice, cls, col = g, j, o
                    break
            if choice != -1:
                break
        if choice == -1 and mb.free >= sizes[k] and sh[0] <= cap:  # a new group of its own class on free ranks
            mb.open(k, int(multi_a[t]), bs[0], nt[0], sh[0], float(own_a[t]))
            misses = missed = upto = 0  # the new group may take what missed
            cooldown -= 1
            bulk = cooldown <= 0
            continue
        if choice == -1 and last:  # the least loaded group with room at any class from its own up
            best = None
            # what the sequence adds to a group of each class (the group's load already holds its fixed cost)
            costs, needs = (cost_tab[k:, c] - fixed_a[k:]).tolist(), tab.shards[k:, c].tolist()
            for j in range(k, top + 1):
                order = ordered.get(j)
                # the class's lightest group bounds what it can offer: skip it when that cannot beat the best
                if not order or (best is not None and order[0][0] + costs[j - k] >= best[0]) or needs[j - k] > cap:
                    continue
                g = mb.least(j, needs[j - k])
                if g is not None and (best is None or load[g] + costs[j - k] < best[0]):
                    best = (load[g] + costs[j - k], g, j)
            if best is not None:
                g, j = best[1], best[2]
                mb.put(g, int(multi_a[t]), float(tab.base[j, c]), float(tab.net[j, c]), needs[j - k], fixed[j])
                misses = 0
                continue
        if choice == -1:
            wait.append(c)
            misses += 1
            missed += 1
            continue
        misses = missed = 0
        before, joined = load[choice], True
        mb.put(choice, int(multi_a[t]), bs[col], nt[col], sh[col], fixed[cls])
        if load[choice] < before:  # lighter (a negative net): what missed may fit now
            upto = 0
    return wait


def _compiled_multi(
    mb: Microbatch, seqs: np.ndarray, k_arr: np.ndarray, shards_a: np.ndarray, base_a: np.ndarray,
    net_a: np.ndarray, own_a: np.ndarray, need_size: np.ndarray, target: float, last: bool,
) -> list[int]:  # fmt: skip
    """:func:`place_multi` by :func:`~lightning_hydra.planner.compiled.place_multi` (the same groups) into the
    empty microbatch ``mb``; the per-sequence arrays as :func:`place_multi` reads them."""
    if mb.gk:
        raise ValueError("the compiled placement starts from a microbatch without groups")
    tab, n = mb.tab, seqs.size
    g_class, g_held = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    g_load, g_bsum, g_nsum = np.empty(n), np.empty(n), np.empty(n)
    seq_group = np.empty(n, dtype=np.int64)
    count, mb.free = compiled.place_multi(
        k_arr, seqs, shards_a, base_a, net_a, own_a, need_size, tab.cost, tab.base, tab.net, tab.shards, tab.fixed,
        mb.ds.sizes, float(target), bool(last), int(mb.cap), float(mb.exposure), int(mb.free), _GIVE_UP, _FIT_SCAN,
        REACH, g_class, g_load, g_bsum, g_nsum, g_held, seq_group,
    )  # fmt: skip
    mb.gk, mb.load, mb.bsum = g_class[:count].tolist(), g_load[:count].tolist(), g_bsum[:count].tolist()
    mb.nsum, mb.held = g_nsum[:count].tolist(), g_held[:count].tolist()
    placed = np.flatnonzero(seq_group >= 0)
    by = placed[np.argsort(seq_group[placed], kind="stable")]  # each group's sequences in the order they came
    mb.flat_members = (tab.multi[seqs[by]], seq_group[by])
    return seqs[seq_group < 0].tolist()
