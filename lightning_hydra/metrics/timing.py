"""Per-step timing of a rank: busy time of every microbatch and the step's wall time.

Busy time is the calling thread's CPU time on CPU (time blocked in a collective consumes none), and CUDA-event
time on GPU (kernels between the events; waits on other ranks included, so GPU busy time is an upper bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

__all__ = ["MicrobatchTimer", "StepTiming"]


@dataclass
class StepTiming:
    """What one rank measured in one optimizer step."""

    busy: list[float] = field(default_factory=list)
    """Busy seconds of every microbatch (0 for an idle one)."""
    comm: list[float] = field(default_factory=list)
    """Seconds inside CP collectives in every microbatch (waits on slower members included)."""
    wall: float = 0.0
    """Wall seconds of the whole step on this rank (from the plan check to the end of the gradient sum)."""

    @property
    def total_busy(self) -> float:
        """Busy seconds summed over the step's microbatches."""
        return float(sum(self.busy))


class MicrobatchTimer:
    """Measures busy time around a block on CPU (thread CPU time) or CUDA (events)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> object:
        """Begin a measurement; returns a token for :meth:`stop`."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.thread_time()

    def stop(self, token: object) -> float:
        """Seconds since :meth:`start`."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return token.elapsed_time(end) / 1e3  # type: ignore[union-attr]
        return time.thread_time() - float(token)  # type: ignore[arg-type]
