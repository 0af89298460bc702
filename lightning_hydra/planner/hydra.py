"""The ``hydra`` policy: load-driven dynamic CP with closed-form targets and lazy-heap placement.

Per global batch:

1. **Microbatches.** Two ways to deal the batch into ``M`` microbatches are both planned and the plan with the
   lower predicted span (sum over microbatches of the maximum rank load) is kept: *sorted* (length-sorted runs
   of equal token count, plus the shortest ``1 / M`` of the tokens dealt to all as filler) and *snake* (longest
   first, dealt ``0..M-1, M-1..0``, so that every microbatch gets the same mix). Each microbatch gets its own
   target.
2. **Target.** Total work is conserved when a sequence is split, so a perfectly balanced microbatch puts
   ``T_m = W_m / N`` on every rank (``W_m`` the rank-time of its sequences at their memory minimum, overheads and
   communication included): the closed form, and the floor of the target. Communication and the
   granularity of group sizes raise the rank-work above ``W_m``; the target is the smallest ``T >= W_m / N`` for
   which the groups the microbatch needs fit the pool (bisection on a vectorised count; no placement). Only the
   sequences whose degree can change above the floor are re-evaluated at each step.
3. **Degrees.** Each sequence gets the smallest allowed degree whose per-rank cost is at most ``T``, never below
   the memory minimum. Degrees are ``ulysses * ring`` with eight steps per octave, so a group can be sized to its
   load; long sequences therefore get degrees larger than memory needs.
4. **Groups.** A sequence above ``T / 2`` needs a group of its own; smaller ones are fluid and fill the slack
   beside the big ones; each degree gets as many groups as its load needs, leftover ranks go to the degrees
   loaded the most, and every group is opened up front.
5. **Placement with lazy heaps.** Sequences go in decreasing work to the least loaded group of their degree if it
   stays within ``T``, else to the least loaded group of their degree or larger, up to the largest degree they
   split into efficiently (no finer than a kernel tile per rank; at most ``SCAN`` sizes looked at), so short
   sequences fill the slack beside long ones where that costs no extra rank-time. One min-heap per size holds the
   groups: a group whose load changes gets a fresh entry, stale entries are dropped when they surface and groups
   without token room are parked until a smaller sequence comes. A placement costs ``O(sizes * log N)``, never a
   scan of the pool.
6. **Move pass.** The most loaded group sheds sequences to the least loaded compatible group while that lowers
   the maximum (bounded). Groups are laid out largest Ulysses degree first, so every group is contiguous and
   every Ulysses block stays inside a node.

Sequences that no group can take (tokens) go to a further microbatch rather than being dropped.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.plan import Group, Plan, PlanError
from lightning_hydra.planner.request import PlanRequest

__all__ = ["schedule_hydra", "split_snake", "split_sorted"]

BISECTION_STEPS = 12
SCAN = 6
"""Sizes looked at per placement beyond a sequence's own: evenly spaced over its reach (bounds the cost)."""
"""Bisection steps of the target search."""
MOVE_LIMIT = 256
"""Most moves of the final move pass per microbatch."""


def split_sorted(lengths: np.ndarray, num_microbatches: int, filler_share: float | None = None) -> list[np.ndarray]:
    """Length-sorted runs of equal token count, plus the shortest sequences dealt to all as filler.

    The shortest sequences, ``filler_share`` of the tokens (default ``1 / M``), are kept aside; the rest is cut
    into ``M`` runs; filler then goes, longest first, to the microbatch holding the fewest tokens.
    """
    order = np.argsort(-lengths, kind="stable")
    tokens = lengths[order].astype(np.float64)
    share = 1.0 / num_microbatches if filler_share is None else filler_share
    from_end = np.cumsum(tokens[::-1])[::-1]
    cut = len(order) if num_microbatches == 1 else int(np.searchsorted(-from_end, -share * tokens.sum()))
    heavy, heavy_tokens = order[:cut], tokens[:cut]
    out: list[list[int]] = [[] for _ in range(num_microbatches)]
    if heavy.size:
        mid = np.cumsum(heavy_tokens) - heavy_tokens / 2
        which = np.minimum((mid / heavy_tokens.sum() * num_microbatches).astype(np.int64), num_microbatches - 1)
        for i, m in zip(heavy.tolist(), which.tolist(), strict=True):
            out[m].append(i)
    held = [(int(lengths[ids].sum()) if ids else 0, m) for m, ids in enumerate(out)]
    heapq.heapify(held)
    for i in order[cut:].tolist():
        tok, m = heapq.heappop(held)
        out[m].append(i)
        heapq.heappush(held, (tok + int(lengths[i]), m))
    return [np.asarray(ids, dtype=np.int64) for ids in out]


