"""The ``hydra`` policy: load-driven dynamic CP, robust to a cost model of the wrong form.

Per global batch, several candidate plans are formed and the most robust one is kept:

- **Candidates** (:mod:`lightning_hydra.planner.formation`): dense microbatches with load-driven degrees from the
  power-of-two and the fine degree sets, dense microbatches at Megatron's memory-driven power-of-two degrees
  (Megatron-shaped, without its whole-pool scans), the ``static`` plan, up to :data:`LIFT_BUDGET` power-of-two
  formations whose degrees are chosen at :data:`LIFTS` times the level (fewer raised degrees, less ring traffic),
  and up to :data:`MCORE_BUDGET` Megatron's own placement (:mod:`lightning_hydra.planner.mcore_fast`).
- **Choice** (:mod:`lightning_hydra.planner.robust`): every candidate is scored under the planner's model and
  perturbed models of another form; the candidate with the smallest worst-case regret wins among those the
  planner's own model predicts no worse than the baselines (the memory-driven formation, static, mcore); where
  Megatron's placement is a candidate it is kept unless the winner is predicted at least :data:`MCORE_MARGIN`
  faster (it may then be predicted up to that margin slower than the memory-driven formation, never slower than
  static or mcore).

Each formation costs ``O(n log N)`` with the single-rank bulk placed in vectorised rounds; no step scans the pool
per sequence.
"""

from __future__ import annotations

import math

import numpy as np

from lightning_hydra.planner.formation import DegreeSet, Formation, _Tables, form
from lightning_hydra.planner.mcore_fast import schedule_mcore_fast
from lightning_hydra.planner.plan import Plan
from lightning_hydra.planner.request import PlanRequest
from lightning_hydra.planner.robust import TIE, Scored, choose, ensemble, spans_of
from lightning_hydra.planner.static import static_layout

__all__ = [
    "CANDIDATES",
    "LIFTS",
    "LIFT_BUDGET",
    "MCORE_BUDGET",
    "MCORE_MARGIN",
    "candidate_plans",
    "candidates",
    "schedule_hydra",
]

CANDIDATES = (("pow2", True), ("fine", True), ("pow2", False))
"""Formations tried: ``(degree set, load-driven degrees)``; ``("pow2", False)`` is the Megatron-shaped baseline."""
LIFTS = (1.1, 1.25, 1.5)
"""Lifts of the extra power-of-two load-driven formations (:func:`~lightning_hydra.planner.formation.form`'s
``lift``): degrees chosen at these multiples of each microbatch's level, between the load-driven formation (fewest
ranks idle, most ring traffic) and the memory-driven one. Where the truth charges rings more than the planner's
analytic model (exposed ring traffic, slower links), calibration finds it and one of these can win; where the
calibrated model is off by more than the gap between near-equal candidates they add choices it can get wrong (the
README's robustness section lists both)."""
LIFT_BUDGET = 131072
"""Largest ``sequences * sqrt(ranks)`` for which the :data:`LIFTS` formations are also candidates. Each costs about
what one load-driven formation costs (2-10 ms up to 512 ranks on this machine); the bound keeps them off 2,048-rank
batches, whose planning time they would double."""
MCORE_BUDGET = 32768
"""Largest ``sequences * sqrt(ranks)`` for which Megatron's own placement is also a candidate, computed by
:mod:`lightning_hydra.planner.mcore_fast` (the baseline's plan without its whole-pool scans; it still costs one
vector expression over the groups per sequence placed, about 1.6 us per unit of that product here: 40 ms for 1,100
sequences on 512 ranks, 0.6 s for 8,900, 2.4 s for 36,000 on 2,048). Where the truth charges every microbatch a
fixed cost (GEMMs below peak, launches) and tokens bind (32K contexts), Megatron's dense first-fit packing can beat
every load-driven formation; within the budget hydra is never predicted worse than it. A run that plans ahead of
its steps with time to spare can raise it (``schedule(..., mcore_budget=...)``, ``PlannerConfig.mcore_budget``)."""


MCORE_MARGIN = 0.005
"""Where Megatron's own placement is a candidate, hydra keeps it unless the chosen candidate is predicted at least
this much faster under the planner's own model (and as long as static's is not predicted faster than it): a gain
within the calibrated model's resolution is not worth leaving the baseline's plan, whose balance holds under any
model. In the robustness grid, candidates predicted less than 0.5% faster than mcore's plan (predicted step time,
not per-rank time) came out up to 0.1% slower under the truths. Keeping mcore's plan may leave hydra's predicted
time up to this margin above its own memory-driven formation's; never above mcore's or static's."""


