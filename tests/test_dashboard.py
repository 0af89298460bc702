"""The dashboard of a resumed tensor-parallel run, from records built without training: resumes and the DP bubble's
step time are marked, one step time holds for the whole run, pool positions and the layout are named, the pipeline
bubble reads as a projection and the cost-model error says calibration was off."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lightning_hydra import BubbleMonitor
from lightning_hydra.metrics.record import RECORDS_FILE, StepRecord
from lightning_hydra.report import dashboard, load_run, render_report
from lightning_hydra.report.dashboard import run_header, summary_table
from lightning_hydra.report.plots import series_figure
from lightning_hydra.report.runs import dp_bubble, position_labels
from lightning_hydra.strategy.layout import RunLayout

LAYOUT = RunLayout(4, 2, 1, 4)  # 4 devices = DP 2 x TP 2: the records hold 2 pool positions


def _timeline(step: int) -> dict:
    """A step's record of 2 positions x 2 microbatches (position 1 waits 0.1 s in microbatch 1); wall 2 s, as
    on a host that time-slices 4 processes on 2 cores."""
    busy = [[0.5, 0.5], [0.5, 0.4]]
    return {
        "step": step, "busy": busy, "comm": [[0.0, 0.0]] * 2, "predicted": busy, "leader": [[0, 1], [0, 1]],
        "degree": [[1, 1], [1, 1]], "wall": [2.0, 2.0], "schedule_ms": 1.0, "trained_tokens": 1000,
        "includes_comm": False, "forward": None, "backward": None, "spans": None, "stage": [0, 0],
    }  # fmt: skip


def _row(step: int, step_time: str, *, both: bool, resumed: bool = False) -> dict:
    busy = np.asarray(_timeline(step)["busy"]).sum(axis=0).mean()
    replay, wall = 1 - busy / 1.0, 1 - busy / 2.0  # replayed critical path 1.0 s; wall clock 2.0 s
    metrics = {"bubble/dp": replay if step_time == "replay" else wall, "bubble/pp": 0.64, "bubble/pp_min": 0.6}
    metrics.update({"cost_model/error": 1.2, "balance/max_over_mean": 1.05, "cp/degree_hist/1": 4.0})
    metrics.update({"throughput/tokens_per_s": 500.0, "time/step_s": 2.0})
    if both:  # what the monitor records now: the bubble under both step times
        metrics.update({"bubble/dp_replay": replay, "bubble/dp_wall": wall})
    row = {"step": step, "metrics": metrics, "loss": 5.0 - 0.1 * step, "policy": "hydra", "step_time": step_time}
    row.update({"layout": LAYOUT.to_json(), "calibrated": False, "pipeline": {"stages": 4, "measured": False}})
    if step % 5 == 4:
        row["record"] = _timeline(step)
    if resumed:
        row["resumed"] = True
    return row


def _resumed_run(tmp: Path, *, both: bool) -> Path:
    """Steps 0-9 replayed (4 ranks on 2 cores), resumed at step 10 in a new log directory; the second part's rows
    say wall (what the monitor did before it kept the method of the run it continues)."""
    first, second = tmp / "version_0" / RECORDS_FILE, tmp / "version_1" / RECORDS_FILE
    for path in (first, second):
        path.parent.mkdir(parents=True)
    first.write_text("".join(json.dumps(_row(k, "replay", both=both)) + "\n" for k in range(10)))
    rows = [{"resumed_from": str(first.resolve()), "step": 10}]
    rows += [_row(k, "wall", both=both, resumed=k == 10) for k in range(10, 20)]
    second.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return second


@pytest.mark.parametrize("both", [True, False])
def test_a_resumed_run_keeps_one_step_time_and_says_which(tmp_path: Path, both: bool) -> None:
    """Records with both bubbles (the monitor's now) give the replayed one for every step; older records give it
    where a step's timeline allows recomputing it, and say how many steps that was."""
    name, rows = load_run(_resumed_run(tmp_path, both=both))
    bubble = dp_bubble(rows)
    assert bubble.method == "replay"
    expected = [s for s in range(20) if both or s < 10 or s % 5 == 4]
    assert [s for s, _ in bubble.values] == expected
    assert bubble.median() == pytest.approx(0.05)  # not the wall clock's 52.5% after the resume
    table = summary_table({name: rows})
    header, line = table[0], dict(zip(table[0], table[1], strict=True))
    assert header[:3] == ["run", "layout", "steps"] and line["layout"] == "DP 2 x TP 2"
    assert line["DP bubble"] == "5.0% (replay step time" + ("" if both else f", {len(expected)} of 20 steps") + ")"
    assert line["PP bubble"] == "64.0% (projected, P=4)" and line["PP bubble minimum"] == "60.0% (projected, P=4)"
    assert line["cost-model error"] == "120.0% (calibration off)"
    said = run_header(name, rows)
    assert said.startswith("hydra (version_1): 4 devices = DP 2 x TP 2 (1 node x 4 devices); CP degree 1; DP bubble ")
    assert "on the replayed step time (the critical path of busy times); calibration off" in said
    assert said.endswith("; resumed at step 10; step time replay -> wall at step 10")


def test_the_plots_mark_the_resume_and_the_switch_and_label_positions(tmp_path: Path, monkeypatch) -> None:
    second = _resumed_run(tmp_path, both=True)
    name, rows = load_run(second)
    legend = {
        metric: [t.get_text() for t in series_figure({name: rows}, metric, metric).axes[0].get_legend().get_texts()]
        for metric in ("bubble/dp", "bubble/pp", "cost_model/error", "loss")
    }
    assert legend["bubble/dp"] == [
        f"{name}: wall step time", f"{name}: replay -> wall", f"{name} (median 0.05, replay step time)",
        f"{name}: resumed",
    ]  # fmt: skip
    assert legend["bubble/pp"][0] == f"{name} (median 0.64, projected, P=4)"
    assert legend["cost_model/error"][0] == f"{name} (median 1.2, calibration off)"
    assert legend["loss"] == [f"{name} (median 4.05)", f"{name}: mean of 10 steps", f"{name}: resumed"]
    labels = []
    draw = dashboard.timeline_figure
    monkeypatch.setattr(dashboard, "timeline_figure", lambda *a, **kw: labels.append(kw["labels"]) or draw(*a, **kw))
    page = render_report([second], tmp_path / "dash").read_text()
    assert labels == [["pos 0 (ranks 0-1)", "pos 1 (ranks 2-3)"]]  # the last timeline, step 19
    assert "4 devices = DP 2 x TP 2 (1 node x 4 devices)" in page and "resumed at step 10" in page
    assert "<td>5.0% (replay step time)</td>" in page
    staged = position_labels(4, RunLayout(8, 2, 2, 4), [0, 0, 1, 1])
    assert staged == ["stage 0 pos 0 (ranks 0-1)", "stage 0 pos 1 (ranks 2-3)", "stage 1 pos 0 (ranks 4-5)",
                      "stage 1 pos 1 (ranks 6-7)"]  # fmt: skip
    assert position_labels(2, None) == ["rank 0", "rank 1"]


def test_the_monitor_keeps_the_step_time_of_the_run_it_resumes_and_records_what_the_dashboard_reads(tmp_path) -> None:
    host = SimpleNamespace(oversubscribed=False, calibrate=False, run_layout=LAYOUT)  # 2 ranks on 2 cores now
    host.planner_config = SimpleNamespace(policy="hydra")
    trainer = SimpleNamespace(strategy=host)
    resumed = BubbleMonitor()
    resumed.load_state_dict({"records_path": None, "step_time": "replay"})  # the run it continues: 4 on 2 cores
    assert resumed._replay(trainer) and resumed.state_dict()["step_time"] == "replay"
    fresh = BubbleMonitor()
    assert not fresh._replay(trainer)
    host.oversubscribed = True
    assert not fresh._replay(trainer)  # decided once per run
    resumed.records_path, resumed._resume_step = tmp_path / RECORDS_FILE, 10
    busy = np.asarray(_timeline(10)["busy"])
    record = StepRecord(10, busy, busy * 0, busy, np.asarray([[0, 1], [0, 1]]), np.ones_like(busy, dtype=int),
                        np.zeros((2, 2, 1)), np.asarray([2.0, 2.0]), 1.0, 1000, False)  # fmt: skip
    for step in (10, 11):
        record.step = step
        resumed._write(trainer, record, {"bubble/dp": 0.05}, 4.0)
    rows = [json.loads(line) for line in resumed.records_path.read_text().splitlines()]
    assert [r.get("resumed") for r in rows] == [True, None]  # the first step after the resume
    assert rows[0]["layout"] == {"devices": 4, "tp": 2, "pp": 1, "pool": 2, "ranks_per_node": 4}
    assert rows[0]["step_time"] == "replay" and rows[0]["calibrated"] is False
    assert rows[0]["pipeline"] == {"stages": 4, "measured": False}


def test_the_summary_shows_the_recent_train_loss_and_the_validation_loss() -> None:
    monitor = BubbleMonitor()
    monitor.history = [{"throughput/tokens_per_s": 1.0, "time/step_s": 1.0, "bubble/dp": 0.0, "bubble/pp": 0.6}] * 12
    monitor.losses = [9.0, 9.0] + [3.0] * 9 + [4.0]  # the last 10: nine at 3, one at 4
    trainer = SimpleNamespace(callback_metrics={"val/loss": 3.25})
    line = monitor.summary(trainer)
    assert "; train loss 3.100 (mean of the last 10 steps; last 4.000), validation loss 3.250; 1 tokens/s" in line


def test_the_dashboard_shows_a_blend_s_realised_mixture_against_the_asked_one(tmp_path: Path) -> None:
    """A run that trained a blend has a data-mixture table: each source's weight, its share of the epoch's tokens at
    the last step (not the first) and the tokens trained from it over the run; a run without a blend has none."""
    rows = []
    for step, (a, b) in enumerate([(300, 100), (250, 150), (280, 120)]):
        row = _row(step, "replay", both=True)
        row["metrics"].update({"data/tokens/web": a, "data/tokens/code": b, "data/weight/web": 0.7})
        row["metrics"].update({"data/weight/code": 0.3, "data/share/web": 0.75 - 0.02 * step})
        row["metrics"]["data/share/code"] = 0.25 + 0.02 * step
        rows.append(row)
    blend, plain = tmp_path / "blend" / RECORDS_FILE, tmp_path / "plain" / RECORDS_FILE
    for path, written in ((blend, rows), (plain, [_row(0, "replay", both=True)])):
        path.parent.mkdir()
        path.write_text("".join(json.dumps(r) + "\n" for r in written))
    table = dashboard.mixture_table({"blend": load_run(blend)[1]})
    assert table[1:] == [["blend", "code", "30.0%", "29.0%", "370"], ["blend", "web", "70.0%", "71.0%", "830"]]
    assert dashboard.mixture_table({"plain": load_run(plain)[1]}) == [table[0]]
    html = render_report([blend], tmp_path / "dash").read_text()
    assert "<h2>Data mixture</h2>" in html and "<td>71.0%</td>" in html
    assert "Data mixture" not in render_report([plain], tmp_path / "dash2").read_text()
