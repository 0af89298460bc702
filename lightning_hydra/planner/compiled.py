"""The planner's three inner loops compiled with Numba: the plans of the NumPy code, in a fraction of the time.

Three loops take most of a large plan's time in Python (a 2,048-rank x 256K lognormal batch,
``python -m lightning_hydra.bench.schedule``): the single-rank deal's rounds
(:func:`~lightning_hydra.planner.dealing.place_single`: some forty NumPy calls a round, about 190 rounds a plan),
the multi-rank placement (:func:`~lightning_hydra.planner.placement.place_multi`: one sequence at a time in the
interpreter) and Megatron's placement as a candidate (:func:`~lightning_hydra.planner.mcore_fast._one_microbatch`).
Where `Numba <https://numba.pydata.org>`_ is installed (the ``fast`` extra), :func:`deal_rounds`,
:func:`place_multi` and :func:`megatron_microbatch` run them as compiled loops. Every comparison and every
floating-point operation is the NumPy code's, in the same order (:func:`pair_parts` and :func:`longest_under` repeat
:meth:`CostModel.pair_parts <lightning_hydra.planner.cost.CostModel.pair_parts>` and
:meth:`CostModel.longest_under <lightning_hydra.planner.cost.CostModel.longest_under>` operation for operation;
the bulk shortcuts of the Python loops, runs of openings and of misses and the check for room, are exact, and the
compiled loops place one sequence at a time), so the plans are identical: ``tests/test_compiled.py`` compares
them, and the two cost functions bit for bit.

Without Numba, or with ``LIGHTNING_HYDRA_COMPILED=0`` in the environment, the NumPy code runs. The first plan in a
process compiles the kernels (about ten seconds) unless Numba's cache beside this file (or its user-wide cache
where the package is read-only) holds them from an earlier process. Where the cache lacks them, the first plans of
a node's processes run one at a time (:func:`first_plan`, a file lock): the first compiles and writes the cache, the
others load it, instead of every rank's planner compiling the same kernels at once (4 CPU ranks on 2 cores, from
the start of training to the first step: 64-66 s with a cold cache before, 15-21 s now, 2.3 s warm;
``python -m lightning_hydra.bench.startup --cold``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator

import numpy as np

from lightning_hydra.planner.cost import CostModel

__all__ = [
    "ENV", "ROUNDING", "cost_params", "deal_rounds", "enabled", "first_plan", "installed", "longest_under",
    "megatron_microbatch", "merge_descending", "pair_parts", "place_multi",
]  # fmt: skip

ENV = "LIGHTNING_HYDRA_COMPILED"
"""Environment variable that turns the compiled kernel off where set to ``0`` (the vectorised rounds run)."""

ROUNDING = 1e-9
"""Relative allowance on the closed-form longest sequence within a group's slack (its rounding; the exact check
decides): the deal's, compiled and vectorised."""

_KERNELS = (
    "pair_parts", "longest_under", "_left", "_right", "_untaken", "_merge_sort", "_order", "_fit", "deal_rounds",
    "_insert", "_remove", "place_multi", "_mcost", "_mshard", "_add_group", "_add_to", "megatron_microbatch",
    "merge_descending",
)  # fmt: skip
"""This module's functions Numba compiles, callees first."""
_INLINE = ("pair_parts", "longest_under", "_left", "_right", "_untaken", "_fit", "_mcost", "_mshard")
"""The small ones, compiled into their callers (a call passing a dozen arrays cost more than the work: the deal's
rounds took 0.8x the time inlined)."""

_compiled: list[bool] = []
"""``[True]`` once :func:`_compile` has bound this module's kernels to their compiled versions."""


@functools.cache
def installed() -> bool:
    """Whether Numba can be imported (the ``fast`` extra; looked up once)."""
    return importlib.util.find_spec("numba") is not None


def enabled() -> bool:
    """Whether the planner runs the compiled kernels: Numba is installed and ``LIGHTNING_HYDRA_COMPILED`` is not
    ``0``. The first ``True`` binds the kernels to their compiled versions (Numba is imported only then, so that a
    process that never plans does not pay for it)."""
    if os.environ.get(ENV, "1") == "0" or not installed():
        return False
    if not _compiled:
        _compile()
    return True


