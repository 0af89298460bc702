"""Placement of one microbatch's sequences into CP groups: the inner loops of :mod:`~lightning_hydra.planner.formation`.

Multi-rank sequences are placed heaviest first, each into the most loaded group within the level that has room
(best fit) or a new group of its own class; runs that can only open groups of their own are opened in bulk, with
exactly the groups the one-by-one placement would open, and runs that certainly find no place wait in bulk.
Single-rank sequences are then dealt in vectorised rounds: every group takes the longest remaining sequence that
fits its slack, its token room and the kernel tile.
"""

from __future__ import annotations

import bisect
import heapq
from typing import TYPE_CHECKING

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.order import descending_order, is_descending

if TYPE_CHECKING:
    from lightning_hydra.planner.formation import DegreeSet, _Tables

__all__ = ["REACH"]

REACH = 2
"""Classes above its own a multi-rank sequence may join (a larger group with room within the level)."""
_FIT_SCAN = 16
"""Groups looked at below the best fit for one with token room."""
_ROUNDS = 64
"""Rounds of the single-rank dealing (a round gives one sequence to each open group) before the rest is dealt in
blocks (:func:`_deal_block`)."""
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
_ROUNDING = 1e-9
"""Relative allowance on the closed-form longest sequence within a group's slack (its rounding; the exact check
decides)."""
_BIG = 1 << 62
"""A group number above any (the upper end of a bisection over ``(load, group)`` pairs)."""


class _Microbatch:
    """Groups of the microbatch being formed: Python lists (fast scalar updates) and, per class, the groups
    ordered by ``(load, group)``."""

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
        self.classes = np.zeros(0, dtype=np.int64)  # every group's class and load, after the single-rank deal
        self.loads = np.zeros(0)
        self.single_seq = np.zeros(0, dtype=np.int64)  # single-rank deal: sequence and group of each placement
        self.single_gid = np.zeros(0, dtype=np.int64)
        self.ordered: dict[int, list[tuple[float, int]]] = {}  # per class, (load, group) ascending
        self.mins = np.full(len(self.sizes), np.inf)  # per class, the smallest load of its groups (``inf``: none)
        self.heaps: dict[int, list[tuple[float, int]]] = {}  # per class, built by the first :meth:`least`
        self.parked: dict[int, list[tuple[int, int]]] = {}

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
    mb: _Microbatch, k: np.ndarray, size: np.ndarray, own: np.ndarray, base: np.ndarray, shards: np.ndarray,
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
    mb: _Microbatch, rows: np.ndarray, bounds: np.ndarray, size: np.ndarray, alone: np.ndarray
) -> np.ndarray:
    """Which of the next sequences certainly find no place as the groups stand: in every class ``rows`` they may join,
    the lightest group is heavier than their ``bounds`` (the one-by-one best fit looks only at groups at or below
    it; ``-inf`` where they may not join), and they cannot open a group of their own (``size`` ranks are more than
    are free, or their shard alone exceeds the capacity). A miss stays one while no group opens or gets lighter:
    joins only fill groups and free ranks only shrink."""
    return (mb.mins[rows] > bounds).all(axis=1) & ((size > mb.free) | alone)


def _place_multi(mb: _Microbatch, seqs: np.ndarray, k_arr: np.ndarray, target: float, last: bool) -> list[int]:
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
    cost_tab, fixed = tab.cost, fixed_a.tolist()
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