def candidates(req: PlanRequest) -> list[Formation]:
    """The formations of :data:`CANDIDATES` (cost tables shared per degree set); with pipeline stages also the
    load-driven ones shaped for the pipeline (every microbatch aiming at the same maximum, none merged); within
    :data:`LIFT_BUDGET` also the power-of-two formations lifted by :data:`LIFTS`."""
    tables: dict[str, _Tables] = {}
    out = []
    for name, load_driven in CANDIDATES:
        ds = DegreeSet.build(req.rules, name)
        if name not in tables:
            tables[name] = _Tables(req, ds)
        out.append(form(req, ds, raise_degrees=load_driven, tables=tables[name]))
        if req.pipeline_stages > 1 and load_driven:
            out.append(form(req, ds, raise_degrees=True, tables=tables[name], even=True))
    if _within(req, LIFT_BUDGET):
        ds = DegreeSet.build(req.rules, "pow2")
        tab = tables["pow2"] if "pow2" in tables else _Tables(req, ds)
        out += [form(req, ds, raise_degrees=True, tables=tab, lift=lift) for lift in LIFTS]
    return out


def schedule_hydra(req: PlanRequest) -> Plan:
    """Load-driven plan: the most robust of the candidate formations, the static plan and, within the budget,
    Megatron's placement (kept unless beaten by :data:`MCORE_MARGIN`).

    The plan's ``stats`` name the chosen candidate and carry every candidate's predicted span and regret.
    """
    lengths = req.lengths
    formed = candidates(req)
    static = static_layout(req)
    models = ensemble(req.cost)

    def spans(*flat: np.ndarray | int, crosses: np.ndarray | None = None) -> np.ndarray:
        return spans_of(models, lengths, *flat, req.pipeline_stages, crosses)

    # the Megatron-shaped formation, static and mcore bound hydra's own prediction; each scored as laid out (a ring
    # is charged the link its ranks use)
    scored = [Scored(f.name, spans(*f.flat(), crosses=f.crosses(req)), f.name.endswith("/memory")) for f in formed]
    scored.append(Scored("static", spans(*static.flat(), crosses=static.crosses(req)), True))
    mcore = _mcore_candidate(req)
    if mcore is not None:
        mb, start, u, r, seq, gid = mcore.flat()
        crosses = req.cost.crossing(start, u * r)
        scored.append(Scored("mcore", spans(mb, u, r, seq, gid, mcore.num_microbatches, crosses=crosses), True))
    pick, regret = choose(scored)
    if mcore is not None and scored[pick].name != "mcore":
        own, static_own = scored[-1].spans[0], scored[len(formed)].spans[0]  # mcore's (scored last) and static's
        if scored[pick].spans[0] > own * (1 - MCORE_MARGIN) and own <= static_own * (1 + TIE):
            pick = len(scored) - 1
    stats: dict[str, float | str] = {"candidate": scored[pick].name}
    for s in scored:
        stats[f"span/{s.name}"] = float(s.spans[0])
        stats[f"regret/{s.name}"] = regret[s.name]
    if pick >= len(formed):
        plan = mcore if mcore is not None and scored[pick].name == "mcore" else static.plan(req)
        plan.policy = "hydra"
        plan.stats = stats
        return plan
    return formed[pick].plan(req, **stats)


def _mcore_candidate(req: PlanRequest) -> Plan | None:
    """Megatron's own placement when the batch is within the budget (:data:`MCORE_BUDGET`), else ``None``."""
    budget = MCORE_BUDGET if req.mcore_budget is None else req.mcore_budget
    return schedule_mcore_fast(req) if _within(req, budget) else None


def _within(req: PlanRequest, budget: float) -> bool:
    """Whether the batch's ``sequences * sqrt(ranks)`` is at most ``budget`` (:data:`LIFT_BUDGET`,
    :data:`MCORE_BUDGET`)."""
    return req.lengths.size * math.sqrt(req.world_size) <= budget


def candidate_plans(req: PlanRequest) -> dict[str, Plan]:
    """Every plan :func:`schedule_hydra` chooses from, by candidate name: the formations of :func:`candidates`, the
    ``static`` plan and, within the budget, ``mcore``'s placement.

    For benchmarks: timed under a cost truth, the best of them bounds what any choice among these candidates could
    reach, which tells a choice that missed the best candidate from candidates that all fall short.

    Args:
        req: The validated request (as :func:`~lightning_hydra.planner.schedule` builds it).
    """
    plans = {f.name: f.plan(req) for f in candidates(req)}
    plans["static"] = static_layout(req).plan(req)
    mcore = _mcore_candidate(req)
    if mcore is not None:
        plans["mcore"] = mcore
    return plans
