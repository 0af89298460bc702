"""Measurements of training: per-microbatch busy time and the projected pipeline bubble."""

from lightning_hydra.metrics.bubbles import one_f_one_b_order, pipeline_bubble
from lightning_hydra.metrics.timing import MicrobatchTimer, StepTiming

__all__ = ["MicrobatchTimer", "StepTiming", "one_f_one_b_order", "pipeline_bubble"]
