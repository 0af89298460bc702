"""``HydraStrategy`` and the runtime the modules talk to.

- :mod:`~lightning_hydra.strategy.strategy`: the Lightning strategy (hooks only).
- :mod:`~lightning_hydra.strategy.runtime`: the typed runtime (one process, or the pool).
- :mod:`~lightning_hydra.strategy.gradients`: bucketed gradient sums overlapped with the last backward.
- :mod:`~lightning_hydra.strategy.checks`: pool shape and plan digest checks.
"""

from lightning_hydra.strategy.checks import check_digests, check_pool
from lightning_hydra.strategy.gradients import GradientReducer
from lightning_hydra.strategy.runtime import GradientSync, HydraRuntime, LocalRuntime, PoolRuntime
from lightning_hydra.strategy.strategy import HydraStrategy

__all__ = [
    "GradientReducer",
    "GradientSync",
    "HydraRuntime",
    "HydraStrategy",
    "LocalRuntime",
    "PoolRuntime",
    "check_digests",
    "check_pool",
]
