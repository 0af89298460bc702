"""``RunGuard``: how a run ends when it does not end normally.

**SIGTERM** (SLURM's signal before preemption or the time limit, ``kill``, ``torchrun`` stopping its workers).
Lightning 2.6's handler runs a ``broadcast`` inside the signal handler; a rank interrupted inside another collective
(a CP all-to-all, a ring step, the gradient sum) then posts a mismatched collective and every rank hangs. Here the
handler only records the signal (and forwards it to the ranks this process launched). Under
:class:`~lightning_hydra.HydraStrategy` the flag travels in the next step's control all-reduce (the step's check, its
first operation: the plan digest and the data error and SIGTERM flags in one ``all_reduce``, read to the host once);
if any rank was signalled, every rank stops there, before anything else of that step runs (with another strategy the
ranks agree at the end of each training or validation batch with one ``all_reduce(MAX)`` of the flag): all of them
save a checkpoint (when a ``ModelCheckpoint`` is configured: ``<its dirpath>/last.ckpt``, which ``--ckpt_path last``
resumes; the state after the last whole step) and stop with exit status 143 (128 + SIGTERM) on each node's first
process, 0 on the others. Lightning's own per-batch broadcast of its SIGTERM flag (a collective and a host read at
every training batch, its flag never set once this handler replaced Lightning's) is turned off for the run. A
watchdog ends the process after ``grace_seconds`` if no step boundary comes: never a hang. Python runs a signal
handler only when the main thread returns to the interpreter, which a rank blocked inside a collective never does; the
watchdog is therefore woken through :func:`signal.set_wakeup_fd`, which the interpreter's C-level handler writes at
once, from any state.

**A run that fails before it starts** (bad data found at set-up, an error in ``configure_model``) leaves no empty
``version_N`` directory: global rank 0 removes the log directory it had just created, if it holds nothing but what
the loggers and the command line write at set-up.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_hydra.errors import check_number
from lightning_hydra.strategy.runtime import HydraRuntime

__all__ = ["SIGTERM_EXIT", "RunGuard", "remove_setup_only_dirs"]

log = logging.getLogger(__name__)

SIGTERM_EXIT = 128 + signal.SIGTERM
"""Exit status of a run stopped by SIGTERM (each node's first process)."""

_SETUP_FILES = re.compile(r"(config\.yaml|hparams\.yaml|metrics\.csv|events\.out\.tfevents\..+)")
"""What loggers and LightningCLI write into a run directory before training starts."""


def remove_setup_only_dirs(trainer: pl.Trainer) -> list[Path]:
    """Remove the log directories of the trainer's CSV and TensorBoard loggers that hold nothing but set-up files
    (call on global rank 0 when a run failed before its first step). Returns the removed directories."""
    removed = []
    for logger in trainer.loggers:
        if not isinstance(logger, (CSVLogger, TensorBoardLogger)) or getattr(logger, "_experiment", None) is None:
            continue  # another kind of logger, or one that never created its directory
        path = Path(logger.log_dir)
        if not path.is_dir():
            continue
        entries = list(path.iterdir())
        if not all(p.is_file() and _SETUP_FILES.fullmatch(p.name) for p in entries):
            continue
        metrics = path / "metrics.csv"
        if metrics.exists() and len(metrics.read_text().splitlines()) > 1:
            continue  # it logged something
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.close()
        logger._experiment = None  # finalize() (called after on_exception) is then a no-op: nothing is re-created
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class RunGuard(Callback):
    """Stops every rank together on SIGTERM (a checkpoint first when a checkpoint callback is configured), and
    removes the empty log directory of a run that fails at set-up. :class:`~lightning_hydra.HydraStrategy` adds
    one unless the trainer has one; see the module documentation."""

    def __init__(self, *, grace_seconds: float = 25.0) -> None:
        """Build the guard.

        Args:
            grace_seconds: After SIGTERM, how long to wait for a step boundary before the process exits without a
                checkpoint. Keep it below the cluster's time between SIGTERM and SIGKILL (SLURM's ``KillWait``,
                30 s by default).
        """
        self.grace_seconds = check_number("grace_seconds", grace_seconds, low=0.0, low_open=True)
        self.checkpoint_path: Path | None = None
        """The checkpoint written when the run stopped on SIGTERM."""
        self._reset()

    def _reset(self) -> None:
        self.requested = threading.Event()
        """Set when this process (or, after the step boundary, any rank) received SIGTERM."""
        self._trainer: pl.Trainer | None = None
        self._started = False
        self._saving = threading.Event()
        self._done = threading.Event()
        self._first = threading.Lock()
        self._wakeup: tuple[socket.socket, socket.socket] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (spawned ranks): the settings only; each process has its own events and signal state."""
        return {"grace_seconds": self.grace_seconds, "checkpoint_path": self.checkpoint_path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    # ------------------------------------------------------------------ the signal
    def _install(self, trainer: pl.Trainer) -> None:
        """Replace Lightning's SIGTERM handler (registered just before the run stage; restored at teardown) and
        listen to the interpreter's wake-up descriptor (only if nothing else does)."""
        self._started = True
        self._trainer = trainer
        if threading.current_thread() is not threading.main_thread():
            return
        runtime = getattr(trainer.strategy, "runtime", None)
        if isinstance(runtime, HydraRuntime):  # the steps' checks carry the flag; a check that finds it stops here
            runtime.stop_requested = self.requested
            runtime.stop = None if trainer.sanity_checking else functools.partial(self._stop, trainer)
            loop = trainer.fit_loop.epoch_loop
            if hasattr(loop, "_broadcast_sigterm_tensor"):  # Lightning >= 2.5: a broadcast and a read per batch
                loop._broadcast_sigterm_tensor = self._lightning_flag
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._wakeup is None:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            if signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False) != -1:
                signal.set_wakeup_fd(-1)  # another owner (an event loop): leave it, rely on the handler alone
                reader.close()
                writer.close()
                return
            self._wakeup = (reader, writer)
            threading.Thread(target=self._listen, args=(reader,), name="hydra-sigterm-listener", daemon=True).start()

    def _listening(self, trainer: pl.Trainer) -> HydraRuntime | None:
        """The strategy's runtime, if its steps' checks carry this guard's flag (a
        :class:`~lightning_hydra.HydraStrategy`'s), else ``None``."""
        runtime = getattr(trainer.strategy, "runtime", None)
        return runtime if isinstance(runtime, HydraRuntime) and runtime.stop_requested is self.requested else None

    def _lightning_flag(self) -> None:
        """Stands in for Lightning's per-batch broadcast of its SIGTERM flag: a flag Lightning's handler set before
        this guard replaced it is this guard's request (the step's check agrees on it)."""
        if self._trainer is not None and getattr(self._trainer, "received_sigterm", False):
            self._requested(signal.SIGTERM)

    def _uninstall(self) -> None:
        loop = getattr(getattr(self._trainer, "fit_loop", None), "epoch_loop", None)
        if loop is not None and vars(loop).get("_broadcast_sigterm_tensor") == self._lightning_flag:
            del loop._broadcast_sigterm_tensor  # Lightning's method again
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            for sock in self._wakeup:
                sock.close()
            self._wakeup = None

    def _listen(self, reader: socket.socket) -> None:
        """Thread: the signal numbers the interpreter's C-level handler writes (even while the main thread is
        blocked in a collective)."""
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._requested(signal.SIGTERM)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._requested(signum)

    def _requested(self, signum: int) -> None:
        """The first notice of SIGTERM (handler or listener): flag it, forward it, start the watchdog."""
        with self._first:
            if self.requested.is_set():
                return
            self.requested.set()
        trainer = self._trainer
        launcher = trainer.strategy.launcher if trainer is not None else None
        if isinstance(launcher, _SubprocessScriptLauncher):
            launcher.kill(signum)  # the ranks this process started stop at the same step boundary
        threading.Thread(target=self._watchdog, name="hydra-sigterm-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline or self._saving.is_set():
            if self._done.wait(0.2):
                return
        sys.stderr.write(
            f"lightning-hydra: SIGTERM: no step boundary within {self.grace_seconds:g} s; exiting without a "
            "checkpoint\n"
        )
        sys.stderr.flush()
        os._exit(SIGTERM_EXIT)

    def _agree_and_stop(self, trainer: pl.Trainer) -> None:
        """At a step's end, with a strategy whose steps do not carry the flag: stop every rank if any received
        SIGTERM (one ``all_reduce`` per batch). Under :class:`~lightning_hydra.HydraStrategy` nothing: the next
        step's check agrees on the flag and calls :meth:`_stop`."""
        if self._listening(trainer) is not None:
            return
        flag = torch.tensor(
            [1 if self.requested.is_set() else 0], dtype=torch.int32, device=trainer.strategy.root_device
        )
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            self._stop(trainer)

    def _stop(self, trainer: pl.Trainer) -> None:
        """Every rank, once the ranks agreed that one received SIGTERM (at a step's end, or in the next step's check
        before anything else of that step ran): save ``last.ckpt`` where a checkpoint callback is configured, then
        raise ``SIGTERMException`` (exit status 143 on each node's first process, 0 on the others)."""
        strategy = trainer.strategy
        self.requested.set()
        checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        where = "; no checkpoint callback is configured: nothing was saved"
        if trainer.state.fn == TrainerFn.FITTING and checkpoints:
            cb = checkpoints[0]
            self.checkpoint_path = Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
            self._saving.set()
            try:
                trainer.save_checkpoint(self.checkpoint_path)  # every rank: the strategy writes on rank 0
                wait = getattr(strategy, "wait_for_checkpoint", None)
                if callable(wait):  # an asynchronous save is written before the process exits
                    wait()
            finally:
                self._saving.clear()
            where = f"; checkpoint {self.checkpoint_path} (resume with --ckpt_path {self.checkpoint_path})"
        rank_zero_info(f"lightning-hydra: stopped by SIGTERM after step {trainer.global_step}{where}")
        self._done.set()
        raise SIGTERMException(SIGTERM_EXIT if trainer.local_rank == 0 else 0)

    # ------------------------------------------------------------------ hooks
    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._agree_and_stop(trainer)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self._agree_and_stop(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._done.set()
        self._uninstall()
        if self._started or isinstance(exception, SIGTERMException) or not trainer.is_global_zero:
            return
        for path in remove_setup_only_dirs(trainer):
            log.debug("removed the empty run directory %s of a run that failed at set-up", path)
