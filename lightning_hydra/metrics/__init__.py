"""Measurements of training: busy and communication time, the step metrics, the projected pipeline bubble, and
the :class:`BubbleMonitor` callback that logs them."""

from lightning_hydra.metrics.bubbles import (
    min_pipeline_bubble,
    one_f_one_b_order,
    pipeline_bubble,
    pipeline_makespan,
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
    "pipeline_makespan",
    "replay_step_time",
    "step_metrics",
]