def _place_single(
    mb: _Microbatch, cost: CostModel, lens: np.ndarray, seqs: np.ndarray, target: float, last: bool
) -> np.ndarray:
    """Deal single-rank-class sequences to every group in vectorised rounds; return those that wait.

    Each round, every open group takes the heaviest remaining sequence that fits its slack (under the level), its
    token room and, on a multi-rank group, the kernel tile (a sequence is split no finer than ``min_chunk_tokens``
    per rank): groups with the most room take the heaviest sequences, and among equal room the least loaded
    first, so that while everything fits a round is a round of longest-processing-time-first. Collisions (two
    groups wanting the same sequence) resolve in one pass: the ``i``-th group takes the first free sequence at or
    after its own candidate. A pair the exact bin time rejects moves that group past the sequence. Rounds end when
    no group can take anything; the last microbatch has no level and takes what any group has room for.
    """
    ds = mb.ds
    free = mb.free
    mb.free = 0
    gk = np.concatenate([np.asarray(mb.gk, dtype=np.int64), np.zeros(free, dtype=np.int64)])
    load = np.concatenate([np.asarray(mb.load), np.zeros(free)])
    mb.classes, mb.loads = gk, load
    if gk.size == 0 or seqs.size == 0:
        return seqs
    bsum = np.concatenate([np.asarray(mb.bsum), np.zeros(free)])
    nsum = np.concatenate([np.asarray(mb.nsum), np.zeros(free)])
    held = np.concatenate([np.asarray(mb.held, dtype=np.int64), np.zeros(free, dtype=np.int64)])
    size, ulysses, ring = ds.sizes[gk], ds.ulysses[gk], ds.ring[gk]
    fixed = mb.tab.fixed[gk]
    exposure = cost.ring_exposure
    # sequences longest first, with their parts and shard at class 0 (their memory minimum: every sequence dealt
    # here has it), so that pairs with a class-0 group are read, not computed
    s_seq, s_len = seqs, lens[seqs]
    if not is_descending(s_len):
        order = descending_order(s_len)
        s_seq, s_len = seqs[order], s_len[order]
    base0, net0, shard0 = mb.tab.base_min, mb.tab.net_min, mb.tab.shard_min  # read at ``s_seq[pos]``
    wide_group = gk > 0
    any_wide = bool(wide_group.any())
    neg_all = -s_len.astype(np.float64)  # every bound below is a float: compare in one dtype
    limit = np.inf if last else target
    tile = 0.0 if last else max(cost.min_chunk_tokens, 1.0)
    tiles = np.where(ds.sizes == 1, np.inf, -(ds.sizes * tile))  # per class: its shortest sequence, negated
    cap = mb.cap
    taken = np.zeros(s_seq.size, dtype=bool)
    lo = np.zeros(gk.size, dtype=np.int64)  # per group: first position (in ``s_seq``) it may still take
    assign = np.full(s_seq.size, -1, dtype=np.int64)

    def fit(g: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, ...]:
        """Parts, shard, load after and whether sequence ``pos`` fits group ``g`` (element-wise)."""
        at = s_seq[pos]
        b, n, shard = base0[at], net0[at], shard0[at]
        wide = np.flatnonzero(wide_group[g]) if any_wide else ()
        if len(wide):
            gw, lw = g[wide], s_len[pos[wide]]
            b[wide], n[wide] = cost.pair_parts(lw, ulysses[gw], ring[gw])
            shard[wide] = shard_tokens(lw, size[gw])
        after = bsum[g] + b + exposure * np.maximum(nsum[g] + n, 0.0) + fixed[g]
        return b, n, shard, after, (after <= limit) & (held[g] + shard <= cap)

    quad, per_token = mb.tab.quad[gk], mb.tab.per_token[gk]
    act = np.arange(gk.size)  # groups that may still take a sequence: one that cannot now never can (see below)
    head = 0  # sequences before this position (in ``s_seq``) no group can take any more
    # the sequences still to deal from ``head`` on (positions in ``s_seq``) and their negated lengths, kept round to
    # round: the taken ones leave, the ones before ``head`` are cut off; all come back when a group got lighter
    rem, neg_len, lighter = np.arange(s_seq.size), neg_all, False
    for _ in range(_ROUNDS):
        if lighter:
            rem = np.flatnonzero(~taken)
            neg_len, lighter = neg_all[rem], False
        elif head:
            cut = int(np.searchsorted(rem, head))
            rem, neg_len = rem[cut:], neg_len[cut:]
        if rem.size == 0:
            break
        # the first sequence each group can still take: within its slack (exact for one rank, the longest the
        # quadratic part allows for more) and its token room, and past any sequence the exact check refused. A
        # group's room and what remains only shrink and the refusal mark only moves on, so a group that can take
        # nothing leaves ``act`` for good (its state is frozen from then on); slack shrinks too unless a newcomer's
        # net ring time is negative, which lowers a load: the sequences before the first any group can take are
        # passed (``head``) until that happens
        longest = 2 * size[act] * ((cap - held[act]) // 2)  # the token room
        if not last:
            slack = limit - _carried(load[act], held[act], fixed[act])
            # the closed form rounds: a sequence whose time fills the slack exactly (the level set by the tallest
            # sequence, alone on a rank) came out a token too long and waited for the last microbatch; a length a
            # hair too generous is caught by the exact check below
            longest = np.minimum(longest, cost.longest_under(slack, quad[act], per_token[act]) * (1 + _ROUNDING))
        first = np.searchsorted(neg_len, -longest, "left")
        refused = np.flatnonzero(lo[act])
        if refused.size:
            first[refused] = np.maximum(first[refused], np.searchsorted(rem, lo[act[refused]], "left"))
        # the tile: a group of ``d`` ranks takes nothing shorter than ``d`` tiles (per class, then per group)
        stop = np.searchsorted(neg_len, tiles, "right")[gk[act]]
        open_ = first < stop
        act, first, stop = act[open_], first[open_], stop[open_]
        if act.size == 0:
            break
        head = int(rem[first.min()])
        by = np.lexsort((_carried(load[act], held[act], fixed[act]), first))
        rank = np.arange(act.size)
        idx = rank + np.maximum.accumulate(first[by] - rank)
        stop_g = stop[by]
        keep = idx < stop_g
        if not keep.all():
            by, idx, stop_g = by[keep], idx[keep], stop_g[keep]
        g, pos = act[by], rem[idx]
        if g.size == 0:
            break
        b, n, shard, after, ok = fit(g, pos)
        if not ok.all():  # the estimate was optimistic: bisect each such group to the first sequence it takes
            bad = ~ok
            gb, left, right = g[bad], idx[bad] + 1, stop_g[bad]
            stop_b = right.copy()
            while (left < right).any():
                mid = (left + right) // 2
                inside = left < right
                good = np.zeros(gb.size, dtype=bool)
                good[inside] = fit(gb[inside], rem[mid[inside]])[4]
                right = np.where(inside & good, mid, right)
                left = np.where(inside & ~good, mid + 1, left)
            lo[gb] = np.where(left < stop_b, rem[np.minimum(left, rem.size - 1)], s_seq.size)
            g, pos, b, n, shard, after, idx = g[ok], pos[ok], b[ok], n[ok], shard[ok], after[ok], idx[ok]
        bsum[g] += b
        nsum[g] += n
        held[g] += shard
        if (after < load[g]).any():  # a newcomer's hidden ring traffic made a group lighter: it may now take
            head, lighter = 0, True  # sequences passed for good above (``act`` stays: a group it left took nothing)
        else:
            left_in = np.ones(rem.size, dtype=bool)
            left_in[idx] = False
            rem, neg_len = rem[left_in], neg_len[left_in]
        load[g] = after
        taken[pos] = True
        assign[pos] = g
    else:  # many short sequences per group: deal the rest in blocks, several per group at once
        state = (bsum, nsum, held, load)
        while _deal_block(cost, s_len, taken, assign, state, size, ulysses, ring, fixed, limit, tile, cap):
            pass
    placed = np.flatnonzero(assign >= 0)
    mb.single_seq, mb.single_gid = s_seq[placed], assign[placed]
    return s_seq[~taken]


def _carried(load: np.ndarray, held: np.ndarray, fixed: np.ndarray) -> np.ndarray:
    """The load each group carries once it holds a sequence: its load (which holds the microbatch's fixed cost), or,
    while it is still empty (no tokens held), the fixed cost its first sequence brings."""
    return np.where(held > 0, load, fixed)


def _deal_block(
    cost: CostModel, s_len: np.ndarray, taken: np.ndarray, assign: np.ndarray, state: tuple[np.ndarray, ...],
    size: np.ndarray, ulysses: np.ndarray, ring: np.ndarray, fixed: np.ndarray, limit: float, tile: float, cap: int,
) -> bool:  # fmt: skip
    """One block of the dealing once its rounds are spent (more than :data:`_ROUNDS` sequences per group): the
    remaining sequences (longest first) go round-robin to the groups, least loaded first, as many per group as there
    are sequences per group left; each group keeps the longest prefix of its share that fits its level, token room
    and tile. Updates ``state`` (per-group base sum, net sum, tokens, load) in place; returns whether anything was
    placed."""
    bsum, nsum, held, load = state
    rem = np.flatnonzero(~taken)
    carried = _carried(load, held, fixed)
    groups = np.flatnonzero((carried < limit) & (held < cap))
    if rem.size == 0 or groups.size == 0:
        return False
    groups = groups[np.argsort(carried[groups], kind="stable")]
    per = -(-rem.size // groups.size)
    slot = np.arange(min(rem.size, per * groups.size))
    g = groups[slot % groups.size]
    pos = rem[slot]
    b, n = cost.pair_parts(s_len[pos], ulysses[g], ring[g])
    shard = shard_tokens(s_len[pos], size[g])
    # per group, its share in dealing order: running sums give the load and tokens after each sequence
    by = np.lexsort((slot, g))
    g, pos, b, n, shard = g[by], pos[by], b[by], n[by], shard[by]
    start = np.r_[0, np.flatnonzero(g[1:] != g[:-1]) + 1]
    share = np.repeat(np.arange(start.size), np.diff(np.r_[start, g.size]))  # which group's share each entry is in

    def running(x: np.ndarray) -> np.ndarray:
        total = np.cumsum(x)
        return total - np.r_[0, total][start[share]]

    after = bsum[g] + running(b) + cost.ring_exposure * np.maximum(nsum[g] + running(n), 0.0) + fixed[g]
    fits = (after <= limit) & (held[g] + running(shard) <= cap) & ((size[g] == 1) | (s_len[pos] >= size[g] * tile))
    # keep each group's longest fitting prefix
    bad = np.where(fits, g.size, np.arange(g.size))
    ok = np.arange(g.size) < np.minimum.reduceat(bad, start)[share]
    if not ok.any():
        return False
    g, pos, b, n, shard = g[ok], pos[ok], b[ok], n[ok], shard[ok]
    np.add.at(bsum, g, b)
    np.add.at(nsum, g, n)
    np.add.at(held, g, shard)
    touched = np.unique(g)
    load[touched] = bsum[touched] + cost.ring_exposure * np.maximum(nsum[touched], 0.0) + fixed[touched]
    taken[pos] = True
    assign[pos] = g
    return True
