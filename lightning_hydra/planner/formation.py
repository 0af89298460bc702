"""Dense, load-driven formation of microbatches: the placement every ``hydra`` candidate uses.

Microbatches are formed one after the other from the sequences still to place, heaviest first, as Megatron's
Dynamic-CP forms them, but with a closed-form load level, load-driven degrees and O(log N) placement:

1. **Level.** Microbatch ``m`` aims at ``T_m = max(dense, even)``: ``dense`` is the work per rank of the heaviest
   remaining sequences that fill the pool's tokens (:data:`DENSE_FILL`), ``even`` the remaining work spread over
   the remaining microbatches (work at the memory minimum, overheads and communication included), each plus the
   fixed cost a busy rank pays once per microbatch (the smallest class's ``CostModel.fixed``: counted per rank, not
   per sequence). Packing a microbatch densely with the heaviest sequences keeps their degrees low; ``even``
   guarantees that the asked number of microbatches holds the batch.
2. **Degrees.** With ``raise_degrees`` every sequence takes the smallest class of the degree set whose per-rank
   cost is at most ``T_m`` (never below its memory minimum): long sequences get more ranks than memory needs.
   Without it every sequence stays at its memory minimum (Megatron's degrees). With a ``lift`` above 1 the class
   is chosen at ``lift * T_m`` instead (fewer sequences raised, less ring traffic). The level then rises to the
   tallest sequence's cost if that is still above it.
3. **Placement of multi-rank sequences**, heaviest first: the most loaded group with token room of the sequence's
   own class, or of a slightly larger class (at most :data:`REACH` classes up), that stays within the level (best
   fit: groups fill up one after the other, whole groups stay free for heavier sequences); else a new group of its
   own class on free ranks. Groups sit in a list per class ordered by load, so a placement costs ``O(log N)``; runs
   of sequences that can only open groups of their own are opened in bulk; what does not fit waits for the next
   microbatch.
4. **Placement of single-rank sequences**, vectorised: every free rank becomes a group, then in rounds every group
   with room takes the longest remaining sequence that fits its slack under the level (a closed-form bound,
   :meth:`CostModel.longest_within`, checked exactly), its token room and, on a multi-rank group, a kernel tile per
   rank; while everything fits a round is a round of longest-processing-time-first. What does not fit waits for
   the next microbatch.

Steps 3 and 4 and Megatron's placement as a candidate run as compiled loops where Numba is installed
(:mod:`~lightning_hydra.planner.compiled`): the same plans.

The last asked microbatch takes everything left (above the level if it must); only sequences no group can hold
(tokens) open further microbatches. Where its raised degrees' work overflows the pool at its level (a long
sequence whose cheapest class is most of the pool, the rest left to pile into its group), it is also formed at the
*water level*, the lowest level whose degrees' work fits the pool (:func:`_water_level`), and the lower maximum is
kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.dealing import place_single
from lightning_hydra.planner.layout import layout
from lightning_hydra.planner.order import descending_order, descending_order_of_two, stable_argsort
from lightning_hydra.planner.placement import REACH, Microbatch, place_multi
from lightning_hydra.planner.plan import Group, Plan
from lightning_hydra.planner.request import PlanRequest
from lightning_hydra.planner.tables import DegreeSet, Tables

__all__ = ["BALANCE_ROUNDS", "BALANCE_TOL", "DENSE_FILL", "REACH", "Formation", "Recipe", "form"]

DENSE_FILL = 0.8
"""Share of the pool's tokens the dense level assumes a microbatch can hold. Aiming higher (0.88 before) set levels
that the placement, bound by tokens, reached only on the multi-rank groups: ranks full of short sequences stayed
below them, and the calibrated model and the truths both scored the plans lower (measured on ten calibrated cells at
50%, 75% and 90% fill: hydra's worst cell against mcore under the truth rose from 0.88 to any of 0.75-0.82 at
every fill at 256K and at 50% and 75% at 32K, where at 90% the even level binds and nothing changed; on the
robustness benchmark at 90% fill the 256K mean fell by 1%, the fine candidate doing better at 0.88 there; see the
robustness benchmark (`bench.robust`))."""

BALANCE_TOL = 0.01
"""Share of a microbatch's largest load its ranks may wait on average (the largest load less the mean over the
pool) before a balanced formation (:func:`form`'s ``balance``) places it again at a lower level."""
BALANCE_ROUNDS = 3
"""Most placements again of one microbatch in a balanced formation (each at the mean load the last one reached)."""


@dataclass(frozen=True)
class Recipe:
    """How :func:`form` made a formation: its arguments besides the request, the degree set and the tables."""

    raise_degrees: bool
    even: bool
    lift: float
    microbatches: int | None


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
    memory_driven: bool
    """Whether degrees were chosen at each sequence's memory minimum (:func:`form` without ``raise_degrees``:
    Megatron's degrees; a sequence may still join a group of a larger class that has room)."""
    planned_for: int
    """Microbatches it was planned for: the request's, or fewer (:func:`form`'s ``microbatches``)."""
    recipe: Recipe | None = None
    """The arguments of :func:`form` that made it (besides the degree set), to form it again balanced."""
    balanced: bool = False
    """Whether every microbatch but the last was balanced at its degrees (:func:`form`'s ``balance``)."""
    _laid: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)

    def loads(self, cost: CostModel, lengths: np.ndarray) -> np.ndarray:
        """Predicted load of every group under ``cost``, as planned (before the layout: a ring of a size that does not
        divide the node counts as crossing one)."""
        k = self.group_class
        return cost.group_loads(lengths[self.seq], self.gid, self.degrees.ulysses[k], self.degrees.ring[k])

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """What :func:`~lightning_hydra.planner.robust.span_of` scores: per group its microbatch, Ulysses and ring
        degrees; per placed sequence its index and group; the number of microbatches."""
        k = self.group_class
        return self.group_mb, self.degrees.ulysses[k], self.degrees.ring[k], self.seq, self.gid, self.num_microbatches

    def _layout(self, req: PlanRequest) -> tuple[np.ndarray, np.ndarray]:
        """``(lay, start)``: the groups in layout order (per microbatch, largest Ulysses degree first, then largest
        size, then group number) and the first rank of each (:func:`layout`); computed once."""
        if self._laid is None:
            ds, k = self.degrees, self.group_class
            lay = np.lexsort((-ds.sizes[k], -ds.ulysses[k], self.group_mb))
            kl = k[lay]
            start = layout(
                ds.sizes[kl], ds.ulysses[kl], ds.ring[kl], self.group_mb[lay], self.num_microbatches,
                req.world_size, req.rules.ranks_per_node,
            )  # fmt: skip
            self._laid = (lay, start)
        return self._laid

    def crosses(self, req: PlanRequest) -> np.ndarray | None:
        """Whether each group spans nodes in the plan's layout (:meth:`CostModel.crossing`), in group order;
        ``None`` without rings of up to a node's ranks where the cost model's node is the request's (then the
        contiguous layout keeps every group that divides a node inside one and every larger one crosses, which is
        :meth:`CostModel.ring_bandwidth`'s default). A model whose ``ranks_per_node`` differs from the request's
        reads the layout (a group larger than the request's node may sit inside the model's, and a small one may
        straddle it), so that the formation is scored as :meth:`Plan.loads` will time it."""
        ds = self.degrees
        node = req.cost.ranks_per_node
        if not node or node == req.rules.ranks_per_node:
            small_rings = (ds.sizes <= req.rules.ranks_per_node) & (ds.ring > 1)
            if not small_rings.any() or not small_rings[self.group_class].any():
                return None
        lay, start = self._layout(req)
        out = np.empty(lay.size, dtype=bool)
        out[lay] = req.cost.crossing(start, self.degrees.sizes[self.group_class[lay]])
        return out

    def plain_rings(self, req: PlanRequest) -> tuple[bool, bool]:
        """Whether the formation has rings without a Ulysses level (``u = 1``, ``r > 1``) inside a node and across
        nodes, as laid out: the rings by which calibration learns a link's ring cost
        (:attr:`CostModel.intra_rings_measured`, :attr:`CostModel.inter_rings_measured`)."""
        k = self.group_class
        plain = (self.degrees.ulysses[k] == 1) & (self.degrees.ring[k] > 1)
        if not plain.any():
            return False, False
        crosses = self.crosses(req)
        across = req.cost.spans_nodes(self.degrees.sizes[k]) if crosses is None else crosses
        return bool((plain & ~across).any()), bool((plain & across).any())

    def plan(self, req: PlanRequest, **stats: float | str) -> Plan:
        """The :class:`Plan`, every group contiguous with its Ulysses blocks inside a node (:func:`layout`); idle
        ranks fill the rest."""
        ds = self.degrees
        seq = tuple(self.seq[stable_argsort(self.gid)].tolist())
        bounds = np.concatenate([[0], np.cumsum(np.bincount(self.gid, minlength=self.group_mb.size))])
        k = self.group_class
        ulysses = ds.ulysses[k]
        lay, start = self._layout(req)
        size, mb = ds.sizes[k][lay], self.group_mb[lay]
        end = start + size
        # every group's ranks and sequences are slices of one tuple each (no per-group tuple(range(...)))
        pool = tuple(range(max(req.world_size, int(end.max(initial=0)))))
        groups = [
            Group._of(pool[s0:s1], u, r, seq[a:b])
            for s0, s1, u, r, a, b in zip(
                start.tolist(), end.tolist(), ulysses[lay].tolist(), ds.ring[k[lay]].tolist(),
                bounds[lay].tolist(), bounds[lay + 1].tolist(), strict=True,
            )
        ]  # fmt: skip
        cuts = np.searchsorted(mb, np.arange(self.num_microbatches + 1)).tolist()
        # idle groups take the ranks left: after the last group where a microbatch covers its ranks from 0 on (the
        # contiguous layout), else wherever the node layout left them
        used = np.zeros(self.num_microbatches, dtype=np.int64)
        np.maximum.at(used, mb, end)
        covered = np.bincount(mb, weights=size, minlength=self.num_microbatches)
        microbatches = [
            groups[a:b] + req.idle_groups(top, req.world_size) if top == held else req.fill_idle(groups[a:b])
            for a, b, top, held in zip(cuts[:-1], cuts[1:], used.tolist(), covered.tolist(), strict=True)
        ]
        return req.plan(microbatches, "hydra", **stats)


