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
from lightning_hydra.report import render_report

LENGTHS = [900, 40, 600, 300, 120, 700, 60, 1000, 250, 30, 500, 80, 420, 150, 800, 20, 350, 640, 90, 200] * 4


def _dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (n,), generator=g) for n in LENGTHS]


def _model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(vocab_size=258, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, lr=1e-3)


class CostRecorder(pl.Callback):
    """Each rank writes the strategy's cost model and the monitor's history at the end of training."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.start: dict | None = None

    def on_train_start(self, trainer, module) -> None:
        self.start = trainer.strategy.cost_model.to_dict()

    def on_train_end(self, trainer, module) -> None:
        monitor = next(c for c in trainer.callbacks if isinstance(c, BubbleMonitor))
        data = {"start": self.start, "end": trainer.strategy.cost_model.to_dict(), "history": monitor.history}
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(data))


def _fit(tmp: Path, name: str, steps: int, cost, ckpt_path: str | None = None) -> list[dict]:
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
        callbacks=[CostRecorder(out), ModelCheckpoint(dirpath=str(tmp / "ckpt"), save_last=True)],
    )
    trainer.fit(_model(), HydraDataModule(_dataset(), global_batch_tokens=5000, seed=3), ckpt_path=ckpt_path)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(900)
def test_calibration_converges_from_a_three_x_wrong_start_and_survives_resume(tmp_path):
    analytic = _model().cost_model().replace(min_chunk_tokens=32)
    wrong = analytic.replace(linear=3 * analytic.linear)
    runs = _fit(tmp_path, "cal", 20, wrong)
    errors = [h["cost_model/error"] for h in runs[0]["history"]]
    assert len(errors) == 20
    assert errors[0] > 0.5, errors  # the start is visibly wrong (2.4 to 6 on this machine, by its load)
    # The measured side is noisy: CPU thread times of 4 ranks time-sharing 2 cores vary with what the other ranks
    # and the rest of the machine run at the same moment. On a quiet machine the median error of the last 10 steps
    # is 0.07-0.10 (single steps 0.01-0.25); under CI's load it reached 0.20 (single steps 0.13-0.34). So the bounds
    # below separate "calibrated" from "not calibrated" (the start is 10-50x further off), not one noise floor from
    # another: within the first half of the run a step below 20% error, and the later steps stay below 30%.
    converged = [k for k, e in enumerate(errors) if e < 0.2]
    assert converged and converged[0] <= 10, errors
    late = float(np.median(errors[-10:]))
    assert late < 0.3 and late < errors[0] / 3, errors
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
