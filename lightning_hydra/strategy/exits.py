"""How a rank that ended without a Python error of its own is named: from the launching process's view of its
children.

A rank killed by a signal (``kill -9``, the out-of-memory killer, a segmentation fault) prints nothing; the ranks
still running see only a closed connection. The process that started the ranks (Lightning's script launcher, each
node's first process) holds their exit statuses, so it names the rank, its pid and how it ended, once:
``rank 1 (pid 4242) was killed by signal 9 (SIGKILL) during step 3``. A rank that exits with status 1 raised a
Python error and printed it itself (the ``lightning-hydra`` command's convention); it is not named again.

:class:`RankWatch` replaces Lightning's child-process observer: it polls the children every second (Lightning's
polls every 5), and when one has ended badly it says so before ending the others, as Lightning's does, with
SIGKILL (SIGTERM does not end a process blocked in a collective). The launching process's own failure, if the cause
is a rank that went away, becomes :class:`~lightning_hydra.errors.RankDiedError` naming that rank (see
:class:`~lightning_hydra.strategy.prelaunch.CheckedSubprocessLauncher`).

The launching process is itself a rank (local rank 0), and nobody holds *its* exit status: when it is killed, its
children are re-parented and would only meet a closed connection (gloo) or wait out the collective timeout (NCCL).
Each child therefore runs a :class:`LauncherWatch` on the process that started it (its pid travels in
:data:`LAUNCHER_PID_ENV`): when that process is gone, local rank 1 names it in one line
(``rank 0 (pid 4242), which launched this node's ranks, ended during step 3``) and every child ends itself. A
child's own error raised because the launching process went away is replaced by that line (the child waits up to
:data:`GRACE_SECONDS` for the watch to see it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from typing_extensions import override

__all__ = ["GRACE_SECONDS", "LAUNCHER_PID_ENV", "POLL_SECONDS", "LauncherWatch", "RankWatch", "exit_reason"]

LAUNCHER_PID_ENV = "LIGHTNING_HYDRA_LAUNCHER_PID"
"""Environment variable through which the ranks a launching process starts learn its pid."""

POLL_SECONDS = 1.0
"""How often :class:`RankWatch` looks at the ranks' exit statuses."""
GRACE_SECONDS = 5.0
"""After a rank exited with its own Python error, how long the launching process has to report its own failure
before the watch ends it (Lightning's observer waited as long, polling every 5 s)."""


def _when(trainer: Any) -> str:
    """`` during step N`` (or set-up, or another stage) from ``trainer``'s progress; empty without a trainer."""
    if trainer is None:
        return ""
    stage = getattr(trainer.state, "stage", None)
    if stage is None:
        return " during set-up"
    if stage.value == "train":
        return f" during step {trainer.global_step + 1}"
    return f" during {stage.value} (after step {trainer.global_step})"


def exit_reason(returncode: int | None) -> str | None:
    """How a child that ended with ``returncode`` ended, where that needs saying: ``None`` while it runs, when it
    succeeded (0) or when it printed its own Python error (1)."""
    if returncode is None or returncode in (0, 1):
        return None
    if returncode < 0:
        number = -returncode
        try:
            name = f" ({signal.Signals(number).name})"
        except ValueError:
            name = ""
        return f"was killed by signal {number}{name}"
    return f"exited with status {returncode} without a Python error"