@dataclass
class _Formed:
    """One formed microbatch: class of every group, its sequences with their group, the largest load and the mean
    load over the pool's ranks (idle ranks count 0)."""

    classes: np.ndarray
    seq: np.ndarray
    gid: np.ndarray
    top: float
    mean: float = 0.0


def _prefix_within(values: np.ndarray, index: np.ndarray, budget: float) -> int:
    """How many leading entries of ``values[index]`` have a running sum within ``budget``: ``np.searchsorted(
    np.cumsum(values[index]), budget, "right")`` for integer ``values``, summed in doubling chunks (the dense
    level's prefix is a microbatch's worth of the remaining sequences, not all of them)."""
    start, chunk, acc = 0, 1024, 0
    while start < index.size:
        sums = np.cumsum(values[index[start : start + chunk]]) + acc
        k = int(np.searchsorted(sums, budget, "right"))
        if k < sums.size:
            return start + k
        start, chunk, acc = start + sums.size, 2 * chunk, int(sums[-1])
    return int(index.size)


def _water_level(
    tab: Tables, ds: DegreeSet, cols: np.ndarray, kdeg: np.ndarray, single_work: float, level: float, n_ranks: int
) -> tuple[float, np.ndarray] | None:
    """The last microbatch's water level where the work at its raised degrees overflows the pool at its level:
    the lowest level ``T`` at which the multi-rank sequences' work at their classes at ``T``
    (:meth:`Tables.classes_at`), plus the single-rank sequences' work, fits ``n_ranks`` ranks each busy ``T`` (less
    the fixed cost a busy rank pays once); ``None`` where it already fits at ``level``.

    A sequence with no class within the level takes its cheapest, on a small batch possibly most of the pool (a
    1M-token sequence: 1.5-1.8% faster on 4,096 ranks than on 2,048), and in the last microbatch the others pile
    into its group. The work only shrinks as the level rises: bisection over the levels where a class changes.

    Args:
        tab: The degree set's cost tables.
        ds: The degree set.
        cols: Columns (in ``tab``'s multi-rank tables) of the microbatch's multi-rank sequences.
        kdeg: Their classes at ``level``.
        single_work: Work of the microbatch's single-rank sequences (at one rank).
        level: The level the microbatch was given (at least its tallest sequence's cost).
        n_ranks: Ranks in the pool.

    Returns:
        ``(T, classes at T)``, or ``None``.
    """

    def fits(k: np.ndarray, t: float) -> bool:
        work = float(((tab.cost_at(k, cols) - tab.fixed[k]) * ds.sizes[k]).sum()) + single_work
        return work <= n_ranks * (t - tab.fixed_min)

    if fits(kdeg, level):
        return None
    steps = tab.runmin[:, cols].ravel()
    steps = np.unique(steps[(steps > level) & np.isfinite(steps)])
    if not steps.size:
        return None
    lo, hi, found = 0, steps.size - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        t = float(steps[mid])
        k = tab.classes_at(t, True, cols)
        if fits(k, t):
            found, hi = (t, k), mid - 1
        else:
            lo = mid + 1
    if found is None:  # every sequence at its cheapest class from its memory minimum on, the least work there is
        t = float(steps[-1])
        found = (t, tab.classes_at(t, True, cols))
    return found


