"""Run a scenario: plan real global batches with the real planner, time them with the simulated truth.

Per step and policy: the planner really runs (its wall time is ``schedule_ms``), the truth times every rank's
microbatches, the step is replayed (groups synchronise per microbatch; with pipeline parallelism every stage runs
the 1F1B schedule of the per-microbatch maxima), and the gradient all-reduce is added. With ``calibrate`` the
planner's cost model is refitted from the simulated measurements exactly as in training
(:class:`~lightning_hydra.planner.calibration.CostCalibrator`), and an uncalibrated run of the same batches is
reported beside.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from lightning_hydra.bench.batches import make_batch
from lightning_hydra.data.batching import global_batches
from lightning_hydra.data.corpus import StdlibCorpus
from lightning_hydra.metrics.bubbles import pipeline_bubble, pipeline_makespan
from lightning_hydra.metrics.loads import replay_step_time
from lightning_hydra.planner import CostModel, PlannerConfig
from lightning_hydra.planner.calibration import CostCalibrator, plan_features, predict, relative_error
from lightning_hydra.sim.footprint import job_memory, memory_headroom
from lightning_hydra.sim.scenario import Scenario
from lightning_hydra.sim.truth import plan_times, plan_tp_times

__all__ = ["COST_DRIVEN", "plan_features", "scenario_batches", "simulate", "simulate_policy", "step_result"]

COST_DRIVEN = frozenset({"hydra"})
"""Policies whose plans depend on the cost model (and therefore on calibration)."""


def scenario_batches(scenario: Scenario) -> list[np.ndarray]:
    """The global batches (lengths) of the scenario, the same for every policy."""
    job, work = scenario.job, scenario.workload
    if work.distribution == "corpus":
        lengths = StdlibCorpus("train", max_bytes=work.corpus_max_bytes).lengths()
        budget = work.global_batch_tokens or int(work.fill * job.pool * job.max_tokens_per_rank * job.num_microbatches)
        batches = global_batches(lengths, budget, seed=scenario.seed, epoch=0, shuffle=True)
        return [lengths[b] for b in batches[: scenario.steps]]
    return [
        make_batch(
            work.distribution, world_size=job.pool, capacity=job.max_tokens_per_rank,
            num_microbatches=job.num_microbatches, fill=work.fill, context=work.context, seed=scenario.seed + step,
        )
        for step in range(scenario.steps)
    ]  # fmt: skip


def step_result(scenario: Scenario, times: np.ndarray, leader: np.ndarray, tokens: int) -> dict[str, float]:
    """Step time and bubbles of one simulated step from its ``[M, N]`` busy times."""
    job, model, hw = scenario.job, scenario.model, scenario.hardware
    per_mb = times.max(axis=1)
    working = per_mb[per_mb > 0]
    if job.pp > 1:
        compute = pipeline_makespan((job.pp * working).tolist(), job.pp)
        bubble_dp = 1.0 - float(times.mean(axis=1).sum() / per_mb.sum())
        bubble_pp = pipeline_bubble((job.pp * working).tolist(), job.pp)
    else:
        compute = replay_step_time(times, leader)
        bubble_dp = 1.0 - float(times.sum(axis=0).mean() / compute)
        bubble_pp = pipeline_bubble(working.tolist(), job.projected_stages) if working.size else 0.0
    n = job.pool
    stage_params = model.params / (job.pp * job.tp)
    grad_sync = 2 * (n - 1) / n * stage_params * 4 / hw.inter_node_bandwidth if n > 1 else 0.0  # fp32 gradients
    step = compute + grad_sync
    return {
        "step_s": step,
        "compute_s": compute,
        "grad_sync_s": grad_sync,
        "tokens_per_s": tokens / step,
        "bubble_dp": bubble_dp,
        "bubble_pp": bubble_pp,
        "busy_per_rank_s": times.sum(axis=0).tolist(),
    }


def simulate_policy(
    scenario: Scenario, policy: str, batches: list[np.ndarray], *, calibrate: bool, cost: CostModel | None = None
) -> dict[str, Any]:
    """Simulate one policy over ``batches``; returns per-step results and their summary."""
    job, model, hw = scenario.job, scenario.model, scenario.hardware
    layers = max(1, model.num_layers // job.pp)
    config = PlannerConfig(
        policy=policy,
        max_tokens_per_rank=job.max_tokens_per_rank,
        num_microbatches=job.num_microbatches,
        ranks_per_node=min(scenario.node_size(), job.pool),
        max_ulysses=1 if scenario.engine == "te-p2p" else None,
        pipeline_stages=job.pp,  # as HydraStrategy(pipeline_stages=...) plans: candidates scored by 1F1B step time
    )
    cost = cost or scenario.starting_cost()
    calibrator = CostCalibrator()
    heads, kv_heads = model.num_heads // job.tp, model.num_kv_heads // job.tp
    memory = job_memory(job, model, hw, ranks_per_node=scenario.node_size())
    steps = []
    for k, lengths in enumerate(batches):
        start = time.perf_counter()
        plan = config.schedule(
            lengths, world_size=job.pool, cost=cost, num_heads=heads, num_kv_heads=kv_heads, seed=scenario.seed + k
        )
        schedule_ms = 1e3 * (time.perf_counter() - start)
        timing = {"model": model, "hardware": hw, "layers": layers, "tp": job.tp}
        timing["sequence_parallel"] = job.sequence_parallel
        times, leader = plan_times(
            plan, **timing, head_share=1.0 / job.pp, include_comm=hw.timer_includes_comm, engine=scenario.engine
        )
        tp_busy = plan_tp_times(plan, **timing, include_comm=hw.timer_includes_comm)
        comm = None
        if not hw.timer_includes_comm:  # a CPU host measures communication apart (wall time in CP collectives)
            comm = plan_times(plan, **timing, head_share=1.0 / job.pp, include_comm=True, engine=scenario.engine)[0]
            comm -= times
        result = step_result(scenario, times, leader, int(np.sum(lengths)))
        features = plan_features(plan, cost)
        predicted = predict(cost, features, includes_comm=hw.timer_includes_comm)
        result["cost_model_error"] = relative_error(predicted, times.ravel())
        result["schedule_ms"] = schedule_ms
        result["tp_comm_share"] = float(tp_busy.sum() / times.sum()) if times.sum() > 0 else 0.0
        result["memory_headroom"] = memory_headroom(memory, float(plan.tokens().max()))
        result["microbatches"] = plan.num_microbatches
        steps.append(result)
        if calibrate:
            calibrator.add(
                features,
                times.ravel(),
                includes_comm=hw.timer_includes_comm,
                comm=None if comm is None else comm.ravel(),
            )
            cost = calibrator.refit(cost)
    return {"steps": steps, "cost": cost.to_dict(), **summarize(steps)}


def summarize(steps: list[dict[str, Any]], skip: int = 0) -> dict[str, float]:
    """Medians over steps (after ``skip`` warm-up steps) of the reported figures; throughput is total tokens over
    total time (planning overlapped with the previous step, and, beside it, planning on the critical path)."""
    use = steps[skip:] or steps
    tokens = sum(s["tokens_per_s"] * s["step_s"] for s in use)
    step_total = sum(s["step_s"] for s in use)
    return {
        "tokens_per_s": tokens / step_total,
        # if planning ran on the critical path instead of ahead of the step in the data loader
        "tokens_per_s_serial_schedule": tokens / (step_total + sum(s["schedule_ms"] for s in use) / 1e3),
        "bubble_dp": float(np.median([s["bubble_dp"] for s in use])),
        "bubble_pp": float(np.median([s["bubble_pp"] for s in use])),
        "schedule_ms": float(np.median([s["schedule_ms"] for s in use])),
        "step_s": float(np.median([s["step_s"] for s in use])),
        "memory_headroom": float(min(s["memory_headroom"] for s in use)),
        "tp_comm_share": float(np.median([s["tp_comm_share"] for s in use])),
        "cost_model_error": float(np.median([s["cost_model_error"] for s in use])),
    }


def simulate(scenario: Scenario) -> dict[str, Any]:
    """Simulate every policy of the scenario on the same batches.

    Returns:
        ``{"scenario": ..., "policies": {policy: summary}}``; with ``calibrate`` each summary is over the steps
        after the first (the closed loop's warm-up) and carries ``tokens_per_s_uncalibrated`` of a run that keeps
        the analytic cost model.
    """
    batches = scenario_batches(scenario)
    out: dict[str, Any] = {}
    for policy in scenario.policies:
        if scenario.calibrate:
            run = simulate_policy(scenario, policy, batches, calibrate=True)
            # static and mcore plan without the cost model: calibration changes their predictions, not their plans
            plain = simulate_policy(scenario, policy, batches, calibrate=False) if policy in COST_DRIVEN else run
            summary = {**summarize(run["steps"], skip=1), "steps": run["steps"]}
            summary["tokens_per_s_uncalibrated"] = summarize(plain["steps"], skip=1)["tokens_per_s"]
            if plain is not run:
                summary["cost_model_error_uncalibrated"] = summarize(plain["steps"], skip=1)["cost_model_error"]
        else:
            run = simulate_policy(scenario, policy, batches, calibrate=False)
            summary = {**summarize(run["steps"]), "steps": run["steps"]}
        out[policy] = summary
    return {
        "scenario": scenario.name,
        "pool": scenario.job.pool,
        "gpus": scenario.job.gpus,
        "steps": len(batches),
        "policies": out,
    }
