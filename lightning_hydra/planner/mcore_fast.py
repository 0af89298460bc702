"""Megatron's placement (:mod:`lightning_hydra.planner.mcore`) computed with per-size arrays: the same plan, as a
``hydra`` candidate at any scale.

The baseline scans the whole pool for every (sequence, group) pair it tries, on purpose (it is what Megatron does).
But while a microbatch is formed every group's ranks carry one load and free ranks carry none, so the pool's maximum
after adding ``cost`` to group ``g`` is ``max(M, load[g] + cost)`` with ``M`` the current maximum: one vector
expression over a size's groups gives all their projected maxima at once, and the first candidate in Megatron's
order (sizes ascending, groups of a size in creation order, a new group of that size after them) with the smallest
one wins, as in its strict ``<`` scan. Most sequences fit somewhere without raising ``M``; that case is checked first,
size by size from the smallest allowed, and ends at the first size with a fit. Each size keeps its groups' loads and
tokens in arrays of their own, and its least load and tokens as numbers, so a size none of whose groups has token
room (most of them, once a microbatch's tokens bind) is skipped without reading its groups. The floating-point
operations are the ones the baseline does, so the plans are identical (``tests`` compare them).

The waiting sequences keep Megatron's order from one microbatch to the next (longest first; what waits is a
subsequence of what was tried), so the batch is sorted and its shards and loads per size computed once
(:class:`_Batch`), and each microbatch reads them by position. While a microbatch forms, room only shrinks, and a
shorter sequence fits wherever a longer one does: a sequence that fits nowhere says the same of every waiting
sequence as long (skipped at once), and after :data:`_MISSES` of those an exact check for room (per size, the least
load among the groups with room for each shard, by a sort of their tokens) finds the next waiting sequence that fits
by galloping from the current one, or ends the microbatch where the shortest fits nowhere. Against the scan of
every waiting sequence this replaced (one at a time, with a vector check for room after 16 misses), the same plans
take 0.48-0.83x the CPU time as hydra forms and stops them (two to four microbatches; 512 and 2,048 ranks, 4,500 to
74,000 sequences) and 0.65-1.12x formed whole (64 to 2,048 ranks, 600 to 74,000 sequences; the smallest batch pays
for the tables computed up front); fastest of three and two runs, one version after the other.

Filling the empty ranks doubles the first smallest group until none is empty, as the baseline does, with a heap
of group sizes instead of a scan and a shift of every group per doubling (:func:`_fill`); where that cannot fill the
pool the baseline's own code makes its fallback. Against the vector expressions over every group that this and the
per-size arrays replaced, the same plans took 0.27-0.44x the CPU time (64 to 2,048 ranks, 2,600 to 37,400
sequences; 2,048 ranks x 35,600 sequences: 0.33x; the two alternating in one process, fastest of three each).
"""

from __future__ import annotations

import bisect
import functools
import heapq
from collections.abc import Callable

import numpy as np

from lightning_hydra.planner import compiled
from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.mcore import CAP_DELTA, MegatronMicrobatch, finish_microbatch, groups_of
from lightning_hydra.planner.plan import Group, Plan
from lightning_hydra.planner.request import PlanRequest

__all__ = ["Stop", "min_degrees", "schedule_mcore_fast"]

Stop = Callable[[list[Group], np.ndarray], bool]
"""Called after each microbatch with its groups and the ids of the sequences still waiting; ``True`` abandons the
placement (:class:`~lightning_hydra.planner.mcore_bound.Hopeless`)."""

_MISSES = 16
"""Sequences that find no place (each a run of equal lengths) before the check for room (:func:`_one_microbatch`'s
``live``) finds the next waiting sequence that fits at all."""
_SAMPLES = 64
"""Indices one narrowing step of the check for room tests at once."""
_GALLOP = np.asarray([0, *(2**k - 1 for k in range(1, 40))], dtype=np.int64)
"""Offsets from the current index the check for room tests first (0, 1, 3, 7, ...: the next sequence that fits is
often near)."""