def split_snake(lengths: np.ndarray, num_microbatches: int) -> list[np.ndarray]:
    """Longest first, dealt ``0, 1, ..., M-1, M-1, ..., 0`` so that every microbatch gets the same mix."""
    order = np.argsort(-lengths, kind="stable")
    pos = np.arange(order.size) % (2 * num_microbatches)
    which = np.where(pos < num_microbatches, pos, 2 * num_microbatches - 1 - pos)
    return [order[which == m] for m in range(num_microbatches)]


class _Degrees:
    """The fine degree table of a pool: sizes, factorizations, Ulysses latencies (shared by all microbatches)."""

    def __init__(self, req: PlanRequest) -> None:
        self.sizes = req.rules.degrees(fine=True)
        self.deg = np.asarray(self.sizes, dtype=np.int64)
        self.factors = [req.rules.factor(d) for d in self.sizes]
        self.u = np.asarray([u for u, _ in self.factors], dtype=np.float64)
        self.r = np.asarray([r for _, r in self.factors], dtype=np.float64)


class _Microbatch:
    """Costs of one microbatch's sequences at every degree, their memory minimums, target and degrees."""

    def __init__(self, req: PlanRequest, table: _Degrees, lengths: np.ndarray) -> None:
        self.table = table
        self.world_size = req.world_size
        self.capacity = req.capacity
        n = lengths.size
        cols = np.arange(n)
        lens = lengths.astype(np.float64)
        # Degrees above what the longest sequence needs at the floor target are never used: costs grow with the
        # length, and the target only rises from the floor. Compute costs up to that degree only.
        longest = int(lengths.max())
        deg = table.deg
        top = req.cost.table(np.asarray([longest]), table.u, table.r)[:, 0]
        fits_top = shard_tokens(np.int64(longest), deg) <= req.capacity
        if not fits_top.any():
            raise PlanError(f"a sequence of {longest} tokens fits no degree of the pool")
        usable = fits_top & (top <= float(req.cost.useful(lens).sum()) / req.world_size)
        last = int(np.argmax(usable)) if usable.any() else int(np.argmin(np.where(fits_top, top, np.inf)))
        self.rows = last + 1
        # cost[k, i]: per-rank time of sequence i alone at degree k; base/ring_comm/ring_attn: the additive parts
        # a bin sums (see CostModel.bin_time); shards[k, i]: its tokens per rank there
        self.base, self.ring_comm, self.ring_attn = req.cost.parts(lens, table.u[: self.rows], table.r[: self.rows])
        self.bin_latency = req.cost.latency(table.u[: self.rows], table.r[: self.rows]).tolist()
        self.cost = self.base + np.maximum(self.ring_comm - self.ring_attn, 0.0) + np.asarray(self.bin_latency)[:, None]
        self.shards = shard_tokens(lengths[None, :], deg[: self.rows, None])
        self.deg = deg[: self.rows]
        self.min_k = np.argmax(self.shards <= req.capacity, axis=0)
        # The closed form: every sequence at its memory minimum (where its rank-time, communication and overheads
        # included, is smallest), spread evenly over the pool. No plan can do better.
        self.floor = float((self.cost[self.min_k, cols] * self.deg[self.min_k]).sum()) / req.world_size
        var = self.cost[self.min_k, cols] > self.floor
        self.var = np.flatnonzero(var)
        rows = np.arange(self.rows)[:, None]
        masked = np.where(rows >= self.min_k[None, self.var], self.cost[:, self.var], np.inf)
        self.runmin = np.minimum.accumulate(masked, axis=0)
        # Largest degree each sequence splits into efficiently (no finer than a kernel tile per rank): joining a
        # larger group would only cost it more rank-time.
        efficient = np.maximum(1.0, lengths / req.cost.min_chunk_tokens)
        self.kmax_tile = np.searchsorted(self.deg, efficient, side="right") - 1
        self.target = self._search_target()
        self.k = self.degrees_at(self.target)
        self.kmax = self._reach(self.k)
        self.work = self.cost[self.k, cols] * self.deg[self.k]

    def _reach(self, k: np.ndarray) -> np.ndarray:
        """Largest degree index a sequence at degree index ``k`` may join: no finer than a kernel tile per rank
        (never below its own)."""
        return np.maximum(self.kmax_tile, k)

    def degrees_at(self, target: float) -> np.ndarray:
        """Smallest degree index (at or above the memory minimum) whose cost is at most ``target``; the cheapest
        allowed degree for a sequence that reaches it nowhere."""
        k = self.min_k.copy()
        if self.var.size:
            count = (self.runmin > target).sum(axis=0)
            cheapest = np.argmin(self.runmin, axis=0)
            k[self.var] = np.where(count < self.runmin.shape[0], count, cheapest)
        return k

    def groups_needed(self, target: float) -> np.ndarray | None:
        """Groups per degree needed at ``target``, or ``None`` when some sequence cannot get down to ``target``
        or the shards overflow the pool's tokens.

        A sequence above half the target needs a group of its own; the others are fluid: they fill the slack
        beside the big ones in groups of their degree or larger and get groups of their own only for the work
        that does not fit there (credited largest degree first: a sequence never joins a smaller group).
        """
        k = self.degrees_at(target)
        cols = np.arange(k.size)
        cost = self.cost[k, cols]
        if (cost > target * (1 + 1e-9)).any():
            return None
        deg = self.deg
        if float((self.shards[k, cols] * deg[k]).sum()) > self.capacity * self.world_size:
            return None  # tokens are checked per degree below, and pool-wide here
        n = deg.size
        big = cost > target / 2
        tokens = self.shards[k, cols] * deg[k]  # tokens a sequence occupies in its group, all members together
        kb = k[big]
        groups = np.bincount(kb, minlength=n).astype(np.float64)
        slack_work = np.bincount(kb, weights=(target - cost[big]) * deg[kb], minlength=n)
        slack_tokens = np.bincount(kb, weights=self.capacity * deg[kb] - tokens[big], minlength=n)
        # A small sequence fills slack beside the big ones in groups from its own degree up to the largest degree it
        # splits into efficiently; credited from the smallest such degree up, the rest gets groups of its own degree.
        small = ~big
        reach = self._reach(k)[small]
        fluid_work = np.bincount(reach, weights=cost[small] * deg[k[small]], minlength=n)
        fluid_tokens = np.bincount(reach, weights=tokens[small], minlength=n)
        home = np.full(n, n, dtype=np.int64)
        np.minimum.at(home, reach, k[small])
        work, room = 0.0, 0.0
        for j in np.flatnonzero((slack_work > 0) | (fluid_work > 0)).tolist():
            work += slack_work[j]
            room += slack_tokens[j]
            if fluid_work[j] <= 0:
                continue
            share = min(1.0, work / fluid_work[j], room / max(fluid_tokens[j], 1.0))
            rest_work, rest_tokens = (1 - share) * fluid_work[j], (1 - share) * fluid_tokens[j]
            h = int(home[j])
            extra = max(
                np.ceil(rest_work / (target * deg[h]) - 1e-9), np.ceil(rest_tokens / (self.capacity * deg[h]) - 1e-9)
            )
            groups[h] += extra
            work += extra * target * deg[h] - fluid_work[j]
            room += extra * self.capacity * deg[h] - fluid_tokens[j]
        return groups

    def ranks_needed(self, target: float) -> float:
        """Ranks the groups of :meth:`groups_needed` occupy (``inf`` when the target is out of reach)."""
        groups = self.groups_needed(target)
        return np.inf if groups is None else float((groups * self.deg).sum())

    def _search_target(self) -> float:
        """Smallest target ``>= W / N`` whose groups fit the pool (bisection on :meth:`ranks_needed`)."""
        lo = self.floor
        if self.ranks_needed(lo) <= self.world_size:
            return lo
        hi = max(2 * lo, float(self.cost[self.min_k, np.arange(self.min_k.size)].max()))
        while self.ranks_needed(hi) > self.world_size:
            if hi > 1e3 * lo:
                return hi  # placement will overload gracefully rather than loop forever
            hi *= 2
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            if self.ranks_needed(mid) <= self.world_size:
                hi = mid
            else:
                lo = mid
        return hi


