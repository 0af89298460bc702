"""What the dashboard reads from a run's step records besides the metrics: its layout, its resumes, the step time
its DP bubble used, whether its pipeline bubble was measured or projected, whether it calibrated (pure: no plotting).

Each step row of ``hydra_steps.jsonl`` (:class:`~lightning_hydra.metrics.monitor.BubbleMonitor`) carries
``step_time`` (``"replay"`` or ``"wall"``), ``layout`` (devices, TP, PP and pool degrees), ``calibrated``,
``pipeline`` (``{"stages": P, "measured": bool}``) and, on the first step after a resume, ``resumed``. Records
written before these fields existed read as far as they say: a resume is then found where a part of a joined run
begins (``resumed_from``), and the step time where ``step_time`` changes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_hydra.metrics.loads import bubble_dp, replay_step_time
from lightning_hydra.strategy.layout import RunLayout

__all__ = [
    "DPBubble",
    "calibration_note",
    "cp_degrees",
    "dp_bubble",
    "layout_of",
    "method_switches",
    "pipeline_note",
    "position_labels",
    "resumes",
]


def resumes(rows: list[dict[str, Any]]) -> list[int]:
    """Steps at which the run was resumed (the first step each resumed part ran)."""
    return [int(r["step"]) for r in rows if r.get("resumed")]


def method_switches(rows: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """``(step, before, after)`` wherever the step time of ``bubble/dp`` changed from one recorded step to the
    next."""
    out = []
    for before, after in itertools.pairwise(rows):
        a, b = before.get("step_time"), after.get("step_time")
        if a is not None and b is not None and a != b:
            out.append((int(after["step"]), a, b))
    return out


@dataclass(frozen=True)
class DPBubble:
    """The DP bubble of a run under one step time, and under the other where it is known."""

    method: str
    """The step time of :attr:`values`: ``"replay"`` or ``"wall"`` (the run's first recorded one)."""
    values: list[tuple[int, float]]
    """``(step, bubble)`` under :attr:`method` (steps recorded under the other method alone are left out)."""
    other: list[tuple[int, float]]
    """``(step, bubble)`` under the other step time, where recorded."""
    steps: int
    """Steps of the run."""

    @property
    def other_method(self) -> str:
        """The step time of :attr:`other`."""
        return "wall" if self.method == "replay" else "replay"

    def median(self) -> float:
        """Median of :attr:`values` (``nan`` without any)."""
        return float(np.median([v for _, v in self.values])) if self.values else float("nan")


def dp_bubble(rows: list[dict[str, Any]]) -> DPBubble:
    """The run's DP bubble under one step time throughout: the run's first method, read from ``bubble/dp_<method>``
    (recorded beside ``bubble/dp`` since both are), from ``bubble/dp`` where the step used that method, or
    recomputed from the step's timeline where it holds one; and the other method's values where recorded."""
    method = next((r["step_time"] for r in rows if r.get("step_time")), "wall")
    other = "wall" if method == "replay" else "replay"
    values, others = [], []
    for row in rows:
        step = int(row["step"])
        mine, theirs = _dp_under(row, method), _dp_under(row, other)
        if mine is not None:
            values.append((step, mine))
        if theirs is not None:
            others.append((step, theirs))
    return DPBubble(method, values, others, len(rows))


def _dp_under(row: dict[str, Any], method: str) -> float | None:
    metrics = row.get("metrics", {})
    value = metrics.get(f"bubble/dp_{method}")
    if value is None and row.get("step_time", "wall") == method:
        value = metrics.get("bubble/dp")
    record = row.get("record")
    if value is None and record is not None:  # a step with a timeline: recompute
        busy = np.asarray(record["busy"], dtype=np.float64)
        wall = float(max(record["wall"])) if record.get("wall") else 0.0
        step_time = replay_step_time(busy, np.asarray(record["leader"])) if method == "replay" else wall
        value = bubble_dp(busy, step_time)
    return float(value) if value is not None and np.isfinite(value) else None


def layout_of(rows: list[dict[str, Any]]) -> RunLayout | None:
    """The layout of the run's last recorded step (``None`` in records written before layouts were)."""
    found = [r["layout"] for r in rows if r.get("layout")]
    return RunLayout.from_json(found[-1]) if found else None


def pipeline_note(rows: list[dict[str, Any]]) -> str:
    """``"measured, P=2"``, or ``"projected, P=4"`` for a run without pipeline stages (whose ``bubble/pp`` is what 1F1B
    over P stages would leave idle with its microbatch times); ``"projected"`` where P was not recorded."""
    found = [r["pipeline"] for r in rows if r.get("pipeline")]
    if found:
        last = found[-1]
        return f"{'measured' if last.get('measured') else 'projected'}, P={int(last['stages'])}"
    staged = [r["metrics"]["plan/pipeline_stages"] for r in rows if "plan/pipeline_stages" in r.get("metrics", {})]
    return f"measured, P={int(staged[-1])}" if staged else "projected"


def calibration_note(rows: list[dict[str, Any]]) -> str:
    """``"calibration off"``, ``"calibrated"``, ``"calibrated from step k"`` (a run that turned it on when resumed),
    or ``""`` where the records do not say."""
    said = [(int(r["step"]), bool(r["calibrated"])) for r in rows if "calibrated" in r]
    if not said:
        return ""
    if not any(on for _, on in said):
        return "calibration off"
    if all(on for _, on in said):
        return "calibrated"
    first = next(step for step, on in said if on)
    return f"calibrated from step {first}"


def cp_degrees(rows: list[dict[str, Any]]) -> tuple[int, int] | None:
    """The smallest and largest CP degree a group had in the run (``cp/degree_hist/<d>`` metrics)."""
    prefix = "cp/degree_hist/"
    found = {int(k[len(prefix) :]) for r in rows for k in r.get("metrics", {}) if k.startswith(prefix)}
    return (min(found), max(found)) if found else None


def position_labels(n: int, layout: dict[str, Any] | RunLayout | None, stage: list[int] | None = None) -> list[str]:
    """Labels of a timeline's ``n`` rows: ranks without TP or stages; with TP, pool positions and the ranks of their
    TP group (``"pos 1 (ranks 2-3)"``); with stages, each row's stage.

    Args:
        n: Rows of the timeline (the stages' pool positions).
        layout: The run's layout (:meth:`RunLayout.to_json` or the layout itself; ``None``: ranks).
        stage: Every row's pipeline stage (``None``: rows in stage order).
    """
    if isinstance(layout, dict):
        layout = RunLayout.from_json(layout)
    if layout is None or (layout.tensor == 1 and layout.stages == 1):
        return [f"rank {j}" for j in range(n)]
    pool = max(1, n // layout.stages)
    labels = []
    for j in range(n):
        s = int(stage[j]) if stage is not None else j // pool
        i = j - s * pool
        where = f"stage {s} " if layout.stages > 1 else ""
        if layout.tensor > 1:
            ranks = layout.position_ranks(i, s)
            labels.append(f"{where}pos {i} (ranks {ranks[0]}-{ranks[-1]})")
        else:
            labels.append(f"rank {j} ({where}pos {i})")
    return labels