def _microbatch(
    tab: Tables, ds: DegreeSet, req: PlanRequest, remaining: np.ndarray, left: int, last: bool, raise_degrees: bool,
    even: bool = False, lift: float = 1.0, balance: bool = False,
) -> tuple[_Formed, np.ndarray]:  # fmt: skip
    """Form one microbatch from ``remaining`` (heaviest first) with ``left`` microbatches still to come (this one
    included); return it and the sequences that wait. ``even``: the level is the remaining work spread evenly
    (no dense term), so that every microbatch aims at the same maximum. ``lift``: raised degrees are chosen at this
    multiple of the level (see :func:`form`). ``balance``: the degrees chosen, the microbatch is placed again at
    lower levels where its ranks wait (:func:`_balanced`)."""
    n_ranks, cap = req.world_size, req.capacity
    work = tab.work_min[remaining]
    level = float(work.sum()) / n_ranks / max(left, 1) + tab.fixed_min
    if not last and not even:
        fill = _prefix_within(tab.tokens_min, remaining, DENSE_FILL * n_ranks * cap)
        level = max(level, float(work[:fill].sum()) / n_ranks + tab.fixed_min)
    col = tab.column[remaining]
    multi_cols = col[col >= 0]
    kdeg = tab.classes_at(level * lift, raise_degrees, multi_cols) if multi_cols.size else multi_cols
    above = kdeg > 0
    multi_cols, kdeg = multi_cols[above], kdeg[above]
    tallest = float(tab.cost_at(kdeg, multi_cols).max()) if multi_cols.size else 0.0
    if multi_cols.size:
        placed_multi = np.zeros(req.lengths.size, dtype=bool)
        placed_multi[tab.multi[multi_cols]] = True
        single = remaining[~placed_multi[remaining]]
    else:
        single = remaining
    tallest = max(tallest, float(tab.cost_min[single].max()) if single.size else 0.0)
    if raise_degrees and tallest > level * lift * (1 + 1e-9) and multi_cols.size:
        kdeg = tab.classes_at(tallest, raise_degrees, multi_cols)
    level = max(level, tallest)
    formed = _place(tab, ds, req, multi_cols, kdeg, single, level, last)
    if balance and not last:
        formed = _balanced(tab, ds, req, multi_cols, kdeg, single, level, formed)
    if last and raise_degrees and multi_cols.size:
        # the last microbatch takes everything: where its raised degrees overflow the pool, it is also formed at
        # the water level, and kept where that lowers its maximum (and leaves no more waiting)
        water = _water_level(tab, ds, multi_cols, kdeg, float(tab.work_min[single].sum()), level, n_ranks)
        if water is not None:
            alt = _place(tab, ds, req, multi_cols, water[1], single, water[0], last)
            if alt[1].size <= formed[1].size and alt[0].top < formed[0].top:
                formed = alt
    return formed


