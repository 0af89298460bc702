"""lightning-hydra: load-driven dynamic context parallelism for PyTorch Lightning.

The names below load their modules on first use (:mod:`lightning_hydra._lazy`): ``import lightning_hydra.planner``
and ``lightning_hydra.cp`` do not import Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_hydra._lazy import lazy_exports

if TYPE_CHECKING:
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

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "BubbleMonitor": "lightning_hydra.metrics.monitor",
        "CostModel": "lightning_hydra.planner",
        "DecoderLM": "lightning_hydra.models",
        "Group": "lightning_hydra.planner",
        "HydraDataModule": "lightning_hydra.data.datamodule",
        "HydraModule": "lightning_hydra.models",
        "HydraStrategy": "lightning_hydra.strategy",
        "Plan": "lightning_hydra.planner",
        "PlanError": "lightning_hydra.planner",
        "schedule": "lightning_hydra.planner",
    },
)
