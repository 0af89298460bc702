"""A rank that ends without a Python error of its own (kill -9, the out-of-memory killer, a segfault) is named once,
with its pid and how it ended, by the process that launched it: on a real 4-rank CPU run and on plain children."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_hydra.strategy.exits import LauncherWatch, RankWatch, exit_reason
from tests.test_signals import ROOT, _alive, _recipe


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (None, None),
        (0, None),
        (1, None),  # its own Python error, printed by that rank
        (-9, "was killed by signal 9 (SIGKILL)"),
        (-11, "was killed by signal 11 (SIGSEGV)"),
        (137, "exited with status 137 without a Python error"),
    ],
)
def test_exit_reasons(code, said) -> None:
    assert exit_reason(code) == said


def _sleepers(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(count)]


def test_the_watch_names_the_dead_child_once_and_ends_the_others() -> None:
    children = _sleepers(3)
    try:
        trainer = SimpleNamespace(state=SimpleNamespace(stage=SimpleNamespace(value="train")), global_step=4)
        watch = RankWatch(children, first_rank=1, trainer=trainer)  # not started: the test polls it
        assert watch.death() is None  # all running
        children[1].send_signal(signal.SIGKILL)
        line = watch.death(wait=10.0, stop=True)
        assert line == f"rank 2 (pid {children[1].pid}) was killed by signal 9 (SIGKILL) during step 5"
        assert watch.death() is None  # named once
        assert watch._run() is True  # stopped: the launching process reports it, the watch ends nothing
        watch.stop(kill=True)
        assert [c.wait(timeout=10) for c in children] == [-9, -9, -9]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()


def _kill_a_rank_while_training(tmp_path: Path, local_rank: int) -> tuple[int, float, str, int]:
    """Start the CPU demo (4 ranks), kill -9 ``local_rank`` (0: the launching process) after the second step; return
    its pid, the seconds until no process of the run runs (60 at most), the run's stderr and the launcher's status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_hydra", "fit", "--config", str(_recipe(tmp_path))]
    records = tmp_path / "sigterm" / "version_0" / "hydra_steps.jsonl"
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        main = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=tmp_path, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while not (records.exists() and len(records.read_text().splitlines()) >= 2):
                assert main.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
                assert time.monotonic() < deadline, "the run did not reach its second step"
                time.sleep(0.5)
            victim = main.pid
            for pid in _alive(main.pid):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                rank = local_rank and f"LOCAL_RANK={local_rank}".encode() in environ
                if rank and b"lightning_hydra.planner.worker" not in command:
                    victim = pid
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            while (_alive(main.pid) or main.poll() is None) and time.monotonic() - killed < 60:
                time.sleep(0.2)
            took = time.monotonic() - killed
        finally:  # a failing test leaves no rank behind
            for pid in _alive(main.pid):
                os.kill(pid, signal.SIGKILL)
            main.wait(timeout=30)
    return victim, took, (tmp_path / "err.txt").read_text(), main.returncode


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.timeout(600)
def test_a_rank_killed_by_sigkill_is_named_in_one_line(tmp_path) -> None:
    victim, took, stderr, status = _kill_a_rank_while_training(tmp_path, local_rank=1)
    said = [line for line in stderr.splitlines() if line.startswith("lightning-hydra:")]
    assert len(said) == 1, stderr[-3000:]
    pattern = rf"lightning-hydra: stopped: rank 1 \(pid {victim}\) was killed by signal 9 \(SIGKILL\) during step \d+"
    assert re.fullmatch(pattern, said[0]), said
    assert "Traceback" not in stderr
    assert took < 30, f"ranks still running {took:.0f} s after the kill"
    assert status != 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.timeout(600)
def test_a_killed_launching_process_is_named_by_its_ranks_and_they_end(tmp_path) -> None:
    victim, took, stderr, status = _kill_a_rank_while_training(tmp_path, local_rank=0)
    said = [line for line in stderr.splitlines() if line.startswith("lightning-hydra:")]
    assert len(said) == 1, stderr[-3000:]
    pattern = (
        r"lightning-hydra: stopped: "
        rf"rank 0 \(pid {victim}\), which launched this node's ranks, ended during step \d+"
    )
    assert re.fullmatch(pattern, said[0]), said
    assert "Traceback" not in stderr
    assert took < 30, f"ranks still running {took:.0f} s after the kill"
    assert status == -signal.SIGKILL


def test_the_launcher_watch_sees_its_parent_go() -> None:
    """A rank's watch on the process that started it: alive while that is its parent, gone otherwise; the line is
    dated by the trainer."""
    assert not LauncherWatch(os.getppid(), launcher_rank=0, local_rank=1).gone()
    stranger = LauncherWatch(os.getppid() + 1, launcher_rank=4, local_rank=2)  # not this process's parent
    assert stranger.gone()
    stranger.trainer = SimpleNamespace(state=SimpleNamespace(stage=SimpleNamespace(value="train")), global_step=2)
    assert stranger.line() == f"rank 4 (pid {os.getppid() + 1}), which launched this node's ranks, ended during step 3"


def test_a_spawned_rank_that_died_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    from lightning_hydra import HydraStrategy
    from lightning_hydra.errors import RankDiedError

    def died(*args, **kwargs):  # what torch's join raises for a rank killed by a signal
        raise torch.multiprocessing.ProcessExitedException(
            "process 2 terminated with signal SIGKILL",
            error_index=2,
            error_pid=4321,
            exit_code=-9,
            signal_name="SIGKILL",
        )

    monkeypatch.setattr(_MultiProcessingLauncher, "launch", died)
    from lightning.fabric.plugins.environments import LightningEnvironment

    devices = [torch.device("cpu")] * 4
    strategy = HydraStrategy(start_method="spawn", parallel_devices=devices, cluster_environment=LightningEnvironment())
    strategy._configure_launcher()
    with pytest.raises(RankDiedError, match=r"^rank 2 \(pid 4321\) was killed by signal 9 \(SIGKILL\)$"):
        strategy.launcher.launch(lambda: None)
