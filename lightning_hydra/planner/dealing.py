"""The single-rank deal of a microbatch: every group takes the longest remaining sequence that fits, round after round.

After the multi-rank sequences are placed (:mod:`~lightning_hydra.planner.placement`), every free rank becomes a
group of one, and the sequences that fit one rank are dealt to all groups in rounds (:func:`place_single`). The
rounds run compiled where Numba is installed (:func:`~lightning_hydra.planner.compiled.deal_rounds`, the same plans)
and vectorised otherwise (:func:`_vector_rounds`); past :data:`_ROUNDS` rounds the rest is dealt in blocks
(:func:`_deal_block`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lightning_hydra.planner import compiled
from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.order import descending_order, is_descending

if TYPE_CHECKING:
    from lightning_hydra.planner.placement import Microbatch

__all__ = ["place_single"]

_ROUNDS = 64
"""Rounds of the single-rank dealing (a round gives one sequence to each open group) before the rest is dealt in
blocks (:func:`_deal_block`)."""
_ROUNDING = compiled.ROUNDING
"""Relative allowance on the closed-form longest sequence within a group's slack (its rounding; the exact check
decides)."""


def place_single(
    mb: Microbatch, cost: CostModel, lens: np.ndarray, seqs: np.ndarray, target: float, last: bool
) -> np.ndarray:
    """Deal single-rank-class sequences to every group in vectorised rounds; return those that wait.

    Each round, every open group takes the heaviest remaining sequence that fits its slack (under the level), its
    token room and, on a multi-rank group, the kernel tile (a sequence is split no finer than ``min_chunk_tokens``
    per rank): groups with the most room take the heaviest sequences, and among equal room the least loaded
    first, so that while everything fits a round is a round of longest-processing-time-first. Collisions (two
    groups wanting the same sequence) resolve in one pass: the ``i``-th group takes the first free sequence at or
    after its own candidate. A pair the exact bin time rejects moves that group past the sequence. Rounds end when
    no group can take anything; the last microbatch has no level and takes what any group has room for. The rounds
    run compiled where :func:`~lightning_hydra.planner.compiled.enabled` says so, vectorised otherwise: the same
    plans.
    """
    ds = mb.ds
    free = mb.free
    mb.free = 0
    gk = np.concatenate([np.asarray(mb.gk, dtype=np.int64), np.zeros(free, dtype=np.int64)])
    load = np.concatenate([np.asarray(mb.load, dtype=np.float64), np.zeros(free)])
    mb.classes, mb.loads = gk, load
    if gk.size == 0 or seqs.size == 0:
        return seqs
    bsum = np.concatenate([np.asarray(mb.bsum, dtype=np.float64), np.zeros(free)])
    nsum = np.concatenate([np.asarray(mb.nsum, dtype=np.float64), np.zeros(free)])
    held = np.concatenate([np.asarray(mb.held, dtype=np.int64), np.zeros(free, dtype=np.int64)])
    size, ulysses, ring = ds.sizes[gk], ds.ulysses[gk], ds.ring[gk]
    fixed = mb.tab.fixed[gk]
    # sequences longest first (their parts and shard at class 0, their memory minimum: every sequence dealt here
    # has it, so that pairs with a class-0 group are read, not computed)
    s_seq, s_len = seqs, lens[seqs]
    if not is_descending(s_len):
        order = descending_order(s_len)
        s_seq, s_len = seqs[order], s_len[order]
    limit = np.inf if last else target
    tile = 0.0 if last else max(cost.min_chunk_tokens, 1.0)
    tiles = np.where(ds.sizes == 1, np.inf, -(ds.sizes * tile))  # per class: its shortest sequence, negated
    taken = np.zeros(s_seq.size, dtype=bool)
    assign = np.full(s_seq.size, -1, dtype=np.int64)
    groups = (gk, load, bsum, nsum, held, size, ulysses, ring, fixed, mb.tab.quad[gk], mb.tab.per_token[gk])
    tables = (mb.tab.base_min, mb.tab.net_min, mb.tab.shard_min)
    if compiled.enabled():
        exhausted = compiled.deal_rounds(
            s_seq, s_len, *tables, *groups, tiles.astype(np.float64), float(limit), bool(last), int(mb.cap),
            float(cost.ring_exposure), compiled.cost_params(cost), _ROUNDS, taken, assign,
        )  # fmt: skip
    else:
        exhausted = _vector_rounds(cost, s_seq, s_len, tables, groups, tiles, limit, last, mb.cap, taken, assign)
    if exhausted:  # many short sequences per group: deal the rest in blocks, several per group at once
        state = (bsum, nsum, held, load)
        while _deal_block(cost, s_len, taken, assign, state, size, ulysses, ring, fixed, limit, tile, mb.cap):
            pass
    placed = np.flatnonzero(assign >= 0)
    mb.single_seq, mb.single_gid = s_seq[placed], assign[placed]
    return s_seq[~taken]


def _vector_rounds(
    cost: CostModel, s_seq: np.ndarray, s_len: np.ndarray, tables: tuple[np.ndarray, ...],
    groups: tuple[np.ndarray, ...], tiles: np.ndarray, limit: float, last: bool, cap: int, taken: np.ndarray,
    assign: np.ndarray,
) -> bool:  # fmt: skip
    """The rounds of :func:`place_single`, vectorised over the groups (at most :data:`_ROUNDS`); update the groups'
    state and ``taken`` and ``assign`` in place. Returns whether every round ran.

    Args:
        cost: The planner's model.
        s_seq: The sequences to deal, longest first; ``s_len`` their lengths.
        tables: Every sequence's base, net and shard on one rank (by sequence id).
        groups: Per group: class, load, base sum, net sum, tokens held, size, Ulysses and ring degree, fixed cost,
            and the quadratic and per-token terms of :meth:`~lightning_hydra.planner.cost.CostModel.length_quadratic`.
        tiles: Per class, its shortest sequence negated (``-inf``-free: ``inf`` where any length is allowed).
        limit: The level (``inf`` in the last microbatch).
        last: Whether this is the last microbatch.
        cap: Tokens a rank may hold.
        taken: Per position, whether its sequence was dealt.
        assign: Per position, the group it was dealt to (``-1``: none).
    """
    base0, net0, shard0 = tables
    gk, load, bsum, nsum, held, size, ulysses, ring, fixed, quad, per_token = groups
    exposure = cost.ring_exposure
    wide_group = gk > 0
    any_wide = bool(wide_group.any())
    neg_all = -s_len.astype(np.float64)  # every bound below is a float: compare in one dtype
    lo = np.zeros(gk.size, dtype=np.int64)  # per group: first position (in ``s_seq``) it may still take

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
            return False
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
            return False
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
            return False
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
    return True


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