class _Placement:
    """Groups being filled for one microbatch: one lazy min-heap of loads per size, token-full groups parked."""

    def __init__(self, mb: _Microbatch) -> None:
        self.mb = mb
        self.gk: list[int] = []
        self.load: list[float] = []
        self.held: list[int] = []
        self.bins: list[list[int]] = []
        self.heaps: dict[int, list[tuple[float, int]]] = {}
        self.parked: dict[int, list[tuple[int, int]]] = {}  # per size: max-heap of (-room, group)
        self.classes: list[int] = []
        self.open_classes: set[int] = set()
        self.cost = mb.cost.tolist()
        self.base = mb.base.tolist()
        self.net = (mb.ring_comm - mb.ring_attn).tolist()  # ring traffic minus the attention that can hide it
        self.shards = mb.shards.tolist()
        self.base_sum: list[float] = []
        self.net_sum: list[float] = []

    def open_planned(self) -> None:
        """Open the groups the target search counted; give leftover ranks to the degrees loaded the most."""
        mb = self.mb
        deg = mb.deg.tolist()
        counts = mb.groups_needed(mb.target)
        if counts is None or float((counts * mb.deg).sum()) > mb.world_size:
            counts = np.zeros(len(deg))
        count = counts.astype(np.int64).tolist()
        load = np.bincount(mb.k, weights=mb.cost[mb.k, np.arange(mb.k.size)], minlength=len(deg)).tolist()
        left = mb.world_size - sum(c * d for c, d in zip(count, deg, strict=True))
        loaded = [k for k in range(len(deg)) if load[k] > 0]
        while left > 0:
            fitting = [k for k in loaded if deg[k] <= left]
            if fitting:
                k = max(fitting, key=lambda j: (load[j] / max(count[j], 1), j))
            else:
                k = max(j for j in range(len(deg)) if deg[j] <= left)
            count[k] += 1
            left -= deg[k]
        for k in range(len(deg) - 1, -1, -1):
            for _ in range(count[k]):
                g = len(self.gk)
                self.gk.append(k)
                self.load.append(0.0)
                self.base_sum.append(0.0)
                self.net_sum.append(0.0)
                self.held.append(0)
                self.bins.append([])
                self.heaps.setdefault(k, []).append((0.0, g))
        self.classes = sorted(self.heaps)
        self.open_classes = set(self.classes)

    def least_loaded(self, k: int, i: int) -> int | None:
        """Least loaded group of size ``k`` with token room for sequence ``i``, or ``None``."""
        heap = self.heaps[k]
        need = self.shards[k][i]
        cap = self.mb.capacity
        parked = self.parked.setdefault(k, [])
        while parked and -parked[0][0] >= need:  # groups with enough room for this smaller sequence come back
            _, g = heapq.heappop(parked)
            heapq.heappush(heap, (self.load[g], g))
        while heap:
            lo, g = heap[0]
            if lo != self.load[g]:
                heapq.heappop(heap)  # stale
            elif self.held[g] + need > cap:
                heapq.heappop(heap)
                heapq.heappush(parked, (-(cap - self.held[g]), g))
            else:
                return g
        return None

    def after(self, g: int, i: int) -> float:
        """Load of group ``g`` if sequence ``i`` joins it (bin time: its ring traffic may hide behind others')."""
        k = self.gk[g]
        net = self.net_sum[g] + self.net[k][i]
        return self.base_sum[g] + self.base[k][i] + (net if net > 0.0 else 0.0) + self.mb.bin_latency[k]

    def put(self, g: int, i: int) -> None:
        """Add sequence ``i`` to group ``g`` and push the group's new load."""
        k = self.gk[g]
        self.load[g] = self.after(g, i)
        self.base_sum[g] += self.base[k][i]
        self.net_sum[g] += self.net[k][i]
        self.held[g] += self.shards[k][i]
        self.bins[g].append(i)
        heapq.heappush(self.heaps[k], (self.load[g], g))

    def place(self, i: int) -> bool:
        """Place sequence ``i``; ``False`` when no group can hold its tokens.

        Its own degree first if that stays within the target; else the least loaded group among the sizes that
        still have a group below the target (of its degree or larger); else among all sizes of its degree or
        larger; failing token room there, the smaller sizes down to its memory minimum.
        """
        mb = self.mb
        own = int(mb.k[i])
        target = mb.target
        if own in self.heaps:
            g = self.least_loaded(own, i)
            if g is not None and self.after(g, i) <= target:
                self.put(g, i)
                return True
        classes = self.classes
        lo, hi = bisect.bisect_left(classes, own), bisect.bisect_right(classes, int(mb.kmax[i]))
        near = classes[lo:hi]
        if len(near) > SCAN + 2:
            near = near[:: -(-len(near) // SCAN)] + near[-1:]
        best = self._best(i, [k for k in near if k in self.open_classes], prune=True)
        if best is None or best[0] > target:
            best = self._best(i, near, prune=False) or best
        if best is None:  # no room within reach: larger groups, then smaller ones down to the memory minimum
            best = self._best(i, classes[hi:], prune=False)
        if best is None:
            best = self._best(i, classes[bisect.bisect_left(classes, int(mb.min_k[i])) : lo], prune=False)
        if best is None:
            return False
        self.put(best[1], i)
        return True

    def _best(self, i: int, classes: list[int], prune: bool) -> tuple[float, int] | None:
        """Least resulting load for sequence ``i`` over the heap tops of ``classes`` (with token room)."""
        best: tuple[float, int] | None = None
        for k in classes:
            g = self.least_loaded(k, i)
            if g is None:
                continue
            if prune and self.load[g] >= self.mb.target:
                self.open_classes.discard(k)  # loads only grow during placement: this size is full for good
                continue
            after = self.after(g, i)
            if best is None or after < best[0]:
                best = (after, g)
        return best

    def move_pass(self) -> None:
        """Move sequences off the most loaded group while that lowers the maximum load (bounded)."""
        mb = self.mb
        gk = np.asarray(self.gk)
        loads = np.asarray(self.load)
        base_sum = np.asarray(self.base_sum)
        net_sum = np.asarray(self.net_sum)
        held = np.asarray(self.held)
        lat = np.asarray(mb.bin_latency)[gk]
        for _ in range(MOVE_LIMIT):
            g = int(loads.argmax())
            moved = False
            for i in sorted(self.bins[g], key=lambda j: self.cost[gk[g]][j]):
                after = base_sum + mb.base[gk, i] + np.maximum(net_sum + (mb.ring_comm - mb.ring_attn)[gk, i], 0) + lat
                after[(gk < mb.k[i]) | (held + mb.shards[gk, i] > mb.capacity)] = np.inf
                after[g] = np.inf
                h = int(after.argmin())
                if after[h] >= loads[g] - 1e-12:
                    continue
                k, kh = int(gk[g]), int(gk[h])
                self.bins[g].remove(i)
                self.bins[h].append(i)
                base_sum[g] -= self.base[k][i]
                net_sum[g] -= self.net[k][i]
                held[g] -= self.shards[k][i]
                loads[g] = base_sum[g] + max(net_sum[g], 0.0) + lat[g] if self.bins[g] else 0.0
                base_sum[h] += self.base[kh][i]
                net_sum[h] += self.net[kh][i]
                held[h] += self.shards[kh][i]
                loads[h] = after[h]
                moved = True
                break
            if not moved:
                break
        self.load, self.base_sum, self.net_sum, self.held = (
            loads.tolist(),
            base_sum.tolist(),
            net_sum.tolist(),
            held.tolist(),
        )


def _place(req: PlanRequest, mb: _Microbatch, ids: np.ndarray) -> tuple[list[Group], list[int]]:
    """Place one microbatch's sequences; return its groups (covering the pool) and the sequences to spill."""
    pl = _Placement(mb)
    pl.open_planned()
    spill = [int(ids[i]) for i in np.argsort(-mb.work, kind="stable").tolist() if not pl.place(i)]
    pl.move_pass()
    factors, sizes = mb.table.factors, mb.table.sizes
    # Largest Ulysses degree first, then largest size: every start is a multiple of its Ulysses degree (sizes of
    # one Ulysses degree are multiples of it), so Ulysses blocks never cross a node.
    layout = sorted(range(len(pl.gk)), key=lambda g: (-factors[pl.gk[g]][0], -sizes[pl.gk[g]], g))
    groups, start = [], 0
    ids_list = ids.tolist()
    for g in layout:
        k = pl.gk[g]
        d = sizes[k]
        u, r = factors[k]
        groups.append(Group(tuple(range(start, start + d)), u, r, tuple(ids_list[i] for i in pl.bins[g])))
        start += d
    return groups, spill


def _plan_split(req: PlanRequest, table: _Degrees, name: str, parts: list[tuple[np.ndarray, _Microbatch]]) -> Plan:
    """Place every microbatch of one split; spilled sequences form further microbatches."""
    queue = list(parts)
    microbatches: list[list[Group]] = []
    targets: list[float] = []
    while queue:
        ids, mb = queue.pop(0)
        groups, spill = _place(req, mb, ids)
        microbatches.append(groups)
        targets.append(mb.target)
        if spill:
            rest = np.asarray(spill, dtype=np.int64)
            queue.append((rest, _Microbatch(req, table, req.lengths[rest])))
    return req.plan(microbatches, "hydra", predicted_span=float(sum(targets)), split=name)


def schedule_hydra(req: PlanRequest) -> Plan:
    """Load-driven plan: per-microbatch closed-form targets, load-driven degrees, lazy-heap placement.

    Both splits are placed and the plan with the lower predicted span (sum over microbatches of the maximum
    rank load) is kept; ties keep the sorted split. An empty microbatch (fewer sequences than microbatches) is a
    microbatch of idle ranks.
    """
    table = _Degrees(req)
    best: tuple[float, Plan] | None = None
    for name, split in (("sorted", split_sorted), ("snake", split_snake)):
        parts = split(req.lengths, req.num_microbatches)
        filled = [(ids, _Microbatch(req, table, req.lengths[ids])) for ids in parts if ids.size]
        plan = _plan_split(req, table, name, filled)
        plan.microbatches += [req.fill_idle([]) for ids in parts if not ids.size]
        span = float(plan.loads(req.cost).max(axis=1).sum())
        if best is None or span < best[0]:
            best = (span, plan)
    assert best is not None
    return best[1]
