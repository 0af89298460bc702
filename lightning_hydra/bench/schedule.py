"""Planner benchmark: the three policies side by side on the same long-tailed global batches.

Prints one JSON object per scenario (and a summary) to stdout::

    python -m lightning_hydra.bench.schedule            # quick grid: pools of 64 and 512 ranks
    python -m lightning_hydra.bench.schedule --full     # adds 2048 ranks (mcore takes a while there)
    python -m lightning_hydra.bench.schedule --rings-timed  # plan as a run whose calibration timed plain rings

Per policy: efficiency ``(useful compute / N) / sum_m max_r load[m, r]`` (communication charged as waste),
max/mean of per-rank load summed over microbatches, microbatches used, degree histogram, mean degree and its
inflation over the memory minimum, and scheduling milliseconds (median of ``--repeat`` runs: wall clock, and the
process's CPU time, which a machine shared with other work inflates less; the load average is reported beside;
``schedule_cpu_ms_min``: the fastest run's CPU time, the figure a machine whose speed drifts affects least), and the
plan's :meth:`~lightning_hydra.planner.Plan.digest`: two commits' outputs tell whether a change altered any plan
(the same digest on every batch: the same plans, so figures measured on them need no new run).

The planner plans with the analytic model; ``--rings-timed`` marks it as a calibrated one that has timed plain rings
on both links (:func:`~lightning_hydra.planner.hydra.rings_timed`), the state in which hydra also forms its twins
within reach and the ``node`` lifts: run in two checkouts, it tells what those cost a plan's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from lightning_hydra.bench.batches import make_batch
from lightning_hydra.planner import CostModel, Plan, schedule
from lightning_hydra.planner.mcore import megatron_min_degree
from lightning_hydra.sim.hardware import ModelShape

__all__ = ["LLAMA_8B", "analytic_cost", "llama8b_cost", "main", "plan_metrics"]

CONTEXTS = {"256K": (262144, 16384), "32K": (32768, 4096)}
"""Context name -> (longest sequence, capacity in tokens per rank)."""


LLAMA_8B = ModelShape(
    hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256
)
"""The model the benchmarks plan by default (Llama-3-8B shape, bf16)."""


def analytic_cost(model: ModelShape = LLAMA_8B) -> CostModel:
    """The planner's analytic model of ``model`` at 400 TFLOP/s achieved (an assumption, not a measurement), 8 ranks
    per node, before any calibration."""
    return CostModel.for_transformer(**model.cost_model_args(), ranks_per_node=8)


def llama8b_cost() -> CostModel:
    """The cost model of a Llama-3-8B-shaped decoder (:func:`analytic_cost` of :data:`LLAMA_8B`)."""
    return analytic_cost(LLAMA_8B)


def plan_metrics(plan: Plan, cost: CostModel, capacity: int) -> dict:
    """The figures docs/benchmarks.md reports for one plan."""
    loads = plan.loads(cost)
    per_rank = loads.sum(axis=0)
    degrees = plan.sequence_degrees()
    lengths = np.asarray(plan.lengths)
    memory_min = np.asarray([megatron_min_degree(int(x), capacity) for x in lengths])
    return {
        "efficiency": round(plan.efficiency(cost), 4),
        "max_over_mean": round(float(per_rank.max() / per_rank.mean()), 4),
        "microbatches": plan.num_microbatches,
        "mean_degree": round(float(degrees.mean()), 3),
        "token_weighted_degree": round(float((degrees * lengths).sum() / lengths.sum()), 3),
        "inflation": round(float((degrees / memory_min).mean()), 3),
        "token_weighted_inflation": round(float((degrees / memory_min * lengths).sum() / lengths.sum()), 3),
        "degree_hist": {str(k): v for k, v in plan.degree_histogram().items()},
    }


def run_scenario(
    *,
    world_size: int,
    context: str,
    fill: float,
    distribution: str,
    num_microbatches: int,
    repeat: int,
    seed: int,
    policies: list[str],
    mcore_repeat: int,
    rings_timed: bool = False,
) -> dict:
    """Plan one batch with every policy; return the scenario's JSON record. ``rings_timed``: the model is marked as
    calibrated on plain rings over both links (module docstring)."""
    longest, capacity = CONTEXTS[context]
    cost = llama8b_cost()
    if rings_timed:
        cost = cost.replace(rings_measured=True, intra_rings_measured=True, inter_rings_measured=True)
    lengths = make_batch(
        distribution,
        world_size=world_size,
        capacity=capacity,
        num_microbatches=num_microbatches,
        fill=fill,
        context=longest,
        seed=seed,
    )
    record: dict = {
        "world_size": world_size,
        "context": context,
        "capacity": capacity,
        "fill": fill,
        "distribution": distribution,
        "sequences": int(lengths.size),
        "tokens": int(lengths.sum()),
        "policies": {},
    }
    if rings_timed:
        record["rings_timed"] = True
    for policy in policies:
        times, cpu, plan = [], [], None
        for _ in range(mcore_repeat if policy == "mcore" else repeat):
            start = time.perf_counter()
            cpu_start = time.process_time()
            plan = schedule(
                lengths,
                world_size=world_size,
                num_microbatches=num_microbatches,
                max_tokens_per_rank=capacity,
                cost=cost,
                policy=policy,
                ranks_per_node=8,
                num_heads=32,
                num_kv_heads=8,
                seed=seed,
                max_seq_len=longest,
            )
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        assert plan is not None
        record["policies"][policy] = {
            **plan_metrics(plan, cost, capacity),
            "schedule_ms": round(1e3 * statistics.median(times), 2),
            "schedule_cpu_ms": round(1e3 * statistics.median(cpu), 2),
            "schedule_cpu_ms_min": round(1e3 * min(cpu), 2),
            "load_average": round(os.getloadavg()[0], 2),
            "digest": plan.digest(),
        }
        if "candidate" in plan.stats:
            record["policies"][policy]["candidate"] = plan.stats["candidate"]
    pol = record["policies"]
    if "hydra" in pol and "mcore" in pol:
        record["hydra_over_mcore"] = {
            "efficiency": round(pol["hydra"]["efficiency"] / pol["mcore"]["efficiency"], 3),
            "schedule_speedup": round(pol["mcore"]["schedule_ms"] / pol["hydra"]["schedule_ms"], 1),
        }
    return record


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="include 2048-rank pools")
    parser.add_argument("--world-sizes", type=int, nargs="*", help="override the pool sizes")
    parser.add_argument("--contexts", nargs="*", default=list(CONTEXTS), choices=list(CONTEXTS))
    parser.add_argument("--fills", type=float, nargs="*", default=[0.5, 0.75])
    parser.add_argument("--distributions", nargs="*", default=["lognormal", "stdlib"])
    parser.add_argument("--policies", nargs="*", default=["static", "mcore", "hydra"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="timing repeats for static and hydra")
    parser.add_argument("--mcore-repeat", type=int, default=1, help="timing repeats for mcore (slow at scale)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rings-timed", action="store_true", help="plan with a model marked as having timed plain rings on both links"
    )
    args = parser.parse_args(argv)
    sizes = args.world_sizes or ([64, 512, 2048] if args.full else [64, 512])
    records = []
    for world_size in sizes:
        for context in args.contexts:
            for fill in args.fills:
                for dist in args.distributions:
                    rec = run_scenario(
                        world_size=world_size,
                        context=context,
                        fill=fill,
                        distribution=dist,
                        num_microbatches=args.microbatches,
                        repeat=args.repeat,
                        seed=args.seed,
                        policies=args.policies,
                        mcore_repeat=args.mcore_repeat,
                        rings_timed=args.rings_timed,
                    )
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
    print(json.dumps({"summary": summarize(records)}), flush=True)
    return 0


def summarize(records: list[dict]) -> list[dict]:
    """One compact row per scenario: efficiency and schedule time of each policy."""
    rows = []
    for r in records:
        row = {k: r[k] for k in ("world_size", "context", "fill", "distribution", "sequences")}
        for name, m in r["policies"].items():
            row[name] = {
                k: m[k]
                for k in ("efficiency", "mean_degree", "inflation", "microbatches", "schedule_ms", "schedule_cpu_ms")
            }
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