def _balanced(
    tab: Tables, ds: DegreeSet, req: PlanRequest, multi_cols: np.ndarray, kdeg: np.ndarray, single: np.ndarray,
    level: float, formed: tuple[_Formed, np.ndarray],
) -> tuple[_Formed, np.ndarray]:  # fmt: skip
    """The microbatch ``formed`` at ``level`` placed again, its sequences' degrees kept, at the mean load it reached
    while its ranks wait more than :data:`BALANCE_TOL` of its largest load, at most :data:`BALANCE_ROUNDS` times;
    the placement that leaves the least waiting (largest load less the mean) is kept.

    Where the level is above what ranks full of tokens can carry (ranks that hold shorter sequences' tokens, whose
    work per token is lower), the placement fills the other groups to the level and those ranks wait; a lower level
    lets fewer sequences join the heaviest groups, and what no longer fits waits for the next microbatches, whose
    levels rise by the work that moved. Least waiting in one microbatch is not least in the step (the next ones may
    hold the work less evenly), so the formation this makes is a candidate of its own, scored whole
    (:func:`~lightning_hydra.planner.hydra.candidates`)."""
    best = current = formed
    for _ in range(BALANCE_ROUNDS):
        top, mean = current[0].top, current[0].mean
        if top - mean <= BALANCE_TOL * top or mean >= level * (1 - BALANCE_TOL):
            break
        level = mean
        current = _place(tab, ds, req, multi_cols, kdeg, single, level, False)
        if current[0].top - current[0].mean < best[0].top - best[0].mean:
            best = current
    return best


