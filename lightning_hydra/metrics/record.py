"""One optimizer step's measurements of every rank, gathered with torchmetrics.

Each rank adds its own row to a :class:`StepGather` metric (``dist_reduce_fx="cat"``: rows are all-gathered,
``N * K`` values per rank), so ``compute()`` returns the same ``[N, K]`` table on every rank. :class:`StepRecord`
unpacks it into arrays indexed ``[microbatch, rank]``; the metrics (:mod:`lightning_hydra.metrics.loads`), the
calibration and the dashboard read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchmetrics import Metric

from lightning_hydra.planner.calibration import NUM_FEATURES

__all__ = ["RECORDS_FILE", "StepGather", "StepRecord", "rank_row"]

RECORDS_FILE = "hydra_steps.jsonl"
"""File, in the run's log directory, holding one JSON line per step: its metrics and (some steps) the timeline."""

_PER_MB = 11 + NUM_FEATURES  # busy, comm, predicted, leader, degree, fwd, bwd, 4 span values, features...
_FEATURES = 11
_TAIL = 3  # wall, schedule_ms, stage


@dataclass
class StepRecord:
    """What every rank measured in one optimizer step (identical on every rank after the gather)."""

    step: int
    """Global step (optimizer steps done before this one)."""
    busy: np.ndarray
    """``[M, N]`` busy seconds of rank ``n`` in microbatch ``m`` (0: idle)."""
    comm: np.ndarray
    """``[M, N]`` seconds spent inside CP collectives (waits on slower members included)."""
    predicted: np.ndarray
    """``[M, N]`` the planning cost model's prediction of ``busy``."""
    leader: np.ndarray
    """``[M, N]`` first global rank of each rank's group (ranks with the same leader synchronise)."""
    degree: np.ndarray
    """``[M, N]`` CP degree of each rank's group."""
    features: np.ndarray
    """``[M, N, F]`` calibration features (:func:`lightning_hydra.planner.calibration.bin_features`)."""
    wall: np.ndarray
    """``[N]`` wall seconds of the step on each rank (from the plan check to the end of the gradient sum)."""
    schedule_ms: float
    """Milliseconds the slowest rank spent planning this global batch."""
    trained_tokens: int
    """Labelled tokens of the global batch."""
    includes_comm: bool
    """Whether ``busy`` includes communication and waits (CUDA events) or excludes them (CPU thread time)."""
    forward: np.ndarray | None = None
    """``[M, N]`` busy seconds of the forward alone (``busy`` is forward plus backward)."""
    backward: np.ndarray | None = None
    """``[M, N]`` busy seconds of the backward alone."""
    spans: np.ndarray | None = None
    """``[M, N, 4]`` forward start, forward end, backward start, backward end: wall seconds since the rank's step
    began (-1: not run; pipelined steps only)."""
    stage: np.ndarray | None = None
    """``[N]`` pipeline stage of every rank (all 0 without a pipeline)."""

    @property
    def stages(self) -> int:
        """Pipeline stages of the run."""
        return int(self.stage.max()) + 1 if self.stage is not None and self.stage.size else 1

    @property
    def num_microbatches(self) -> int:
        """``M``."""
        return int(self.busy.shape[0])

    @property
    def world_size(self) -> int:
        """``N``."""
        return int(self.busy.shape[1])

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the dashboard's timeline input)."""
        return {
            "step": self.step,
            "busy": self.busy.tolist(),
            "comm": self.comm.tolist(),
            "predicted": self.predicted.tolist(),
            "leader": self.leader.astype(int).tolist(),
            "degree": self.degree.astype(int).tolist(),
            "wall": self.wall.tolist(),
            "schedule_ms": self.schedule_ms,
            "trained_tokens": self.trained_tokens,
            "includes_comm": self.includes_comm,
            "forward": None if self.forward is None else self.forward.tolist(),
            "backward": None if self.backward is None else self.backward.tolist(),
            "spans": None if self.spans is None else self.spans.tolist(),
            "stage": None if self.stage is None else self.stage.astype(int).tolist(),
        }

    @classmethod
    def from_table(
        cls, table: np.ndarray, *, step: int, num_microbatches: int, trained_tokens: int, includes_comm: bool
    ) -> StepRecord:
        """Unpack the gathered ``[N, K]`` table of :func:`rank_row` rows."""
        n, m = table.shape[0], num_microbatches
        per = table[:, : m * _PER_MB].reshape(n, m, _PER_MB).transpose(1, 0, 2)  # [M, N, K]
        return cls(
            step=step,
            busy=per[..., 0].copy(),
            comm=per[..., 1].copy(),
            predicted=per[..., 2].copy(),
            leader=per[..., 3].astype(np.int64),
            degree=per[..., 4].astype(np.int64),
            features=per[..., _FEATURES:].copy(),
            wall=table[:, m * _PER_MB].copy(),
            schedule_ms=float(table[:, m * _PER_MB + 1].max()),
            trained_tokens=int(trained_tokens),
            includes_comm=includes_comm,
            forward=per[..., 5].copy(),
            backward=per[..., 6].copy(),
            spans=per[..., 7:11].copy(),
            stage=table[:, m * _PER_MB + 2].astype(np.int64),
        )