class _Batch:
    """Every sequence's figures in Megatron's order (longest first, ties by id), computed once per plan: a
    microbatch's waiting sequences keep that order (what waits is a subsequence of what was tried), so each
    microbatch reads them by position instead of sorting and converting the batch again. The tables per size and
    the Python lists are computed on first use: the compiled placement
    (:func:`~lightning_hydra.planner.compiled.megatron_microbatch`) reads none of them."""

    def __init__(self, req: PlanRequest, sizes: list[int]) -> None:
        lengths = np.asarray(req.lengths, dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        self.ids = order
        """Sequence id at each position."""
        self.lens_arr = lengths[order]
        """Length at each position."""
        self.size_arr = np.asarray(sizes, dtype=np.int64)
        """The allowed sizes."""
        self.klo_arr = np.searchsorted(self.size_arr, min_degrees(self.lens_arr, req.capacity))
        """Index of the smallest size each sequence may take."""
        self.shorter_arr = np.searchsorted(-self.lens_arr, -self.lens_arr, side="right")
        """First position of a shorter sequence after each position."""

    @functools.cached_property
    def id_list(self) -> list[int]:
        """:attr:`ids` as Python ints (read one at a time)."""
        return self.ids.tolist()

    @functools.cached_property
    def lens(self) -> list[int]:
        """:attr:`lens_arr` as Python ints."""
        return self.lens_arr.tolist()

    @functools.cached_property
    def klo(self) -> list[int]:
        """:attr:`klo_arr` as Python ints."""
        return self.klo_arr.tolist()

    @functools.cached_property
    def shorter(self) -> list[int]:
        """:attr:`shorter_arr` as Python ints."""
        return self.shorter_arr.tolist()

    @functools.cached_property
    def shards(self) -> np.ndarray:
        """Zigzag shard ``[position, size]``."""
        return shard_tokens(self.lens_arr[:, None], self.size_arr[None, :])

    @functools.cached_property
    def costs(self) -> np.ndarray:
        """Megatron's load ``L * L / size`` ``[position, size]`` (the baseline's division of the same integers: the
        same floats)."""
        return (self.lens_arr * self.lens_arr)[:, None] / self.size_arr[None, :]

    @functools.cached_property
    def allowed(self) -> np.ndarray:
        """Whether a sequence may take a size ``[position, size]``."""
        return np.arange(self.size_arr.size)[None, :] >= self.klo_arr[:, None]


def _one_microbatch(
    b: _Batch, pend: np.ndarray, sizes: list[int], world_size: int, capacity: int, whole: bool = True
) -> tuple[list[tuple[int, int, list[int]]], np.ndarray]:
    """Form one microbatch from the waiting positions ``pend`` (ascending); return its groups ``(start, size, ids)``
    and the positions that wait (``whole``: whether the pool is a group,
    :func:`~lightning_hydra.planner.mcore.finish_microbatch`)."""
    if compiled.enabled():
        return _compiled_microbatch(b, pend, sizes, world_size, capacity, whole)
    n = pend.size
    pos = pend.tolist()
    cap = float(b.lens[pos[0]]) * float(capacity) * (1.0 + CAP_DELTA)  # Megatron's cap on a rank's load
    n_sizes = len(sizes)
    size_arr = np.asarray(sizes, dtype=np.int64)
    # per size, its groups (numbered in creation order), their loads and tokens (the scans read only the sizes a
    # sequence may take, without gathers); the fill reads them back in creation order
    c_group = [np.zeros(world_size // z, dtype=np.int64) for z in sizes]
    c_load = [np.zeros(world_size // z) for z in sizes]
    c_packed = [np.zeros(world_size // z, dtype=np.int64) for z in sizes]
    c_count = [0] * n_sizes
    # per size, the least tokens and load of its groups: a size none of whose groups has room is skipped unread
    low_packed = [capacity + 1] * n_sizes
    low_load = [np.inf] * n_sizes
    present: list[int] = []  # the sizes that have groups, ascending
    members: list[list[int]] = []  # positions of each group's sequences
    count = 0
    next_free = 0
    top = 0.0  # the pool's maximum load

    def add_group(k: int, p: int) -> None:
        nonlocal count, next_free, top
        size = sizes[k]
        load, packed = float(b.costs[p, k]), int(b.shards[p, k])
        j = c_count[k]
        c_group[k][j], c_load[k][j], c_packed[k][j] = count, load, packed
        c_count[k] = j + 1
        if not j:
            bisect.insort(present, k)
        low_packed[k], low_load[k] = min(low_packed[k], packed), min(low_load[k], load)
        members.append([p])
        top = max(top, load)
        count += 1
        next_free += size

    def add_to(k: int, j: int, p: int, cost: float, shard: int) -> None:
        nonlocal top
        was_low = c_packed[k][j] == low_packed[k], c_load[k][j] == low_load[k]
        c_load[k][j] += cost
        c_packed[k][j] += shard
        if was_low[0]:
            low_packed[k] = int(c_packed[k][: c_count[k]].min())
        if was_low[1]:
            low_load[k] = float(c_load[k][: c_count[k]].min())
        members[int(c_group[k][j])].append(p)
        top = max(top, float(c_load[k][j]))

    def live(start: int) -> int:
        # token room, free ranks and the loads' room under the cap only shrink while a microbatch forms: a sequence
        # that fits no group of an allowed size and no free block now never will in this microbatch (the baseline
        # finds the same); and a shorter sequence fits wherever a longer one does (a smaller shard, load and
        # degree), so those that fit are the waiting ones from some index on: that index (from ``start``, by
        # galloping and narrowing samples; ``n`` where none fits). Per size, its groups' tokens ascending and the
        # least load among the groups holding at most that many: a sequence fits a group of that size exactly where
        # the least load among those with room for its shard, plus its cost, stays within the cap
        tables = []
        for k in range(n_sizes):
            if c_count[k] and top <= cap:
                order = np.argsort(c_packed[k][: c_count[k]], kind="stable")
                tables.append((k, c_packed[k][order], np.minimum.accumulate(c_load[k][order])))
        fresh = (size_arr <= world_size - next_free) & (top <= cap)

        def fit_now(at: np.ndarray) -> np.ndarray:
            rows = pend[at]
            shards, costs = b.shards[rows], b.costs[rows]
            fits = fresh & (shards <= capacity) & (costs <= cap)
            for k, packed, least in tables:
                held = np.searchsorted(packed, capacity - shards[:, k], side="right")
                fits[:, k] |= (held > 0) & (least[np.maximum(held - 1, 0)] + costs[:, k] <= cap)
            return (fits & b.allowed[rows]).any(axis=1)

        at = np.unique(np.minimum(start + _GALLOP, n - 1))
        fits = fit_now(at)
        if not fits[-1]:
            return n
        while True:  # the first sample that fits is at ``at[j]``; the one before it does not
            j = int(fits.argmax())
            if j == 0 or at[j] == at[j - 1] + 1:
                return int(at[j])
            lo, hi = int(at[j - 1]) + 1, int(at[j])
            at = np.arange(lo, hi + 1, max(1, -(-(hi - lo + 1) // _SAMPLES)), dtype=np.int64)
            if at[-1] != hi:
                at = np.append(at, hi)
            fits = fit_now(at)

    add_group(b.klo[pos[0]], pos[0])  # the longest, alone at its smallest size
    placed = np.zeros(n, dtype=bool)
    placed[0] = True
    i, misses = 1, 0
    while i < n:
        if misses >= _MISSES:
            i, misses = live(i), 0
            if i >= n:
                break
        p = pos[i]
        costs = b.costs[p].tolist()
        klo = b.klo[p]
        shards = b.shards[p].tolist()
        free = world_size - next_free
        grouped = present[bisect.bisect_left(present, klo) :]  # the sizes it may take that have groups, ascending
        if top <= cap:
            # the common case first: a candidate that leaves the maximum at ``top`` (every projection is at least
            # ``top``, so one that equals it is a minimum); the first in Megatron's order among them wins: sizes
            # ascending, groups of a size in creation order, a new group after them
            # the first size from ``klo`` on whose new group leaves ``top``; sizes ascend, so where it exceeds the
            # free ranks no larger one fits them either
            kn = klo
            while kn < n_sizes and costs[kn] > top:
                kn += 1
            if kn < n_sizes and sizes[kn] > free:
                kn = n_sizes
            done = False
            for k in grouped:
                if k > kn:
                    break
                cost = costs[k]
                if low_packed[k] > capacity - shards[k] or low_load[k] + cost > top:
                    continue
                n_k = c_count[k]
                fit = (c_load[k][:n_k] + cost <= top) & (c_packed[k][:n_k] <= capacity - shards[k])
                j = int(fit.argmax())
                if fit[j]:
                    add_to(k, j, p, cost, shards[k])
                    done = True
                    break
            if not done and kn < n_sizes:
                add_group(kn, p)
                done = True
            if done:
                placed[i] = True
                i, misses = i + 1, 0
                continue
        # the smallest projected maximum within the cap over existing groups of an allowed size with token room
        # and new groups on free ranks; the first in Megatron's order at it wins
        # (Megatron's order: sizes ascending and, at a size, its groups before a new one; the earliest at the
        # smallest projection wins: existing groups over the sizes that have them, then new groups over the sizes
        # that fit the free ranks, a new one winning a tie only at a smaller size)
        best_p, best_k, best_j = np.inf, n_sizes, -1
        for k in grouped:
            cost = costs[k]
            if low_packed[k] <= capacity - shards[k] and max(top, low_load[k] + cost) <= cap:
                n_k = c_count[k]
                proj = np.maximum(top, c_load[k][:n_k] + cost)
                ok = (proj <= cap) & (c_packed[k][:n_k] <= capacity - shards[k])
                if ok.any():
                    q = float(proj[ok].min())
                    if q < best_p:
                        best_p, best_k, best_j = q, k, int(np.flatnonzero(ok & (proj == q))[0])
        for k in range(klo, n_sizes):
            if sizes[k] > free:
                break
            q = max(top, costs[k])
            if q <= cap and (q < best_p or (q == best_p and k < best_k)):
                best_p, best_k, best_j = q, k, -1
        if best_k == n_sizes:
            # it fits nowhere now, nor will any sequence as long (the same shards, loads and sizes): on to the next
            # shorter one
            i, misses = bisect.bisect_left(pos, b.shorter[p], i + 1), misses + 1
            continue
        placed[i] = True
        i, misses = i + 1, 0
        if best_j >= 0:
            add_to(best_k, best_j, p, costs[best_k], shards[best_k])
        else:
            add_group(best_k, p)

    # every group's size, load and tokens in creation order (groups sit contiguously in that order)
    g_size = np.empty(count, dtype=np.int64)
    g_load = np.empty(count)
    g_packed = np.empty(count, dtype=np.int64)
    for k in range(n_sizes):
        made = c_group[k][: c_count[k]]
        g_size[made] = sizes[k]
        g_load[made] = c_load[k][: c_count[k]]
        g_packed[made] = c_packed[k][: c_count[k]]
    return _close(b, pend, members, (g_size, g_load, g_packed), next_free, placed, sizes, world_size, capacity, whole)


def _compiled_microbatch(
    b: _Batch, pend: np.ndarray, sizes: list[int], world_size: int, capacity: int, whole: bool
) -> tuple[list[tuple[int, int, list[int]]], np.ndarray]:
    """:func:`_one_microbatch` by :func:`~lightning_hydra.planner.compiled.megatron_microbatch` (the same
    groups)."""
    n = pend.size
    g_size, g_load, g_packed = np.empty(n, dtype=np.int64), np.empty(n), np.empty(n, dtype=np.int64)
    pos_group = np.empty(n, dtype=np.int64)
    count = compiled.megatron_microbatch(
        pend, b.lens_arr, b.klo_arr, b.shorter_arr, b.size_arr, world_size, capacity, CAP_DELTA, g_size, g_load,
        g_packed, pos_group,
    )  # fmt: skip
    placed = pos_group >= 0
    at = np.flatnonzero(placed)
    by = at[np.argsort(pos_group[at], kind="stable")]  # each group's positions in the order they joined
    members: list[list[int]] = [[] for _ in range(count)]
    for p, g in zip(pend[by].tolist(), pos_group[by].tolist(), strict=True):
        members[g].append(p)
    made = (g_size[:count], g_load[:count], g_packed[:count])
    return _close(b, pend, members, made, int(made[0].sum()), placed, sizes, world_size, capacity, whole)


def _close(
    b: _Batch, pend: np.ndarray, members: list[list[int]], made: tuple[np.ndarray, np.ndarray, np.ndarray],
    next_free: int, placed: np.ndarray, sizes: list[int], world_size: int, capacity: int, whole: bool,
) -> tuple[list[tuple[int, int, list[int]]], np.ndarray]:  # fmt: skip
    """The microbatch's groups ``(start, size, ids)`` once its sequences are placed, and the positions that wait:
    the empty ranks filled as the baseline fills them (:func:`_fill`, or the baseline's own code where that cannot
    fill them).

    Args:
        b: The batch's figures.
        pend: The waiting positions the microbatch was formed from.
        members: Each group's positions, in creation order.
        made: Each group's size, load and tokens, in creation order.
        next_free: Ranks the groups take.
        placed: Which of ``pend`` were placed.
        sizes: The allowed sizes.
        world_size: Ranks in the pool.
        capacity: Tokens a rank may hold.
        whole: Whether the pool is a group (:func:`~lightning_hydra.planner.mcore.finish_microbatch`).
    """
    g_size, g_load, g_packed = made
    pos = pend.tolist()
    group_sizes = g_size.tolist()
    filled = _fill(group_sizes, sizes, world_size, next_free)
    if filled is not None:
        ids = b.id_list
        groups = [(s, z, [ids[p] for p in q]) for s, z, q in zip(_starts(filled), filled, members, strict=True)]
        return groups, pend[~placed]
    # the baseline's fill on its own state (it ends in one group of the whole pool)
    mb = MegatronMicrobatch(world_size)
    for start, size, packed, load, group_seqs in zip(
        _starts(group_sizes), group_sizes, g_packed.tolist(), g_load.tolist(), members, strict=True
    ):
        mb.starts.append(start)
        mb.sizes.append(size)
        mb.packed.append(packed)
        mb.seqs.append([(b.id_list[p], b.lens[p]) for p in group_seqs])
        mb.exec[start : start + size] = load
    mb.next_free = next_free
    seqs = [(b.id_list[p], b.lens[p]) for p in pos]
    leftovers = [seqs[i] for i in np.flatnonzero(~placed).tolist()]
    groups, rest = finish_microbatch(mb, seqs, leftovers, sizes, world_size, capacity, whole)
    position = {seq[0]: p for seq, p in zip(seqs, pos, strict=True)}
    return groups, np.asarray([position[i] for i, _ in rest], dtype=np.int64)


def _starts(group_sizes: list[int]) -> list[int]:
    """First rank of each group: groups take the lowest free ranks in creation order, so the running sum."""
    return np.cumsum([0, *group_sizes[:-1]]).tolist()


def min_degrees(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The baseline's minimum degree of every sequence (:func:`~lightning_hydra.planner.mcore._min_degree`: the
    power of two at or above ``ceil(L / capacity)``, doubled while the zigzag shard exceeds the capacity), for all
    of them at once."""
    need = np.maximum(1, -(-lengths // capacity))
    degree = np.ones_like(need)
    while (short := degree < need).any():
        degree[short] *= 2
    while (over := shard_tokens(lengths, degree) > capacity).any():
        degree[over] *= 2
    return degree


def _fill(group_sizes: list[int], sizes: list[int], world_size: int, next_free: int) -> list[int] | None:
    """The group sizes after the baseline's fill of the empty ranks
    (:func:`~lightning_hydra.planner.mcore.finish_microbatch`), or ``None`` where it cannot fill them (then it makes
    one group of the whole pool).

    The baseline doubles the first smallest group (creation order) until no rank is empty, shifting the groups after
    it; groups sit contiguously in creation order, so their starts stay the running sum of their sizes, and a group
    can grow exactly when the pool has room for it (a heap of ``(size, group)`` finds it in ``O(log G)`` rather than
    a scan and a shift of every group).
    """
    out = list(group_sizes)
    heap = [(z, g) for g, z in enumerate(out)]
    heapq.heapify(heap)
    index = {z: k for k, z in enumerate(sizes)}
    while next_free < world_size:
        if not heap:
            return None
        z, g = heap[0]
        k = index[z]
        if k + 1 >= len(sizes) or next_free + sizes[k + 1] - z > world_size:
            return None
        heapq.heapreplace(heap, (sizes[k + 1], g))
        out[g] = sizes[k + 1]
        next_free += sizes[k + 1] - z
    return out


def schedule_mcore_fast(req: PlanRequest, stop: Stop | None = None) -> Plan | None:
    """The plan :func:`~lightning_hydra.planner.mcore.schedule_mcore` makes, without its whole-pool scans.

    Args:
        req: The validated request.
        stop: Called after each microbatch (:data:`Stop`); where it returns ``True`` the placement is abandoned and
            ``None`` returned. ``None``: always the whole plan.
    """
    sizes = req.rules.degrees()
    batch = _Batch(req, sizes)
    whole = req.rules.factor(req.world_size) is not None
    pend = np.arange(req.lengths.size, dtype=np.int64)
    microbatches: list[list[Group]] = []
    while pend.size:
        groups, pend = _one_microbatch(batch, pend, sizes, req.world_size, req.capacity, whole)
        microbatches.append(groups_of(req, groups))
        if stop is not None and pend.size and stop(microbatches[-1], batch.ids[pend]):
            return None
    return req.plan(microbatches, "mcore")
