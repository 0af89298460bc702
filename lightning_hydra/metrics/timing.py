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

__all__ = ["MicrobatchTimer", "OpTimer", "StepTiming"]


@dataclass
class StepTiming:
    """What one rank measured in one optimizer step."""

    busy: list[float] = field(default_factory=list)
    """Busy seconds of every microbatch (0 for an idle one)."""
    comm: list[float] = field(default_factory=list)
    """Seconds inside CP collectives in every microbatch (waits on slower members included)."""
    wall: float = 0.0
    """Wall seconds of the whole step on this rank (from the plan check to the end of the gradient sum)."""
    forward: list[float] = field(default_factory=list)
    """Busy seconds of every microbatch's forward (empty: not split)."""
    backward: list[float] = field(default_factory=list)
    """Busy seconds of every microbatch's backward (empty: not split)."""
    spans: list[list[float]] = field(default_factory=list)
    """Per microbatch forward start/end and backward start/end, wall seconds since the step began (pipelined
    steps; empty otherwise)."""

    @property
    def total_busy(self) -> float:
        """Busy seconds summed over the step's microbatches."""
        return float(sum(self.busy))


class MicrobatchTimer:
    """Busy time of the microbatches of one step, forward and backward apart, on CPU (thread CPU time) or CUDA
    (events, read at the end).

    Around every microbatch call :meth:`start`, :meth:`mark` (forward done), :meth:`stop` (backward done); an idle
    microbatch: :meth:`skip`; then :meth:`read` once.
    """

    def __init__(self, device: torch.device) -> None:
        """Args:
        device: The device the microbatches run on (CUDA: events on its current stream).
        """
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[object, object, object] | None] = []
        self._open: list[object] = []

    def _now(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.thread_time()

    def start(self) -> None:
        """Begin a microbatch."""
        self._open = [self._now()]

    def mark(self) -> None:
        """The microbatch's forward is done (its backward begins)."""
        if len(self._open) != 1:
            raise RuntimeError("MicrobatchTimer.mark without start")
        self._open.append(self._now())

    def stop(self) -> None:
        """End the microbatch begun by :meth:`start` (no host synchronisation)."""
        if not self._open:
            raise RuntimeError("MicrobatchTimer.stop without start")
        end = self._now()
        middle = self._open[1] if len(self._open) > 1 else end
        self._spans.append((self._open[0], middle, end))
        self._open = []

    def skip(self) -> None:
        """Record an idle microbatch (0 seconds)."""
        self._spans.append(None)

    def read_split(self) -> tuple[list[float], list[float]]:
        """``(forward, backward)`` busy seconds of every microbatch in order (CUDA: waits once for the last
        event)."""

        def seconds(a: object, b: object) -> float:
            if self.cuda:
                return a.elapsed_time(b) / 1e3  # type: ignore[union-attr]
            return float(b) - float(a)  # type: ignore[arg-type]

        done = [s for s in self._spans if s is not None]
        if self.cuda and done:
            done[-1][2].synchronize()  # type: ignore[union-attr]
        forward = [0.0 if s is None else seconds(s[0], s[1]) for s in self._spans]
        backward = [0.0 if s is None else seconds(s[1], s[2]) for s in self._spans]
        return forward, backward

    def read(self) -> list[float]:
        """Busy seconds (forward plus backward) of every microbatch in order."""
        forward, backward = self.read_split()
        return [f + b for f, b in zip(forward, backward, strict=True)]


class OpTimer:
    """Busy time and wall span of named operations of one step (a pipeline's forwards and backwards), without
    synchronising the host before :meth:`read`.

    CPU: busy is the thread's CPU time, spans are wall seconds since the timer was made. CUDA: both from events on
    the current stream (busy is the span: kernels, waits included), read once at the end.
    """

    def __init__(self, device: torch.device) -> None:
        """Args:
        device: The device the operations run on.
        """
        self.cuda = device.type == "cuda"
        self._origin: object = self._mark()
        self._open: dict[object, tuple[object, float]] = {}
        self._done: dict[object, tuple[object, object, float]] = {}

    def _mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self, key: object) -> None:
        """Start operation ``key``."""
        self._open[key] = (self._mark(), 0.0 if self.cuda else time.thread_time())

    def end(self, key: object) -> None:
        """End operation ``key``."""
        start, cpu = self._open.pop(key)
        self._done[key] = (start, self._mark(), 0.0 if self.cuda else time.thread_time() - cpu)

    def read(self) -> dict[object, tuple[float, float, float]]:
        """``{key: (busy seconds, start, end)}``, start and end in seconds since the timer was made."""
        out = {}
        if self.cuda and self._done:
            list(self._done.values())[-1][1].synchronize()  # the last recorded event: every earlier one is done
        for key, (start, end, cpu) in self._done.items():
            if self.cuda:
                begin = self._origin.elapsed_time(start) / 1e3  # type: ignore[union-attr]
                finish = self._origin.elapsed_time(end) / 1e3  # type: ignore[union-attr]
                out[key] = (finish - begin, begin, finish)
            else:
                origin = float(self._origin)  # type: ignore[arg-type]
                out[key] = (cpu, float(start) - origin, float(end) - origin)  # type: ignore[arg-type]
        return out