def rank_row(
    busy: list[float],
    comm: list[float],
    predicted: list[float],
    groups: list[tuple[int, int]],
    features: np.ndarray,
    wall: float,
    schedule_ms: float,
    *,
    forward: list[float] | None = None,
    backward: list[float] | None = None,
    spans: list[list[float]] | None = None,
    stage: int = 0,
) -> np.ndarray:
    """This rank's row of the gathered table: per microbatch ``busy, comm, predicted, leader, degree, forward,
    backward, 4 span values, features``, then ``wall, schedule_ms, stage``.

    Args:
        busy: Busy seconds per microbatch.
        comm: Seconds in CP collectives per microbatch.
        predicted: Predicted busy seconds per microbatch.
        groups: ``(leader rank, degree)`` of this rank's group per microbatch.
        features: ``[M, F]`` calibration features per microbatch.
        wall: Wall seconds of the step.
        schedule_ms: Milliseconds spent planning the global batch.
        forward: Busy seconds of each forward (default: unknown, 0).
        backward: Busy seconds of each backward (default: unknown, 0).
        spans: Per microbatch forward start/end and backward start/end (default: not recorded, -1).
        stage: This rank's pipeline stage.
    """
    m = len(busy)
    if not (len(comm) == len(predicted) == len(groups) == features.shape[0] == m):
        raise ValueError("every per-microbatch input needs one entry per microbatch")
    per = np.zeros((m, _PER_MB))
    per[:, 0], per[:, 1], per[:, 2] = busy, comm, predicted
    per[:, 3] = [g[0] for g in groups]
    per[:, 4] = [g[1] for g in groups]
    if forward is not None:
        per[:, 5] = forward
    if backward is not None:
        per[:, 6] = backward
    per[:, 7:11] = -1.0 if spans is None else np.asarray(spans, dtype=np.float64).reshape(m, 4)
    per[:, _FEATURES:] = features
    return np.concatenate([per.ravel(), [wall, schedule_ms, float(stage)]])


class StepGather(Metric):
    """Gathers one row per rank into an ``[N, K]`` table, identical on every rank after :meth:`compute`.

    The state is a list with this rank's row (``dist_reduce_fx="cat"``): the distributed sync all-gathers rows, so
    each rank receives ``N * K`` values (not an ``N x N x K`` one-hot table). Rows come back in rank order. Move the
    metric to the backend's device (``.to(root_device)``: nccl takes CUDA tensors only). Call :meth:`reset`
    before every step.
    """

    full_state_update = False

    def __init__(self, world_size: int, row_size: int, **kwargs: Any) -> None:
        """Args:
        world_size: Ranks taking part (rows).
        row_size: Values per row.
        **kwargs: Passed to ``torchmetrics.Metric`` (for example ``process_group``).
        """
        super().__init__(**kwargs)
        self.world_size = world_size
        self.row_size = row_size
        self.add_state("rows", default=[], dist_reduce_fx="cat")

    def update(self, row: np.ndarray | torch.Tensor) -> None:  # type: ignore[override]
        """Add this rank's row."""
        values = torch.as_tensor(np.asarray(row, dtype=np.float64), dtype=torch.float64, device=self.device)
        if values.numel() != self.row_size:
            raise ValueError(f"a row has {values.numel()} values, expected {self.row_size}")
        self.rows.append(values.reshape(1, -1))

    def compute(self) -> torch.Tensor:  # type: ignore[override]
        """The table of every rank's row, in rank order."""
        rows = self.rows
        table = torch.cat(rows, dim=0) if isinstance(rows, list) else rows
        table = table.reshape(-1, self.row_size)
        if table.shape[0] != self.world_size:
            raise RuntimeError(f"gathered {table.shape[0]} rows from a pool of {self.world_size} ranks")
        return table


def step_row(batch: Any, timing: Any, *, includes_comm: bool, offset: int = 0, stage: int = 0) -> np.ndarray:
    """This rank's :func:`rank_row` for a :class:`~lightning_hydra.data.packing.StepBatch` and its
    :class:`~lightning_hydra.metrics.timing.StepTiming`.

    The prediction of ``busy`` is the plan's: the whole predicted load when the timer includes communication,
    its compute part (load minus predicted communication) otherwise. Group leaders are global ranks (``offset``:
    the global rank of this stage's pool position 0).
    """
    features = np.asarray(batch.features, dtype=np.float64).reshape(-1, NUM_FEATURES)
    loads = np.asarray(batch.predicted_loads, dtype=np.float64)
    predicted = loads if includes_comm else loads - features[:, -1]
    groups = [(offset + mb.ranks[0], len(mb.ranks)) for mb in batch.microbatches]
    return rank_row(
        timing.busy,
        timing.comm,
        predicted.tolist(),
        groups,
        features,
        timing.wall,
        batch.schedule_ms,
        forward=timing.forward or None,
        backward=timing.backward or None,
        spans=timing.spans or None,
        stage=stage,
    )
