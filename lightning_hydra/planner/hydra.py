"""The ``hydra`` policy: load-driven dynamic CP, robust to a cost model of the wrong form.

Per global batch, several candidate plans are formed and the most robust one is kept:

- **Candidates** (:mod:`lightning_hydra.planner.formation`): dense microbatches with load-driven degrees from the
  power-of-two and the fine degree sets, dense microbatches at Megatron's memory-driven power-of-two degrees
  (Megatron-shaped, without its whole-pool scans), the ``static`` plan, up to :data:`LIFT_BUDGET` power-of-two
  formations whose degrees are chosen at :data:`LIFTS` times the level (fewer raised degrees, less ring traffic),
  where a fixed cost per microbatch makes it pay the memory-driven formation planned for fewer microbatches than
  asked (:func:`fewer_microbatches`), and up to :data:`MCORE_BUDGET` Megatron's own placement
  (:mod:`lightning_hydra.planner.mcore_fast`), up to :data:`MCORE_BUDGET_MEMORY` where the choice would otherwise be
  a memory-driven formation or within :data:`MCORE_REACH` of one. Within :data:`BALANCE_BUDGET` the front-runner
  under the planner's own model is also formed again with its degrees kept and each microbatch placed to balance its
  ranks (:func:`balanced_twin`); once the model has timed plain rings on both links (:func:`rings_timed`), so is every
  load-driven formation within :data:`TWIN_REACH` of it (within :data:`TWIN_BUDGET`), and the ``node`` formation is
  lifted too (:data:`LIFTED_SETS`).
- **Choice** (:mod:`lightning_hydra.planner.robust`): every candidate is scored under the planner's model and
  perturbed models of another form; the candidate with the smallest worst-case regret wins among those the
  planner's own model predicts no worse than the baselines (the memory-driven formation, static, mcore) and no
  perturbed model predicts more than :data:`~lightning_hydra.planner.robust.BASELINE_SLACK` slower than them; where
  Megatron's placement is a candidate it is kept unless the winner is predicted at least :data:`MCORE_MARGIN`
  faster (it may then be predicted up to that margin slower than the memory-driven formation, never slower than
  static or mcore). Where it is kept, within :data:`POLISH_BUDGET` and without pipeline stages, its sequences are
  moved between its groups while the planner's model predicts a shorter step
  (:func:`~lightning_hydra.planner.polish.polish`).
- **Exploration** (:func:`_explore`): where a calibrated model has not yet timed plain rings on a link, a formation
  with such rings that the planner's own model predicts at least :data:`EXPLORE_GAIN` faster than the choice (its
  worst-case regret within :data:`EXPLORE_RISK`) is planned instead for a step (once per link and calibration
  window), so that calibration times what the ensemble hedges.

Each formation costs ``O(n log N)`` with the single-rank bulk placed in vectorised rounds; no step scans the pool
per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lightning_hydra.planner.calibration import plain_rings_readable
from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.formation import Formation, form
from lightning_hydra.planner.mcore_bound import Hopeless
from lightning_hydra.planner.mcore_fast import schedule_mcore_fast
from lightning_hydra.planner.plan import Plan
from lightning_hydra.planner.polish import polish
from lightning_hydra.planner.request import PlanRequest
from lightning_hydra.planner.robust import (
    BASELINE_SLACK,
    TIE,
    Scored,
    choose,
    ensemble,
    member_weights,
    spans_of,
    standing,
)
from lightning_hydra.planner.static import StaticLayout, static_layout
from lightning_hydra.planner.tables import DegreeSet, Tables

__all__ = [
    "BALANCE_BUDGET",
    "CANDIDATES",
    "EXPLORE_GAIN",
    "EXPLORE_RISK",
    "FEWER_SHARE",
    "FINE_LIFT_BUDGET",
    "LIFTED_SETS",
    "LIFTS",
    "LIFT_BUDGET",
    "MCORE_BUDGET",
    "MCORE_BUDGET_MEMORY",
    "MCORE_MARGIN",
    "MCORE_REACH",
    "NODE_BUDGET",
    "POLISH_BUDGET",
    "TWIN_BUDGET",
    "TWIN_REACH",
    "balanced_twin",
    "candidate_plans",
    "candidates",
    "rings_timed",
    "schedule_hydra",
]

CANDIDATES = (("pow2", True), ("fine", True), ("pow2", False), ("node", True))
"""Formations tried: ``(degree set, load-driven degrees)``; ``("pow2", False)`` is the Megatron-shaped baseline.
``("node", True)`` raises degrees in whole Ulysses blocks above a node (the ``node`` set of
:data:`~lightning_hydra.planner.tables.DEGREE_SETS`): every rank a raised degree adds moves the fewest ring bytes
any factorisation of its size can, for truths where communication is dear (issue 58). It is formed within
:data:`NODE_BUDGET` and only where some degree can differ from the power-of-two formation's (:func:`_node_differs`).
"""
LIFTS = (1.1, 1.25, 1.5)
"""Lifts of the extra load-driven formations (power-of-two, :data:`LIFTED_SETS`' and, under its own rule,
:data:`FINE_LIFT_BUDGET`'s ``fine`` ones; :func:`~lightning_hydra.planner.formation.form`'s ``lift``): degrees
chosen at these multiples of each microbatch's level, between the load-driven formation (fewest ranks idle, most
ring traffic) and the memory-driven one. Where the truth charges rings more than the planner's analytic model
(exposed ring traffic, slower links), calibration finds it and one of these can win; where the calibrated model is
off by more than the gap between near-equal candidates they add choices it can get wrong (the robustness benchmark
(`bench.robust`) lists both)."""
LIFTED_SETS = ("node",)
"""Degree sets besides ``pow2`` whose load-driven formations are also lifted by :data:`LIFTS` within
:data:`LIFT_BUDGET`, where the set's formation was formed (``node`` only where it differs from ``pow2``) and the
cost model timed plain rings on both links (:func:`rings_timed`); the ``fine`` set is lifted under
:data:`FINE_LIFT_BUDGET` instead. Fewer raised degrees in whole Ulysses blocks: where communication is dear (issue
58; 64 ranks, 256K Pareto lengths, ``dear50``) hydra's choice on a held-out batch went from the memory-driven
formation to a lifted ``node`` formation balanced, 3.4% faster under the truth. The ``fine`` set was not lifted
here: with its odd all-ring groups lifted, a miscalibrated model (512 ranks x 32K standard-library lengths,
``bw0.5`` truth: the closed-loop staking test of ``tests/test_truth_family.py``) guarded by the baseline slack alone
took a plan the truth timed at 0.72x Megatron's (without the lifts the slack alone keeps it as fast). That was
before :func:`rings_timed` gated the lifts: that model has timed no plain ring, so now it forms none."""
LIFT_BUDGET = 131072
"""Largest ``sequences * sqrt(ranks)`` for which the :data:`LIFTS` formations are also candidates. Each costs about
what one load-driven formation costs (2-10 ms up to 512 ranks on this machine); the bound keeps them off 2,048-rank
batches, whose planning time they would double."""
FINE_LIFT_BUDGET = LIFT_BUDGET
"""Largest ``sequences * sqrt(ranks)`` for which the ``fine`` load-driven formation is also lifted by :data:`LIFTS`,
whether or not the model has timed plain rings. Of these lifts hydra keeps the one its own model predicts fastest,
only where that model predicts it faster than every other formation (:func:`_fine_lift`; it then gets a balanced twin
too). It makes its choice without them, as before, and replaces it by a lift only where every member of the ensemble
predicts the lift no slower (:func:`_with_lifts`); the twin is formed within :data:`BALANCE_BUDGET`. A lifted ``fine``
formation is no hedge: its raised degrees are plain rings of 3-7 ranks, and the step that plans it times them. The
robust choice is the one without the lifts, or a lift; the step planned may still be one that explores
(:func:`_explore`, which reads the regrets among every candidate, the lifts included, and may take a lift to time
plain rings on a link the model has not timed them on).

