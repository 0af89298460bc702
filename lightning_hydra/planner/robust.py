"""Choosing among candidate plans by their worst case over an ensemble of cost models.

A plan balanced to one model's exact numbers loses its balance under a truth of a different form; calibration
refits coefficients but cannot repair a form it lacks. So every candidate is scored under :func:`ensemble`: the
planner's model and variants that charge, each in one direction, what a truth of another form may charge more
(communication twice as slow, a share of ring traffic exposed whatever attention hides, attention below peak on
short per-rank chunks, per-sequence and per-microbatch overheads). The chosen candidate minimises its largest
*regret* (span under a model over the best candidate's span under that model) among the candidates that the
planner's own model predicts no worse than the baselines: by construction hydra's plan is never predicted worse
than its baseline candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_hydra.planner.cost import CostModel

__all__ = ["Scored", "choose", "ensemble", "span_of"]


def ensemble(cost: CostModel) -> list[CostModel]:
    """The planner's model first, then the perturbed models a plan must also do well under.

    Args:
        cost: The planner's (possibly calibrated) model.
    """
    return [
        cost,
        cost.replace(
            intra_node_bandwidth=cost.intra_node_bandwidth / 2, inter_node_bandwidth=cost.inter_node_bandwidth / 2
        ),
        cost.replace(ring_share=cost.ring_share + 0.25),
        cost.replace(length_overhead=cost.length_overhead + 512 * cost.attn),
        cost.replace(seq_overhead=cost.seq_overhead + 50e-6, bin_overhead=cost.bin_overhead + 1e-3),
    ]


def span_of(
    cost: CostModel, lengths: np.ndarray, mb: np.ndarray, ulysses: np.ndarray, ring: np.ndarray, seq: np.ndarray,
    gid: np.ndarray, num_microbatches: int, pipeline_stages: int = 1,
) -> float:  # fmt: skip
    """Predicted step time from flat arrays (see :meth:`Plan.flat`): the sum over microbatches of the largest group
    load, plus, through ``P`` pipeline stages under 1F1B, ``P - 1`` times the largest microbatch (the warm-up and
    cool-down a step cannot hide; equal microbatches of time ``t`` take ``(M + P - 1) t``)."""
    loads = cost.group_loads(lengths[seq], gid, ulysses, ring)
    per_mb = np.zeros(max(num_microbatches, int(mb.max()) + 1 if mb.size else 1))
    np.maximum.at(per_mb, mb, loads)
    return float(per_mb.sum() + (pipeline_stages - 1) * per_mb.max())


@dataclass
class Scored:
    """A candidate's spans under every model of the ensemble."""

    name: str
    """The candidate."""
    spans: np.ndarray
    """Span under each model (the planner's own first)."""
    baseline: bool
    """Whether hydra must never be predicted worse than this one."""


def choose(scored: list[Scored]) -> tuple[int, dict[str, float]]:
    """Index of the candidate with the smallest worst-case regret among those the planner's model predicts no
    worse than every baseline (ties: the smaller predicted span), and the regrets.

    Args:
        scored: Every candidate with its spans.
    """
    spans = np.stack([s.spans for s in scored])
    best = spans.min(axis=0)
    regret = (spans / np.where(best > 0, best, 1.0)).max(axis=1)
    bound = min((s.spans[0] for s in scored if s.baseline), default=np.inf)
    feasible = spans[:, 0] <= bound * (1 + 1e-12)
    key = np.where(feasible, regret, np.inf)
    pick = int(np.lexsort((spans[:, 0], key))[0])
    return pick, {s.name: float(r) for s, r in zip(scored, regret, strict=True)}