def _place(
    tab: Tables, ds: DegreeSet, req: PlanRequest, multi_cols: np.ndarray, kdeg: np.ndarray, single: np.ndarray,
    level: float, last: bool,
) -> tuple[_Formed, np.ndarray]:  # fmt: skip
    """Place one microbatch's sequences at ``level``: the multi-rank ones (columns ``multi_cols`` at classes
    ``kdeg``) heaviest first, then the single-rank ones dealt to every group; return it and the sequences that
    wait (heaviest first)."""
    heaviest = descending_order(tab.cost_at(kdeg, multi_cols))
    multi_cols, kdeg = multi_cols[heaviest], kdeg[heaviest]
    mb = Microbatch(tab, ds, req.cost, req.world_size, req.capacity)
    wait_multi = place_multi(mb, multi_cols, kdeg, level, last)
    wait_single = place_single(mb, req.cost, req.lengths, single, level, last)
    if not mb.classes.size:  # nothing was dealt: the groups of the multi-rank phase as they are
        mb.classes, mb.loads = np.asarray(mb.gk, dtype=np.int64), np.asarray(mb.load)
    member_seq, member_gid = mb.member_arrays()
    seq = np.concatenate([member_seq, mb.single_seq])
    gid = np.concatenate([member_gid, mb.single_gid])
    present = np.bincount(gid, minlength=mb.classes.size) > 0  # groups without sequences are dropped (ranks idle)
    used = np.flatnonzero(present)
    gid = (np.cumsum(present) - 1)[gid]
    top = float(mb.loads[used].max()) if used.size else 0.0
    mean = float(np.dot(mb.loads[used], ds.sizes[mb.classes[used]])) / req.world_size
    wait_multi = tab.multi[np.asarray(wait_multi, dtype=np.int64)]
    waiting = np.concatenate([wait_multi, wait_single])  # heaviest first (the single-rank ones mostly are)
    heaviest = descending_order_of_two(tab.cost_min[wait_multi], tab.cost_min[wait_single])
    return _Formed(mb.classes[used], seq, gid.reshape(-1), top, mean), waiting[heaviest]