def _compile() -> None:
    """Bind every kernel of :data:`_KERNELS` to ``numba.njit`` of itself (cached on disk; IEEE division: ``x / 0``
    is ``inf``, as in NumPy; :data:`_INLINE` inlined). The kernels call one another through this module's names,
    which Numba reads when a kernel is first called, after this has bound them all."""
    import numba

    namespace = globals()
    for name in _KERNELS:
        inline = "always" if name in _INLINE else "never"
        namespace[name] = numba.njit(cache=True, error_model="numpy", inline=inline)(namespace[name])
    _compiled.append(True)


def _cached() -> bool:
    """Whether Numba's cache holds every kernel it compiles on its own (its index written after this file was)."""
    source = os.path.getmtime(__file__)
    for name in _KERNELS:
        if name in _INLINE:
            continue  # compiled into its callers
        try:
            index = globals()[name]._cache._cache_file._index_path
        except AttributeError:  # another Numba: unknown, treat as cold
            return False
        if not os.path.exists(index) or os.path.getmtime(index) < source:
            return False
    return True


_LOADED = [False]
"""Whether this process has planned once (its kernels compiled or loaded): a fact of the process, as Numba's
compiled functions are."""


@contextlib.contextmanager
def first_plan() -> Iterator[None]:
    """Around a process's plans: while Numba's cache lacks the kernels, one process of the node plans at a time (an
    exclusive lock on a file in the temporary directory, named after this file), so that the first compiles the
    kernels and writes the cache, and the others, waiting, then load it (at once, the lock released); with the
    cache warm, or without compiled kernels, nothing is locked. After a process's first plan its kernels are in
    memory: later plans check nothing (they run every step, and a kernel that only some batches compile would
    otherwise keep the cache cold and the lock taken for the whole run)."""
    if _LOADED[0] or not enabled() or _cached():
        yield
        _LOADED[0] = True
        return
    import fcntl

    key = hashlib.sha256(os.path.abspath(__file__).encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"lightning_hydra-compile-{key}-{os.getuid()}.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, however the plan ends
        if _cached():  # another process wrote the cache while this one waited: load it beside the others
            fcntl.flock(lock, fcntl.LOCK_UN)
        yield
    _LOADED[0] = True


def cost_params(cost: CostModel) -> np.ndarray:
    """The coefficients :func:`pair_parts` and :func:`longest_under` read, as one float64 array (a compiled function
    takes no Python object)."""
    return np.array(
        [
            cost.attn, cost.linear, cost.seq_overhead, cost.length_overhead, cost.min_chunk_tokens,
            cost.a2a_bytes_per_token, cost.intra_node_bandwidth, cost.ring_bytes_per_token, cost.ring_share,
            cost.inter_node_bandwidth, cost.intra_node_ring_bandwidth, float(cost.ranks_per_node),
        ],
        dtype=np.float64,
    )  # fmt: skip


def pair_parts(length: float, u: float, r: float, p: np.ndarray) -> tuple[float, float]:
    """:meth:`CostModel.pair_parts <lightning_hydra.planner.cost.CostModel.pair_parts>` of one sequence at degree
    ``(u, r)``, operation for operation: ``(base, net)``. ``p``: :func:`cost_params`."""
    attn, linear, seq_overhead, length_overhead, min_chunk = p[0], p[1], p[2], p[3], p[4]
    a2a_bytes, intra, ring_bytes, ring_share, inter, intra_ring, node = p[5], p[6], p[7], p[8], p[9], p[10], p[11]
    d = u * r
    # ring_steps: the ring's traffic and the attention that can hide it (ring_bandwidth without a layout)
    steps = max(r - 1.0, 0.0)
    inside = node > 0.0 and d <= node and node % d == 0.0  # the group divides the node: its ring stays inside
    bw = intra_ring if inside else inter
    traffic = steps * ring_bytes * (length / r) / u / bw
    hideable = steps * attn * length * length / (u * r * r)
    # compute, with the tile-bounded degree attention scales with
    eff = min(d, max(1.0, length / min_chunk))
    compute = attn * length * length / eff + linear * length / d + seq_overhead + length_overhead * length
    a2a = (a2a_bytes * (length / d) * (u - 1.0) / u if u > 1.0 else 0.0) / intra
    return compute + a2a + ring_share * traffic, traffic - hideable


def longest_under(budget: float, quad: float, per_token: float, seq_overhead: float) -> float:
    """:meth:`CostModel.longest_under <lightning_hydra.planner.cost.CostModel.longest_under>` of one group,
    operation for operation."""
    spare = budget - seq_overhead
    if spare == np.inf:
        return np.inf
    if not spare > 0.0:
        return 0.0
    if quad > 0.0:
        return 2.0 * spare / (per_token + np.sqrt(per_token * per_token + 4.0 * quad * max(spare, 0.0)))
    return spare / per_token


def _left(a: np.ndarray, n: int, x: float) -> int:
    """``np.searchsorted(a[:n], x, "left")`` (compiled for each type of ``a`` and ``x``)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _right(a: np.ndarray, n: int, x: float) -> int:
    """``np.searchsorted(a[:n], x, "right")``: how many of the ascending ``a[:n]`` are at most ``x``."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _order(
    first: np.ndarray, carried: np.ndarray, n: int, out: np.ndarray, work: np.ndarray, count: np.ndarray
) -> None:
    """``out[:n] = np.lexsort((carried[:n], first[:n]))``: a counting sort of the indices by ``first`` (stable), then
    a stable merge sort by ``carried`` of each run of equal ``first`` (``count``: zeros, longer than the largest
    ``first``; left zero). Few indices are merge-sorted whole."""
    if n < 64:
        for i in range(n):
            out[i] = i
        _merge_sort(first, carried, out, work, 0, n)
        return
    low, high = first[0], first[0]
    for a in range(n):
        low, high = min(low, first[a]), max(high, first[a])
    for a in range(n):
        count[first[a] - low + 1] += 1
    for v in range(1, high - low + 2):
        count[v] += count[v - 1]
    for a in range(n):
        v = first[a] - low
        out[count[v]] = a
        count[v] += 1
    count[: high - low + 2] = 0
    start = 0
    for i in range(1, n + 1):
        if i == n or first[out[i]] != first[out[start]]:
            if i - start > 1:
                _merge_sort(first, carried, out, work, start, i)
            start = i


