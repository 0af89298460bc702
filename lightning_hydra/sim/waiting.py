"""Where a plan's step goes under a truth: useful work, busy overhead and waiting, the waiting split by its cause.

A step of ``M`` microbatches on ``N`` ranks lasts ``span = sum_m max_r T[m, r]`` (the slowest rank of each
microbatch; :func:`lightning_hydra.sim.truth.plan_times` gives ``T``). Of the ``N * span`` rank-seconds, the useful
FLOP time (:func:`~lightning_hydra.sim.truth.useful_time`) is the efficiency; the rest is

- ``overhead``: busy but not useful, ``sum T - useful`` (exposed communication, kernels below their best
  efficiency, launches and per-sequence bookkeeping): what a rank spends working on the plan's degrees;
- waiting, ``N * max_m - sum_r T[m, r]`` per microbatch, split by what forces it. With ``mu_m`` the microbatch's
  mean rank time, ``mu`` the step's mean over microbatches and ``G_m`` the slowest rank of its heaviest multi-rank
  CP group (a group's ranks work in step: the group is one indivisible unit of the microbatch),

  - ``cp_groups``: ``N * max(0, G_m - max(mu, mu_m))``: a CP group slower than even an even split of the step's work
    would make the microbatch (too few ranks for the sequence, or the group's own imbalance);
  - ``microbatch_split``: ``N * max(0, min(G_m, mu) - mu_m)``: a group an even split would have covered, in a
    microbatch that holds less work than the step's mean (the split of work across microbatches);
  - ``single_bins``: ``N * (max_m - max(G_m, mu_m))``: the rest, ranks of single-rank bins (or a group's other
    ranks) above what the microbatch's work and its heaviest group force (the maxima of single-rank bins).

  A microbatch without multi-rank groups takes ``G_m = 0``. The three add up to the waiting exactly.

Of the waiting, ``no_token_room`` is the part on ranks whose free tokens (capacity minus what the rank holds,
:meth:`~lightning_hydra.planner.Plan.tokens`) are fewer than the batch's shortest sequence: no move of a sequence
can fill it at the plan's degrees, only other degrees or another membership of the slowest groups (it overlaps the
three causes; it is not added to them).

Given the model's predicted times of the same bins, ``model_unseen`` is the share of the step the truth waits that
the model did not predict (truth's waiting share minus the model's): the part of the waiting owed to calibration
error. Given the same bins' times without communication (:func:`~lightning_hydra.sim.truth.plan_times` with
``include_comm=False``), ``communication`` is the part of the overhead that is exposed communication (all-to-all and
ring bandwidth time and ring transfers attention did not hide; latencies stay in the rest of the overhead). Shares are
of ``N * span``; ``useful + overhead + cp_groups + microbatch_split + single_bins == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_hydra.planner.plan import Plan

__all__ = ["CAUSES", "Waiting", "waiting"]

CAUSES = ("single_bins", "cp_groups", "microbatch_split", "overhead", "no_token_room", "model_unseen", "communication")
"""The columns :meth:`Waiting.shares` reports, besides ``useful`` (``model_unseen`` and ``communication`` where their
inputs were given)."""


@dataclass(frozen=True)
class Waiting:
    """One plan's step under a truth, per microbatch (rank-seconds; divide by :attr:`total` for shares)."""

    useful: float
    """Useful FLOP rank-seconds of the batch."""
    overhead: float
    """Busy rank-seconds beyond the useful ones."""
    single_bins: np.ndarray
    """Waiting per microbatch above what its work and heaviest CP group force."""
    cp_groups: np.ndarray
    """Waiting per microbatch forced by a CP group slower than the step's even split."""
    microbatch_split: np.ndarray
    """Waiting per microbatch forced by a CP group in a microbatch lighter than the step's mean."""
    total: float
    """``N * span``: the step's rank-seconds."""
    no_token_room: float = 0.0
    """Waiting rank-seconds on ranks with fewer free tokens than the batch's shortest sequence (``capacity``
    given; else 0)."""
    model_unseen: float | None = None
    """Truth's waiting share minus the model's predicted waiting share (``None`` without predicted times)."""
    communication: float | None = None
    """Busy rank-seconds of exposed communication, a part of :attr:`overhead` (``None`` without the times without
    communication)."""

    def shares(self) -> dict[str, float]:
        """``useful`` and every cause of :data:`CAUSES` as a share of the step's rank-seconds."""
        out = {
            "useful": self.useful / self.total,
            "single_bins": float(self.single_bins.sum()) / self.total,
            "cp_groups": float(self.cp_groups.sum()) / self.total,
            "microbatch_split": float(self.microbatch_split.sum()) / self.total,
            "overhead": self.overhead / self.total,
            "no_token_room": self.no_token_room / self.total,
        }
        if self.model_unseen is not None:
            out["model_unseen"] = self.model_unseen
        if self.communication is not None:
            out["communication"] = self.communication / self.total
        return out


def waiting(
    plan: Plan, times: np.ndarray, useful: float, predicted: np.ndarray | None = None, capacity: int | None = None,
    quiet: np.ndarray | None = None,
) -> Waiting:  # fmt: skip
    """Split ``plan``'s step under a truth into useful work, overhead and the causes of waiting (module docstring).

    Args:
        plan: The plan.
        times: Its ``[M, N]`` rank times under the truth (communication included).
        useful: The batch's useful FLOP time on one device (``useful_time``), summed over the sequences.
        predicted: The model's ``[M, N]`` predicted times of the same bins, for ``model_unseen``; ``None``: skip it.
        capacity: Tokens a rank may hold in a microbatch, for ``no_token_room``; ``None``: skip it (0).
        quiet: The same bins' ``[M, N]`` times without communication, for ``communication``; ``None``: skip it.
    """
    times = np.asarray(times, dtype=np.float64)
    if times.shape != (plan.num_microbatches, plan.world_size):
        raise ValueError(f"times of shape {times.shape} for a plan of {plan.num_microbatches}x{plan.world_size}")
    n = plan.world_size
    top = times.max(axis=1)
    mean_m = times.mean(axis=1)
    mean = float(mean_m.mean())
    heaviest = np.zeros(plan.num_microbatches)
    for m, groups in enumerate(plan.microbatches):
        for g in groups:
            if g.seq_ids and len(g.ranks) > 1:
                heaviest[m] = max(heaviest[m], float(times[m, list(g.ranks)].max()))
    cp = n * np.maximum(0.0, heaviest - np.maximum(mean, mean_m))
    split = n * np.maximum(0.0, np.minimum(heaviest, mean) - mean_m)
    single = n * (top - np.maximum(heaviest, mean_m))
    total = n * float(top.sum())
    unseen = None
    if predicted is not None:
        pred = np.asarray(predicted, dtype=np.float64).reshape(times.shape)
        idle_pred = 1.0 - float(pred.sum()) / (n * float(pred.max(axis=1).sum()))
        unseen = (1.0 - float(times.sum()) / total) - idle_pred
    stuck = 0.0
    if capacity is not None:
        full = capacity - plan.tokens() < min(plan.lengths)
        stuck = float(((top[:, None] - times) * full).sum())
    comm = None
    if quiet is not None:
        comm = float(times.sum()) - float(np.asarray(quiet, dtype=np.float64).reshape(times.shape).sum())
    return Waiting(
        useful=useful,
        overhead=float(times.sum()) - useful,
        single_bins=single,
        cp_groups=cp,
        microbatch_split=split,
        total=total,
        model_unseen=unseen,
        no_token_room=stuck,
        communication=comm,
    )
