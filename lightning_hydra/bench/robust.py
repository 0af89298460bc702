"""Robustness benchmark: hydra, mcore and static under a family of cost truths, before and after calibration.

Prints one JSON object per cell (pool, context, distribution, truth) and a summary::

    python -m lightning_hydra.bench.robust                  # pools of 64 and 512 ranks
    python -m lightning_hydra.bench.robust --full           # adds 2,048 ranks (mcore takes minutes per batch there)
    python -m lightning_hydra.bench.robust --markdown t.md  # also writes the tables of docs/benchmarks.md
    python -m lightning_hydra.bench.robust --fill 0.9       # batches at 90% of the pool's tokens (default 75%)
    python -m lightning_hydra.bench.robust --microbatches 16  # batches planned into 16 microbatches (default 8)
    python -m lightning_hydra.bench.robust --model llama3-70b  # another model shape (llama3-1b, default llama3-8b)
    python -m lightning_hydra.bench.robust --truths gemm2k fastgpu  # truths of other device constants
    python -m lightning_hydra.bench.robust --truths --random-truths 40 --seed-offset 5000  # drawn truths, new batches
    python -m lightning_hydra.bench.robust --truths --random-truths 20 --first-random-truth 40 --seed-offset 9000
    python -m lightning_hydra.bench.robust --noise 0.03  # the closed loop's timer scatters by about 3% per bin

Per cell, on held-out evaluation batches (seeds the planner never saw): the efficiency under the truth
(:mod:`lightning_hydra.sim.family`; useful FLOP time at the device's best efficiencies over the pool, divided by the
sum over microbatches of the slowest rank's time, communication counted as waste) of

- ``mcore`` and ``static`` (their plans do not depend on the cost model);
- ``hydra`` planning with the analytic Llama-3-8B model (``uncalibrated``);
- ``hydra`` after a closed loop of ``--steps`` global batches on fresh batches: each planned with the current model,
  timed by the truth (the timer includes communication, as CUDA events do) and fed to
  :class:`~lightning_hydra.planner.calibration.CostCalibrator` exactly as training does (``calibrated``).

Besides: ``hydra_over_mcore`` of both, what the calibrated model predicts for hydra's and mcore's plans, the
calibrated model's relative error on the evaluation batches under the truth, and ``best_candidate_over_mcore``: the
best of the calibrated hydra's candidates under the truth (:func:`~lightning_hydra.planner.hydra.candidate_plans`),
which bounds what any choice among them could reach. Where hydra falls short of a target and its best candidate
does not, the choice missed; where both fall short, no candidate reaches the target. And ``ceiling``: the highest
efficiency *any* plan of the held-out batches can reach under the truth (:mod:`lightning_hydra.sim.ceiling`: perfect
balance with every sequence at its cheapest degree; an upper bound, not a reachable target), with
``hydra_of_ceiling``; where the ceiling is below :data:`EFFICIENCY_TARGET`, no scheduler meets that target there.
``waiting`` (and ``mcore_waiting`` for mcore's plans): the calibrated hydra's step under the truth split into
``useful`` work, busy ``overhead`` and its waiting by cause (:mod:`lightning_hydra.sim.waiting`): ``single_bins``
(single-rank bins above what the microbatch's work and heaviest CP group force), ``cp_groups`` (a CP group slower
than an even split of the step's work), ``microbatch_split`` (a group in a microbatch lighter than the step's mean)
and ``model_unseen`` (the waiting the calibrated model did not predict: calibration error); ``no_token_room``: the
waiting on ranks without room for the batch's shortest sequence (no move of a sequence can fill it; it overlaps
the causes); the summary averages them per context. ``loop_steps``: the efficiency of each closed-loop step under
the truth (what a run pays while it calibrates, on its own batches), and ``loop_min_of_ceiling`` the lowest step's
share of its own batch's ceiling.

The truths are noise-free: a device's timer is not. ``--noise SIGMA`` multiplies every bin the closed loop times by
its own lognormal factor of mean 1 (log-standard deviation ``SIGMA``, seeded per cell and step:
:func:`measurement_noise`) before calibration reads it; the evaluations stay noise-free (the truth's expected
times), so the cells say what calibrating on a scattering timer costs the plans.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from typing import Any

import numpy as np

from lightning_hydra.bench.batches import DISTRIBUTIONS, make_batch
from lightning_hydra.bench.schedule import CONTEXTS, LLAMA_8B, analytic_cost
from lightning_hydra.planner import CostModel, DegreeRules, Plan, PlanRequest, schedule
from lightning_hydra.planner.calibration import CostCalibrator, plan_features, predict, relative_error
from lightning_hydra.planner.hydra import candidate_plans
from lightning_hydra.planner.mcore_fast import schedule_mcore_fast
from lightning_hydra.sim.ceiling import efficiency_ceiling
from lightning_hydra.sim.family import DEAR_TRUTHS, DEVICE_TRUTHS, RANDOM_PREFIX, TRUTHS, truth
from lightning_hydra.sim.hardware import Hardware, ModelShape
from lightning_hydra.sim.truth import plan_times, useful_time
from lightning_hydra.sim.waiting import CAUSES, waiting

__all__ = [
    "CEILING_TARGET",
    "EFFICIENCY_TARGET",
    "LLAMA_1B",
    "LLAMA_70B",
    "LLAMA_8B",
    "MODELS",
    "RATIO_TARGETS",
    "ROOM",
    "analytic_cost",
    "breakdown",
    "cell_batches",
    "closed_loop",
    "efficiency",
    "main",
    "measurement_noise",
    "plan_batch",
    "plan_request",
    "run_pool",
]

EFFICIENCY_TARGET = 0.93
"""The efficiency the summary counts cells against (the planner's target at 512 ranks, 32K and 256K; 0.90 before
issue 46 asked for 0.93)."""
CEILING_TARGET = 0.96
"""Share of its cell's ceiling (:mod:`lightning_hydra.sim.ceiling`) the calibrated hydra aims at in every cell
(issue 58: the target in the truths' own terms, where :data:`EFFICIENCY_TARGET` lies above what some truths allow)."""
ROOM = 0.94
"""Share of the ceiling below which mcore leaves room to win: there the calibrated hydra aims at
:data:`RATIO_TARGETS` over mcore (issue 58); above it, at no cell below mcore."""
RATIO_TARGETS = {"256K": 1.03, "32K": 1.03}
"""Calibrated hydra / mcore the summary counts cells against, per context (the planner's targets; 32K's was 1.00
before issue 46 asked for 1.03 there too)."""

LLAMA_70B = ModelShape(
    hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672, vocab_size=128256
)
"""A larger model with another balance of GEMM, attention and KV traffic (Llama-3-70B shape, bf16, one device per
CP rank): ``--model llama3-70b``."""
LLAMA_1B = ModelShape(
    hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_hidden_size=8192, vocab_size=128256
)
"""A smaller model, whose KV traffic weighs more against its compute (Llama-3.2-1B shape, bf16): ``--model
llama3-1b``."""
MODELS = {"llama3-1b": LLAMA_1B, "llama3-8b": LLAMA_8B, "llama3-70b": LLAMA_70B}
"""The models ``--model`` names."""


def efficiency(plan: Plan, hardware: Hardware, model: ModelShape = LLAMA_8B) -> tuple[float, np.ndarray]:
    """Efficiency of ``plan`` under the truth ``hardware``, and its ``[M, N]`` times."""
    times, _ = plan_times(plan, model=model, hardware=hardware, layers=model.num_layers, head_share=1.0)
    useful = useful_time(
        np.asarray(plan.lengths), model=model, hardware=hardware, layers=model.num_layers, head_share=1.0
    )
    span = float(times.max(axis=1).sum())
    return useful / plan.world_size / span, times


def breakdown(
    plan: Plan, hardware: Hardware, model: ModelShape, cost: CostModel, capacity: int | None = None
) -> dict[str, float]:
    """Shares of ``plan``'s step under the truth ``hardware``: useful work, every cause of
    :data:`~lightning_hydra.sim.waiting.CAUSES` (``model_unseen`` against ``cost``'s predicted times,
    ``no_token_room`` at ``capacity`` tokens per rank, ``communication`` against the truth's times without
    communication) and ``waiting``, the three causes of waiting together."""
    times, _ = plan_times(plan, model=model, hardware=hardware, layers=model.num_layers, head_share=1.0)
    quiet, _ = plan_times(
        plan, model=model, hardware=hardware, layers=model.num_layers, head_share=1.0, include_comm=False
    )
    useful = useful_time(
        np.asarray(plan.lengths), model=model, hardware=hardware, layers=model.num_layers, head_share=1.0
    )
    predicted = predict(cost, plan_features(plan, cost), includes_comm=True)
    shares = waiting(plan, times, useful, predicted, capacity, quiet).shares()
    shares["waiting"] = shares["single_bins"] + shares["cp_groups"] + shares["microbatch_split"]
    return shares


def _mean_shares(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of every share over ``rows``, rounded."""
    return {k: round(statistics.fmean(r[k] for r in rows), 4) for k in ("useful", *CAUSES, "waiting")}


def plan_batch(
    lengths: np.ndarray, policy: str, cost: CostModel, world: int, context: str, microbatches: int = 8,
    model: ModelShape = LLAMA_8B, mcore_fast: bool = False,
) -> tuple[Plan, float]:  # fmt: skip
    """The plan of ``policy`` and its planning milliseconds; with ``mcore_fast`` mcore's plan is made by
    :func:`~lightning_hydra.planner.mcore_fast.schedule_mcore_fast` on the same request (the same plan, without the
    baseline's whole-pool scans)."""
    longest, capacity = CONTEXTS[context]
    start = time.perf_counter()
    if policy == "mcore" and mcore_fast:
        plan = schedule_mcore_fast(plan_request(lengths, cost, world, context, microbatches, model))
        assert plan is not None  # only a ``stop`` abandons it
    else:
        plan = schedule(
            lengths, world_size=world, num_microbatches=microbatches, max_tokens_per_rank=capacity, cost=cost,
            policy=policy, ranks_per_node=8, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
            max_seq_len=longest,
        )  # fmt: skip
    return plan, 1e3 * (time.perf_counter() - start)


def plan_request(
    lengths: np.ndarray, cost: CostModel, world: int, context: str, microbatches: int = 8,
    model: ModelShape = LLAMA_8B,
) -> PlanRequest:  # fmt: skip
    """The request :func:`plan_batch`'s ``schedule`` call builds (tests compare the plans made from both; benchmarks
    form candidates from it)."""
    longest, capacity = CONTEXTS[context]
    return PlanRequest(
        lengths=np.asarray(lengths, dtype=np.int64), num_microbatches=microbatches, capacity=capacity, cost=cost,
        rules=DegreeRules(world_size=world, ranks_per_node=8, num_heads=model.num_heads), max_seq_len=longest,
    )  # fmt: skip


def _best_candidate(
    lengths: np.ndarray, cost: CostModel, hw: Hardware, world: int, context: str, microbatches: int = 8,
    model: ModelShape = LLAMA_8B,
) -> tuple[str, float]:  # fmt: skip
    """The candidate of hydra's (planning as :func:`plan_batch` does) with the best efficiency under the truth
    ``hw``."""
    plans = candidate_plans(plan_request(lengths, cost, world, context, microbatches, model))
    scores = {name: efficiency(plan, hw, model)[0] for name, plan in plans.items()}
    name = max(scores, key=scores.__getitem__)
    return name, scores[name]


def cell_batches(
    dist: str, world: int, context: str, seeds: range, fill: float = 0.75, microbatches: int = 8
) -> list[np.ndarray]:
    """The batches of a cell, one per seed: ``dist``'s lengths holding ``fill`` of ``world`` ranks' tokens at
    ``context`` over ``microbatches`` microbatches (held-out seeds from 1000, closed-loop ones from 2000)."""
    longest, capacity = CONTEXTS[context]
    return [
        make_batch(
            dist, world_size=world, capacity=capacity, num_microbatches=microbatches, fill=fill, context=longest, seed=s
        )
        for s in seeds
    ]


def closed_loop(
    batches: list[np.ndarray], hw: Hardware, world: int, context: str, microbatches: int = 8,
    model: ModelShape = LLAMA_8B, steps: list[float] | None = None, noise: float = 0.0, noise_seed: int = 0,
) -> CostModel:  # fmt: skip
    """The analytic model refitted over ``batches``: hydra plans each, the truth times it, calibration refits; each
    step's efficiency under the truth (what training pays while it calibrates) is appended to ``steps``.

    ``noise``: where positive, each timed bin (a rank's time in a microbatch) reaches calibration multiplied by its
    own draw of a lognormal factor of mean 1 and log-standard deviation ``noise`` (:func:`measurement_noise`; step
    ``i``'s draws seeded by ``(noise_seed, i)``), as a device's timer scatters; the step's efficiency is the
    truth's, without noise."""
    cost = analytic_cost(model)
    calibrator = CostCalibrator()
    for i, lengths in enumerate(batches):
        plan, _ = plan_batch(lengths, "hydra", cost, world, context, microbatches, model)
        step, times = efficiency(plan, hw, model)
        if steps is not None:
            steps.append(step)
        if noise > 0:
            times = times * measurement_noise(times.shape, noise, (noise_seed, i))
        calibrator.add(plan_features(plan, cost), times.ravel(), includes_comm=True)
        cost = calibrator.refit(cost)
    return cost


def measurement_noise(shape: tuple[int, ...], sigma: float, seed: tuple[int, ...]) -> np.ndarray:
    """Independent multiplicative timer noise: ``exp(sigma * Z - sigma**2 / 2)`` per entry (``Z`` standard normal),
    a factor of mean 1 whose logarithm has standard deviation ``sigma`` (0.03: about 3% scatter per timed bin).

    Args:
        shape: Shape of the timed array.
        sigma: Log-standard deviation (non-negative).
        seed: Seed of the draws (:func:`numpy.random.default_rng`).
    """
    if sigma < 0:
        raise ValueError(f"noise must not be negative, got {sigma}")
    return np.exp(np.random.default_rng(list(seed)).normal(-0.5 * sigma * sigma, sigma, size=shape))


def _noise_seed(*key: object) -> int:
    """A seed for a cell's measurement noise that every process derives alike (not Python's salted ``hash``)."""
    return zlib.crc32("/".join(map(str, key)).encode())


def run_pool(
    world: int, context: str, dist: str, truths: list[str], *, steps: int, evaluations: int, fill: float = 0.75,
    microbatches: int = 8, model: ModelShape = LLAMA_8B, seed_offset: int = 0, mcore_fast: bool = False,
    noise: float = 0.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every truth's cell for one pool, context and distribution (baselines planned once); batches hold ``fill`` of
    the pool's tokens over ``microbatches`` microbatches; ``model`` is planned and timed; the evaluation batches'
    seeds are ``1000 + seed_offset`` on, the closed loop's ``2000 + seed_offset`` on. ``mcore_fast``: mcore's plan
    is made by :func:`~lightning_hydra.planner.mcore_fast.schedule_mcore_fast` (the same plan, without the
    baseline's whole-pool scans, which take hours on 2,048-rank batches of 70,000 sequences); its ``schedule_ms``
    is then that placement's. ``noise``: the closed loop's timer scatter (:func:`closed_loop`), seeded per cell;
    the evaluations are timed without it."""
    if noise < 0:
        raise ValueError(f"noise must not be negative, got {noise}")
    mbs = microbatches
    held_out = cell_batches(
        dist, world, context, range(1000 + seed_offset, 1000 + seed_offset + evaluations), fill, mbs
    )
    loop = cell_batches(dist, world, context, range(2000 + seed_offset, 2000 + seed_offset + steps), fill, mbs)
    analytic = analytic_cost(model)
    fixed = {
        p: [plan_batch(b, p, analytic, world, context, mbs, model, mcore_fast) for b in held_out]
        for p in ("mcore", "static", "hydra")
    }
    cells = []
    for name in truths:
        hw = truth(name, model.num_layers)
        cell: dict[str, Any] = {"world_size": world, "context": context, "distribution": dist, "truth": name}
        if fill != 0.75:
            cell["fill"] = fill
        if mbs != 8:
            cell["microbatches"] = mbs
        if model != LLAMA_8B:
            cell["model"] = next((key for key, shape in MODELS.items() if shape == model), str(model))
        if seed_offset:
            cell["seed_offset"] = seed_offset
        if mcore_fast:
            cell["mcore_planner"] = "mcore_fast"
        if noise:
            cell["noise"] = noise
        eff = {p: statistics.fmean(efficiency(plan, hw, model)[0] for plan, _ in runs) for p, runs in fixed.items()}
        cell["uncalibrated"] = {
            **{p: round(v, 4) for p, v in eff.items()},
            "hydra_over_mcore": round(eff["hydra"] / eff["mcore"], 4),
        }

        def ceiling_of(batch: np.ndarray, hw: Hardware = hw) -> float:
            return efficiency_ceiling(batch, world_size=world, capacity=CONTEXTS[context][1], model=model, hardware=hw)

        ceiling = statistics.fmean(ceiling_of(b) for b in held_out)
        steps_eff: list[float] = []
        seed = _noise_seed(world, context, dist, name, fill, mbs, seed_offset)
        cost = closed_loop(loop, hw, world, context, mbs, model, steps_eff, noise, seed)
        cal, own_h, own_m, errors, picks, best, best_names = [], [], [], [], [], [], []
        shares_h, shares_m = [], []
        for lengths, (mplan, _) in zip(held_out, fixed["mcore"], strict=True):
            plan, _ = plan_batch(lengths, "hydra", cost, world, context, mbs, model)
            e, times = efficiency(plan, hw, model)
            cal.append(e)
            name, e_best = _best_candidate(lengths, cost, hw, world, context, mbs, model)
            best.append(e_best)
            best_names.append(name)
            own_h.append(plan.efficiency(cost))
            own_m.append(mplan.efficiency(cost))
            errors.append(relative_error(predict(cost, plan_features(plan, cost), includes_comm=True), times.ravel()))
            picks.append(str(plan.stats.get("candidate", "")))
            shares_h.append(breakdown(plan, hw, model, cost, CONTEXTS[context][1]))
            shares_m.append(breakdown(mplan, hw, model, cost, CONTEXTS[context][1]))
        hydra = statistics.fmean(cal)
        cell["calibrated"] = {
            "hydra": round(hydra, 4),
            "mcore": round(eff["mcore"], 4),
            "static": round(eff["static"], 4),
            "hydra_over_mcore": round(hydra / eff["mcore"], 4),
            "hydra_own_model": round(statistics.fmean(own_h), 4),
            "mcore_own_model": round(statistics.fmean(own_m), 4),
            "model_error": round(statistics.fmean(errors), 4),
            "candidates": picks,
            "best_candidate_over_mcore": round(statistics.fmean(best) / eff["mcore"], 4),
            "best_candidates": best_names,
            "waiting": _mean_shares(shares_h),
            "mcore_waiting": _mean_shares(shares_m),
            "ceiling": round(ceiling, 4),
            "hydra_of_ceiling": round(hydra / ceiling, 4),
            "mcore_of_ceiling": round(eff["mcore"] / ceiling, 4),
            "loop_steps": [round(e, 4) for e in steps_eff],
            "loop_min_of_ceiling": round(min(e / ceiling_of(b) for e, b in zip(steps_eff, loop, strict=True)), 4)
            if steps_eff
            else None,
        }
        cell["schedule_ms"] = {p: round(statistics.median(ms for _, ms in runs), 1) for p, runs in fixed.items()}
        cells.append(cell)
        print(json.dumps(cell), flush=True)
    return cells


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Worst cells per context (after calibration and before), and where hydra falls below mcore."""
    out: dict[str, Any] = {}
    for context in sorted({c["context"] for c in cells}):
        mine = [c for c in cells if c["context"] == context]
        worst = min(mine, key=lambda c: c["calibrated"]["hydra_over_mcore"])
        worst_uncal = min(mine, key=lambda c: c["uncalibrated"]["hydra_over_mcore"])
        low = min(mine, key=lambda c: c["calibrated"]["hydra"])
        out[context] = {
            "worst_calibrated_hydra_over_mcore": worst["calibrated"]["hydra_over_mcore"],
            "worst_calibrated_cell": {k: worst[k] for k in ("world_size", "distribution", "truth")},
            "worst_uncalibrated_hydra_over_mcore": worst_uncal["uncalibrated"]["hydra_over_mcore"],
            "worst_uncalibrated_cell": {k: worst_uncal[k] for k in ("world_size", "distribution", "truth")},
            "lowest_calibrated_hydra_efficiency": low["calibrated"]["hydra"],
            "lowest_efficiency_cell": {k: low[k] for k in ("world_size", "distribution", "truth")},
            "mean_calibrated_hydra_over_mcore": round(
                statistics.fmean(c["calibrated"]["hydra_over_mcore"] for c in mine), 4
            ),
            "cells_below_mcore": sum(c["calibrated"]["hydra_over_mcore"] < 1 for c in mine),
            "cells_below_ratio_target": sum(
                c["calibrated"]["hydra_over_mcore"] < RATIO_TARGETS.get(context, 1.0) for c in mine
            ),
            "mean_best_candidate_minus_hydra": round(
                statistics.fmean(
                    c["calibrated"]["best_candidate_over_mcore"] - c["calibrated"]["hydra_over_mcore"] for c in mine
                ),
                4,
            ),
            "worst_best_candidate_over_mcore": min(c["calibrated"]["best_candidate_over_mcore"] for c in mine),
            "cells_where_best_candidate_below_mcore": sum(
                c["calibrated"]["best_candidate_over_mcore"] < 1 for c in mine
            ),
            "cells_hydra_efficiency_at_target": sum(c["calibrated"]["hydra"] >= EFFICIENCY_TARGET for c in mine),
            "cells_ceiling_below_target": sum(c["calibrated"]["ceiling"] < EFFICIENCY_TARGET for c in mine),
            "lowest_hydra_of_ceiling": min(c["calibrated"]["hydra_of_ceiling"] for c in mine),
            "lowest_loop_step_of_ceiling": min(
                (c["calibrated"]["loop_min_of_ceiling"] for c in mine if c["calibrated"].get("loop_steps")),
                default=None,
            ),
            "mean_calibrated_waiting": _mean_shares([c["calibrated"]["waiting"] for c in mine]),
            "cells_below_efficiency_target": sum(c["calibrated"]["hydra"] < EFFICIENCY_TARGET for c in mine),
            "cells": len(mine),
            **_ceiling_counts(mine, RATIO_TARGETS.get(context, 1.0)),
        }
        dear = [c["calibrated"] for c in mine if c["truth"] in DEAR_TRUTHS]
        if dear:
            out[context]["dear_family"] = {
                "cells": len(dear),
                **{
                    f"{who}_{share}": round(statistics.fmean(c[key][share] for c in dear), 4)
                    for who, key in (("hydra", "waiting"), ("mcore", "mcore_waiting"))
                    for share in ("waiting", "communication")
                },
                "cells_waiting_at_most_half_of_mcores": sum(
                    c["waiting"]["waiting"] <= 0.5 * c["mcore_waiting"]["waiting"] for c in dear
                ),
                "cells_communication_within_a_point_of_mcores": sum(
                    c["waiting"]["communication"] <= c["mcore_waiting"]["communication"] + 0.01 for c in dear
                ),
            }
    out["targets"] = {"cells": len(cells), **_ceiling_counts(cells, None)}
    return out


def _ceiling_counts(cells: list[dict[str, Any]], ratio: float | None) -> dict[str, int]:
    """The cells against issue 58's targets: hydra at :data:`CEILING_TARGET` of the ceiling or above, the cells where
    mcore leaves room (below :data:`ROOM` of the ceiling) and of them those where hydra reaches the ratio target over
    mcore (``ratio``; ``None``: each cell's context's :data:`RATIO_TARGETS`), and the cells below mcore."""
    room = [c for c in cells if c["calibrated"]["mcore_of_ceiling"] < ROOM]
    return {
        "cells_at_ceiling_target": sum(c["calibrated"]["hydra_of_ceiling"] >= CEILING_TARGET for c in cells),
        "cells_with_room": len(room),
        "cells_with_room_at_ratio_target": sum(
            c["calibrated"]["hydra_over_mcore"] >= (RATIO_TARGETS.get(c["context"], 1.0) if ratio is None else ratio)
            for c in room
        ),
        "cells_below_mcore": sum(c["calibrated"]["hydra_over_mcore"] < 1 for c in cells),
    }


def markdown(cells: list[dict[str, Any]]) -> str:
    """The docs' tables: per (pool, context, distribution) the worst and mean hydra/mcore over the truths, before
    and after calibration, and in the worst cell the best candidate's; and per truth the worst over pools and
    distributions."""
    lines = [
        "| pool | context | distribution | worst truth (calibrated) | hydra / mcore worst, calibrated | "
        "best candidate / mcore there | mean | uncalibrated worst | hydra eff. min, calibrated | ceiling there | "
        "mcore eff. min |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(c["world_size"], c["context"], c["distribution"]) for c in cells}, key=lambda k: (k[0], k[1], k[2]))
    for key in keys:
        mine = [c for c in cells if (c["world_size"], c["context"], c["distribution"]) == key]
        worst = min(mine, key=lambda c: c["calibrated"]["hydra_over_mcore"])
        low = min(mine, key=lambda c: c["calibrated"]["hydra"])
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {worst['truth']} | {worst['calibrated']['hydra_over_mcore']:.3f} | "
            f"{worst['calibrated']['best_candidate_over_mcore']:.3f} | "
            f"{statistics.fmean(c['calibrated']['hydra_over_mcore'] for c in mine):.3f} | "
            f"{min(c['uncalibrated']['hydra_over_mcore'] for c in mine):.3f} | "
            f"{low['calibrated']['hydra']:.3f} | {low['calibrated']['ceiling']:.3f} | "
            f"{min(c['calibrated']['mcore'] for c in mine):.3f} |"
        )
    contexts = sorted({c["context"] for c in cells})
    lines += [
        "",
        "| truth | "
        + " | ".join(
            f"{ctx} worst hydra / mcore (cal.) | {ctx} hydra eff. (cal.) | {ctx} ceiling | {ctx} hydra / ceiling"
            for ctx in contexts
        )
        + " |",
        "|---|" + "---|---|---|---|" * len(contexts),
    ]
    for name in [t for t in (*TRUTHS, *DEAR_TRUTHS, *DEVICE_TRUTHS) if any(c["truth"] == t for c in cells)]:
        row = []
        for ctx in contexts:
            mine = [c["calibrated"] for c in cells if c["truth"] == name and c["context"] == ctx]
            if not mine:
                row += ["-"] * 4
                continue
            hyd, ceil, of = ([m[k] for m in mine] for k in ("hydra", "ceiling", "hydra_of_ceiling"))
            row += [
                f"{min(m['hydra_over_mcore'] for m in mine):.3f}",
                f"{min(hyd):.3f}-{max(hyd):.3f}",
                f"{min(ceil):.3f}-{max(ceil):.3f}",
                f"{min(of):.3f}-{max(of):.3f}",
            ]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join([*lines, "", *_ceiling_table(cells)]) + "\n"  # fmt: skip


def _ceiling_table(cells: list[dict[str, Any]]) -> list[str]:
    """The docs' table of issue 58's targets: per pool, context and truth, over the distributions, the ceiling,
    hydra's and mcore's shares of it and hydra / mcore (lowest to highest), and hydra's and mcore's waiting and
    communication shares of the step (means)."""
    lines = [
        "| pool | context | truth | ceiling | hydra / ceiling | mcore / ceiling | hydra / mcore | hydra waiting | "
        "hydra comm. | mcore waiting | mcore comm. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {t: i for i, t in enumerate((*TRUTHS, *DEAR_TRUTHS, *DEVICE_TRUTHS))}
    keys = sorted(
        {(c["world_size"], c["context"], c["truth"]) for c in cells},
        key=lambda k: (k[0], k[1], order.get(k[2], len(order)), k[2]),
    )

    def span(values: list[float]) -> str:
        return f"{min(values):.3f}" if min(values) == max(values) else f"{min(values):.3f}-{max(values):.3f}"

    for key in keys:
        mine = [c["calibrated"] for c in cells if (c["world_size"], c["context"], c["truth"]) == key]
        row = [span([m[k] for m in mine]) for k in ("ceiling", "hydra_of_ceiling", "mcore_of_ceiling")]
        row.append(span([m["hydra_over_mcore"] for m in mine]))
        row += [
            f"{statistics.fmean(m[who][share] for m in mine):.3f}"
            for who in ("waiting", "mcore_waiting")
            for share in ("waiting", "communication")
        ]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(row) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="include 2,048-rank pools")
    parser.add_argument("--world-sizes", type=int, nargs="*", help="override the pool sizes")
    parser.add_argument("--contexts", nargs="*", default=list(CONTEXTS), choices=list(CONTEXTS))
    parser.add_argument("--distributions", nargs="*", default=list(DISTRIBUTIONS), choices=list(DISTRIBUTIONS))
    parser.add_argument(
        "--truths",
        nargs="*",
        default=[*TRUTHS, *DEAR_TRUTHS],
        choices=[*TRUTHS, *DEVICE_TRUTHS, *DEAR_TRUTHS],
        help="default: the grid's and the dear-communication family's",
    )
    parser.add_argument(
        "--random-truths", type=int, default=0, help=f"K drawn truths, {RANDOM_PREFIX}<F> .. {RANDOM_PREFIX}<F+K-1>"
    )
    parser.add_argument(
        "--first-random-truth", type=int, default=0,
        help="F, the first drawn truth's number (truths no change was measured on: 40 on)",
    )  # fmt: skip
    parser.add_argument("--seed-offset", type=int, default=0, help="shift every batch seed (other held-out batches)")
    parser.add_argument("--steps", type=int, default=8, help="closed-loop steps before the calibrated evaluation")
    parser.add_argument("--evaluations", type=int, default=2, help="held-out batches per cell (1 at 2,048 ranks)")
    parser.add_argument("--fill", type=float, default=0.75, help="share of the pool's tokens a batch holds")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches each batch is planned into")
    parser.add_argument("--model", default="llama3-8b", choices=list(MODELS), help="the model planned and timed")
    parser.add_argument("--markdown", default=None, help="write the docs' tables (markdown) to this file")
    parser.add_argument(
        "--mcore-fast", action="store_true",
        help="plan mcore's baseline without its whole-pool scans (the same plan; for 2,048-rank batches of 70,000 "
        "sequences, where the scans take hours)",
    )  # fmt: skip
    parser.add_argument(
        "--noise", type=float, default=0.0,
        help="log-standard deviation of the closed loop's timer noise per timed bin (0.03: about 3%%; default 0)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.fill <= 1:
        parser.error(f"--fill must be in (0, 1], got {args.fill}")
    if args.microbatches < 1:
        parser.error(f"--microbatches must be at least 1, got {args.microbatches}")
    if min(args.random_truths, args.first_random_truth, args.seed_offset, args.noise) < 0:
        parser.error("--random-truths, --first-random-truth, --seed-offset and --noise must not be negative")
    first = args.first_random_truth
    truths = [*args.truths, *(f"{RANDOM_PREFIX}{k}" for k in range(first, first + args.random_truths))]
    if not truths:
        parser.error("no truths: name some with --truths or draw some with --random-truths")
    sizes = args.world_sizes or ([64, 512, 2048] if args.full else [64, 512])
    cells = []
    start = time.perf_counter()
    for world in sizes:
        for context in args.contexts:
            for dist in args.distributions:
                evaluations = 1 if world >= 2048 else args.evaluations
                cells += run_pool(
                    world, context, dist, truths, steps=args.steps, evaluations=evaluations, fill=args.fill,
                    microbatches=args.microbatches, model=MODELS[args.model], seed_offset=args.seed_offset,
                    mcore_fast=args.mcore_fast, noise=args.noise,
                )  # fmt: skip
    summary = {"summary": summarize(cells), "seconds": round(time.perf_counter() - start, 1), "load": os.getloadavg()}
    print(json.dumps(summary), flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