def form(
    req: PlanRequest, ds: DegreeSet, *, raise_degrees: bool, tables: Tables | None = None, even: bool = False,
    lift: float = 1.0, microbatches: int | None = None, balance: bool = False,
) -> Formation:  # fmt: skip
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
        lift: With ``raise_degrees``, choose every sequence's degree at this multiple of the microbatch's level
            (``1``: the smallest class at or under the level). Above 1, fewer sequences are raised and the level
            rises to the tallest of them: less ring traffic, more room for the rest to fill. Between the
            load-driven (``1``) and the memory-driven formation (no raise), for truths where rings cost more than
            the planner's model charges.
        microbatches: Plan for this many microbatches instead of the request's (named with ``/m`` and the count;
            ``None``: the request's).
        balance: Place every microbatch but the last again at lower levels, its degrees kept, where its ranks wait
            (:func:`_balanced`; named with ``/bal``).

    Returns:
        The candidate as flat arrays.
    """
    tab = tables if tables is not None else Tables(req, ds)
    asked = req.num_microbatches if microbatches is None else microbatches
    # heaviest first (ties in index order), sorted from the longest-first order: it is nearly that, so the sort
    # merges a few runs; equal costs of different lengths (possible only without attention cost) would come out
    # longest first instead, so then the batch's own order is sorted
    by_length = req.longest_first
    remaining = by_length[np.argsort(-tab.cost_min[by_length], kind="stable")]
    cost_sorted = tab.cost_min[remaining]
    if ((cost_sorted[1:] == cost_sorted[:-1]) & (req.lengths[remaining[1:]] != req.lengths[remaining[:-1]])).any():
        remaining = np.argsort(-tab.cost_min, kind="stable")
    formed: list[_Formed] = []
    while remaining.size:
        m = len(formed)
        mb, waiting = _microbatch(
            tab, ds, req, remaining, asked - m, m >= asked - 1, raise_degrees, even, lift, balance
        )
        if m >= asked - 1 and waiting.size == remaining.size:
            raise RuntimeError("formation made no progress")  # pragma: no cover - capacity was checked upstream
        formed.append(mb)
        remaining = waiting
    if len(formed) >= 2 and not even:
        both = np.concatenate([formed[-2].seq, formed[-1].seq])
        # a microbatch holds at most the pool's tokens (every rank holds its shard of each of its group's sequences):
        # where the two hold more, the merged one would leave some waiting and is not formed at all
        if int(req.lengths[both].sum()) <= req.world_size * req.capacity:
            both = both[np.argsort(-tab.cost_min[both], kind="stable")]
            mb, waiting = _microbatch(tab, ds, req, both, 1, True, raise_degrees, lift=lift)
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
        memory_driven=not raise_degrees,
        planned_for=asked,
        recipe=Recipe(raise_degrees, even, lift, microbatches),
        balanced=balance,
        name=f"{ds.name}/{'load' if raise_degrees else 'memory'}"
        + ("/even" if even else "")
        + (f"/x{lift:g}" if raise_degrees and lift != 1.0 else "")
        + (f"/m{microbatches}" if microbatches is not None else "")
        + ("/bal" if balance else ""),
    )
