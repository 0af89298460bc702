"""SIGTERM (SLURM's signal before preemption) ends every rank of a real 4-rank CPU run promptly, with a checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lightning_hydra.cli import RECIPES

ROOT = RECIPES.parent


def _alive(group: int) -> list[int]:
    """Processes of a process group that are still running (zombies waiting to be reaped do not count)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if int(fields[2]) == group and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def _recipe(tmp: Path) -> Path:
    recipe = yaml.safe_load((RECIPES / "cpu-demo.yaml").read_text())
    trainer = recipe["trainer"]
    trainer.update(max_steps=500, enable_checkpointing=True, limit_val_batches=0, enable_progress_bar=False)
    trainer.pop("val_check_interval")
    trainer["logger"]["init_args"].update(save_dir=str(tmp), name="sigterm")
    trainer["callbacks"] = [
        {"class_path": "lightning_hydra.BubbleMonitor", "init_args": {"dashboard": False}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(tmp / "ckpt")}},
    ]
    recipe["model"]["init_args"].update(hidden_size=64, num_layers=2)
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _terminate_when_training(main: subprocess.Popen, tmp: Path) -> tuple[float, int | None]:
    """Wait for the second step's record, send SIGTERM to the launching process; return the seconds until no rank
    and no planning process runs (60 at most) and the exit status."""
    records = tmp / "sigterm" / "version_0" / "hydra_steps.jsonl"
    deadline = time.monotonic() + 400
    while not (records.exists() and len(records.read_text().splitlines()) >= 2):
        assert main.poll() is None, (tmp / "err.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run did not reach its second step"
        time.sleep(0.5)
    alive = _alive(main.pid)
    workers = [pid for pid in alive if b"lightning_hydra.planner.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    # the launching process and the three ranks it started, each rank with its planning process
    assert (len(alive) - len(workers), len(workers)) == (4, 4)
    sent = time.monotonic()
    main.send_signal(signal.SIGTERM)  # as `kill`; SLURM signals every rank, which works the same way
    # the launching process counts until it can be reaped: its main thread may show as a zombie in /proc while its
    # other threads still exit, and only then does it report its status
    while (_alive(main.pid) or main.poll() is None) and time.monotonic() - sent < 60:
        time.sleep(0.2)
    return time.monotonic() - sent, main.poll()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.timeout(600)
def test_sigterm_stops_every_rank_within_30_s_and_saves_a_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_hydra", "fit", "--config", str(_recipe(tmp_path))]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        main = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=tmp_path, env=env, start_new_session=True)
        try:
            took, code = _terminate_when_training(main, tmp_path)
        finally:  # a failing test leaves no rank behind
            for pid in _alive(main.pid):
                os.kill(pid, signal.SIGKILL)
            main.wait(timeout=30)
    stderr = (tmp_path / "err.txt").read_text()
    assert took < 30, f"ranks still running {took:.0f} s after SIGTERM"
    assert code == 143, stderr[-3000:]
    assert "lightning-hydra: stopped by SIGTERM after step" in stderr and "Traceback" not in stderr
    checkpoint = tmp_path / "ckpt" / "last.ckpt"
    assert checkpoint.exists()
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert state["global_step"] >= 2  # the steps done, the data position and the calibrated model: resumable
    assert state["HydraDataModule"]["step"] == state["global_step"] and "cost_model" in state["hydra"]


def test_sigterm_is_noticed_while_the_main_thread_cannot_run_python(monkeypatch):
    """A rank blocked inside a collective never returns to the interpreter, so a Python signal handler would not
    run; the guard's listener hears the interpreter's wake-up descriptor instead, and starts the watchdog."""
    from types import SimpleNamespace

    from lightning_hydra.strategy.guard import RunGuard

    guard = RunGuard(grace_seconds=1)
    started = []
    monkeypatch.setattr(guard, "_watchdog", lambda: started.append(True))  # never exit the test process
    previous = signal.getsignal(signal.SIGTERM)
    try:
        guard._install(SimpleNamespace(strategy=SimpleNamespace(launcher=None)))
        if guard._wakeup is None:
            pytest.skip("another owner holds the interpreter's wake-up descriptor")
        signal.signal(signal.SIGTERM, lambda *args: None)  # the Python-level handler never reaches the guard
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested.wait(5)
        deadline = time.monotonic() + 5
        while not started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started == [True]
    finally:
        guard._uninstall()
        signal.signal(signal.SIGTERM, previous)
