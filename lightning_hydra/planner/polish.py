"""Polishing a chosen plan: sequences moved between its groups while the planner's model predicts a shorter step.

A formation places sequences level by level and Megatron's placement first fit by tokens; neither revisits a
sequence once placed. Where several CP groups of a microbatch hold short sequences besides their long one, moving a
short sequence from the microbatch's slowest group to a group with slack (in the same or another microbatch) can
lower the step. :func:`polish` does that on the plan robust selection chose, keeping every group's ranks, degrees
and layout, so the plan's communicators and its every-token-once invariant are untouched:

- take the slowest group of the slowest microbatch (then of the next, while none of its changes helps);
- try its :data:`POLISH_TRIES` shortest sequences, each moved to one of the :data:`POLISH_TARGETS` groups with the
  most slack that have token room for it, or swapped with a shorter sequence of one of the groups with the most
  slack;
- keep a change when the predicted step (the sum over microbatches of the slowest group's
  :meth:`~lightning_hydra.planner.cost.CostModel.bin_time`) falls by :data:`POLISH_GAIN` of it or more; stop after
  :data:`POLISH_MOVES` changes or when none helps.

Only single-stage plans are polished (a pipeline's step is not the sum of its microbatches' maxima). Pure and
deterministic: the same plan and model give the same result on every rank.
"""

from __future__ import annotations

import itertools

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.planner.plan import Group, Plan

__all__ = ["POLISH_GAIN", "POLISH_MOVES", "POLISH_TARGETS", "POLISH_TRIES", "polish"]

POLISH_MOVES = 32
"""Most changes :func:`polish` keeps on one plan."""
POLISH_TRIES = 3
"""Shortest sequences of the slowest group tried per round."""
POLISH_TARGETS = 6
"""Groups with the most slack tried per sequence."""
POLISH_GAIN = 1e-4
"""Least share of the predicted step a change must save to be kept (changes within the model's rounding are not
changes the truth would time)."""


def polish(
    plan: Plan,
    cost: CostModel,
    capacity: int,
    *,
    moves: int = POLISH_MOVES,
    tries: int = POLISH_TRIES,
    targets: int = POLISH_TARGETS,
) -> tuple[Plan, int]:
    """``plan`` with sequences moved between its groups while ``cost`` predicts a shorter step.

    Args:
        plan: A single-stage plan (its groups' ranks and degrees are kept).
        cost: The planner's cost model.
        capacity: Most tokens a rank holds in one microbatch (zigzag shards, as :meth:`Plan.check` counts them).
        moves: Most changes kept.
        tries: Shortest sequences of the slowest group tried per round.
        targets: Groups with the most slack tried per sequence.

    Returns:
        The polished plan (``plan`` itself where nothing helps) and the number of changes kept.
    """
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    flat = [g for mb in plan.microbatches for g in mb]  # every group, numbered in microbatch order
    mb_of, start, u, r, seq, gid = plan.flat()
    bounds = np.r_[0, np.cumsum([len(mb) for mb in plan.microbatches])].astype(np.int64)
    degree = u * r
    crosses = np.asarray(cost.crossing(start, degree), dtype=bool)
    times = cost.group_loads(lengths[seq].astype(np.float64), gid, u, r, crosses)
    tokens = np.bincount(gid, weights=shard_tokens(lengths[seq], degree[gid]), minlength=len(flat)).astype(np.int64)
    peak = np.array([times[a:b].max(initial=0.0) for a, b in itertools.pairwise(bounds.tolist())])
    span = float(peak.sum())
    kept = 0

    def time_of(k: int, ids: tuple[int, ...]) -> float:
        g = flat[k]
        return cost.bin_time(lengths[list(ids)], g.ulysses, g.ring, bool(crosses[k])) if ids else 0.0

    def shard(i: int, k: int) -> int:
        return int(shard_tokens(int(lengths[i]), int(degree[k])))

    def attempt(k: int, ids: tuple[int, ...], k2: int, ids2: tuple[int, ...], out: int, into: int) -> bool:
        """Give group ``k`` the sequences ``ids`` and ``k2`` the ``ids2`` (``out`` leaves ``k`` for ``k2``, ``into``
        comes back; -1 for none) where both hold their tokens and the predicted step falls enough."""
        nonlocal span
        tok = tokens[k] - shard(out, k) + (shard(into, k) if into >= 0 else 0)
        tok2 = tokens[k2] + shard(out, k2) - (shard(into, k2) if into >= 0 else 0)
        if tok > capacity or tok2 > capacity:
            return False
        was = times[k], times[k2]
        times[k], times[k2] = time_of(k, ids), time_of(k2, ids2)
        touched = sorted({int(mb_of[k]), int(mb_of[k2])})
        peaks = {m: float(times[bounds[m] : bounds[m + 1]].max()) for m in touched}
        saved = sum(peak[m] - peaks[m] for m in touched)
        if saved < POLISH_GAIN * span:
            times[k], times[k2] = was
            return False
        tokens[k], tokens[k2] = tok, tok2
        for m in touched:
            peak[m] = peaks[m]
        span -= saved
        flat[k] = Group._of(flat[k].ranks, flat[k].ulysses, flat[k].ring, tuple(sorted(ids)))
        flat[k2] = Group._of(flat[k2].ranks, flat[k2].ulysses, flat[k2].ring, tuple(sorted(ids2)))
        return True

    def round_() -> bool:
        slack = peak[mb_of] - times
        order = [int(k) for k in np.lexsort((np.arange(slack.size), -slack)) if slack[k] > 0]
        for m in sorted(range(peak.size), key=lambda x: (-peak[x], x)):
            if peak[m] <= 0:
                return False
            a, b = int(bounds[m]), int(bounds[m + 1])
            k = a + int(np.argmax(times[a:b]))
            others = float(np.delete(times[a:b], k - a).max(initial=0.0))
            if peak[m] - others < POLISH_GAIN * span:
                continue  # another group as slow: no change of this one's sequences lowers the microbatch
            g = flat[k]
            for s in sorted(g.seq_ids, key=lambda i: (lengths[i], i))[:tries]:
                rest = tuple(i for i in g.seq_ids if i != s)
                tried = 0
                for k2 in order:  # a move to a group with slack and room
                    if k2 == k or tokens[k2] + shard(s, k2) > capacity:
                        continue
                    if attempt(k, rest, k2, (*flat[k2].seq_ids, s), s, -1):
                        return True
                    tried += 1
                    if tried == targets:
                        break
                for k2 in order[:targets]:  # or a swap for a shorter sequence
                    if k2 == k:
                        continue
                    h = flat[k2]
                    shorter = sorted((i for i in h.seq_ids if lengths[i] < lengths[s]), key=lambda i: (-lengths[i], i))
                    for i in shorter[:tries]:
                        theirs = (*(x for x in h.seq_ids if x != i), s)
                        if attempt(k, (*rest, i), k2, theirs, s, i):
                            return True
        return False

    while kept < moves and round_():
        kept += 1
    if kept == 0:
        return plan, 0
    groups = [flat[a:b] for a, b in itertools.pairwise(bounds.tolist())]
    polished = Plan(
        lengths=plan.lengths, world_size=plan.world_size, ranks_per_node=plan.ranks_per_node,
        microbatches=groups, policy=plan.policy, stats=dict(plan.stats),
    )  # fmt: skip
    polished.stats["polished"] = float(kept)
    return polished, kept
