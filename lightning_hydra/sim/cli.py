"""``lightning-hydra simulate``: run a scenario recipe, print its table or JSON, optionally validate against runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lightning_hydra.recipes import recipe_path
from lightning_hydra.sim.scenario import load_scenario
from lightning_hydra.sim.simulate import simulate
from lightning_hydra.sim.truth import ENGINES

__all__ = ["main", "validate"]

_REPORTED = ("tokens_per_s", "bubble_dp", "bubble_pp", "schedule_ms")

TABLE_LEGEND = """columns (medians over the steps after the first, the closed loop's warm-up):
  tokens/s      simulated trained tokens per second, planning overlapped with the previous step
  uncalib.      the same with the planner's analytic cost model kept (no calibration); static and mcore plan
                without the cost model, so theirs is the same as tokens/s
  bubble_dp     share of rank-time spent waiting in a step (data-parallel bubble)
  bubble_pp     pipeline bubble: measured on the simulated 1F1B schedule with pipeline parallelism, else projected
                for the scenario's projected_stages
  sched ms      wall time of planning one global batch on this machine (the real planner)
  mem headroom  share of a GPU's memory left on the fullest rank (the planner's memory model: model state for
                the job's sharding, communicators, activations of its tokens); below 0 the plan would not fit
  (--json also reports tp_comm_share: the share of busy time in tensor parallelism's own collectives)"""
"""What each column of the ``simulate`` table means."""


def _measured(run_dir: Path) -> dict[str, Any]:
    from lightning_hydra.metrics.loads import replay_step_time
    from lightning_hydra.report import find_runs, load_run

    rows = load_run(find_runs([run_dir])[0])[1]
    records = [r["record"] for r in rows if "record" in r]
    if not records:
        raise ValueError(f"{run_dir} has no timelines: run with BubbleMonitor(timeline_every_n_steps=1)")
    busy = [np.asarray(r["busy"]) for r in records]
    step = [replay_step_time(b, np.asarray(r["leader"])) for b, r in zip(busy, records, strict=True)]
    return {"busy_per_rank_s": np.sum([b.sum(axis=0) for b in busy], axis=0), "step_s": step, "steps": len(records)}


def validate(result: dict[str, Any], runs: Path) -> dict[str, dict[str, float]]:
    """Prediction errors of a simulated CPU scenario against recorded runs ``runs/<policy>/version_*/``.

    Per policy: the relative error of every rank's busy time summed over the steps (mean and worst rank), and of
    the median step time (the measured step is the replayed critical path of the measured busy times, which is
    what the simulator's step is on a CPU host).
    """
    out = {}
    for policy, summary in result["policies"].items():
        versions = sorted((runs / policy).glob("version_*"), key=lambda d: int(d.name.split("_")[1]))
        if not versions:
            continue
        measured = _measured(versions[-1])
        steps = summary["steps"][: measured["steps"]]
        predicted_busy = np.sum([s["busy_per_rank_s"] for s in steps], axis=0)
        busy_err = np.abs(predicted_busy - measured["busy_per_rank_s"]) / measured["busy_per_rank_s"]
        predicted_step = float(np.median([s["compute_s"] for s in steps]))
        measured_step = float(np.median(measured["step_s"]))
        out[policy] = {
            "busy_error_mean": float(busy_err.mean()),
            "busy_error_max": float(busy_err.max()),
            "step_error": abs(predicted_step - measured_step) / measured_step,
            "predicted_step_s": predicted_step,
            "measured_step_s": measured_step,
            "predicted_busy_per_rank_s": predicted_busy.tolist(),
            "measured_busy_per_rank_s": measured["busy_per_rank_s"].tolist(),
        }
    return out


def _positive(high: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: allowed 1..{high:,}")
        return value

    parse.__name__ = "int"
    return parse


def _simulate_with_progress(scenario: Any) -> dict[str, Any]:
    """:func:`simulate`, one policy at a time, saying on stderr which one runs and that it still runs (the batches
    depend on the scenario only, so running the policies apart gives the same results)."""
    from lightning_hydra.console import progress

    parts = []
    for k, policy in enumerate(scenario.policies, 1):
        label = (
            f"lightning-hydra simulate: {policy} ({k}/{len(scenario.policies)}), {scenario.steps} steps on "
            f"{scenario.job.gpus:,} GPUs"
        )
        with progress(label, every=15.0, stream=sys.stderr):
            parts.append(simulate(dataclasses.replace(scenario, policies=[policy])))
    result = parts[0]
    for part in parts[1:]:
        result["policies"].update(part["policies"])
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-hydra simulate``."""
    parser = argparse.ArgumentParser(prog="lightning-hydra simulate", description=__doc__)
    parser.add_argument("--config", required=True, help="scenario recipe (recipes/sim-*.yaml)")
    parser.add_argument("--json", action="store_true", help="print per policy tokens_per_s, bubble_dp, ... as JSON")
    parser.add_argument(
        "--steps", type=_positive(10_000), default=None, help="override the number of global batches (1..10000)"
    )
    parser.add_argument(
        "--gpus", type=_positive(16384), default=None, help="override the job's GPU count (reduced runs; 1..16384)"
    )
    parser.add_argument("--policies", nargs="+", default=None, choices=["static", "mcore", "hydra"])
    parser.add_argument("--no-calibrate", action="store_true", help="keep the analytic cost model")
    parser.add_argument("--engine", default=None, choices=sorted(ENGINES), help="CP engine the truth times")
    parser.add_argument("--validate", default=None, help="directory of recorded runs (runs/compare) to compare with")
    parser.add_argument("--full", action="store_true", help="include per-step results in the JSON")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {
        "steps": args.steps,
        "job.gpus": args.gpus,
        "policies": args.policies,
        "engine": args.engine,
    }
    if args.no_calibrate:
        overrides["calibrate"] = False
    scenario = load_scenario(recipe_path(args.config), **overrides)
    start = time.perf_counter()
    result = _simulate_with_progress(scenario)
    result["simulated_in_s"] = time.perf_counter() - start
    policies = result["policies"]
    if "hydra" in policies:
        for base in ("mcore", "static"):
            if base in policies:
                result[f"hydra_over_{base}"] = policies["hydra"]["tokens_per_s"] / policies[base]["tokens_per_s"]
    if args.validate:
        result["validation"] = validate(result, Path(args.validate))
    if args.json:
        if not args.full:
            for summary in policies.values():
                summary.pop("steps", None)
        print(json.dumps(result, indent=2))
        return 0
    print(f"{scenario.name}: {scenario.job.gpus} GPUs, pool {scenario.job.pool}, {result['steps']} steps "
          f"(simulated in {result['simulated_in_s']:.1f} s)")  # fmt: skip
    print(f"{'policy':>8} {'tokens/s':>12} {'uncalib.':>12} {'bubble_dp':>10} {'bubble_pp':>10} {'sched ms':>9} "
          f"{'mem headroom':>12}")  # fmt: skip
    for policy, s in policies.items():
        uncal = s.get("tokens_per_s_uncalibrated", float("nan"))
        print(f"{policy:>8} {s['tokens_per_s']:>12,.0f} {uncal:>12,.0f} {s['bubble_dp']:>10.3f} "
              f"{s['bubble_pp']:>10.3f} {s['schedule_ms']:>9.1f} {s['memory_headroom']:>12.2f}")  # fmt: skip
    print(TABLE_LEGEND)
    for key in ("hydra_over_mcore", "hydra_over_static"):
        if key in result:
            print(f"{key}: {result[key]:.3f}")
    for policy, v in result.get("validation", {}).items():
        print(f"validation {policy}: busy per rank error mean {v['busy_error_mean']:.1%} (worst rank "
              f"{v['busy_error_max']:.1%}), step time {v['predicted_step_s']:.2f} s predicted vs "
              f"{v['measured_step_s']:.2f} s measured ({v['step_error']:.1%})")  # fmt: skip
    return 0
