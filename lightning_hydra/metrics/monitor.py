"""``BubbleMonitor``: logs the bubble, balance, planning and cost-model metrics of every training step."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_hydra.errors import check_bool, check_choice, check_int
from lightning_hydra.metrics.loads import LOSS_WINDOW, step_metrics
from lightning_hydra.metrics.record import RECORDS_FILE, StepRecord
from lightning_hydra.planner.calibration import FITTED

__all__ = ["RECORDS_FILE", "BubbleMonitor"]

log = logging.getLogger(__name__)

_PROG_BAR = {"throughput/tokens_per_s": "tok/s", "bubble/dp": "dp_bubble"}


class BubbleMonitor(Callback):
    """Logs every metric of docs/design.md section 10 each training step, through the trainer's loggers.

    The measurements are gathered by the strategy (one collective per step, on every rank, through torchmetrics),
    so every rank computes and logs the same values; this callback runs no collective of its own. Global rank 0
    also appends each step to ``<log_dir>/hydra_steps.jsonl`` (the input of ``lightning-hydra report``) and, with a
    TensorBoard logger, draws the rank x microbatch timeline as an image.
    """

    def __init__(
        self,
        *,
        pipeline_stages: int = 4,
        step_time: Literal["auto", "wall", "replay"] = "auto",
        timeline_every_n_steps: int = 1,
        records: bool = True,
        dashboard: bool = False,
        prog_bar: bool = True,
    ) -> None:
        """Configure what is logged each step.

        Args:
            pipeline_stages: Pipeline depth ``P`` of the projected ``bubble/pp`` of a run without pipeline stages
                (a pipelined run measures its own bubble at its own depth).
            step_time: Step time ``S`` of ``bubble/dp``: the measured wall time (``"wall"``), the replayed critical
                path of the measured busy times (``"replay"``), or ``"auto"``: replay when the host runs more ranks
                than it has cores (CPU runs), where wall time measures the operating system's time slicing. A run
                resumed from a checkpoint keeps the method the run it continues used (``"auto"`` is decided once per
                run); every step records the bubble under both (``bubble/dp_wall``, ``bubble/dp_replay``).
            timeline_every_n_steps: Keep the full rank x microbatch measurements (timeline) every this many steps.
            records: Append every step to ``hydra_steps.jsonl`` in the first logger's directory (global rank 0; nothing
                is written without a logger).
            dashboard: Render the HTML dashboard into the log directory at the end of training (global rank 0).
            prog_bar: Show tokens/s and the DP bubble in the progress bar.
        """
        self.pipeline_stages = check_int("pipeline_stages", pipeline_stages, high=1 << 16)
        self.step_time = check_choice("step_time", step_time, ("auto", "wall", "replay"))
        self.timeline_every_n_steps = check_int("timeline_every_n_steps", timeline_every_n_steps)
        self.records = check_bool("records", records)
        self.dashboard = check_bool("dashboard", dashboard)
        self.prog_bar = check_bool("prog_bar", prog_bar)
        self.history: list[dict[str, float]] = []
        """The metrics of every step of this run (same on every rank)."""
        self.losses: list[float] = []
        """The train loss of every step of this run (same on every rank)."""
        self.overhead_seconds = 0.0
        """Wall seconds of this callback's last step (its share of the measurement overhead)."""
        self.records_path: Path | None = None
        """Where the step records are written (global rank 0), once training started."""
        self.resumed_from: Path | None = None
        """The records file of the run this one resumed (from the checkpoint), if any."""
        self.method: str | None = None
        """The step time ``bubble/dp`` uses in this run (``"replay"`` or ``"wall"``), once decided: at the first step,
        or from the checkpoint of the run this one continues."""
        self._resume_step = 0
        self._marked = False

    # ------------------------------------------------------------------ helpers
    def _replay(self, trainer: pl.Trainer) -> bool:
        if self.step_time != "auto":
            return self.step_time == "replay"
        if self.method is None:  # decided once per run: a resumed run keeps the method of the run it continues
            self.method = "replay" if getattr(trainer.strategy, "oversubscribed", False) else "wall"
        return self.method == "replay"

    @staticmethod
    def log_dir(trainer: pl.Trainer) -> Path:
        """The run's log directory (the first logger's, else the trainer's root directory).

        ``Trainer.log_dir`` broadcasts from rank 0: call this on every rank.
        """
        path = trainer.log_dir if trainer.loggers else None
        return Path(path or trainer.default_root_dir)

    def _write(self, trainer: pl.Trainer, record: StepRecord, metrics: dict[str, float], loss: float | None) -> None:
        assert self.records_path is not None
        self.records_path.parent.mkdir(parents=True, exist_ok=True)
        row: dict[str, Any] = {"step": record.step, "metrics": metrics, "loss": loss}
        strategy = trainer.strategy
        row["policy"] = getattr(getattr(strategy, "planner_config", None), "policy", "single")
        row["step_time"] = "replay" if self._replay(trainer) else "wall"
        layout = getattr(strategy, "run_layout", None)  # devices = DP x TP x PP (the dashboard's header, labels)
        if layout is not None:
            row["layout"] = layout.to_json()
        row["calibrated"] = bool(getattr(strategy, "calibrate", False))
        measured = "plan/pipeline_stages" in metrics
        depth = int(metrics["plan/pipeline_stages"]) if measured else self.pipeline_stages
        row["pipeline"] = {"stages": depth, "measured": measured}  # bubble/pp: measured, or projected at P
        if self._resume_step and not self._marked:  # the first step after a resume
            row["resumed"] = True
        self._marked = True
        if record.step % self.timeline_every_n_steps == 0:
            row["record"] = record.to_json()
        with open(self.records_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _tensorboard_timeline(self, trainer: pl.Trainer, record: StepRecord) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        boards = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not boards or record.step % self.timeline_every_n_steps:
            return
        from lightning_hydra.report.plots import timeline_figure

        fig = timeline_figure(record.to_json(), title=f"step {record.step}")
        for board in boards:
            board.experiment.add_figure("hydra/timeline", fig, global_step=record.step)

    def throughput(self) -> float:
        """Trained tokens per second over the steps so far (what the progress bar and the summary show)."""
        seconds = sum(h["time/step_s"] for h in self.history)
        tokens = sum(h["throughput/tokens_per_s"] * h["time/step_s"] for h in self.history)
        return tokens / seconds if seconds > 0 else float("nan")

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        path = str(self.records_path.resolve()) if self.records_path is not None else None
        return {"records_path": path, "step_time": self.method}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        path = state_dict.get("records_path")
        self.resumed_from = Path(path) if path else None
        if self.step_time == "auto" and state_dict.get("step_time") in ("replay", "wall"):
            self.method = state_dict["step_time"]  # the run this one continues decided it

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.history = []
        self.losses = []
        self._resume_step = int(trainer.global_step)
        self._marked = False
        if not self._resume_step:
            self.method = None  # a fresh run decides again
        if self._resume_step and self.method is not None and self.step_time == "auto":
            rank_zero_info(
                f"BubbleMonitor: resumed at step {self._resume_step}; bubble/dp keeps the {self.method} step time of "
                "the run it continues"
            )
        if not trainer.loggers:
            self.records_path = None  # no logger, no log directory: nothing is written
            return
        self.records_path = self.log_dir(trainer) / RECORDS_FILE  # on every rank: log_dir is a collective
        if not (trainer.is_global_zero and self.records):
            return
        if self.records_path.exists() and trainer.global_step == 0:
            self.records_path.unlink()  # a fresh run in a reused directory; a resumed run appends
        previous = self.resumed_from
        if trainer.global_step and previous is not None and previous != self.records_path.resolve():
            # a resumed run in a new log directory: its records start by naming the part they continue, so that
            # the dashboard and `lightning-hydra report` join the parts into one run
            self.records_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.records_path, "a") as f:
                f.write(json.dumps({"resumed_from": str(previous), "step": int(trainer.global_step)}) + "\n")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        record: StepRecord | None = getattr(pl_module, "last_record", None)
        if record is None:
            return
        start = time.perf_counter()
        metrics = step_metrics(record, pipeline_stages=self.pipeline_stages, replay=self._replay(trainer))
        strategy = trainer.strategy
        measure = getattr(strategy, "measure_seconds", 0.0) + self.overhead_seconds
        metrics["monitor/overhead"] = measure / metrics["time/step_s"] if metrics["time/step_s"] > 0 else 0.0
        cost = getattr(strategy, "cost_model", None) if getattr(strategy, "calibrate", False) else None
        if cost is not None:
            for name in FITTED:
                metrics[f"cost_model/{name}"] = float(getattr(cost, name))
        source_metrics = getattr(batch, "source_metrics", None)  # a blend's tokens per source (HydraDataModule)
        if callable(source_metrics):
            metrics.update(source_metrics())
        self.history.append(metrics)
        loss = trainer.callback_metrics.get("train/loss")  # the same on every rank (summed over the pool)
        if loss is not None:
            self.losses.append(float(loss))
            if self.prog_bar:
                recent = float(np.mean(self.losses[-LOSS_WINDOW:]))
                pl_module.log(
                    "loss_avg", recent, on_step=True, on_epoch=False, batch_size=1, prog_bar=True, logger=False
                )
        shown = dict(metrics, **{"throughput/tokens_per_s": self.throughput()})  # the bar: over the run so far
        for name, value in metrics.items():
            pl_module.log(name, float(value), on_step=True, on_epoch=False, batch_size=1, prog_bar=False)
            if self.prog_bar and name in _PROG_BAR:
                pl_module.log(
                    _PROG_BAR[name],
                    float(shown[name]),
                    on_step=True,
                    on_epoch=False,
                    batch_size=1,
                    prog_bar=True,
                    logger=False,
                )
        if trainer.is_global_zero:
            if self.records and self.records_path is not None:
                self._write(trainer, record, metrics, None if loss is None else float(loss))
            self._tensorboard_timeline(trainer, record)
        self.overhead_seconds = time.perf_counter() - start

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank_zero_info(self.summary(trainer))
        if self.dashboard and trainer.is_global_zero and self.records_path is not None:
            from lightning_hydra.report import render_report

            out = render_report([self.records_path], self.records_path.parent / "dashboard")
            rank_zero_info(f"lightning-hydra: dashboard written to {out}")

    def summary(self, trainer: pl.Trainer | None = None) -> str:
        """One line: tokens trained, median bubbles and balance, tokens per second over the run (as the progress bar
        shows), where the records are. The pipeline bubble is measured in a pipelined run, else a projection at
        ``pipeline_stages`` (said so); beside it its floor for the same steps' microbatch times (each step's
        ``bubble/pp`` is at least its ``bubble/pp_min``, so the median of one is at least the median of the
        other)."""
        if not self.history:
            return "lightning-hydra: no training step was measured"

        def median(name: str) -> float:
            values = [h[name] for h in self.history if name in h and np.isfinite(h[name])]
            return float(np.median(values)) if values else float("nan")

        tokens = sum(h["throughput/tokens_per_s"] * h["time/step_s"] for h in self.history)
        where = (
            f"; records {self.records_path} (lightning-hydra report {self.records_path.parent})"
            if (self.records_path)
            else ""
        )
        resumed = f" (resumed at step {self._resume_step})" if self._resume_step else ""
        staged = median("plan/pipeline_stages")  # a pipelined run measures its own depth
        if np.isfinite(staged):
            pp = f"bubble/pp (P={int(staged)}, measured)"
        else:
            pp = f"bubble/pp (projected for P={self.pipeline_stages}; no pipeline stages in this run)"
        paired = [h for h in self.history if np.isfinite(h.get("bubble/pp", np.nan) + h.get("bubble/pp_min", np.nan))]
        if paired:  # the same steps for both medians
            bubble, floor = (float(np.median([h[k] for h in paired])) for k in ("bubble/pp", "bubble/pp_min"))
            pp += f" {bubble:.3f} (minimum {floor:.3f} for these microbatch times)"
        else:
            pp += f" {median('bubble/pp'):.3f}"
        losses = ""
        if self.losses:
            window = self.losses[-LOSS_WINDOW:]
            losses = f"; train loss {np.mean(window):.3f} (mean of the last {len(window)} steps; last {window[-1]:.3f})"
            val = trainer.callback_metrics.get("val/loss") if trainer is not None else None
            losses += f", validation loss {float(val):.3f}" if val is not None else ""
        return (
            f"lightning-hydra: {len(self.history)} steps{resumed}, {tokens:,.0f} tokens trained; median "
            f"bubble/dp {median('bubble/dp'):.3f}, {pp}, balance {median('balance/max_over_mean'):.3f}{losses}; "
            f"{self.throughput():,.0f} tokens/s{where}"
        )