def _merge_sort(first: np.ndarray, carried: np.ndarray, out: np.ndarray, work: np.ndarray, lo: int, hi: int) -> None:
    """Sort ``out[lo:hi]`` by ``(first, carried)`` of its entries, stably (bottom-up merges through ``work``)."""
    n = hi - lo
    width = 1
    in_work = False  # whether the sorted runs are in ``work``
    while width < n:
        src, dst = (work, out) if in_work else (out, work)
        for left in range(lo, hi, 2 * width):
            mid, right = min(left + width, hi), min(left + 2 * width, hi)
            i, j, k = left, mid, left
            while i < mid and j < right:
                a, b = src[i], src[j]
                if first[b] < first[a] or (first[b] == first[a] and carried[b] < carried[a]):
                    dst[k] = b
                    j += 1
                else:
                    dst[k] = a
                    i += 1
                k += 1
            while i < mid:
                dst[k] = src[i]
                i += 1
                k += 1
            while j < right:
                dst[k] = src[j]
                j += 1
                k += 1
        in_work = not in_work
        width *= 2
    if in_work:
        out[lo:hi] = work[lo:hi]


def _fit(
    g: int, pos: int, s_seq: np.ndarray, s_len: np.ndarray, base0: np.ndarray, net0: np.ndarray, shard0: np.ndarray,
    gk: np.ndarray, bsum: np.ndarray, nsum: np.ndarray, held: np.ndarray, fixed: np.ndarray, size: np.ndarray,
    ulysses: np.ndarray, ring: np.ndarray, limit: float, cap: int, exposure: float, p: np.ndarray,
) -> tuple[float, float, int, float, bool]:  # fmt: skip
    """The vectorised rounds' ``fit`` for one pair: parts, shard, load after and whether sequence ``pos`` fits
    group ``g``."""
    if gk[g] > 0:  # a multi-rank group: the pair's parts at its degree
        length = s_len[pos]
        b, n = pair_parts(float(length), float(ulysses[g]), float(ring[g]), p)
        shard = 2 * -(-length // (2 * size[g]))
    else:  # one rank: the sequence's memory minimum, read
        at = s_seq[pos]
        b, n, shard = base0[at], net0[at], shard0[at]
    after = bsum[g] + b + exposure * max(nsum[g] + n, 0.0) + fixed[g]
    return b, n, shard, after, (after <= limit) and (held[g] + shard <= cap)


def _untaken(nxt: np.ndarray, taken: np.ndarray, p: int) -> int:
    """The first position at or after ``p`` not taken (``taken.size`` where none): ``nxt`` links each taken position
    towards the next one that may not be (path halving keeps the links short)."""
    n = taken.size
    while p < n and taken[p]:
        q = nxt[p]
        if q < n and taken[q]:
            nxt[p] = nxt[q]
        p = q
    return p


def deal_rounds(
    s_seq: np.ndarray, s_len: np.ndarray, base0: np.ndarray, net0: np.ndarray, shard0: np.ndarray, gk: np.ndarray,
    load: np.ndarray, bsum: np.ndarray, nsum: np.ndarray, held: np.ndarray, size: np.ndarray, ulysses: np.ndarray,
    ring: np.ndarray, fixed: np.ndarray, quad: np.ndarray, per_token: np.ndarray, tiles: np.ndarray, limit: float,
    last: bool, cap: int, exposure: float, p: np.ndarray, rounds: int, taken: np.ndarray, assign: np.ndarray,
) -> bool:  # fmt: skip
    """The rounds of :func:`~lightning_hydra.planner.dealing.place_single` (see there), at most ``rounds`` of
    them; updates the groups' ``load``, ``bsum``, ``nsum`` and ``held`` and the positions' ``taken`` and ``assign``
    in place. Returns whether every round ran (the caller then deals the rest in blocks).

    The vectorised rounds keep the positions still to deal as an array they compact every round; here they are
    every position from ``start`` on that is not taken, read through links to the next untaken one, and positions
    are compared as they are (the array is in position order: its indices and its positions order the same). Only
    a group whose closed-form estimate was optimistic bisects over that array's indices, and it is built for it.

    Args mirror the vectorised rounds' names: ``s_seq``/``s_len`` the sequences longest first, ``base0``/``net0``/
    ``shard0`` their parts and shard on one rank (by sequence id), the group arrays (class ``gk``, state, degree,
    fixed cost and :meth:`~lightning_hydra.planner.cost.CostModel.length_quadratic`), ``tiles`` per class (its
    shortest sequence, negated), ``limit`` the level (``inf`` in the last microbatch), ``p`` :func:`cost_params`.
    """
    n, n_groups = s_seq.size, gk.size
    seq_overhead = p[2]
    neg_all = -s_len.astype(np.float64)
    nxt = np.arange(1, n + 1)  # links from taken positions onwards
    lo = np.zeros(n_groups, dtype=np.int64)  # per group: first position it may still take (0: none refused)
    act = np.arange(n_groups)
    n_act = n_groups
    start = 0  # positions before it no group can take any more (the vectorised rounds' cut at ``head``)
    head = 0
    lighter = False
    first = np.empty(n_groups, dtype=np.int64)
    stop = np.empty(n_groups, dtype=np.int64)
    carried = np.empty(n_groups)
    sel_g = np.empty(n_groups, dtype=np.int64)
    sel_stop = np.empty(n_groups, dtype=np.int64)
    sel_pos = np.empty(n_groups, dtype=np.int64)
    by = np.empty(n_groups, dtype=np.int64)
    order_work = np.empty(n_groups, dtype=np.int64)
    order_count = np.zeros(n + 2, dtype=np.int64)
    class_stop = np.empty(tiles.size, dtype=np.int64)
    for j in range(tiles.size):  # per class, the end of the sequences at or above its tile
        class_stop[j] = _right(neg_all, n, tiles[j])
    rem = np.empty(n, dtype=np.int64)  # built only for a bisect
    f_b = np.empty(n_groups)
    f_n = np.empty(n_groups)
    f_shard = np.empty(n_groups, dtype=np.int64)
    f_after = np.empty(n_groups)
    f_ok = np.empty(n_groups, dtype=np.bool_)
    for _ in range(rounds):
        if lighter:  # every sequence not taken comes back
            start, lighter = 0, False
        elif head:
            start = head
        if _untaken(nxt, taken, start) >= n:
            return False
        # per group still taking: the first sequence within its slack and token room, past any it was refused, and
        # the end of those at or above its tile (per class)
        m = 0
        for a in range(n_act):
            g = act[a]
            longest = float(2 * size[g] * ((cap - held[g]) // 2))
            c = load[g] if held[g] > 0 else fixed[g]
            if not last:
                bound = longest_under(limit - c, quad[g], per_token[g], seq_overhead) * (1 + ROUNDING)
                if bound < longest:
                    longest = bound
            f = _untaken(nxt, taken, max(start, _left(neg_all, n, -longest)))
            if lo[g] != 0 and lo[g] > f:
                f = _untaken(nxt, taken, lo[g])
            s = class_stop[gk[g]]
            if f < s:
                act[m], first[m], stop[m], carried[m] = g, f, s, c
                m += 1
        n_act = m
        if n_act == 0:
            return False
        low = first[0]
        for a in range(1, n_act):
            low = min(low, first[a])
        head = low
        # groups by first sequence, then by load carried, then in order; each takes the first untaken position at or
        # after its own, past the one the group before took (the vectorised ``rank + maximum.accumulate(...)``)
        _order(first, carried, n_act, by, order_work, order_count)
        k, prev = 0, -1
        for a in range(n_act):
            b = by[a]
            at = first[b] if first[b] > prev else _untaken(nxt, taken, prev + 1)
            prev = at
            if at < stop[b]:
                sel_g[k], sel_pos[k], sel_stop[k] = act[b], at, stop[b]
                k += 1
        if k == 0:
            return False
        bad = False
        for t in range(k):
            f_b[t], f_n[t], f_shard[t], f_after[t], f_ok[t] = _fit(
                sel_g[t], sel_pos[t], s_seq, s_len, base0, net0, shard0, gk, bsum, nsum, held, fixed, size, ulysses,
                ring, limit, cap, exposure, p,
            )  # fmt: skip
            bad = bad or not f_ok[t]
        if bad:  # the estimate was optimistic: bisect (over the positions still to deal) to the first it takes
            n_rem, q = 0, _untaken(nxt, taken, start)
            while q < n:
                rem[n_rem] = q
                n_rem += 1
                q = _untaken(nxt, taken, q + 1)
            for t in range(k):
                if f_ok[t]:
                    continue
                g = sel_g[t]
                left, right = _left(rem, n_rem, sel_pos[t]) + 1, _left(rem, n_rem, sel_stop[t])
                end = right
                while left < right:
                    mid = (left + right) // 2
                    if _fit(g, rem[mid], s_seq, s_len, base0, net0, shard0, gk, bsum, nsum, held, fixed, size,
                            ulysses, ring, limit, cap, exposure, p)[4]:  # fmt: skip
                        right = mid
                    else:
                        left = mid + 1
                lo[g] = rem[min(left, n_rem - 1)] if left < end else n
        for t in range(k):
            if f_ok[t]:
                g = sel_g[t]
                bsum[g] += f_b[t]
                nsum[g] += f_n[t]
                held[g] += f_shard[t]
                if f_after[t] < load[g]:  # a newcomer's hidden ring traffic made a group lighter
                    lighter = True
        if lighter:
            head = 0
        for t in range(k):
            if f_ok[t]:
                load[sel_g[t]] = f_after[t]
                taken[sel_pos[t]] = True
                assign[sel_pos[t]] = sel_g[t]
    return True


def _insert(ord_load: np.ndarray, ord_g: np.ndarray, cnt: np.ndarray, j: int, load: float, g: int) -> None:
    """Insert ``(load, g)`` into class ``j``'s groups ordered by ``(load, group)`` (``bisect.insort``)."""
    n = cnt[j]
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if load < ord_load[j, mid] or (load == ord_load[j, mid] and g < ord_g[j, mid]):
            hi = mid
        else:
            lo = mid + 1
    for q in range(n, lo, -1):
        ord_load[j, q] = ord_load[j, q - 1]
        ord_g[j, q] = ord_g[j, q - 1]
    ord_load[j, lo] = load
    ord_g[j, lo] = g
    cnt[j] = n + 1


def _remove(ord_load: np.ndarray, ord_g: np.ndarray, cnt: np.ndarray, j: int, load: float, g: int) -> None:
    """Remove ``(load, g)`` from class ``j``'s ordered groups."""
    n = cnt[j]
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if ord_load[j, mid] < load or (ord_load[j, mid] == load and ord_g[j, mid] < g):
            lo = mid + 1
        else:
            hi = mid
    for q in range(lo, n - 1):
        ord_load[j, q] = ord_load[j, q + 1]
        ord_g[j, q] = ord_g[j, q + 1]
    cnt[j] = n - 1


def place_multi(
    k_arr: np.ndarray, cols: np.ndarray, shards_a: np.ndarray, base_a: np.ndarray, net_a: np.ndarray,
    own_a: np.ndarray, need_size: np.ndarray, cost_tab: np.ndarray, base_tab: np.ndarray, net_tab: np.ndarray,
    shard_tab: np.ndarray, fixed: np.ndarray, sizes: np.ndarray, target: float, last: bool, cap: int,
    exposure: float, free: int, give_up: int, fit_scan: int, reach: int, g_class: np.ndarray, g_load: np.ndarray,
    g_bsum: np.ndarray, g_nsum: np.ndarray, g_held: np.ndarray, seq_group: np.ndarray,
) -> tuple[int, int]:  # fmt: skip
    """:func:`~lightning_hydra.planner.placement.place_multi` one sequence at a time (its runs of openings and of
    misses, found in bulk there, are what this does one by one): the same groups, loads and waiting sequences.

    Sequences ``i`` come heaviest first with their class ``k_arr``, table column ``cols``, shard, base and net at
    the ``reach + 1`` classes from theirs (``[n, reach + 1]``), load alone ``own_a`` and ranks ``need_size``; the
    ``*_tab`` tables ``[class, column]`` serve the last microbatch, which may take any class. Fills the groups'
    class, load, base and net sums and tokens (``g_*``, in opening order) and each sequence's group
    (``seq_group``, ``-1``: it waits). Returns the number of groups and the ranks left free.
    """
    n, n_classes = k_arr.size, sizes.size
    top = n_classes - 1
    ord_load = np.empty((n_classes, max(n, 1)))
    ord_g = np.empty((n_classes, max(n, 1)), dtype=np.int64)
    cnt = np.zeros(n_classes, dtype=np.int64)
    count = 0
    misses = 0
    i = 0
    while i < n:
        if misses >= give_up and not last:  # what cannot open a group of its own waits without a look
            while i < n and need_size[i] > free:
                seq_group[i] = -1
                i += 1
            if i >= n:
                break
        k = k_arr[i]
        choice, cls, col = -1, k, 0
        for o in range(min(reach, top - k) + 1):
            j, need = k + o, shards_a[i, o]
            if need > cap or cnt[j] == 0:
                continue
            b = base_a[i, o]
            q = _right(ord_load[j], cnt[j], target - b) - 1  # loads hold the fixed cost: the base adds
            lowest = max(q - fit_scan, -1)
            while q > lowest:  # best fit: the most loaded with room
                g = ord_g[j, q]
                if g_held[g] + need <= cap:
                    nn = g_nsum[g] + net_a[i, o]
                    if g_bsum[g] + b + (exposure * nn if nn > 0 else 0.0) + fixed[j] <= target:
                        choice, cls, col = g, j, o
                    break
                q -= 1
            if choice != -1:
                break
        if choice == -1 and free >= sizes[k] and shards_a[i, 0] <= cap:  # a new group of its own class
            g = count
            g_class[g], g_load[g], g_held[g] = k, own_a[i], shards_a[i, 0]
            g_bsum[g], g_nsum[g] = base_a[i, 0], net_a[i, 0]
            free -= sizes[k]
            _insert(ord_load, ord_g, cnt, k, own_a[i], g)
            seq_group[i] = g
            count += 1
            misses = 0
            i += 1
            continue
        base, net, shard, fix = 0.0, 0.0, 0, 0.0
        if choice == -1 and last:  # the least loaded group with room at any class from its own up
            c = cols[i]
            best_v, best_g = 0.0, -1
            for j in range(k, top + 1):
                add, need = cost_tab[j, c] - fixed[j], shard_tab[j, c]
                if cnt[j] == 0 or (best_g >= 0 and ord_load[j, 0] + add >= best_v) or need > cap:
                    continue
                for q in range(cnt[j]):  # its least loaded group with room
                    g = ord_g[j, q]
                    if g_held[g] + need <= cap:
                        if best_g < 0 or g_load[g] + add < best_v:
                            best_v, best_g = g_load[g] + add, g
                            base, net, shard, fix = base_tab[j, c], net_tab[j, c], need, fixed[j]
                        break
            choice = best_g
        elif choice != -1:
            base, net, shard, fix = base_a[i, col], net_a[i, col], shards_a[i, col], fixed[cls]
        if choice == -1:
            seq_group[i] = -1
            misses += 1
            i += 1
            continue
        misses = 0
        g = choice
        j = g_class[g]
        _remove(ord_load, ord_g, cnt, j, g_load[g], g)
        g_bsum[g] += base
        g_nsum[g] += net
        nn = g_nsum[g]
        g_load[g] = g_bsum[g] + (exposure * nn if nn > 0 else 0.0) + fix
        g_held[g] += shard
        _insert(ord_load, ord_g, cnt, j, g_load[g], g)
        seq_group[i] = g
        i += 1
    return count, free


def _mcost(length: int, size: int) -> float:
    """Megatron's load of a sequence on ``size`` ranks, ``L * L / size``, as ``_Batch.costs`` computes it (the
    integer square, then a true division)."""
    return float(length * length) / float(size)


def _mshard(length: int, size: int) -> int:
    """:func:`~lightning_hydra.planner.degrees.shard_tokens` of one sequence."""
    return 2 * -(-length // (2 * size))


def _add_group(
    k: int, load: float, packed: int, c_group: np.ndarray, c_load: np.ndarray, c_packed: np.ndarray,
    c_count: np.ndarray, low_packed: np.ndarray, low_load: np.ndarray, count: int,
) -> float:  # fmt: skip
    """Megatron's new group of size ``k`` (number ``count``) holding a sequence of ``load`` and ``packed`` tokens;
    returns its load."""
    j = c_count[k]
    c_group[k, j], c_load[k, j], c_packed[k, j] = count, load, packed
    c_count[k] = j + 1
    low_packed[k], low_load[k] = min(low_packed[k], packed), min(low_load[k], load)
    return load


def _add_to(
    k: int, j: int, cost: float, shard: int, c_load: np.ndarray, c_packed: np.ndarray, c_count: np.ndarray,
    low_packed: np.ndarray, low_load: np.ndarray,
) -> float:  # fmt: skip
    """Add a sequence's ``cost`` and ``shard`` to group ``j`` of size ``k``; returns the group's new load."""
    was_packed, was_load = c_packed[k, j] == low_packed[k], c_load[k, j] == low_load[k]
    c_load[k, j] += cost
    c_packed[k, j] += shard
    if was_packed:
        low_packed[k] = c_packed[k, : c_count[k]].min()
    if was_load:
        low_load[k] = c_load[k, : c_count[k]].min()
    return c_load[k, j]


def megatron_microbatch(
    pos: np.ndarray, lens: np.ndarray, klo: np.ndarray, shorter: np.ndarray, sizes: np.ndarray, world_size: int,
    capacity: int, cap_delta: float, g_size: np.ndarray, g_load: np.ndarray, g_packed: np.ndarray,
    pos_group: np.ndarray,
) -> int:  # fmt: skip
    """The sequence-by-sequence loop of :func:`~lightning_hydra.planner.mcore_fast._one_microbatch` (Megatron's
    placement of one microbatch): the same groups, one waiting sequence at a time (a sequence that fits nowhere
    skips every one as long; the check for room that finds the next one that fits there is a shortcut of this).

    ``pos`` are the waiting positions (ascending; per position its length ``lens``, its smallest size ``klo`` and
    the first shorter position ``shorter``; a sequence's shard and load at a size are computed as the NumPy tables
    are, :func:`_mshard` and :func:`_mcost`). Fills every group's
    size, load and tokens in creation order (``g_*``) and each waiting index's group (``pos_group``, ``-1``: it
    waits). Returns the number of groups.
    """
    n, n_sizes = pos.size, sizes.size
    cap = float(lens[pos[0]]) * float(capacity) * (1.0 + cap_delta)  # Megatron's cap on a rank's load
    c_group = np.zeros((n_sizes, world_size), dtype=np.int64)
    c_load = np.zeros((n_sizes, world_size))
    c_packed = np.zeros((n_sizes, world_size), dtype=np.int64)
    c_count = np.zeros(n_sizes, dtype=np.int64)
    low_packed = np.full(n_sizes, capacity + 1, dtype=np.int64)
    low_load = np.full(n_sizes, np.inf)
    pos_group[:] = -1
    p = pos[0]  # the longest, alone at its smallest size
    k = klo[p]
    top = _add_group(k, _mcost(lens[p], sizes[k]), _mshard(lens[p], sizes[k]), c_group, c_load, c_packed, c_count,
                     low_packed, low_load, 0)  # fmt: skip
    g_size[0] = sizes[k]
    pos_group[0] = 0
    count, next_free = 1, sizes[k]
    i = 1
    while i < n:
        p = pos[i]
        length, lo_k = lens[p], klo[p]
        free = world_size - next_free
        new_k, add_k, add_j = -1, -1, -1
        if top <= cap:  # a candidate that leaves the maximum at ``top``, the first in Megatron's order
            kn = lo_k
            while kn < n_sizes and _mcost(length, sizes[kn]) > top:
                kn += 1
            if kn < n_sizes and sizes[kn] > free:
                kn = n_sizes
            for k in range(lo_k, min(kn, n_sizes - 1) + 1):
                if c_count[k] == 0:
                    continue
                cost, room = _mcost(length, sizes[k]), capacity - _mshard(length, sizes[k])
                if low_packed[k] > room or low_load[k] + cost > top:
                    continue
                for j in range(c_count[k]):
                    if c_load[k, j] + cost <= top and c_packed[k, j] <= room:
                        add_k, add_j = k, j
                        break
                if add_k >= 0:
                    break
            if add_k < 0 and kn < n_sizes:
                new_k = kn
        if add_k < 0 and new_k < 0:
            # the smallest projected maximum within the cap over groups with token room and new groups on free
            # ranks; the first in Megatron's order at it wins
            best_p, best_k, best_j = np.inf, n_sizes, -1
            for k in range(lo_k, n_sizes):
                if c_count[k] == 0:
                    continue
                cost, room = _mcost(length, sizes[k]), capacity - _mshard(length, sizes[k])
                if low_packed[k] <= room and max(top, low_load[k] + cost) <= cap:
                    q_best, j_best = np.inf, -1
                    for j in range(c_count[k]):
                        q = max(top, c_load[k, j] + cost)
                        if q <= cap and c_packed[k, j] <= room and q < q_best:
                            q_best, j_best = q, j
                    if j_best >= 0 and q_best < best_p:
                        best_p, best_k, best_j = q_best, k, j_best
            for k in range(lo_k, n_sizes):
                if sizes[k] > free:
                    break
                q = max(top, _mcost(length, sizes[k]))
                if q <= cap and (q < best_p or (q == best_p and k < best_k)):
                    best_p, best_k, best_j = q, k, -1
            if best_k == n_sizes:  # it fits nowhere, nor does any sequence as long: on to the next shorter one
                nxt = shorter[p]
                lo, hi = i + 1, n
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if pos[mid] < nxt:
                        lo = mid + 1
                    else:
                        hi = mid
                i = lo
                continue
            if best_j >= 0:
                add_k, add_j = best_k, best_j
            else:
                new_k = best_k
        if add_k >= 0:
            cost, shard = _mcost(length, sizes[add_k]), _mshard(length, sizes[add_k])
            load = _add_to(add_k, add_j, cost, shard, c_load, c_packed, c_count, low_packed, low_load)
            pos_group[i] = c_group[add_k, add_j]
        else:
            cost, shard = _mcost(length, sizes[new_k]), _mshard(length, sizes[new_k])
            load = _add_group(new_k, cost, shard, c_group, c_load, c_packed, c_count, low_packed, low_load, count)
            g_size[count] = sizes[new_k]
            pos_group[i] = count
            count += 1
            next_free += sizes[new_k]
        top = max(top, load)
        i += 1
    for k in range(n_sizes):
        for j in range(c_count[k]):
            g_load[c_group[k, j]] = c_load[k, j]
            g_packed[c_group[k, j]] = c_packed[k, j]
    return count


def merge_descending(head_values: np.ndarray, head: np.ndarray, second: np.ndarray, out: np.ndarray) -> bool:
    """:func:`~lightning_hydra.planner.order.descending_order_of_two` once ``first`` is sorted: merge the indices
    ``head`` of ``first`` (values ``head_values``, non-increasing) with those of ``second`` (offset by
    ``head.size``), ties first-before-second, into ``out``. Returns ``False``, ``out`` unfilled, where ``second`` is
    not non-increasing (the caller sorts the concatenation)."""
    n_first, n_second = head.size, second.size
    for j in range(1, n_second):
        if second[j] > second[j - 1]:
            return False
    i, j, k = 0, 0, 0
    while i < n_first and j < n_second:
        if head_values[i] >= second[j]:
            out[k] = head[i]
            i += 1
        else:
            out[k] = n_first + j
            j += 1
        k += 1
    while i < n_first:
        out[k] = head[i]
        i += 1
        k += 1
    while j < n_second:
        out[k] = n_first + j
        j += 1
        k += 1
    return True
