"""The projected pipeline bubble: a 1F1B schedule over measured (or predicted) microbatch times.

Microbatch ``m`` is taken to run ``times[m] / stages`` on every pipeline stage (the step's slowest rank sets it),
split into a forward and a backward ``backward_ratio`` times as long. Every stage executes the 1F1B order
(``stages - s - 1`` warm-up forwards, then one forward / one backward alternating, then the remaining backwards);
an operation starts when its stage is free and its dependency is done (the forward on the previous stage, the
backward on the next). The bubble is ``1 - useful / (stages * makespan)``; with equal microbatches it equals the
closed form ``(P - 1) / (M + P - 1)``.

That closed form is not a lower bound once microbatches differ (a long first forward and a short last backward
give 2 stages of microbatches ``[1.75, 1.17]`` a bubble of 0.318, below 1/3), nor once stages differ (a measured
step). :func:`pipeline_bubble_floor` is one: the idle time every schedule of these times has at the ends, where
a rank waits for the first forward to reach its stage and, after its last backward, for that backward to return
to the first stage. With equal microbatches on equal stages it is the closed form.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from lightning_hydra.errors import check_int, check_number

__all__ = [
    "min_pipeline_bubble",
    "one_f_one_b_order",
    "pipeline_bubble",
    "pipeline_bubble_floor",
    "pipeline_makespan",
    "replay_1f1b",
    "stage_split",
]


def _times(times: Iterable[float]) -> list[float]:
    """Microbatch times as a list of floats (lists, tuples, numpy arrays, tensors), checked."""
    try:
        values = np.asarray(times if not isinstance(times, (set, frozenset)) else sorted(times), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"microbatch times must be numbers, got {times!r}") from exc
    if values.ndim != 1:
        raise ValueError(f"microbatch times must be one value per microbatch (1-D), got shape {values.shape}")
    if values.size == 0:
        raise ValueError("pipeline_bubble needs at least one microbatch")
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError(f"microbatch times must be finite and non-negative, got {values.tolist()}")
    return values.tolist()


def min_pipeline_bubble(microbatches: int, stages: int) -> float:
    """The 1F1B bubble of ``stages`` equal stages over ``microbatches`` equal microbatches: ``(P - 1) / (M + P - 1)``
    (the floor of such a run; with unequal microbatches or stages see :func:`pipeline_bubble_floor`)."""
    m = check_int("microbatches", microbatches)
    p = check_int("stages", stages)
    return (p - 1) / (m + p - 1)


def stage_split(times: Iterable[float], stages: int, backward_ratio: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """``(forward, backward)``, each ``[M, stages]``: whole-model microbatch times split evenly over the stages, as
    :func:`pipeline_bubble` runs them."""
    per_stage = np.repeat(np.asarray(_times(times))[:, None] / stages, stages, axis=1)
    return per_stage / (1 + backward_ratio), per_stage * backward_ratio / (1 + backward_ratio)


def pipeline_bubble_floor(forward: np.ndarray, backward: np.ndarray, stages: int) -> float:
    """A lower bound of the 1F1B bubble of a step with these forward and backward times, whatever their order.

    Rank ``r`` (stage ``s``, pool position ``i``) starts its first working microbatch ``a`` no earlier than the
    forwards of ``a`` at position ``i`` of every earlier stage take, works its own busy time, and the step ends no
    earlier than the backwards of its last working microbatch ``z`` at those ranks take after it:
    ``makespan >= sum_(s' < s) F[a, s'] + busy_r + sum_(s' < s) B[z, s']``. The bubble is then at least
    ``1 - busy / (ranks * max_r bound_r)``; the measured (replayed) and the projected bubbles never fall below it,
    and with equal microbatches on equal stages it is ``(P - 1) / (M + P - 1)``.

    Args:
        forward: ``[M, N]`` forward seconds of microbatch ``m`` on rank ``n`` (ranks stage-major: stage ``s`` is
            ranks ``[s * N / stages, (s + 1) * N / stages)``; 0 where the rank is idle).
        backward: ``[M, N]`` backward seconds.
        stages: Pipeline stages ``P``.

    Returns:
        The floor in ``[0, 1)``, ``nan`` when no rank worked.
    """
    forward, backward = np.asarray(forward, dtype=np.float64), np.asarray(backward, dtype=np.float64)
    busy = forward + backward
    ranks = busy.shape[1]
    pool = ranks // check_int("stages", stages, high=ranks)
    bound = 0.0
    for r in range(ranks):
        work = np.flatnonzero(busy[:, r] > 0)
        if work.size:
            earlier = np.arange(r % pool, r - r % pool, pool)  # position r % pool of every earlier stage
            fill, drain = forward[work[0], earlier].sum(), backward[work[-1], earlier].sum()
            bound = max(bound, float(fill + busy[:, r].sum() + drain))
    return 1.0 - float(busy.sum()) / (ranks * bound) if bound > 0 else float("nan")


def one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B operation order of one stage: ``("F", m)`` and ``("B", m)``."""
    warmup = min(stages - stage - 1, microbatches)
    order = [("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < microbatches:
        order.append(("F", f))
        f += 1
        order.append(("B", b))
        b += 1
    order += [("B", m) for m in range(b, microbatches)]
    return order


def pipeline_bubble(times: Iterable[float], stages: int, backward_ratio: float = 2.0) -> float:
    """Projected 1F1B bubble of ``stages`` pipeline stages for per-microbatch times ``times``.

    Args:
        times: Time of every microbatch (for example ``max_r t[m, r]``), forward plus backward, whole model: a list,
            tuple, numpy array or 1-D tensor.
        stages: Pipeline depth ``P``.
        backward_ratio: Backward time over forward time.

    Returns:
        The share of stage-time spent idle, in ``[0, 1)``.
    """
    times = _times(times)
    makespan = pipeline_makespan(times, stages, backward_ratio)
    useful = sum(times) / stages
    return 0.0 if makespan == 0 else 1.0 - useful / makespan


def pipeline_makespan(times: Iterable[float], stages: int, backward_ratio: float = 2.0) -> float:
    """Duration of one 1F1B pipeline flush of ``stages`` stages for whole-model microbatch times ``times``
    (each stage runs ``times[m] / stages``); see :func:`pipeline_bubble` for the arguments."""
    stages = check_int("stages", stages, high=1 << 16)
    check_number("backward_ratio", backward_ratio, low=0.0, low_open=True)
    return replay_1f1b(*stage_split(times, stages, backward_ratio), stages)


def replay_1f1b(forward: np.ndarray, backward: np.ndarray, stages: int, leader: np.ndarray | None = None) -> float:
    """Makespan of a 1F1B step replayed from its forward and backward times, every rank on a core of its own.

    An operation starts when its rank is free, its input has arrived (the forward of the same microbatch on the
    previous stage, or the backward on the next stage, at the same pool position) and every member of its CP group
    is ready (their collectives synchronise them). A rank idle in a microbatch (no forward or backward time) does
    nothing for it.

    Args:
        forward: ``[M, N]`` forward seconds of microbatch ``m`` on rank ``n`` (ranks stage-major, as
            :func:`pipeline_bubble_floor` takes them).
        backward: ``[M, N]`` backward seconds.
        stages: Pipeline stages ``P`` (dividing ``N``).
        leader: ``[M, N]`` the CP group of each rank in each microbatch, by its leader (``None``: every rank alone).
    """
    fwd, bwd = np.asarray(forward, dtype=np.float64).tolist(), np.asarray(backward, dtype=np.float64).tolist()
    m_count, n = len(fwd), len(fwd[0]) if fwd else 0
    pool = n // stages
    leads = np.asarray(leader).tolist() if leader is not None else [list(range(n))] * m_count
    free = [0.0] * n
    done: dict[tuple[str, int], list[float]] = {}  # (kind, microbatch) -> end on every rank (-1: not yet)
    orders = [one_f_one_b_order(s, stages, m_count) for s in range(stages)]
    cursor = [0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            if cursor[s] == len(orders[s]):
                continue
            kind, m = orders[s][cursor[s]]
            ranks = range(s * pool, (s + 1) * pool)
            neighbour = s - 1 if kind == "F" else s + 1  # the stage the input comes from
            shift = (neighbour - s) * pool
            ends = done.setdefault((kind, m), [-1.0] * n)
            has_dep = 0 <= neighbour < stages
            if has_dep and min(ends[r + shift] for r in ranks) < 0:  # not done yet
                continue
            ready = [max(free[r], ends[r + shift]) if has_dep else free[r] for r in ranks]
            if kind == "B":
                own = done[("F", m)]
                ready = [max(t, own[r]) for t, r in zip(ready, ranks, strict=True)]
            lead, dur = leads[m], (fwd[m] if kind == "F" else bwd[m])
            active = [fwd[m][r] + bwd[m][r] > 0 for r in ranks]
            group: dict[int, float] = {}  # a CP group starts when its last member is ready
            for t, r, a in zip(ready, ranks, active, strict=True):
                if a:
                    group[lead[r]] = max(group.get(lead[r], 0.0), t)
            for t, r, a in zip(ready, ranks, active, strict=True):
                if a:
                    ends[r] = free[r] = group[lead[r]] + dur[r]
                else:
                    ends[r] = t
            cursor[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:  # cannot happen for a valid 1F1B order; guard against an infinite loop
            raise RuntimeError("1F1B replay deadlocked")
    return max(free, default=0.0)
