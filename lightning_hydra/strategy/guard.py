"""``RunGuard``: how a run ends when it does not end normally.

**SIGTERM** (SLURM's signal before preemption or the time limit, ``kill``, ``torchrun`` stopping its workers).
Lightning 2.6's handler runs a ``broadcast`` inside the signal handler; a rank interrupted inside another collective
(a CP all-to-all, a ring step, the gradient sum) then posts a mismatched collective and every rank hangs. Here the
handler only records the signal (and forwards it to the ranks this process launched). At the next step boundary
(the end of a training or validation batch, where every rank is in the same place) the ranks agree with one
``all_reduce(MAX)`` of the flag; if any rank was signalled, all of them save a checkpoint (when a
``ModelCheckpoint`` is configured: ``<its dirpath>/last.ckpt``, which ``--ckpt_path last`` resumes) and stop with
exit status 143 (128 + SIGTERM) on each node's first process, 0 on the others. A watchdog ends the process after
``grace_seconds`` if no step boundary comes (a rank stuck in a collective with a vanished peer): never a hang.

**A run that fails before it starts** (bad data found at set-up, an error in ``configure_model``) leaves no empty
``version_N`` directory: global rank 0 removes the log directory it had just created, if it holds nothing but what
the loggers and the command line write at set-up.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
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
        self.requested = threading.Event()
        """Set when this process received SIGTERM."""
        self.checkpoint_path: Path | None = None
        """The checkpoint written when the run stopped on SIGTERM."""
        self._trainer: pl.Trainer | None = None
        self._started = False
        self._saving = threading.Event()
        self._done = threading.Event()

    # ------------------------------------------------------------------ the signal
    def _install(self, trainer: pl.Trainer) -> None:
        """Replace Lightning's SIGTERM handler (registered just before the run stage; restored at teardown)."""
        self._started = True
        self._trainer = trainer
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
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
        """At a step boundary: stop every rank if any received SIGTERM (one ``all_reduce`` per batch)."""
        strategy = trainer.strategy
        flag = torch.tensor([1 if self.requested.is_set() else 0], dtype=torch.int32, device=strategy.root_device)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return
        self.requested.set()
        checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        where = "; no checkpoint callback is configured: nothing was saved"
        if trainer.state.fn == TrainerFn.FITTING and checkpoints:
            cb = checkpoints[0]
            self.checkpoint_path = Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
            self._saving.set()
            try:
                trainer.save_checkpoint(self.checkpoint_path)  # every rank: the strategy writes on rank 0
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
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._done.set()
        if self._started or isinstance(exception, SIGTERMException) or not trainer.is_global_zero:
            return
        for path in remove_setup_only_dirs(trainer):
            log.debug("removed the empty run directory %s of a run that failed at set-up", path)
