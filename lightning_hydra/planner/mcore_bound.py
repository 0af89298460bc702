"""A lower bound on Megatron's placement while it forms, to stop forming it once it cannot change hydra's choice.

hydra forms Megatron's placement (:mod:`lightning_hydra.planner.mcore_fast`) where its own choice is within
:data:`~lightning_hydra.planner.hydra.MCORE_REACH` of the memory-driven formation. On long-context batches that costs
up to 8x the rest of the planning and Megatron's plan then loses: its first microbatches hold the longest sequences at
their memory-driven degrees, and their maxima alone already exceed what the choice predicts. After each microbatch,
:class:`Hopeless` bounds the placement's span under every model of the ensemble from below: the microbatches formed
(their maxima, exactly as :func:`~lightning_hydra.planner.robust.spans_of` scores them) plus the sequences still
waiting, perfectly balanced over the pool at their memory-driven degrees and charged only their compute (every
term of a rank's load is non-negative, and a sequence's compute summed over its ranks does not fall as its degree
rises). Once the bound shows that Megatron's plan, whole, could not be chosen, move any model's best span, put the
choice outside the baseline slack, or be kept by :data:`~lightning_hydra.planner.hydra.MCORE_MARGIN`, hydra stops
forming it: its choice is the one it would have made with the whole plan scored. Where the bound still lies below
another model's best span (Megatron's plan may be the best under a model that charges communication more), it also
stops once the choice's regret, with every such best span lowered to the bound, stays below every other candidate's
regret and Megatron's plan's own (the others' regrets only rise as a best span falls): the choice stands whatever
Megatron's plan turns out to be above the bound.
"""

from __future__ import annotations

import numpy as np

from lightning_hydra.planner.calibration import FITTED
from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.mcore_fast import min_degrees
from lightning_hydra.planner.plan import Group, group_arrays
from lightning_hydra.planner.request import PlanRequest
from lightning_hydra.planner.robust import Scored, spans_of, standing, worst_ratio

__all__ = ["Hopeless"]

_STRICT = 1e-9
"""Relative room by which the bound must clear each limit (far above rounding, far below any difference of
plans)."""
_TERMS = (*FITTED, "a2a_bytes_per_token", "ring_bytes_per_token")
"""Coefficients of a rank's load (the calibrated ones and the bytes per token); the bound holds only where none is
negative (a model with one never stops the placement)."""


