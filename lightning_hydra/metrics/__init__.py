"""Measurements of training: per-microbatch busy time (and, later, bubble metrics)."""

from lightning_hydra.metrics.timing import MicrobatchTimer, StepTiming

__all__ = ["MicrobatchTimer", "StepTiming"]
