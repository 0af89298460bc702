"""``render_report``: a self-contained HTML dashboard (and PNGs) from the step records of one or more runs."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_hydra.metrics.record import RECORDS_FILE
from lightning_hydra.report.plots import SERIES, save, series_figure, timeline_figure
from lightning_hydra.report.runs import (
    calibration_note,
    cp_degrees,
    dp_bubble,
    layout_of,
    method_switches,
    pipeline_note,
    position_labels,
    resumes,
)

__all__ = ["find_runs", "load_run", "mixture_table", "render_report", "run_header", "summary_table"]

_SUMMARY = (
    ("balance/max_over_mean", "balance max/mean", "{:.3f}"),
    ("bubble/dp", "DP bubble", "{:.1%}"),
    ("bubble/pp", "PP bubble", "{:.1%}"),
    ("bubble/pp_min", "PP bubble minimum", "{:.1%}"),
    ("throughput/tokens_per_s", "tokens/s", "{:,.0f}"),
    ("schedule/ms", "schedule ms", "{:.1f}"),
    ("cost_model/error", "cost-model error", "{:.1%}"),
    ("cp/comm_ms", "CP comm ms", "{:.0f}"),
    ("monitor/overhead", "measuring overhead", "{:.2%}"),
)


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Every ``hydra_steps.jsonl`` under the given files or directories (sorted)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(p.rglob(RECORDS_FILE)))
    if not found:
        raise FileNotFoundError(f"no {RECORDS_FILE} under {[str(p) for p in paths]}: was BubbleMonitor enabled?")
    return found


SUMMARY_LEGEND = (
    ("layout", "the run's devices as DP x TP (x PP): DP is the pool of positions that dynamic CP plans over"),
    ("steps", "optimizer steps recorded"),
    ("balance max/mean", "the busiest rank's busy time over the mean (1.0 is perfect)"),
    (
        "DP bubble",
        "share of rank-time spent waiting in a step, on the step time in brackets: the wall clock, or the critical "
        "path replayed from busy times (hosts with more ranks than cores); one step time per run",
    ),
    (
        "PP bubble",
        "a pipelined run's measured 1F1B bubble; without stages, projected: the bubble a pipeline of depth P (4 by "
        "default) would have with these microbatch times (in brackets: measured or projected, and P)",
    ),
    (
        "PP bubble minimum",
        "the fill and drain idle time of the step's own microbatch times: a bound no 1F1B order goes below",
    ),
    ("tokens/s", "trained tokens per wall second"),
    ("schedule ms", "wall time of planning one global batch (in the data loader, ahead of the step)"),
    (
        "cost-model error",
        "relative error of the planner's predicted microbatch times (with calibration off, the analytic model's: "
        "typically 2-3x off on a CPU)",
    ),
    ("CP comm ms", "time per rank inside context-parallel collectives, waits included"),
    ("measuring overhead", "share of the step spent gathering measurements, calibrating and logging"),
)
"""What each column of :func:`summary_table` means (printed by ``lightning-hydra compare``, shown on the dashboard)."""


def _read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """``(name, rows)`` of one records file; the name is the policy and the run directory.

    A resumed run's records start with ``{"resumed_from": <records file>, "step": k}``: the parts are joined (the
    earlier part's steps before ``k``, then this part's), so a run interrupted and resumed reads as one. Where a
    step was recorded twice (a part ran past its last checkpoint), the later record wins.
    """
    rows = _read_rows(path)
    seen = {path.resolve()}
    while rows and "resumed_from" in rows[0]:
        head, rows = rows[0], rows[1:]
        previous = Path(head["resumed_from"])
        if previous.resolve() in seen or not previous.exists():
            break  # a loop, or the earlier part was moved: show what is here
        seen.add(previous.resolve())
        rows = [r for r in _read_rows(previous) if r.get("step", 0) < head["step"]] + rows
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "metrics" in row:
            by_step[int(row["step"])] = row
    if not by_step:
        raise ValueError(f"{path} holds no step")
    rows = [by_step[k] for k in sorted(by_step)]
    policy = rows[0].get("policy", "run")
    return f"{policy} ({path.parent.name})", rows


def summary_table(runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """Header and one row per run: its layout, then the median of each summary metric over the run's steps, each
    saying how it was obtained where that varies: the DP bubble's step time (one per run,
    :func:`~lightning_hydra.report.runs.dp_bubble`), the pipeline bubble measured or projected at ``P``, the
    cost-model error with calibration off."""
    table = [["run", "layout", "steps"] + [label for _, label, _ in _SUMMARY]]
    for name, rows in runs.items():
        layout = layout_of(rows)
        line = [name, layout.degrees() if layout is not None else "-", str(len(rows))]
        for metric, _, fmt in _SUMMARY:
            note = ""
            if metric == "bubble/dp":
                bubble = dp_bubble(rows)
                values = [v for _, v in bubble.values]
                note = f"{bubble.method} step time"
                if len(values) < len(rows):
                    note += f", {len(values)} of {len(rows)} steps"
            else:
                values = [r["metrics"][metric] for r in rows if metric in r["metrics"]]
                values = [v for v in values if v is not None and np.isfinite(v)]
                note = pipeline_note(rows) if metric in ("bubble/pp", "bubble/pp_min") else ""
                note = calibration_note(rows) if metric == "cost_model/error" else note
            cell = fmt.format(float(np.median(values))) if values else "-"
            line.append(f"{cell} ({note})" if values and note else cell)
        table.append(line)
    return table


def mixture_table(runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """Header and one row per source of every run that trained a blend (``HydraDataModule(sources=...)``): the
    weight asked (normalised), the share of the epoch's tokens realised up to the run's last step, and the tokens
    the run trained from it (from the ``data/weight/``, ``data/share/`` and ``data/tokens/`` metrics); only the
    header when no run blended sources."""
    table = [["run", "source", "weight asked", "share realised", "tokens trained"]]
    for name, rows in runs.items():
        metrics = [r["metrics"] for r in rows]
        sources = sorted({k.removeprefix("data/weight/") for m in metrics for k in m if k.startswith("data/weight/")})
        for source in sources:
            last = [m for m in metrics if f"data/share/{source}" in m]
            weight = last[-1].get(f"data/weight/{source}") if last else None
            share = last[-1][f"data/share/{source}"] if last else None
            tokens = sum(float(m.get(f"data/tokens/{source}", 0.0)) for m in metrics)
            table.append(
                [
                    name,
                    source,
                    "-" if weight is None else f"{float(weight):.1%}",
                    "-" if share is None else f"{float(share):.1%}",
                    f"{tokens:,.0f}",
                ]
            )
    return table


_STEP_TIMES = {"replay": "replayed step time (the critical path of busy times)", "wall": "wall-clock step time"}


def run_header(name: str, rows: list[dict[str, Any]]) -> str:
    """One line about a run for the dashboard's header: its layout (devices = DP x TP x PP, CP degrees inside the
    pool), the DP bubble's step time, calibration, and where it was resumed or changed step time."""
    layout = layout_of(rows)
    parts = [layout.describe("devices") if layout is not None else "layout not recorded"]
    degrees = cp_degrees(rows)
    if degrees is not None:
        low, high = degrees
        parts.append(f"CP degrees {low}-{high} per sequence inside the DP pool" if high > low else f"CP degree {low}")
    bubble = dp_bubble(rows)
    parts.append(f"DP bubble on the {_STEP_TIMES[bubble.method]}")
    calibration = calibration_note(rows)
    if calibration:
        parts.append(calibration)
    parts += [f"resumed at step {step}" for step in resumes(rows)]
    parts += [f"step time {before} -> {after} at step {step}" for step, before, after in method_switches(rows)]
    return f"{name}: " + "; ".join(parts)


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(path.stem)}">'


_STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; max-width: 1400px }
h1 { font-size: 22px } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd }
table { border-collapse: collapse; font-size: 13px }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: right }
td:first-child, th:first-child { text-align: left } th { background: #f3f3f3 }
.grid { display: flex; flex-wrap: wrap; gap: 8px } .grid img { width: 620px; border: 1px solid #eee }
.timeline { display: flex; flex-wrap: wrap; gap: 8px } .timeline img { width: 620px; border: 1px solid #eee }
p.note { font-size: 13px; color: #555; max-width: 900px }
"""


def render_report(paths: Sequence[str | Path], out_dir: str | Path, *, steps: Sequence[int] | None = None) -> Path:
    """Render ``out_dir/index.html`` (self-contained: images inlined) and the PNGs it shows.

    Args:
        paths: Run directories (searched for ``hydra_steps.jsonl``) or records files; several runs are overlaid.
        out_dir: Output directory (created).
        steps: Steps whose rank x microbatch timeline is drawn (default: the last recorded timeline of each run).

    Returns:
        The path of the HTML page.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in find_runs(paths):
        name, rows = load_run(path)
        runs[name] = rows
    series = []
    for metric, title in SERIES:
        png = out / f"{metric.replace('/', '_')}.png"
        save(series_figure(runs, metric, title), png)
        series.append(png)
    timelines = []
    for k, (name, rows) in enumerate(runs.items()):
        recorded = [r for r in rows if "record" in r]
        chosen = [r for r in recorded if steps is None or r["step"] in steps]
        if steps is None and recorded:
            chosen = [recorded[-1]]
        for row in chosen:
            png = out / f"timeline_{k}_step{row['step']}.png"
            record = row["record"]
            width = len(record["busy"][0]) if record["busy"] else 0
            labels = position_labels(width, row.get("layout"), record.get("stage"))
            save(timeline_figure(record, title=f"{name}: step {row['step']}", labels=labels), png)
            timelines.append(png)
    table = summary_table(runs)
    replayed = [name for name, rows in runs.items() if dp_bubble(rows).method == "replay"]
    replay_note = (
        f'<p class="note">Runs {", ".join(html.escape(n) for n in replayed)} ran more ranks than CPU cores: their DP '
        "bubble uses the step time replayed from the measured busy times (each rank on a core of its own), since the "
        "wall clock there measures the operating system's time slicing.</p>"
        if replayed
        else ""
    )
    headers = "".join(f"<li>{html.escape(run_header(name, rows))}</li>" for name, rows in runs.items())
    blend = mixture_table(runs)
    mixture = ""
    if len(blend) > 1:  # a run blended sources: the mixture realised against the one asked
        cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in blend[1:])
        mixture = (
            '<h2>Data mixture</h2><p class="note">Per source of a blend: its weight (normalised), its share of the '
            "epoch's tokens up to the last step, and the tokens trained from it.</p><table><tr>"
            + "".join(f"<th>{html.escape(c)}</th>" for c in blend[0])
            + f"</tr>{cells}</table>"
        )
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table[1:])
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>lightning-hydra dashboard</title>
<style>{_STYLE}</style></head><body>
<h1>lightning-hydra dashboard</h1>
<ul class="note">{headers}</ul>
<p class="note">{len(runs)} run(s). Medians over each run's steps. <b>Layout</b>: devices = DP x TP (x PP), DP being
the pool of positions (a position is a TP group under TP) that context parallelism is planned over. <b>DP
bubble</b>: share of rank-time spent waiting in a step, on one step time per run (in brackets); <b>PP bubble</b>:
the 1F1B bubble, measured in a pipelined run, and for a run without stages projected: what a pipeline of the assumed
depth P would have with these microbatch times (in brackets), beside its <b>minimum</b> for these microbatch times
(the idle time at the pipeline's ends; (P-1)/(M+P-1) when every microbatch is equally long); <b>balance</b>: the
busiest position's busy time over the mean; <b>cost-model error</b>: relative error of the planner's predicted
microbatch time (with calibration off, the analytic model's). Dashed vertical lines mark resumes; dotted ones a change
of step time.</p>
<table><tr>{head}</tr>{body}</table>
{replay_note}
{mixture}
<h2>Over training</h2><div class="grid">{"".join(_img(p) for p in series)}</div>
<h2>Pool position x microbatch timelines</h2>
<p class="note">One row per pool position (a rank; under TP a TP group, its ranks in brackets). Coloured: busy
(forward + backward of a microbatch, labelled with its CP degree); hatched grey: waiting for the slowest position
before the step's gradient sum.</p>
<div class="timeline">{"".join(_img(p) for p in timelines)}</div>
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index