class RankWatch(_ChildProcessObserver):
    """Watches the ranks a launching process started; names the first one that ended badly, once, and ends the
    others (see the module documentation)."""

    def __init__(self, children: list[subprocess.Popen], *, first_rank: int, trainer: Any = None) -> None:
        """Build the watch (``start()`` it).

        Args:
            children: The started ranks, in local-rank order from local rank 1.
            first_rank: Global rank of the first child.
            trainer: The trainer, whose progress dates the failure (``None``: undated).
        """
        super().__init__(os.getpid(), children, sleep_period=POLL_SECONDS)  # type: ignore[arg-type]
        self.first_rank = first_rank
        self.trainer = trainer
        self._lock = threading.Lock()
        self._said = False
        self._stopped = False

    def death(self, wait: float = 0.0, *, stop: bool = False) -> str | None:
        """The line naming the first rank that ended without a Python error, waiting up to ``wait`` seconds for
        one; ``None`` if there is none or it was named already (it is named once). ``stop``: the caller reports it
        (the watch then neither prints it nor ends this process)."""
        deadline = time.monotonic() + wait
        while True:
            for i, proc in enumerate(self._child_processes):
                reason = exit_reason(proc.poll())
                if reason is None:
                    continue
                with self._lock:
                    if self._said:
                        return None
                    self._said = True
                    self._stopped = self._stopped or stop
                return f"rank {self.first_rank + i} (pid {proc.pid}) {reason}{_when(self.trainer)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def stop(self, kill: bool = True) -> None:
        """Stop watching (the launching process reports the failure itself); ``kill``: end the ranks still
        running (they would only notice the failure at their next collective)."""
        with self._lock:
            self._stopped = True
        if kill:
            for proc in self._child_processes:
                if proc.poll() is None:
                    proc.send_signal(self._termination_signal)

    @override
    def _run(self) -> bool:
        if self._stopped:
            return True
        codes = [proc.poll() for proc in self._child_processes]
        if all(code == 0 for code in codes):
            return True
        if not any(codes):  # all running (or some done well)
            return False
        line = self.death()
        if line is not None:
            sys.stderr.write(f"lightning-hydra: stopped: {line}\n")
            sys.stderr.flush()
        else:  # a rank that raised and printed its error: this process may be saying its own, give it the time
            time.sleep(GRACE_SECONDS)
        with self._lock:
            if self._stopped:
                return True
        self._terminate_all()  # as Lightning's observer: the other ranks and this process, with SIGKILL
        return True


class LauncherWatch(threading.Thread):
    """Runs in a rank started by a launching process (a child of Lightning's script launcher) and ends this rank
    when the launching process is gone (see the module documentation)."""

    def __init__(self, launcher_pid: int, *, launcher_rank: int, local_rank: int, trainer: Any = None) -> None:
        """Build the watch (``start()`` it).

        Args:
            launcher_pid: Pid of the process that started this rank.
            launcher_rank: Global rank of that process (its node's local rank 0).
            local_rank: This rank's local rank; local rank 1 says the line, the others end quietly.
            trainer: The trainer, whose progress dates the line (``None``: undated).
        """
        super().__init__(daemon=True, name="lightning-hydra-launcher-watch")
        self.launcher_pid = launcher_pid
        self.launcher_rank = launcher_rank
        self.local_rank = local_rank
        self.trainer = trainer
        self._gone = threading.Event()
        self._ending = threading.Lock()

    def gone(self, wait: float = 0.0) -> bool:
        """Whether the launching process is gone, waiting up to ``wait`` seconds for the watch to see it."""
        return self._gone.wait(wait) if wait > 0 else self._gone.is_set() or not self._alive()

    def _alive(self) -> bool:
        return os.getppid() == self.launcher_pid  # a child whose parent ended is re-parented

    def line(self) -> str:
        """The line that names the launching process."""
        return (
            f"rank {self.launcher_rank} (pid {self.launcher_pid}), which launched this node's ranks, ended"
            f"{_when(self.trainer)}"
        )

    def end(self) -> None:
        """Say the line (local rank 1 only) and end this rank at once (a rank blocked in a collective cannot be
        ended more gently); a second caller waits for the first's exit."""
        self._ending.acquire()  # never released: this process ends here
        if self.local_rank == 1:
            sys.stderr.write(f"lightning-hydra: stopped: {self.line()}\n")
            sys.stderr.flush()
        os._exit(1)

    @override
    def run(self) -> None:
        while self._alive():
            time.sleep(POLL_SECONDS)
        self._gone.set()
        self.end()
