"""What runs print and record: one error said once across ranks, resumed runs joined into one record, no
misleading checkpoint warning, the pipeline bubble beside its floor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_hydra import BubbleMonitor, DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.cli import RECIPES
from lightning_hydra.metrics.monitor import RECORDS_FILE
from lightning_hydra.report import load_run, render_report

ROOT = RECIPES.parent

pytestmark = pytest.mark.usefixtures("isolated_process")  # in-process launches leave no trace


class OutOfVocabulary(torch.utils.data.Dataset):
    """40 byte sequences; every fifth holds token 300, outside the demo decoder's 258-token vocabulary. No
    ``lengths()``: the data module scans the lengths at set-up, and the bad ids surface only when a rank reads them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(0, 250, (int(n),), generator=g) for n in torch.randint(20, 200, (40,), generator=g)]
        for k in range(0, 40, 5):
            self.items[k][3] = 300

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


@pytest.mark.timeout(600)
def test_bad_token_ids_on_some_ranks_are_one_error_said_once(tmp_path):
    recipe = yaml.safe_load((RECIPES / "cpu-demo.yaml").read_text())
    trainer = recipe["trainer"]
    trainer.update(devices=2, max_steps=3, limit_val_batches=0, enable_progress_bar=False)
    trainer["logger"]["init_args"].update(save_dir=str(tmp_path), name="bad")
    trainer["callbacks"] = []
    trainer["strategy"]["init_args"].update(ranks_per_node=2, max_tokens_per_rank=512, calibrate=False)
    recipe["model"]["init_args"].update(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    recipe["data"] = {"train_dataset": {"class_path": "tests.test_output.OutOfVocabulary"}, "global_batch_tokens": 900}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_hydra", "fit", "--config", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=560, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("lightning-hydra: error: train item ")
    assert "holds token id 300, outside the model's vocabulary of 258 (ids 0..257)" in errors[0]
    assert "(found by rank" in errors[0]
    for noise in ("Traceback", "IndexError", "Connection closed by peer"):
        assert noise not in done.stderr


def _fit(tmp: Path, steps: int, ckpt_path: str | None = None) -> BubbleMonitor:
    monitor = BubbleMonitor(dashboard=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HydraStrategy(ranks_per_node=1, max_tokens_per_rank=2048, monitor=monitor),
        max_steps=steps,
        logger=CSVLogger(str(tmp), name="run"),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=str(tmp / "ckpt"), save_last=True, every_n_train_steps=1)],
    )
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 250, (n,), generator=g) for n in [300, 40, 700, 120, 90, 500, 60, 200] * 3]
    torch.manual_seed(0)
    model = DecoderLM(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    trainer.fit(model, HydraDataModule(data, global_batch_tokens=1000, seed=1), ckpt_path=ckpt_path)
    return monitor


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_the_same_records_and_dashboard(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, 2)
        resumed = _fit(tmp_path, 4, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    # no advice about manual optimization: a HydraModule steps once per global batch, the checkpoint is exact
    assert not [w for w in caught if "manual optimization" in str(w.message)], [str(w.message) for w in caught]
    first, second = (tmp_path / "run" / v / RECORDS_FILE for v in ("version_0", "version_1"))
    head = json.loads(second.read_text().splitlines()[0])
    assert head == {"resumed_from": str(first.resolve()), "step": 2}
    _, rows = load_run(second)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the parts joined, in order, once each
    assert "2 steps (resumed at step 2)" in resumed.summary()
    page = second.parent / "dashboard" / "index.html"  # the resumed run's dashboard shows the whole run
    assert page.exists() and "<td>4</td>" in page.read_text()
    rendered = render_report([second.parent], tmp_path / "report")
    assert rendered.exists()


def test_the_dashboard_and_summary_show_the_pipeline_bubble_floor(tmp_path):
    rows = []
    for step in range(3):
        metrics = {"bubble/pp": 0.62 + 0.01 * step, "bubble/pp_min": 0.6, "bubble/dp": 0.02, "time/step_s": 1.0}
        metrics.update({"throughput/tokens_per_s": 1000.0, "balance/max_over_mean": 1.01})
        rows.append({"step": step, "metrics": metrics, "loss": 5.0 - step, "policy": "hydra"})
    records = tmp_path / RECORDS_FILE
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = render_report([records], tmp_path / "dash").read_text()
    assert "<th>PP bubble minimum</th>" in html and "<td>60.0% (projected)</td>" in html  # no stages, P unrecorded
    assert "the idle time at the pipeline's ends" in " ".join(html.split())
    monitor = BubbleMonitor(pipeline_stages=4)
    monitor.history = [r["metrics"] for r in rows]
    projected = "bubble/pp (projected for P=4; no pipeline stages in this run) 0.630 (minimum 0.600 for these"
    assert projected in monitor.summary()
    monitor.history = [{**r["metrics"], "plan/pipeline_stages": 2.0} for r in rows]
    assert "bubble/pp (P=2, measured) 0.630 (minimum 0.600 for these microbatch times)" in monitor.summary()
    assert "; 1,000 tokens/s" in monitor.summary() and monitor.throughput() == pytest.approx(1000.0)
