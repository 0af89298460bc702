"""What a run prints: Lightning's progress bars and model summaries without meaningless fields, and known noise
filtered where it arises.

:func:`adapt_console` (called by :class:`~lightning_hydra.HydraStrategy` when it connects a model) turns the
trainer's own progress bar and model summary into the subclasses below, keeping their settings:

- no ``v_num`` (the logger's version number is in the run's directory name, not a metric);
- no ``Epoch 0/-2`` when training is bounded by ``max_steps`` (Lightning prints ``max_epochs - 1`` = ``-2``);
- no ``FLOPs`` column and ``Total FLOPs: 0`` (Lightning counts FLOPs only with an ``example_input_array``, which
  a module trained on planned microbatches has no use for).

:func:`quiet_known_noise` filters messages that say nothing about the user's configuration, each by its exact text:
Lightning 2.6's use of a ``torch.utils._pytree`` class that torch 2.13 deprecates, the advertisements for cloud
services printed when a Trainer is built, and ``ModelCheckpoint``'s advice for manual optimization (a
:class:`~lightning_hydra.HydraModule` steps its optimizer once per global batch, after every microbatch's backward,
so the checkpoint after the step is the exact training state).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override

__all__ = [
    "HydraModelSummary",
    "HydraRichModelSummary",
    "HydraRichProgressBar",
    "HydraTQDMProgressBar",
    "adapt_console",
    "progress",
    "quiet_known_noise",
]

NOISE_WARNINGS = (
    (FutureWarning, r".*isinstance\(treespec, LeafSpec\)` is deprecated"),
    (UserWarning, r"Using ModelCheckpoint with manual optimization and every_n_train_steps"),
)
"""``(category, message regex)`` of the warnings :func:`quiet_known_noise` ignores."""

NOISE_LOG_PREFIXES = ("💡 Tip: For seamless cloud",)
"""Starts of Lightning's info messages that :func:`quiet_known_noise` drops."""


class _DropMessages(logging.Filter):
    """A logging filter dropping records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__("lightning_hydra.noise")
        self.prefixes = prefixes

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


def quiet_known_noise() -> None:
    """Filter the messages listed in :data:`NOISE_WARNINGS` and :data:`NOISE_LOG_PREFIXES` in this process
    (idempotent; every other warning still shows)."""
    for category, message in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages(NOISE_LOG_PREFIXES))


def _without_version(items: dict[str, Any]) -> dict[str, Any]:
    items.pop("v_num", None)
    return items


def _train_description(trainer: pl.Trainer) -> str:
    """``Epoch e``, and ``Epoch e/E`` only when a number of epochs bounds the run (Lightning sets ``max_epochs=-1``
    when ``max_steps`` does, and would print ``Epoch 0/-2``)."""
    text = f"Epoch {trainer.current_epoch}"
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        text += f"/{trainer.max_epochs - 1}"
    return text


class HydraRichProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` without ``v_num`` and with a truthful description (see the module doc)."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        text = _train_description(self.trainer)
        if len(self.validation_description) > len(text):  # as Lightning: equal widths avoid flicker
            text = f"{text:{len(self.validation_description)}}"
        return text


class HydraTQDMProgressBar(TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` without ``v_num``."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))


def _drop_flops(summary_data: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    return [(name, column) for name, column in summary_data if name != "FLOPs"]


class HydraModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` without the FLOPs column and total when nothing was counted."""

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            ModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
            )
            return
        from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, 0, *_drop_flops(summary_data)
        )
        lines = [line for line in table.splitlines() if not line.rstrip().endswith("Total Flops")]
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("\n" + "\n".join(lines))


class HydraRichModelSummary(RichModelSummary):
    """Lightning's ``RichModelSummary`` without the FLOPs column and total when nothing was counted."""

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        from rich import get_console
        from rich.table import Table

        console = get_console()
        columns = _drop_flops(summary_data)
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        table.add_column(" ", style="dim")
        for name, _ in columns[1:]:
            table.add_column(name, justify="left" if name in ("Name", "Type", "Mode") else "right")
        for row in zip(*(column for _, column in columns), strict=True):
            table.add_row(*row)
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        lines = (
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
        )
        for label, value in lines:
            grid.add_row(f"[bold]{label}[/]: {value}")
        console.print(grid)


_ADAPTED = {
    RichProgressBar: HydraRichProgressBar,
    TQDMProgressBar: HydraTQDMProgressBar,
    ModelSummary: HydraModelSummary,
    RichModelSummary: HydraRichModelSummary,
}


def adapt_console(trainer: pl.Trainer | None) -> int:
    """Turn the trainer's Lightning progress bar and model summary (exactly those classes, configured or default)
    into the ``Hydra*`` subclasses of this module, keeping their settings; user subclasses are left alone.
    Call before training starts. Returns how many callbacks were adapted."""
    if trainer is None:
        return 0
    adapted = 0
    for callback in trainer.callbacks:
        target = _ADAPTED.get(type(callback))
        if target is not None:
            callback.__class__ = target  # the subclasses add no state: only what they print differs
            adapted += 1
    return adapted


@contextmanager
def progress(label: str, *, every: float = 10.0, stream: TextIO | None = None) -> Iterator[None]:
    """Say that a long task started, that it is still running every ``every`` seconds, and how long it took
    (to ``stream``, default stderr, so that machine-readable output on stdout stays clean).

    Args:
        label: What runs (``"planning 17,992 sequences on 2,048 ranks"``).
        every: Seconds between "still running" lines.
        stream: Where to write.
    """
    out = stream if stream is not None else sys.stderr
    print(f"{label} ...", file=out, flush=True)
    start = time.perf_counter()
    finished = threading.Event()

    def heartbeat() -> None:
        while not finished.wait(every):
            print(f"    ... still running ({time.perf_counter() - start:.0f} s)", file=out, flush=True)

    beat = threading.Thread(target=heartbeat, name="lightning-hydra-progress", daemon=True)
    beat.start()
    try:
        yield
    finally:
        finished.set()
        beat.join()
    print(f"{label}: done in {time.perf_counter() - start:.1f} s", file=out, flush=True)