At 32K, where the ``fine`` formation raises too many sequences and the power-of-two one raises them to the next power
of two, a lift between them packs each microbatch's ranks more tightly: on 64 ranks x 32K lognormal lengths (``base``
truth, held-out batch 1000) hydra's choice went from the memory-driven formation to ``fine`` lifted by 1.1, 2.2%
faster under the truth. Measured with ``bench.robust`` (closed loop, 2 held-out batches per cell) against the planner
before: on 96 cells of drawn truths at 32K (64 and 512 ranks, seeds shifted by 5000) +0.40% on average, up to +7.4%,
none below by more than 0.13%; at 256K +1.2% on average, up to +6.2%, 5 cells below by 0.2-1.3%; on the grid's 84
32K cells +0.05% (5 cells up by 1.0-2.1%; 2 down, by 0.3% and by 2.1% where a held-out step explored a lift's rings)
and its 84 256K cells +0.06% (at most -0.1%). Chosen wherever robust selection ranked it first, without the test
against the choice made without it, a model whose refit made short rings free (``tests/test_fine_lift.py``) took
lifts the truth timed at 0.73-0.87x that choice. Each lift costs about what one load-driven formation costs
(:data:`LIFT_BUDGET`)."""
POLISH_BUDGET = 131072
"""Largest ``sequences * sqrt(ranks)`` for which Megatron's placement, where robust selection chooses it, is
polished (:func:`~lightning_hydra.planner.polish.polish`: sequences moved between its groups while the planner's
model predicts a shorter step; first fit never revisits a sequence). Measured on the robustness benchmark's 64 x 32K
standard-library cells, where hydra chooses that placement: the truths time the polished plan 0.4-1.1% faster. The
same search timed by the truth itself (``bench.headroom``) finds at most 0.3% on hydra's own formations at 256K,
which are not polished. A polish takes a few milliseconds of CPU at 64 and 512 ranks; the bound keeps it off the
2,048-rank batches of ``bench.schedule``, whose plans are unchanged."""
MCORE_BUDGET = 32768
"""Largest ``sequences * sqrt(ranks)`` for which Megatron's own placement is also a candidate, computed by
:mod:`lightning_hydra.planner.mcore_fast` (the baseline's plan without its whole-pool scans; it still costs a
few vector expressions per sequence placed, 0.26-0.55 us per unit of that product at 512 and 2,048 ranks; formed
whole it takes 1.85x the CPU time of hydra's plan without it on 512 ranks x 9,000 sequences, 2.3x on 2,048 x 36,000
and 3.3x on 2,048 x 74,000, one run alternating the two, fastest of three). Where the truth charges every
microbatch a
fixed cost (GEMMs below peak, launches) and tokens bind (32K contexts), Megatron's dense first-fit packing can beat
every load-driven formation; within the budget hydra is never predicted worse than it. A run that plans ahead of
its steps with time to spare can raise it (``schedule(..., mcore_budget=...)``, ``PlannerConfig.mcore_budget``).
Where hydra's own choice is the memory-driven formation or within :data:`MCORE_REACH` of it,
:data:`MCORE_BUDGET_MEMORY` applies instead."""
MCORE_BUDGET_MEMORY = 8388608
"""The budget for Megatron's placement where, without it, hydra would choose its memory-driven formation or a
candidate predicted less than :data:`MCORE_REACH` faster than it: Megatron's first fit places the same degrees
(each sequence where the projected maximum is lowest) and balances ranks full of short sequences better than
hydra's level-driven placement. Measured at 512 ranks and 32K contexts where tokens bind (80-90% of the pool's
token room; lognormal and Pareto lengths, base and ``worst`` truths): its plan was 0.5-2.2% faster than the best
hydra formation and up to 3.8% faster than hydra's choice under the truths after calibration, and hydra's own
calibrated model said so. The same held at 2,048 ranks x 32K, where the budget was 524,288 (11,500 sequences):
under drawn truths whose GEMMs reach half their efficiency only at 2-4K tokens (a large fixed cost per
microbatch) hydra's choice was up to 7.5% slower than Megatron's plan in 21 of 40 truths on lognormal batches of
36,000 sequences and 21 of 40 on Pareto batches of 76,000, and under the grid's truths at 90% fill in all 20
cells, its calibrated model agreeing in 19, 21 and 20 of them; with the budget at 4,194,304 none is
(``bench.robust --truths --random-truths 40 --seed-offset 5000 --world-sizes 2048 --contexts 32K --mcore-fast``,
``bench.robust --world-sizes 2048 --contexts 32K --fill 0.9 --mcore-fast``). Past that budget it held again: at
2,048 ranks x 16 microbatches x 90% fill (Pareto, 180,000 sequences) hydra was 0.6-3.9% below Megatron's plan in 6
of 8 truths (four of the grid's, four drawn), its own model agreeing; with this budget all 6 are ties
(``bench.robust --world-sizes 2048 --contexts 32K --distributions pareto --microbatches 16 --fill 0.9 --mcore-fast
--truths base worst bw0.5 tile512 --random-truths 4 --seed-offset 5000``). Doubled when reading the waiting
sequences by position halved the placement's cost (:mod:`~lightning_hydra.planner.mcore_fast`): hydra's plan at
the new edge (2,048 x 180,000 sequences) took 1.1-3.0 s, at the old edge (2,048 x 87,000-89,000) 2.0-2.9 s
before. Up to this bound (512 ranks: about 370,000 sequences; 2,048: 185,000; 4,096: 131,000) hydra pays for it
(above), which :class:`~lightning_hydra.HydraDataModule` hides behind the step that trains while the next is
planned (``plan_ahead``); it stops once a bound shows Megatron's plan cannot change the choice. A batch where a
load-driven formation wins by more than :data:`MCORE_REACH` never pays it. An explicit ``mcore_budget`` replaces
both budgets. The bound counts sequences, not the step's length: more microbatches per step (more time to plan
behind) reach it sooner; past it the shortfall can return."""


BALANCE_BUDGET = 524288
"""Largest ``sequences * sqrt(ranks)`` for which the balanced twin of the front-runner (:func:`balanced_twin`) is
also a candidate. Forming it costs up to four placements per microbatch: at 2,048 ranks x 256K lognormal (18,000
sequences, 814,000) it raised hydra's planning time from 70 to 93 ms of CPU (1.33x; with the ``node`` candidate
1.61x, 113 ms), past the 100 ms target with both. The bound keeps every 512-rank batch of the robustness grid (at
most about 420,000) and the 2,048-rank batches of up to 11,500 sequences."""
NODE_BUDGET = 524288
"""Largest ``sequences * sqrt(ranks)`` for which the ``node`` formation of :data:`CANDIDATES` is formed (one more
formation and its cost tables: 1.43x hydra's planning time at 2,048 ranks x 256K lognormal); see
:data:`BALANCE_BUDGET`."""


TWIN_REACH = 0.05
"""Within :data:`TWIN_BUDGET` and once the model timed plain rings on both links (:func:`rings_timed`), the
load-driven formations predicted within this share of the front-runner (under the planner's own model) are also
formed again balanced (:func:`_twin_sources`): robust selection often takes another formation than the front-runner,
and a balanced twin of a lifted or ``node`` formation can beat every formation unbalanced (issue 58)."""
TWIN_BUDGET = LIFT_BUDGET
"""Largest ``sequences * sqrt(ranks)`` for which the twins of :data:`TWIN_REACH` are formed besides the
front-runner's (:data:`BALANCE_BUDGET`). Each costs up to four placements per microbatch, about what a lifted
formation costs: the same bound as :data:`LIFT_BUDGET`, off 2,048-rank batches of more than about 2,900 sequences."""


MCORE_REACH = 0.08
"""Where hydra's choice is predicted less than this share faster than its memory-driven formation (under the
planner's own model), Megatron's placement may beat it and hydra forms it too, up to :data:`MCORE_BUDGET_MEMORY`.
Megatron's first fit places the memory-driven degrees more densely: under models calibrated to truths whose GEMMs
reach half their efficiency at 2,048-4,096 tokens (a fixed cost per bin that dense packing saves) it was predicted
up to 10% faster than the memory-driven formation, and faster than load-driven choices predicted 0.4-4.3% faster
than that formation (64-512 ranks, 32K lognormal, Pareto and standard-library lengths: 1-10% faster than hydra's
choice without it). It never beat a choice predicted faster by more in any batch measured, nor any choice at 256K
contexts (at least 2% slower there). The rule is on the predicted span, not the name: a load-driven formation that
raises no degree has the memory-driven formation's span and may be chosen in its place (the rule before this one,
on the name, then skipped Megatron's placement where it was predicted 3-10% faster). The placement is stopped after
any microbatch once a lower bound on its span shows that it cannot change the choice
(:mod:`~lightning_hydra.planner.mcore_bound`): the same choice, for a part of the planning time."""


MCORE_MARGIN = 0.005
"""Where Megatron's own placement is a candidate, hydra keeps it unless the chosen candidate is predicted at least
this much faster under the planner's own model (and as long as static's is not predicted faster than it): a gain
within the calibrated model's resolution is not worth leaving the baseline's plan, whose balance holds under any
model. Measured on the robustness grid's held-out decisions where Megatron's plan was a candidate (64 ranks, 512 x
32K; the chosen candidate's predicted gain over Megatron's plan against its gain under the truth): the 13 choices
at a predicted gain of 0.5-1% came out 0.02% faster on average and 2.1% slower at worst (512 x 32K stdlib x
``tile512``: a lifted formation whose smaller chunks the truth's tile floor charged more than the calibrated model
did); the 20 at 1-2% came out 0.6% faster on average, 0.2% slower at worst. On drawn truths and other batches
(``--random-truths``, 64 ranks x 32K/256K and 512 ranks x 32K) raising the margin from 0.5% to 1% changed no worst
cell and the mean by at most 0.03%; 2% cost 0.2%. Keeping mcore's plan may leave hydra's predicted time up to this
margin above its own memory-driven formation's; never above mcore's or static's. The margin is also a limit
:class:`~lightning_hydra.planner.mcore_bound.Hopeless` must clear before it stops Megatron's placement: at 1% it
stops later than at 0.5% (hydra's plan 1.05-1.15x the CPU time at 2,048 ranks, ``bench.schedule``). Back at 0.5%
since the token-wise work is charged at ``L / d`` (2026-12-03): the calibrated model now predicts Megatron's plan as
the truth times it, and on 282 32K cells where that plan is a candidate (the grid's 64 and 512 x 32K, 512 x 32K at
90% fill, the 1B and 70B shapes at 64 and 512 ranks, 12 drawn truths) 0.5% against 1% raised 73 cells (by up to
0.9%), lowered 2 (by at most 0.08%, the loop's path) and left none under 1.00; the grid's 60 256K cells at 64 and
512 ranks came out the same."""


FEWER_SHARE = 0.01
"""Share of the predicted step that the fixed costs of the microbatches a denser plan saves must exceed for the
memory-driven formation planned for fewer microbatches to join the candidates (:func:`fewer_microbatches`). Every
busy rank pays the model's fixed cost (``CostModel.fixed``: launches, GEMMs below peak on few tokens) once per
microbatch; spread evenly over the asked microbatches, a batch that fits fewer pays it more often than Megatron's
first fit, which packs each microbatch to its tokens. Own-model scan with Megatron's placement not formed
(``mcore_budget=0``; 64 and 512 ranks x 32K x three distributions x 8/16 microbatches x 50/90% fill x a model with
0.1 s per microbatch and three calibrated by the closed loop to truths with 0.13-0.7 s): with this candidate
hydra's predicted step came out better in 22 of the 96 batches (by up to 4.7%; every gain above 0.5% at 16
microbatches) and worse in none; Megatron's over hydra's predicted step 0.995 -> 1.000 on average. Under the
analytic model (no fixed cost on a single rank) it is never formed."""


EXPLORE_GAIN = 0.01
"""Least share by which the planner's own (calibrated) model must predict a formation faster than the robust
choice for hydra to plan it instead while the calibration window has timed no plain ring (one without a Ulysses
level) on a link the formation's plain rings use (:func:`_explore`)."""

EXPLORE_RISK = 0.10
"""Largest worst-case regret excess (:func:`~lightning_hydra.planner.robust.standing`, the members weighted as the
choice weighs them) of a formation hydra plans to time rings its hedges are about: what the step that times them
may cost if the hedge was right. The same bound as :data:`~lightning_hydra.planner.robust.BASELINE_SLACK`; the
step the slack was set by (a fine candidate predicted 12-17% slower by the ring member, timed at 0.41 efficiency
against 0.73) is outside it."""


def fewer_microbatches(req: PlanRequest, tables: Tables) -> int | None:
    """The microbatches the denser memory-driven candidate is planned for, or ``None`` where it is not formed: the
    fewest that the batch's tokens (at the memory minimum, zigzag padding included) could fill, where that is fewer
    than asked and the fixed cost the saved microbatches would pay on every rank exceeds :data:`FEWER_SHARE` of the
    step (the work at the memory minimum spread over the pool, plus the fixed cost of every asked microbatch). The
    formation spills into more where its groups cannot reach the tokens. Never with pipeline stages (fewer
    microbatches raise a pipeline's warm-up and cool-down share).

    Args:
        req: The validated request.
        tables: The power-of-two degree set's cost tables (:class:`~lightning_hydra.planner.formation.Tables`).
    """
    asked, fixed = req.num_microbatches, tables.fixed_min
    if req.pipeline_stages > 1 or fixed <= 0.0:
        return None
    fewest = max(1, math.ceil(float(tables.tokens_min.sum()) / (req.world_size * req.capacity)))
    step = float(tables.work_min.sum()) / req.world_size + asked * fixed
    if fewest >= asked or (asked - fewest) * fixed <= FEWER_SHARE * step:
        return None
    return fewest


def candidates(req: PlanRequest, tables: dict[str, Tables] | None = None) -> list[Formation]:
    """The formations of :data:`CANDIDATES` (cost tables shared per degree set, kept in ``tables`` where given); with
    pipeline stages also the load-driven ones shaped for the pipeline (every microbatch aiming at the same maximum,
    none merged); within :data:`LIFT_BUDGET` also the power-of-two formations lifted by :data:`LIFTS`, and those of the
    :data:`LIFTED_SETS` where their load-driven formation was formed; within :data:`FINE_LIFT_BUDGET` the ``fine``
    formation lifted by :data:`LIFTS` (of which :func:`schedule_hydra` keeps at most one, :func:`_fine_lift`); where a
    fixed cost per microbatch makes it worth it (:func:`fewer_microbatches`), the memory-driven formation planned for
    fewer microbatches than asked (named with ``/m`` and their count)."""
    tables = {} if tables is None else tables
    out: list[Formation] = []
    for name, load_driven in CANDIDATES:
        ds = DegreeSet.build(req.rules, name)
        if name == "node" and not _node_differs(req, ds, out):
            continue
        if name not in tables:
            tables[name] = Tables(req, ds)
        out.append(form(req, ds, raise_degrees=load_driven, tables=tables[name]))
        if req.pipeline_stages > 1 and load_driven:
            out.append(form(req, ds, raise_degrees=True, tables=tables[name], even=True))
    ds = DegreeSet.build(req.rules, "pow2")
    if "pow2" not in tables:
        tables["pow2"] = Tables(req, ds)
    tab = tables["pow2"]
    lifted: list[str] = []  # the power-of-two formation lifted, then LIFTED_SETS' where formed and timed
    if req.within(LIFT_BUDGET):
        lifted += ["pow2", *LIFTED_SETS] if rings_timed(req.cost) else ["pow2"]
    if req.within(FINE_LIFT_BUDGET):  # and the fine one, of whose lifts _choice keeps at most one (_fine_lift)
        lifted.append("fine")
    for name in lifted:
        base = next((f for f in out if f.degrees.name == name and not f.memory_driven), None)
        if base is not None:
            out += [form(req, base.degrees, raise_degrees=True, tables=tables[name], lift=lift) for lift in LIFTS]
    fewer = fewer_microbatches(req, tab)
    if fewer is not None:
        out.append(form(req, ds, raise_degrees=False, tables=tab, microbatches=fewer))
    return out


def _node_differs(req: PlanRequest, ds: DegreeSet, formed: list[Formation]) -> bool:
    """Whether the ``node`` formation is worth forming: within :data:`NODE_BUDGET`, and where the power-of-two
    load-driven formation (formed before it) holds a group at least as large as the first size the ``node`` set has
    and ``pow2`` lacks (``3 U``). Below that size the two sets are the same sizes with the same factorisation, so
    where no sequence's class reaches it the ``node`` formation is the ``pow2`` one again (32K contexts, where
    degrees stay within a node or two): forming it would only cost time."""
    if not req.within(NODE_BUDGET):
        return False
    pow2 = next((f for f in formed if f.degrees.name == "pow2" and not f.memory_driven), None)
    if pow2 is None:
        return True
    sizes, theirs = ds.sizes, pow2.degrees.sizes
    extra = np.setdiff1d(sizes, theirs)
    if not extra.size:
        return False
    first = int(extra[0])
    if not np.array_equal(sizes[sizes < first], theirs[theirs < first]):
        return True  # pragma: no cover - the sets agree below it by construction
    return bool(pow2.group_class.size) and int(theirs[pow2.group_class].max()) >= first


def balanced_twin(req: PlanRequest, formation: Formation, tables: dict[str, Tables] | None = None) -> Formation:
    """``formation`` formed again with every microbatch balanced at the degrees it chose
    (:func:`~lightning_hydra.planner.formation.form`'s ``balance``): the candidate that keeps a degree assignment
    (Megatron's memory-minimal one where ``formation`` is memory-driven, hydra's load-driven one else) and places
    the sequences to even out each microbatch's time under the planner's model (issue 58).

    Args:
        req: The validated request.
        formation: A formation of :func:`candidates` (its :attr:`~Formation.recipe` says how it was made).
        tables: Cost tables per degree set already computed (shared with :func:`candidates`).
    """
    recipe = formation.recipe
    if recipe is None:
        raise ValueError(f"formation {formation.name!r} has no recipe to form it again")
    ds = formation.degrees
    tab = (tables or {}).get(ds.name) or Tables(req, ds)
    return form(
        req, ds, raise_degrees=recipe.raise_degrees, tables=tab, even=recipe.even, lift=recipe.lift,
        microbatches=recipe.microbatches, balance=True,
    )  # fmt: skip


def schedule_hydra(req: PlanRequest) -> Plan:
    """Load-driven plan: the most robust of the candidate formations, the static plan and, within the budget,
    Megatron's placement (kept unless beaten by :data:`MCORE_MARGIN`), or a formation that times rings the window
    has not (:func:`_explore`).

    The plan's ``stats`` name the chosen candidate and carry every candidate's predicted span and regret (each
    member's share weighted as :func:`~lightning_hydra.planner.robust.choose` weighs it:
    :func:`~lightning_hydra.planner.robust.member_weights`); where the step times untimed rings (:func:`_explore`),
    ``explored_over`` names the choice it was planned instead of.
    """
    c = _choice(req)
    stats: dict[str, float | str] = {"candidate": c.scored[c.pick].name}
    if c.hedged != c.pick:
        stats["explored_over"] = c.scored[c.hedged].name  # the choice the step was planned instead of
    for s in c.scored:
        stats[f"span/{s.name}"] = float(s.spans[0])
        stats[f"regret/{s.name}"] = c.regret[s.name]
    if c.pick >= len(c.formed):
        if c.mcore is not None and c.scored[c.pick].name == "mcore":
            plan = _polished(req, c.mcore)
        else:
            plan = c.static.plan(req)
        if "polished" in plan.stats:  # the polish's count of changes, beside the choice's
            stats["polished"] = plan.stats["polished"]
        plan.policy = "hydra"
        plan.stats = stats
        return plan
    return c.formed[c.pick].plan(req, **stats)


@dataclass
class _Choice:
    """What :func:`schedule_hydra` chose from and what it chose."""

    formed: list[Formation]
    static: StaticLayout
    mcore: Plan | None
    scored: list[Scored]
    pick: int
    regret: dict[str, float]
    hedged: int
    """The robust choice (``pick`` unless :func:`_explore` took another formation)."""


def _fine_lift(
    formed: list[Formation], formed_spans: list[np.ndarray]
) -> tuple[list[Formation], list[np.ndarray], list[tuple[Formation, np.ndarray]]]:
    """``formed`` (and its spans) without the lifted ``fine`` formations of :func:`candidates`, and of those the one
    the planner's own model predicts fastest with its spans, where that model predicts it faster than every other
    formation (else none: :data:`FINE_LIFT_BUDGET`)."""
    lifted = [i for i, f in enumerate(formed) if _fine_lifted(f)]
    rest = [i for i in range(len(formed)) if i not in lifted]
    if not lifted or not rest:
        return [formed[i] for i in rest], [formed_spans[i] for i in rest], []
    own = [float(x[0]) for x in formed_spans]
    best = min(lifted, key=own.__getitem__)
    kept = [(formed[best], formed_spans[best])] if own[best] < min(own[i] for i in rest) else []
    return [formed[i] for i in rest], [formed_spans[i] for i in rest], kept


def _with_lifts(
    formed: list[Formation], scored: list[Scored], lifted: list[tuple[Formation, np.ndarray]], pick: int
) -> tuple[list[Formation], list[Scored], int]:
    """The choice ``pick`` made without the ``fine`` lifts, with the lifts (the one :func:`_fine_lift` kept and its
    twin) joined to the formations (after them in ``formed`` and ``scored``, before static and Megatron's placement):
    still ``pick``, unless a lift is predicted faster by the planner's own model (by :data:`MCORE_MARGIN` where
    ``pick`` is Megatron's placement) and no slower by any member of the ensemble, then the fastest such lift under the
    planner's model (:data:`FINE_LIFT_BUDGET`)."""
    if not lifted:
        return formed, scored, pick
    n = len(formed)
    scored = [*scored[:n], *(Scored(f.name, x, False) for f, x in lifted), *scored[n:]]
    pick = pick if pick < n else pick + len(lifted)
    chosen = scored[pick].spans
    faster = chosen[0] * (1 - MCORE_MARGIN) if scored[pick].name == "mcore" else chosen[0]
    wins = [n + i for i, (_, x) in enumerate(lifted) if x[0] < faster and np.all(x <= chosen * (1 + TIE))]
    if wins:
        pick = min(wins, key=lambda i: float(scored[i].spans[0]))
    return [*formed, *(f for f, _ in lifted)], scored, pick


def _fine_lifted(formation: Formation) -> bool:
    """Whether ``formation`` is the ``fine`` load-driven formation lifted (:data:`FINE_LIFT_BUDGET`), not its twin."""
    recipe = formation.recipe
    return formation.degrees.name == "fine" and recipe is not None and recipe.lift != 1.0 and not formation.balanced


def _choice(req: PlanRequest) -> _Choice:
    """Form and score the candidates and choose one; Megatron's placement joins them within :data:`MCORE_BUDGET`,
    or within :data:`MCORE_BUDGET_MEMORY` where the choice without it is within :data:`MCORE_REACH` of the
    memory-driven formation."""
    lengths = req.lengths
    tables: dict[str, Tables] = {}
    formed = candidates(req, tables)
    static = static_layout(req)
    models = ensemble(req.cost)
    weights = member_weights(models)

    def spans(*flat: np.ndarray | int, crosses: np.ndarray | None = None) -> np.ndarray:
        return spans_of(models, lengths, *flat, req.pipeline_stages, crosses)

    # the Megatron-shaped formation (the memory-driven one for the asked microbatches), static and mcore bound
    # hydra's own prediction; each scored as laid out (a ring is charged the link its ranks use)
    formed_spans = [spans(*f.flat(), crosses=f.crosses(req)) for f in formed]
    formed, formed_spans, lifted = _fine_lift(formed, formed_spans)
    if formed and req.within(BALANCE_BUDGET):  # the front-runners under the planner's own model, balanced
        for i in _twin_sources(formed, formed_spans, req.within(TWIN_BUDGET) and rings_timed(req.cost)):
            twin = balanced_twin(req, formed[i], tables)
            formed.append(twin)
            formed_spans.append(spans(*twin.flat(), crosses=twin.crosses(req)))
        if lifted:  # the kept fine lift's own twin
            twin = balanced_twin(req, lifted[0][0], tables)
            lifted.append((twin, spans(*twin.flat(), crosses=twin.crosses(req))))
    memory = [i for i, f in enumerate(formed) if f.memory_driven]
    shaped = [f.memory_driven and f.planned_for == req.num_microbatches and not f.balanced for f in formed]
    scored = [Scored(f.name, x, b) for f, x, b in zip(formed, formed_spans, shaped, strict=True)]
    scored.append(Scored("static", spans(*static.flat(), crosses=static.crosses(req)), True))
    budget = MCORE_BUDGET if req.mcore_budget is None else req.mcore_budget
    mcore = schedule_mcore_fast(req) if req.within(budget) else None
    if mcore is None:
        pick, regret = choose(scored, weights, BASELINE_SLACK)
        if req.mcore_budget is None and _within_reach(scored, pick, memory) and req.within(MCORE_BUDGET_MEMORY):
            # formed until it provably cannot change the choice (then ``None``: the choice stands)
            hopeless = Hopeless(req, models, weights, scored, pick, BASELINE_SLACK, MCORE_MARGIN)
            mcore = schedule_mcore_fast(req, stop=hopeless)
    if mcore is not None:
        mb, start, u, r, seq, gid = mcore.flat()
        crosses = req.cost.crossing(start, u * r)
        scored.append(Scored("mcore", spans(mb, u, r, seq, gid, mcore.num_microbatches, crosses=crosses), True))
        pick, regret = choose(scored, weights, BASELINE_SLACK)
        if scored[pick].name != "mcore":
            own, static_own = scored[-1].spans[0], scored[len(formed)].spans[0]  # mcore's (scored last) and static's
            if scored[pick].spans[0] > own * (1 - MCORE_MARGIN) and own <= static_own * (1 + TIE):
                pick = len(scored) - 1
    if lifted:  # joined once the choice without them is made; the regrets (stats) among every candidate
        formed, scored, pick = _with_lifts(formed, scored, lifted, pick)
        regret = choose(scored, weights, BASELINE_SLACK)[1]
    return _Choice(formed, static, mcore, scored, _explore(req, formed, scored, weights, pick), regret, pick)


def _explore(req: PlanRequest, formed: list[Formation], scored: list[Scored], weights: np.ndarray, pick: int) -> int:
    """The formation to plan instead of the robust choice ``pick`` so that the step times plain rings on a link the
    calibration window has not timed them on, or ``pick``.

    Until a window times plain rings on a link, the ensemble's members charge them what they may cost there (the link
    halved, slowed as the all-to-all, a larger exposed share), and the choice avoids formations that use them; the loop
    then never times them, and the hedge stays whether the truth agrees or not (measured with ``bench.robust`` when "A
    loop that times the rings its hedge is about" was made). Once the model is a calibrated one that has timed rings
    (``CostModel.rings_measured``, which stays set), hydra plans the formation its own model predicts fastest among
    those with plain rings on an untimed link the choice's own rings do not time, where that model predicts it at least
    :data:`EXPLORE_GAIN` faster than the choice, it may be chosen (no slower than the baselines under the planner's
    model, within the baseline slack under every member) and its worst regret is at
    most 1 + :data:`EXPLORE_RISK`.
    The refit after that step marks the link timed: the members stop hedging it, and the choice follows what the
    rings cost. Each such step times a link the window had not, so a window explores at most once per link (twice
    where steps are planned one ahead, :class:`~lightning_hydra.HydraDataModule`'s ``plan_ahead``: the next step was
    planned before the refit that marks it). The regrets and the baseline slack are read among the candidates as
    scored: with Megatron's placement where it was formed, without it where
    :class:`~lightning_hydra.planner.mcore_bound.Hopeless` stopped it (which keeps the choice, not necessarily a
    regret: where it stopped on :meth:`~lightning_hydra.planner.mcore_bound.Hopeless.outranked`, Megatron's plan
    could have been the best under a member, and a formation's regret there a little higher). Read without it where
    it was formed, the fine candidate's regret on 64 x 32K standard-library batches fell under the bound and hydra
    explored rings the ring member predicted 11% slower than Megatron's plan, timed 4.7% slower. Where a plain ring's
    link cannot be read from the step's measurements
    (:func:`~lightning_hydra.planner.calibration.plain_rings_readable`), no refit would mark it, and hydra does not
    explore.

    Args:
        req: The request (its cost model tells which links were timed).
        formed: The formations, as scored first in ``scored``.
        scored: Every candidate as scored (formations, static, then Megatron's placement where formed).
        weights: Each member's regret weight (:func:`~lightning_hydra.planner.robust.member_weights`).
        pick: Index in ``scored`` of the robust choice.

    Returns:
        Index in ``scored`` of the candidate to plan.
    """
    cost = req.cost
    intra = bool(cost.ranks_per_node) and not cost.intra_rings_measured
    inter = not cost.inter_rings_measured
    if not cost.rings_measured or not (intra or inter):
        return pick
    if not plain_rings_readable(cost):
        return pick  # no refit would mark the link: exploring would not end
    if pick < len(formed):  # links the choice's own plain rings time anyway
        inside, across = formed[pick].plain_rings(req)
        intra, inter = intra and not inside, inter and not across
        if not (intra or inter):
            return pick
    regret, feasible = standing(scored, weights, BASELINE_SLACK)
    own = np.array([s.spans[0] for s in scored])
    limit = own[pick] * (1 - EXPLORE_GAIN)
    eligible = [
        i
        for i, f in enumerate(formed)
        if feasible[i]
        and regret[i] <= 1 + EXPLORE_RISK
        and own[i] < limit
        and any(used and untimed for used, untimed in zip(f.plain_rings(req), (intra, inter), strict=True))
    ]
    return min(eligible, key=lambda i: (own[i], i), default=pick)


def rings_timed(cost: CostModel) -> bool:
    """Whether ``cost`` was calibrated on plain rings over every link it tells apart (inside a node where it knows
    the node's ranks, and across nodes): the condition under which hydra adds the lifted :data:`LIFTED_SETS`
    formations and the twins within :data:`TWIN_REACH`. Until then the ensemble's ring members charge plain rings
    what they may cost, and these candidates (balanced, lifted, in whole Ulysses blocks) are hedges close enough to
    the fine formation's span that robust selection takes them over it: a closed loop would then never time plain
    rings, and never learn that they cost what its model says (measured on drawn truths at 512 ranks x 256K, where
    that kept hydra 2.5-3.1% below the fine formation its model ranked first)."""
    return cost.rings_measured and cost.plain_rings_timed


def _twin_sources(formed: list[Formation], formed_spans: list[np.ndarray], reach: bool = True) -> list[int]:
    """The formations :func:`balanced_twin` forms again balanced: the front-runner under the planner's own model and,
    with ``reach``, every load-driven formation predicted within :data:`TWIN_REACH` of it (one per predicted span:
    equal spans are the same plan).

    Args:
        formed: The formations of :func:`candidates`.
        formed_spans: Their spans under the ensemble (the planner's own model first).
        reach: Whether the formations within reach join the front-runner (:data:`TWIN_BUDGET`).
    """
    own = np.array([x[0] for x in formed_spans])
    best = int(np.argmin(own))
    out, seen = [best], {float(own[best])}
    if not reach:
        return out
    for i in np.argsort(own, kind="stable").tolist():
        f = formed[i]
        if i == best or f.memory_driven or float(own[i]) in seen or own[i] > own[best] * (1 + TWIN_REACH):
            continue
        out.append(i)
        seen.add(float(own[i]))
    return out


def _within_reach(scored: list[Scored], pick: int, memory: list[int]) -> bool:
    """Whether a memory-driven formation is chosen or the choice is predicted less than :data:`MCORE_REACH`
    faster than the fastest of them under the planner's own model (then Megatron's placement, which places the same
    degrees more densely, may beat the choice).

    Args:
        scored: The candidates as scored.
        pick: Index of the choice in ``scored``.
        memory: Indices in ``scored`` of the memory-driven formations (:attr:`Formation.memory_driven`: the one for
            the asked microbatches and the one planned for fewer, :func:`fewer_microbatches`).

    Returns:
        Whether Megatron's placement may change the choice (``False`` without a memory-driven formation).
    """
    fastest = min((scored[i].spans[0] for i in memory), default=np.inf)
    return bool(scored[pick].spans[0] >= fastest * (1 - MCORE_REACH))


def candidate_plans(req: PlanRequest) -> dict[str, Plan]:
    """Every plan :func:`schedule_hydra` chooses from, by candidate name: the formations of :func:`candidates` as it
    keeps them (at most one ``fine`` lift, :func:`_fine_lift`) with their balanced twins, the
    ``static`` plan and, where it joins them (:data:`MCORE_BUDGET`, :data:`MCORE_BUDGET_MEMORY`), ``mcore``'s
    placement as hydra keeps it (polished within :data:`POLISH_BUDGET`).

    For benchmarks: timed under a cost truth, the best of them bounds what any choice among these candidates could
    reach, which tells a choice that missed the best candidate from candidates that all fall short.

    Args:
        req: The validated request (as :func:`~lightning_hydra.planner.schedule` builds it).
    """
    c = _choice(req)
    plans = {f.name: f.plan(req) for f in c.formed}
    plans["static"] = c.static.plan(req)
    if c.mcore is not None:
        plans["mcore"] = _polished(req, c.mcore)
    return plans


def _polished(req: PlanRequest, plan: Plan) -> Plan:
    """Megatron's placement as hydra keeps it: polished within :data:`POLISH_BUDGET` for single-stage plans."""
    if req.pipeline_stages == 1 and req.within(POLISH_BUDGET):
        return polish(plan, req.cost, req.capacity)[0]
    return plan
