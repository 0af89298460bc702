"""The step metrics of DESIGN.md section 6, computed from a :class:`StepRecord` (pure numpy, same on every rank)."""

from __future__ import annotations

import numpy as np

from lightning_hydra.metrics.bubbles import pipeline_bubble
from lightning_hydra.metrics.record import StepRecord
from lightning_hydra.planner.calibration import relative_error

__all__ = ["balance", "bubble_dp", "degree_histogram", "replay_step_time", "step_metrics"]


def balance(busy: np.ndarray) -> float:
    """``max_r sum_m t[m, r] / mean_r sum_m t[m, r]`` (1.0 is perfect; ``nan`` when nobody worked)."""
    per_rank = np.asarray(busy, dtype=np.float64).sum(axis=0)
    mean = float(per_rank.mean())
    return float(per_rank.max() / mean) if mean > 0 else float("nan")


def replay_step_time(busy: np.ndarray, leader: np.ndarray) -> float:
    """Step time if every rank had a core of its own: replay the measured busy times in plan order.

    A group starts microbatch ``m`` when all its members finished ``m - 1`` (its collectives synchronise them) and
    each member then works for its own busy time; the step ends when the last rank finishes.

    Args:
        busy: ``[M, N]`` busy seconds.
        leader: ``[M, N]`` first rank of each rank's group (same leader, same group).
    """
    busy = np.asarray(busy, dtype=np.float64)
    finish = np.zeros(busy.shape[1])
    for m in range(busy.shape[0]):
        start = finish.copy()
        for lead in np.unique(leader[m]):
            members = leader[m] == lead
            start[members] = finish[members].max()
        finish = start + busy[m]
    return float(finish.max()) if finish.size else 0.0


def bubble_dp(busy: np.ndarray, step_time: float) -> float:
    """``1 - mean_r(sum_m t[m, r]) / S``: the share of rank-time spent waiting in a step of ``S`` seconds."""
    if step_time <= 0:
        return float("nan")
    return float(1.0 - np.asarray(busy, dtype=np.float64).sum(axis=0).mean() / step_time)


def degree_histogram(record: StepRecord) -> dict[int, int]:
    """Number of working groups at each CP degree in the step (idle groups excluded)."""
    hist: dict[int, int] = {}
    for m in range(record.num_microbatches):
        for lead in np.unique(record.leader[m]):
            members = record.leader[m] == lead
            if record.features[m, members, 2].max() > 0:  # the group holds sequences
                d = int(record.degree[m, members][0])
                hist[d] = hist.get(d, 0) + 1
    return dict(sorted(hist.items()))


def step_metrics(record: StepRecord, *, pipeline_stages: int = 4, replay: bool = False) -> dict[str, float]:
    """Every logged metric of one step (names as in DESIGN.md section 6).

    Args:
        record: The gathered measurements.
        pipeline_stages: Depth ``P`` of the projected pipeline bubble.
        replay: Use :func:`replay_step_time` as the step time ``S`` of ``bubble/dp`` instead of the measured wall
            time (for hosts running more ranks than cores, where the wall clock measures time slicing).
    """
    wall = float(record.wall.max())
    step_time = replay_step_time(record.busy, record.leader) if replay else wall
    per_mb = record.busy.max(axis=1)
    working = per_mb[per_mb > 0].tolist()
    out = {
        "balance/max_over_mean": balance(record.busy),
        "bubble/dp": bubble_dp(record.busy, step_time),
        "bubble/pp": pipeline_bubble(working, pipeline_stages) if working else float("nan"),
        "schedule/ms": record.schedule_ms,
        "cost_model/error": relative_error(record.predicted, record.busy),
        "cp/comm_ms": 1e3 * float(record.comm.sum(axis=0).mean()),
        "throughput/tokens_per_s": record.trained_tokens / wall if wall > 0 else float("nan"),
        "time/step_s": wall,
        "time/busy_s": float(record.busy.sum(axis=0).mean()),
        "plan/microbatches": float(record.num_microbatches),
    }
    for d, count in degree_histogram(record).items():
        out[f"cp/degree_hist/{d}"] = float(count)
    return out