class Hopeless:
    """``stop`` for :func:`~lightning_hydra.planner.mcore_fast.schedule_mcore_fast`: ``True`` once Megatron's plan
    provably cannot change the choice ``pick`` made among ``scored``.

    Megatron's plan, appended to ``scored`` as a baseline, leaves :func:`~lightning_hydra.planner.robust.choose`'s
    answer and :data:`~lightning_hydra.planner.hydra.MCORE_MARGIN`'s unchanged when, under every model ``k``, its span
    is at least the best candidate's (no regret changes), and at least the choice's over ``1 + slack / w_k`` where the
    choice is not a baseline (the slack's reference may fall, not past the choice); and under the planner's model
    more than the choice's worst regret times the best span (its own regret exceeds the choice's) and more than the
    choice's span over ``1 - margin``.

    Args:
        req: The request being planned.
        models: The ensemble the candidates were scored under (the planner's model first).
        weights: Each model's regret weight (:func:`~lightning_hydra.planner.robust.member_weights`).
        scored: The candidates without Megatron's plan, as scored.
        pick: Index in ``scored`` of the choice made without it.
        slack: The baseline slack the choice was made with (``None``: none).
        margin: :data:`~lightning_hydra.planner.hydra.MCORE_MARGIN`.
    """

    def __init__(
        self, req: PlanRequest, models: list[CostModel], weights: np.ndarray, scored: list[Scored], pick: int,
        slack: float | None, margin: float,
    ) -> None:  # fmt: skip
        spans = np.stack([s.spans for s in scored])
        regrets, feasible = standing(scored, weights, slack)  # what the choice was made by
        self._best, self._chosen = spans.min(axis=0), spans[pick]
        limit = self._best.copy()
        if slack is not None and not scored[pick].baseline:
            limit = np.maximum(limit, self._chosen / (1.0 + slack / np.maximum(weights, _STRICT)))
        limit[0] = max(limit[0], regrets[pick] * self._best[0], self._chosen[0] / (1.0 - margin))
        self.limit = limit * (1.0 + _STRICT)
        """Each model's span the placement's bound must exceed."""
        # for :meth:`outranked`
        feasible[pick] = False
        self._weights = np.asarray(weights, dtype=np.float64)
        self._rival = float(regrets[feasible].min()) if feasible.any() else np.inf
        """The least regret of the other candidates that may be chosen (adding Megatron's plan only raises it)."""
        base = np.array([s.baseline for s in scored])
        self._slack = None if slack is None or scored[pick].baseline or not base.any() else float(slack)
        self._reference = spans[base].min(axis=0) if base.any() else np.full(spans.shape[1], np.inf)
        self._req = req
        self._models = models
        self._lengths = np.asarray(req.lengths, dtype=np.int64)
        lens = self._lengths.astype(np.float64)
        degree = min_degrees(self._lengths, req.capacity).astype(np.float64)
        # per sequence, summed over its ranks at the memory-driven degree: sum L^2, L, ranks, L * ranks (the
        # factors of attn, linear, seq_overhead and length_overhead)
        self._compute = np.stack([lens * lens, lens, degree, lens * degree], axis=1)
        self._rates = np.array([[m.attn, m.linear, m.seq_overhead, m.length_overhead] for m in models])
        self._formed = np.zeros(len(models))
        self._top = np.zeros(len(models))
        self._sound = all(float(getattr(m, name)) >= 0.0 for m in models for name in _TERMS)

    def bound(self, groups: list[Group], waiting: np.ndarray) -> np.ndarray:
        """Add the microbatch of ``groups`` and return each model's lower bound on the whole placement's span, the
        sequences of ids ``waiting`` still to be placed."""
        start, u, r, seq, gid = group_arrays(groups)
        crosses = self._req.cost.crossing(start, u * r)
        mb = np.zeros(len(groups), dtype=np.int64)
        tops = spans_of(self._models, self._lengths, mb, u, r, seq, gid, 1, 1, crosses)
        self._formed += tops
        self._top = np.maximum(self._top, tops)
        rest = self._rates @ self._compute[waiting].sum(axis=0) / self._req.world_size
        return self._formed + (self._req.pipeline_stages - 1) * self._top + rest

    def __call__(self, groups: list[Group], waiting: np.ndarray) -> bool:
        """Whether, with the microbatch of ``groups`` formed, the bound clears every model's limit, or clears the
        planner's model's and leaves the choice :meth:`outranked`-proof."""
        if not self._sound:
            return False
        bound = self.bound(groups, waiting)
        return bool(bound[0] > self.limit[0]) and (bool((bound > self.limit).all()) or self.outranked(bound))

    def outranked(self, bound: np.ndarray) -> bool:
        """Whether the choice stays chosen for any Megatron's plan whose span under each model is at least
        ``bound`` (the planner's model's limit cleared, so that neither its best span nor the margin moves).

        Under a model whose best span the plan may undercut, the best falls at most to the bound: the choice's
        regret rises at most to its ratio to that, every other candidate's only rises (its ratio to a lower best),
        and the plan's own is at least its bound over the best span. The choice stays where its largest regret so
        is below every other candidate's that may be chosen and below the plan's, and, where it is no baseline,
        within the baseline slack against the baselines' spans lowered to the bound.

        Args:
            bound: Each model's lower bound on the placement's span (:meth:`bound`).
        """
        best, chosen, w = self._best, self._chosen, self._weights
        regret = float(worst_ratio(chosen, np.minimum(best, bound), w)) * (1.0 + _STRICT)
        own = float(worst_ratio(np.maximum(bound, best), best, w))  # Megatron's plan's regret, at least
        if not regret < min(self._rival, own):
            return False
        if self._slack is None:
            return True
        return float(worst_ratio(chosen, np.minimum(self._reference, bound), w)) * (1.0 + _STRICT) <= 1.0 + self._slack
