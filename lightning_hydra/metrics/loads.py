"""The step metrics of docs/design.md section 10, computed from a :class:`StepRecord` (pure numpy, the same on every
rank)."""

from __future__ import annotations

import numpy as np

from lightning_hydra.metrics.bubbles import pipeline_bubble, pipeline_bubble_floor, replay_1f1b, stage_split
from lightning_hydra.metrics.record import StepRecord
from lightning_hydra.planner.calibration import relative_error

__all__ = [
    "LOSS_WINDOW",
    "balance",
    "bubble_dp",
    "degree_histogram",
    "measured_pipeline_bubble",
    "pipeline_replay",
    "projected_pipeline_bubble",
    "replay_step_time",
    "step_metrics",
]


LOSS_WINDOW = 10
"""Steps of the mean train loss that the progress bar (``loss_avg``), the run's summary line and the dashboard show
beside each step's: one step's loss follows its batch's documents (the demo's step 19, whose batch holds two
generated tables of the standard library, reads 4.27 after 2.97)."""


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


def pipeline_replay(record: StepRecord) -> float:
    """Makespan of a pipelined step if every rank had a core of its own: each rank's measured forward and backward
    busy times replayed in the 1F1B order of its stage, CP groups synchronised
    (:func:`~lightning_hydra.metrics.bubbles.replay_1f1b`)."""
    assert record.forward is not None and record.backward is not None and record.stage is not None
    return replay_1f1b(record.forward, record.backward, record.stages, record.leader)


def measured_pipeline_bubble(record: StepRecord, *, replay: bool) -> float:
    """``1 - busy / (ranks * makespan)`` of a pipelined step: the makespan replayed from busy times
    (:func:`pipeline_replay`, for hosts with more ranks than cores) or from the recorded wall spans."""
    assert record.forward is not None and record.backward is not None and record.spans is not None
    busy = float((record.forward + record.backward).sum())
    makespan = pipeline_replay(record) if replay else float(record.spans.max())
    return 1.0 - busy / (record.world_size * makespan) if makespan > 0 else float("nan")


def projected_pipeline_bubble(record: StepRecord) -> float:
    """The bubble a 1F1B schedule would have if microbatch ``m`` took ``sum_s max_(r in s) busy[m, r]`` over the
    stages (:func:`~lightning_hydra.metrics.bubbles.pipeline_bubble`): the projection from microbatch times that
    data-parallel runs report as ``bubble/pp``."""
    assert record.stage is not None
    stages = record.stages
    per_stage = [record.busy[:, record.stage == s].max(axis=1) for s in range(stages)]
    times = np.sum(per_stage, axis=0).tolist()
    return pipeline_bubble(times, stages) if any(t > 0 for t in times) else float("nan")


def step_metrics(record: StepRecord, *, pipeline_stages: int = 4, replay: bool = False) -> dict[str, float]:
    """Every logged metric of one step (names as in docs/design.md section 10).

    Args:
        record: The gathered measurements.
        pipeline_stages: Depth ``P`` of the projected pipeline bubble (a run without pipeline stages; a pipelined
            run measures its own).
        replay: Use :func:`replay_step_time` as the step time ``S`` of ``bubble/dp`` instead of the measured wall
            time (for hosts running more ranks than cores, where the wall clock measures time slicing).
            ``bubble/dp_wall`` and ``bubble/dp_replay`` hold the bubble under either step time.
    """
    wall = float(record.wall.max())
    replayed = replay_step_time(record.busy, record.leader)
    per_mb = record.busy.max(axis=1)
    working = per_mb[per_mb > 0].tolist()
    out = {
        "balance/max_over_mean": balance(record.busy),
        "bubble/dp": bubble_dp(record.busy, replayed if replay else wall),
        "bubble/dp_wall": bubble_dp(record.busy, wall),  # both step times, whichever bubble/dp uses: a dashboard
        "bubble/dp_replay": bubble_dp(record.busy, replayed),  # keeps one method over a run (a resumed one too)
        "schedule/ms": record.schedule_ms,
        "cost_model/error": relative_error(record.predicted, record.busy),
        "cp/comm_ms": 1e3 * float(record.comm.sum(axis=0).mean()),
        "throughput/tokens_per_s": record.trained_tokens / wall if wall > 0 else float("nan"),
        "time/step_s": wall,
        "time/busy_s": float(record.busy.sum(axis=0).mean()),
        "plan/microbatches": float(record.num_microbatches),
    }
    if record.stages > 1:  # measured
        stages = record.stages
        out["bubble/pp"] = measured_pipeline_bubble(record, replay=replay)
        out["bubble/pp_projected"] = projected_pipeline_bubble(record)
        out["bubble/pp_min"] = pipeline_bubble_floor(record.forward, record.backward, stages)
        out["plan/pipeline_stages"] = float(stages)
    elif working:  # projected for a pipeline of depth pipeline_stages
        out["bubble/pp"] = pipeline_bubble(working, pipeline_stages)
        out["bubble/pp_min"] = pipeline_bubble_floor(*stage_split(working, pipeline_stages), pipeline_stages)
    else:
        out["bubble/pp"] = out["bubble/pp_min"] = float("nan")
    for d, count in degree_histogram(record).items():
        out[f"cp/degree_hist/{d}"] = float(count)
    return out
