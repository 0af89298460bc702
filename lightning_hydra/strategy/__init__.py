"""``HydraStrategy`` and the runtime the modules talk to.

- :mod:`~lightning_hydra.strategy.strategy`: the Lightning strategy (hooks only).
- :mod:`~lightning_hydra.strategy.runtime`: the typed runtime interface, and the one-process runtime.
- :mod:`~lightning_hydra.strategy.pool`: the pool's runtime (plans, communicators, gradient sums, gathers).
- :mod:`~lightning_hydra.strategy.sharding`, :mod:`~lightning_hydra.strategy.checkpoint`: FSDP2 state, checkpoints.
- :mod:`~lightning_hydra.strategy.capacity`: the memory budget and ``max_tokens_per_rank="auto"``.
- :mod:`~lightning_hydra.strategy.pipeline`, :mod:`~lightning_hydra.strategy.clipping`: 1F1B stages, clipping.
- :mod:`~lightning_hydra.strategy.gradients`: bucketed gradient sums overlapped with the last backward.
- :mod:`~lightning_hydra.strategy.checks`: pool shape and plan digest checks.
- :mod:`~lightning_hydra.strategy.tensor`, :mod:`~lightning_hydra.strategy.tensor_pool`: tensor parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_hydra._lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_hydra.strategy.checks import check_digests
    from lightning_hydra.strategy.gradients import GradientReducer
    from lightning_hydra.strategy.layout import check_pool
    from lightning_hydra.strategy.pool import PoolRuntime
    from lightning_hydra.strategy.runtime import GradientSync, HydraRuntime, LocalRuntime
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

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "GradientReducer": "lightning_hydra.strategy.gradients",
        "GradientSync": "lightning_hydra.strategy.runtime",
        "HydraRuntime": "lightning_hydra.strategy.runtime",
        "HydraStrategy": "lightning_hydra.strategy.strategy",
        "LocalRuntime": "lightning_hydra.strategy.runtime",
        "PoolRuntime": "lightning_hydra.strategy.pool",
        "check_digests": "lightning_hydra.strategy.checks",
        "check_pool": "lightning_hydra.strategy.layout",
    },
)
