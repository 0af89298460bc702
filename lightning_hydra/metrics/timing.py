"""Per-step timing of a rank: busy time of every microbatch and the step's wall time.

Busy time is the calling thread's CPU time on CPU (time blocked in a collective consumes none), and CUDA-event
time on GPU (kernels between the events; waits on other ranks included, so GPU busy time is an upper bound).
Nothing synchronises the host inside the step: CUDA events are recorded as the microbatches are issued and read
once, by :meth:`MicrobatchTimer.read`, after the step's last collective.
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
    """Busy time of the microbatches of one step, on CPU (thread CPU time) or CUDA (events, read at the end).

    Call :meth:`start` and :meth:`stop` around every microbatch (an idle one: :meth:`skip`), then :meth:`read` once.
    """

    def __init__(self, device: torch.device) -> None:
        """Args:
        device: The device the microbatches run on (CUDA: events on its current stream).
        """
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[object, object] | float] = []
        self._open: object | None = None

    def start(self) -> None:
        """Begin a microbatch."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open = event
        else:
            self._open = time.thread_time()

    def stop(self) -> None:
        """End the microbatch begun by :meth:`start` (no host synchronisation)."""
        if self._open is None:
            raise RuntimeError("MicrobatchTimer.stop without start")
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._open, end))
        else:
            self._spans.append(time.thread_time() - float(self._open))  # type: ignore[arg-type]
        self._open = None

    def skip(self) -> None:
        """Record an idle microbatch (0 seconds)."""
        self._spans.append(0.0)

    def read(self) -> list[float]:
        """Busy seconds of every microbatch in order (CUDA: waits once for the last event)."""
        if self.cuda:
            events = [s for s in self._spans if isinstance(s, tuple)]
            if events:
                events[-1][1].synchronize()  # type: ignore[union-attr]
        out = [
            s[0].elapsed_time(s[1]) / 1e3 if isinstance(s, tuple) else float(s)  # type: ignore[union-attr]
            for s in self._spans
        ]
        return out
