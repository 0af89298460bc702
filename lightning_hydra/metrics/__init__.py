"""Measurements of training: busy and communication time, the step metrics, the projected pipeline bubble, and
the :class:`BubbleMonitor` callback that logs them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_hydra._lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_hydra.metrics.bubbles import (
        min_pipeline_bubble,
        one_f_one_b_order,
        pipeline_bubble,
        pipeline_bubble_floor,
        pipeline_makespan,
        replay_1f1b,
    )
    from lightning_hydra.metrics.loads import balance, bubble_dp, degree_histogram, replay_step_time, step_metrics
    from lightning_hydra.metrics.monitor import BubbleMonitor
    from lightning_hydra.metrics.record import StepGather, StepRecord
    from lightning_hydra.metrics.timing import MicrobatchTimer, StepTiming

__all__ = [
    "BubbleMonitor",
    "MicrobatchTimer",
    "StepGather",
    "StepRecord",
    "StepTiming",
    "balance",
    "bubble_dp",
    "degree_histogram",
    "min_pipeline_bubble",
    "one_f_one_b_order",
    "pipeline_bubble",
    "pipeline_bubble_floor",
    "pipeline_makespan",
    "replay_1f1b",
    "replay_step_time",
    "step_metrics",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "BubbleMonitor": "lightning_hydra.metrics.monitor",
        "MicrobatchTimer": "lightning_hydra.metrics.timing",
        "StepGather": "lightning_hydra.metrics.record",
        "StepRecord": "lightning_hydra.metrics.record",
        "StepTiming": "lightning_hydra.metrics.timing",
        "balance": "lightning_hydra.metrics.loads",
        "bubble_dp": "lightning_hydra.metrics.loads",
        "degree_histogram": "lightning_hydra.metrics.loads",
        "min_pipeline_bubble": "lightning_hydra.metrics.bubbles",
        "one_f_one_b_order": "lightning_hydra.metrics.bubbles",
        "pipeline_bubble": "lightning_hydra.metrics.bubbles",
        "pipeline_bubble_floor": "lightning_hydra.metrics.bubbles",
        "pipeline_makespan": "lightning_hydra.metrics.bubbles",
        "replay_1f1b": "lightning_hydra.metrics.bubbles",
        "replay_step_time": "lightning_hydra.metrics.loads",
        "step_metrics": "lightning_hydra.metrics.loads",
    },
)
