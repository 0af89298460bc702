"""BubbleMonitor and closed-loop calibration on a real 4-rank run (Lightning's multiprocessing launcher, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_hydra import BubbleMonitor, DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.metrics.monitor import RECORDS_FILE
from lightning_hydra.planner import CostModel
from lightning_hydra.planner.calibration import predict, relative_error
from lightning_hydra.report import render_report

LENGTHS = [900, 40, 600, 300, 120, 700, 60, 1000, 250, 30, 500, 80, 420, 150, 800, 20, 350, 640, 90, 200] * 4


def _dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (n,), generator=g) for n in LENGTHS]


def _model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(vocab_size=258, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, lr=1e-3)


class CostRecorder(pl.Callback):
    """Each rank writes the strategy's cost model and the monitor's history at the end of training, and per step the
    error ``baseline`` would have made on that step's own measured times."""

    def __init__(self, out: Path, baseline: CostModel) -> None:
        self.out = out
        self.baseline = baseline
        self.start: dict | None = None
        self.baseline_errors: list[float] = []

    def on_train_start(self, trainer, module) -> None:
        self.start = trainer.strategy.cost_model.to_dict()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        record = module.last_record  # the step's gathered measurements, as the monitor reads them
        features = record.features.reshape(-1, record.features.shape[-1])
        predicted = predict(self.baseline, features, includes_comm=record.includes_comm)
        self.baseline_errors.append(relative_error(predicted, record.busy))

    def on_train_end(self, trainer, module) -> None:
        monitor = next(c for c in trainer.callbacks if isinstance(c, BubbleMonitor))
        data = {"start": self.start, "end": trainer.strategy.cost_model.to_dict(), "history": monitor.history}
        data["baseline_errors"] = self.baseline_errors
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(data))


def _fit(tmp: Path, name: str, steps: int, cost: CostModel, ckpt_path: str | None = None) -> list[dict]:
    out = tmp / name
    out.mkdir()
    strategy = HydraStrategy(
        max_tokens_per_rank=1024,
        num_microbatches=2,
        ranks_per_node=2,
        start_method="forkserver",
        kernel="cpu",
        cost=cost,
        calibrate=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=steps,
        logger=CSVLogger(str(tmp), name=name),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[CostRecorder(out, cost), ModelCheckpoint(dirpath=str(tmp / "ckpt"), save_last=True)],
    )
    trainer.fit(_model(), HydraDataModule(_dataset(), global_batch_tokens=5000, seed=3), ckpt_path=ckpt_path)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(900)
def test_calibration_converges_from_a_three_x_wrong_start_and_survives_resume(tmp_path):
    analytic = _model().cost_model().replace(min_chunk_tokens=32)
    wrong = analytic.replace(linear=3 * analytic.linear)
    runs = _fit(tmp_path, "cal", 20, wrong)
    errors = [h["cost_model/error"] for h in runs[0]["history"]]
    wrong_errors = runs[0]["baseline_errors"]  # the wrong start's error on each step's own measured times
    assert len(errors) == len(wrong_errors) == 20
    # step 0 was planned with the wrong start: its logged error is the recomputed one (to 1%: the logged one reads the
    # plan's own predicted loads, the recomputed one the calibration's prediction from the step's features; 0.05%
    # apart here)
    assert errors[0] == pytest.approx(wrong_errors[0], rel=0.01)
    # The measured side is noisy: CPU thread times of 4 ranks time-sharing 2 cores vary with what the other ranks
    # and the rest of the machine run at the same moment (on a quiet machine the median error of the last 10 steps
    # is 0.07-0.10; under CI's load it reached 0.20). So no error bound is asserted: each step's error is set
    # against the wrong start's on the same step's times, which that step's load moves alike, and "calibrated" is
    # a step within the first half of the run at under a third of it, and the later steps at under a fifth.
    ratios = [e / w for e, w in zip(errors, wrong_errors, strict=True)]
    converged = [k for k, r in enumerate(ratios) if r < 1 / 3]
    assert converged and converged[0] <= 10, (errors, wrong_errors)
    assert float(np.median(ratios[-10:])) < 1 / 5, (errors, wrong_errors)
    assert all(r["baseline_errors"] == wrong_errors for r in runs)  # every rank measured the same (gathered) times
    # every rank refitted the same coefficients (the digests of later plans agreed, or the run would have failed)
    assert all(r["end"] == runs[0]["end"] for r in runs)
    assert runs[0]["end"] != wrong.to_dict()
    for name in ("bubble/dp", "bubble/pp", "balance/max_over_mean", "schedule/ms", "cp/comm_ms"):
        assert all(name in h for h in runs[0]["history"]), name

    # the records and the logger got the metrics; the dashboard renders from them
    records = list((tmp_path / "cal").rglob(RECORDS_FILE))
    assert len(records) == 1 and len(records[0].read_text().splitlines()) == 20
    # the logged balance is the one of the recorded per-rank busy times
    for row, logged in zip(map(json.loads, records[0].read_text().splitlines()), runs[0]["history"], strict=True):
        per_rank = np.asarray(row["record"]["busy"]).sum(axis=0)
        assert logged["balance/max_over_mean"] == pytest.approx(per_rank.max() / per_rank.mean(), rel=1e-9)
    metrics_csv = next((tmp_path / "cal").rglob("metrics.csv")).read_text().splitlines()[0]
    for name in ("bubble/dp", "cost_model/error", "throughput/tokens_per_s", "cp/degree_hist/1"):
        assert name in metrics_csv, name
    page = render_report([tmp_path / "cal"], tmp_path / "dash")
    assert page.exists() and "data:image/png;base64" in page.read_text()

    # resume: the calibrated model comes back from the checkpoint, not the wrong one given to the strategy
    resumed = _fit(tmp_path, "resume", 22, wrong, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed[0]["start"] == runs[0]["end"]


def test_single_process_run_draws_the_timeline_into_tensorboard(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = BubbleMonitor(pipeline_stages=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=TensorBoardLogger(str(tmp_path), name="tb"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[monitor],
    )
    trainer.fit(_model(), HydraDataModule(_dataset()[:10], global_batch_tokens=2000, seed=0))
    assert len(monitor.history) == 2
    assert all(h["balance/max_over_mean"] == pytest.approx(1.0) for h in monitor.history)  # one rank
    events = EventAccumulator(str(next((tmp_path / "tb").glob("version_*"))), size_guidance={"images": 0})
    events.Reload()
    assert "hydra/timeline" in events.Tags()["images"]
    assert "bubble/dp" in events.Tags()["scalars"]
    assert "2 steps" in monitor.summary()
