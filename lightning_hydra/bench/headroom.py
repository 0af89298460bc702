"""Placement headroom: what moving sequences between groups gains on a plan, timed by the truth itself.

Issue 58 asks hydra for 0.96 of :mod:`lightning_hydra.sim.ceiling`'s bound in every cell of the robustness
benchmark. Where it falls short, the question is whether a better *placement* exists at the plan's degrees (the
planner missed it) or the loss is the degrees' (indivisible groups, raised degrees' overhead). This benchmark asks
the truth directly: it takes hydra's calibrated choice and Megatron's placement of a held-out batch and improves each
by a local search that knows the truth's times, which no planner does::

    python -m lightning_hydra.bench.headroom                          # 64 ranks, both contexts, three mixtures
    python -m lightning_hydra.bench.headroom --truths base dear25 --world-sizes 64 512 --moves 100

The search (:func:`improve`) keeps every group's ranks and degrees and every microbatch's groups, and changes only
which group holds which sequence: it takes the slowest group of the slowest microbatch and tries to move one of its
shortest sequences to the group with the most slack (in any microbatch) that has room for it, or to swap it with a
sequence of that group that leaves both within their token room; a change is kept when the step's span (the sum
over microbatches of the slowest rank's time) falls. It is a lower estimate of what placement can still gain (a
search of single moves and swaps, not an optimum): a small gain says the planner's placement is near what its
degrees allow, a large one that placement was missed.

Each cell prints one JSON object: efficiency under the truth before and after the search, as shares of the ceiling,
and the moves kept. The closed loop and the batches are :mod:`lightning_hydra.bench.robust`'s (the same cells).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

from lightning_hydra.bench.cells import add_cell_arguments, cells_of
from lightning_hydra.bench.robust import LLAMA_8B, cell_batches, closed_loop, efficiency, plan_batch
from lightning_hydra.bench.schedule import CONTEXTS
from lightning_hydra.planner.plan import Group, Plan, PlanError
from lightning_hydra.sim.ceiling import efficiency_ceiling
from lightning_hydra.sim.family import truth
from lightning_hydra.sim.hardware import Hardware, ModelShape

__all__ = ["improve", "main", "run_cell"]


def improve(
    plan: Plan,
    hardware: Hardware,
    capacity: int,
    *,
    model: ModelShape = LLAMA_8B,
    moves: int = 200,
    tries: int = 3,
    targets: int = 6,
    seconds: float = 120.0,
) -> tuple[Plan, int]:
    """``plan`` with its sequences moved between groups while the truth ``hardware`` times the step faster.

    Args:
        plan: The plan to improve (its groups' ranks and degrees are kept).
        hardware: The truth that times every candidate change.
        capacity: Most tokens a rank holds in one microbatch (every kept plan passes :meth:`Plan.check`).
        model: The model timed.
        moves: Most changes kept.
        tries: Shortest sequences of the slowest group tried per round.
        targets: Groups with the most slack tried per sequence.
        seconds: Wall-clock limit of the search.

    Returns:
        The improved plan (``plan`` itself if no change helps) and the number of changes kept.
    """
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    groups = [list(mb) for mb in plan.microbatches]
    best, times = efficiency(plan, hardware, model)
    span = float(times.max(axis=1).sum())
    kept = 0
    start = time.perf_counter()

    def tokens(g: Group) -> int:
        return int(lengths[list(g.seq_ids)].sum()) if g.seq_ids else 0

    def crowd(t: np.ndarray) -> float:  # how far ranks sit within 1% of their microbatch's peak (breaks ties)
        top = t.max(axis=1, keepdims=True)
        return float(np.clip(t - 0.99 * top, 0.0, None).sum())

    def attempt(changes: list[tuple[int, int, Group]]) -> bool:
        nonlocal span, times, best
        old = [(m, j, groups[m][j]) for m, j, _ in changes]
        for m, j, g in changes:
            groups[m][j] = g
        candidate = dataclasses.replace(plan, microbatches=[list(mb) for mb in groups])
        try:
            candidate.check(lengths.tolist(), capacity)
        except PlanError:
            ok = False
        else:
            eff, new = efficiency(candidate, hardware, model)
            new_span = float(new.max(axis=1).sum())
            ok = new_span < span * (1 - 1e-9) or (new_span <= span and crowd(new) < crowd(times) * (1 - 1e-9))
            if ok:
                best, times, span = eff, new, new_span
        if not ok:
            for m, j, g in old:
                groups[m][j] = g
        return ok

    def with_ids(g: Group, ids: tuple[int, ...]) -> Group:
        return Group._of(g.ranks, g.ulysses, g.ring, tuple(sorted(ids)))

    progress = True
    while progress and kept < moves and time.perf_counter() - start < seconds:
        progress = False
        peak = times.max(axis=1)
        for m in np.argsort(-peak, kind="stable"):
            if peak[m] <= 0:
                break
            busy = [j for j, g in enumerate(groups[m]) if g.seq_ids]
            src = max(busy, key=lambda j: float(times[m, list(groups[m][j].ranks)].max()))
            g = groups[m][src]
            slack = [
                (float(peak[m2] - times[m2, list(h.ranks)].max()), m2, j)
                for m2 in range(len(groups))
                if peak[m2] > 0
                for j, h in enumerate(groups[m2])
                if (m2, j) != (m, src)
            ]
            slack.sort(key=lambda x: (-x[0], x[1], x[2]))
            for s in sorted(g.seq_ids, key=lambda i: (lengths[i], i))[:tries]:
                rest = tuple(i for i in g.seq_ids if i != s)
                fits = [
                    (m2, j)
                    for _, m2, j in slack
                    if tokens(groups[m2][j]) + lengths[s] <= groups[m2][j].degree * capacity
                ]
                for m2, j in fits[:targets]:  # a move to the groups with the most slack and room for it
                    h = groups[m2][j]
                    if attempt([(m, src, with_ids(g, rest)), (m2, j, with_ids(h, (*h.seq_ids, s)))]):
                        progress = True
                        break
                if progress:
                    break
                for _, m2, j in slack[:targets]:  # or a swap for a shorter sequence of a group with slack
                    h = groups[m2][j]
                    room_g = g.degree * capacity - tokens(g) + lengths[s]
                    room_h = h.degree * capacity - tokens(h)
                    swaps = [
                        i for i in h.seq_ids if lengths[i] < lengths[s] and lengths[s] - lengths[i] <= room_h
                        and lengths[i] <= room_g
                    ]  # fmt: skip
                    for i in sorted(swaps, key=lambda i: (-lengths[i], i))[:tries]:
                        mine = with_ids(g, (*rest, i))
                        theirs = with_ids(h, (*(x for x in h.seq_ids if x != i), s))
                        if attempt([(m, src, mine), (m2, j, theirs)]):
                            progress = True
                            break
                    if progress:
                        break
                if progress:
                    break
            if progress:
                kept += 1
                break
    if kept == 0:
        return plan, 0
    return dataclasses.replace(plan, microbatches=[list(mb) for mb in groups]), kept


def run_cell(
    world: int, context: str, dist: str, truth_name: str, *, batch: int = 1000, steps: int = 8, moves: int = 200
) -> dict[str, Any]:
    """One cell: hydra calibrated by :mod:`~lightning_hydra.bench.robust`'s closed loop on its batches, then its
    choice and Megatron's placement of held-out batch ``batch``, each before and after :func:`improve`."""
    hw = truth(truth_name, LLAMA_8B.num_layers)
    loop = cell_batches(dist, world, context, range(2000, 2000 + steps))
    cost = closed_loop(loop, hw, world, context)
    lengths = cell_batches(dist, world, context, range(batch, batch + 1))[0]
    capacity = CONTEXTS[context][1]
    ceiling = efficiency_ceiling(lengths, world_size=world, capacity=capacity, model=LLAMA_8B, hardware=hw)
    cell: dict[str, Any] = {
        "world_size": world, "context": context, "distribution": dist, "truth": truth_name, "batch": batch,
        "ceiling": round(ceiling, 4),
    }  # fmt: skip
    for policy in ("hydra", "mcore"):
        plan, _ = plan_batch(lengths, policy, cost, world, context)
        before, _ = efficiency(plan, hw)
        start = time.perf_counter()
        better, kept = improve(plan, hw, capacity, moves=moves)
        after, _ = efficiency(better, hw)
        cell[policy] = {
            "of_ceiling": round(before / ceiling, 4),
            "searched_of_ceiling": round(after / ceiling, 4),
            "gain": round(after / before, 4),
            "moves": kept,
            "seconds": round(time.perf_counter() - start, 1),
        }
    return cell


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_arguments(parser, truths=["base", "dear25"])
    parser.add_argument("--batch", type=int, default=1000, help="the held-out batch's seed (robust's first is 1000)")
    parser.add_argument("--moves", type=int, default=200, help="most changes the search keeps per plan")
    args = parser.parse_args(argv)
    gains = []
    for world, context, dist, name in cells_of(args):
        cell = run_cell(world, context, dist, name, batch=args.batch, moves=args.moves)
        gains += [cell["hydra"]["gain"], cell["mcore"]["gain"]]
        print(json.dumps(cell), flush=True)
    if gains:
        print(
            json.dumps(
                {
                    "summary": {
                        "plans": len(gains),
                        "largest_gain": max(gains),
                        "mean_gain": round(float(np.mean(gains)), 4),
                    }
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
