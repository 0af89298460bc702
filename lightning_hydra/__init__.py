"""lightning-hydra: load-driven dynamic context parallelism for PyTorch Lightning."""

from lightning_hydra.planner import CostModel, Group, Plan, PlanError, schedule

__all__ = ["CostModel", "Group", "Plan", "PlanError", "schedule"]
__version__ = "0.1.0"
