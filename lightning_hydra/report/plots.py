"""Figures of the dashboard (matplotlib, headless): metric time series of several runs, and step timelines."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from lightning_hydra.metrics.loads import LOSS_WINDOW, replay_step_time
from lightning_hydra.report.runs import calibration_note, dp_bubble, method_switches, pipeline_note, resumes

__all__ = ["SERIES", "save", "series_figure", "timeline_figure"]

SERIES: tuple[tuple[str, str], ...] = (
    ("bubble/dp", "DP bubble (share of rank-time waiting)"),
    ("bubble/pp", "pipeline bubble (measured with stages; without: projected at P)"),
    ("balance/max_over_mean", "busy time max / mean over ranks"),
    ("throughput/tokens_per_s", "throughput (trained tokens / s)"),
    ("cost_model/error", "cost-model error (relative)"),
    ("loss", "training loss"),
)
"""The time series of the dashboard: ``(metric, title)``."""

_FLOORS = {"bubble/pp": "bubble/pp_min"}
"""Metrics drawn with their floor (dashed): the pipeline bubble of equally long microbatches."""

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def series_figure(runs: dict[str, list[dict[str, Any]]], metric: str, title: str) -> Figure:
    """One metric over steps, one line per run (runs are named, e.g. by policy), with each run's resumes marked
    (dashed vertical lines).

    The DP bubble is drawn under one step time per run (:func:`~lightning_hydra.report.runs.dp_bubble`; the other,
    where recorded, dotted), and a change of step time between steps is marked (dotted vertical line). The pipeline
    bubble's label says whether it was measured or projected at an assumed depth, the cost-model error's whether the
    run calibrated.

    Args:
        runs: ``name -> rows`` of ``hydra_steps.jsonl``.
        metric: A metric name, or ``"loss"``.
        title: Axis title.
    """
    fig = _figure(6.4, 3.2)
    ax = fig.subplots()
    for k, (name, rows) in enumerate(runs.items()):
        color = _COLORS[k % len(_COLORS)]
        note = ""
        if metric == "bubble/dp":
            bubble = dp_bubble(rows)
            pairs = bubble.values
            note = f", {bubble.method} step time"
            if bubble.other:
                xs, ys = zip(*bubble.other, strict=True)
                ax.plot(xs, ys, linestyle=":", color=color, alpha=0.6, label=f"{name}: {bubble.other_method} step time")
            for step, before, after in method_switches(rows):
                ax.axvline(step - 0.5, linestyle=":", color=color, alpha=0.8, label=f"{name}: {before} -> {after}")
        else:
            pairs = []
            for row in rows:
                value = row.get("loss") if metric == "loss" else row["metrics"].get(metric)
                if value is not None and np.isfinite(value):
                    pairs.append((row["step"], value))
            note = f", {pipeline_note(rows)}" if metric in ("bubble/pp", "bubble/pp_min") else ""
            calibration = calibration_note(rows) if metric == "cost_model/error" else ""
            note += f", {calibration}" if calibration else ""
        if pairs:
            steps, values = zip(*pairs, strict=True)
            med = float(np.median(values))
            ax.plot(steps, values, marker=".", color=color, label=f"{name} (median {med:.3g}{note})")
            if metric == "loss" and len(values) > 1:  # one step's loss follows its batch's documents
                mean = [float(np.mean(values[max(0, k - LOSS_WINDOW + 1) : k + 1])) for k in range(len(values))]
                ax.plot(
                    steps, mean, linestyle="--", color=color, alpha=0.7, label=f"{name}: mean of {LOSS_WINDOW} steps"
                )
        for n, step in enumerate(resumes(rows)):
            ax.axvline(step - 0.5, linestyle="--", color=color, alpha=0.6, label=f"{name}: resumed" if not n else None)
        floor = [(row["step"], row["metrics"].get(_FLOORS[metric])) for row in rows if metric in _FLOORS]
        floor = [(x, y) for x, y in floor if y is not None and np.isfinite(y)]
        if floor:
            xs, ys = zip(*floor, strict=True)
            ax.plot(xs, ys, linestyle="--", color=color, alpha=0.6, label=f"{name}: minimum (equal microbatches)")
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="#888")
    fig.tight_layout()
    return fig


def timeline_figure(record: dict[str, Any], title: str = "", labels: list[str] | None = None) -> Figure:
    """Rank x time chart of one step: each pool position's microbatches (busy) and the gaps where it waits.

    Busy times are the measured ones; their placement in time is replayed from the plan (a group starts a
    microbatch when all its members finished the previous one), so the chart shows the schedule's waiting even on
    a host that time-slices several ranks per core.

    Args:
        record: ``StepRecord.to_json()``.
        title: Figure title.
        labels: One label per row (default ``"rank r"``; under TP a row is a pool position, a TP group:
            :func:`~lightning_hydra.report.runs.position_labels`).
    """
    busy = np.asarray(record["busy"], dtype=np.float64)
    leader = np.asarray(record["leader"], dtype=np.int64)
    degree = np.asarray(record["degree"], dtype=np.int64)
    m_count, n = busy.shape
    fig = _figure(8.0, 0.45 * n + 1.6)
    ax = fig.subplots()
    finish = np.zeros(n)
    for m in range(m_count):
        start = finish.copy()
        for lead in np.unique(leader[m]):
            members = leader[m] == lead
            start[members] = finish[members].max()
        color = _COLORS[m % len(_COLORS)]
        for r in range(n):
            if busy[m, r] > 0:
                ax.barh(r, busy[m, r], left=start[r], color=color, edgecolor="white", height=0.8)
                if busy[m, r] > 0.06 * max(replay_step_time(busy, leader), 1e-12):
                    ax.text(
                        start[r] + busy[m, r] / 2,
                        r,
                        f"mb{m} d{degree[m, r]}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        finish = start + busy[m]
    end = float(finish.max()) if n else 0.0
    for r in range(n):
        if end > finish[r]:
            ax.barh(r, end - finish[r], left=finish[r], color="#dddddd", hatch="//", edgecolor="#aaaaaa", height=0.8)
    waiting = 1.0 - busy.sum() / (n * end) if end > 0 else 0.0
    handles = [Patch(color=_COLORS[m % len(_COLORS)], label=f"microbatch {m}") for m in range(min(m_count, 6))]
    handles.append(Patch(facecolor="#dddddd", hatch="//", edgecolor="#aaaaaa", label=f"waiting ({waiting:.1%})"))
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(len(handles), 4))
    ax.set_yticks(range(n), labels if labels is not None else [f"rank {r}" for r in range(n)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (busy time, replayed in plan order)")
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    return fig


def _figure(width: float, height: float) -> Figure:
    """A figure on its own Agg canvas (no pyplot: no global backend or figure registry is touched)."""
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Any) -> None:
    """Write a figure as PNG."""
    fig.savefig(path, format="png")
