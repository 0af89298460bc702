"""lightning-hydra: load-driven dynamic context parallelism for PyTorch Lightning."""

from lightning_hydra.data.datamodule import HydraDataModule
from lightning_hydra.metrics.monitor import BubbleMonitor
from lightning_hydra.models import DecoderLM, HydraModule
from lightning_hydra.planner import CostModel, Group, Plan, PlanError, schedule
from lightning_hydra.strategy import HydraStrategy

__all__ = [
    "BubbleMonitor",
    "CostModel",
    "DecoderLM",
    "Group",
    "HydraDataModule",
    "HydraModule",
    "HydraStrategy",
    "Plan",
    "PlanError",
    "schedule",
]
__version__ = "0.1.0"
