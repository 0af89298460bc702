"""Cluster-scale simulator: the real planner on simulated hardware (``lightning-hydra simulate``)."""

from lightning_hydra.sim.ceiling import efficiency_ceiling, span_floor
from lightning_hydra.sim.hardware import PRESETS, Hardware, ModelShape
from lightning_hydra.sim.scenario import Job, Scenario, Workload, load_scenario
from lightning_hydra.sim.simulate import scenario_batches, simulate, simulate_policy, step_result
from lightning_hydra.sim.truth import bin_time, plan_times

__all__ = [
    "PRESETS",
    "Hardware",
    "Job",
    "ModelShape",
    "Scenario",
    "Workload",
    "bin_time",
    "efficiency_ceiling",
    "load_scenario",
    "plan_times",
    "scenario_batches",
    "simulate",
    "simulate_policy",
    "span_floor",
    "step_result",
]
