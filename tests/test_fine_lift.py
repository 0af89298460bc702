"""The ``fine`` formation lifted (``planner.hydra.FINE_LIFT_BUDGET``): formed within its budget, kept by the choice
only where the planner's own model ranks it first, and what it is worth after a closed loop."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lightning_hydra.planner.hydra as hydra
from lightning_hydra.bench.robust import LLAMA_8B, cell_batches, closed_loop, efficiency, plan_batch, plan_request
from lightning_hydra.bench.schedule import llama8b_cost
from lightning_hydra.planner.formation import Recipe
from lightning_hydra.planner.robust import TIE, Scored
from lightning_hydra.sim.family import truth


def _fake(name: str, degrees: str, lift: float, balanced: bool = False) -> SimpleNamespace:
    recipe = Recipe(raise_degrees=True, even=False, lift=lift, microbatches=None)
    return SimpleNamespace(name=name, degrees=SimpleNamespace(name=degrees), recipe=recipe, balanced=balanced)


def test_the_fastest_lift_is_kept_only_where_it_leads_every_other_formation():
    formed = [
        _fake("pow2/load", "pow2", 1.0), _fake("fine/load", "fine", 1.0), _fake("fine/load/x1.1", "fine", 1.1),
        _fake("fine/load/x1.25", "fine", 1.25), _fake("pow2/load/x1.1", "pow2", 1.1),
    ]  # fmt: skip
    spans = [np.array([s, 9.0]) for s in (3.0, 3.2, 2.9, 2.8, 3.1)]  # the own model first, then a hedging member
    rest, rest_spans, kept = hydra._fine_lift(formed, spans)
    assert [f.name for f in rest] == ["pow2/load", "fine/load", "pow2/load/x1.1"] and rest_spans[2][0] == 3.1
    assert [(f.name, float(x[0])) for f, x in kept] == [("fine/load/x1.25", 2.8)]

    spans[3] = np.array([3.0, 9.0])  # ties the front-runner: not faster than every other formation
    spans[2] = np.array([3.05, 9.0])
    assert hydra._fine_lift(formed, spans)[2] == []
    rest, _, kept = hydra._fine_lift(formed[:2], spans[:2])  # nothing lifted: as it was
    assert rest == formed[:2] and kept == []
    assert not hydra._fine_lifted(_fake("fine/load/x1.1/bal", "fine", 1.1, balanced=True))
    assert not hydra._fine_lifted(_fake("node/load/x1.1", "node", 1.1))
    assert not hydra._fine_lifted(_fake("fine/load", "fine", 1.0))


def test_a_lift_replaces_the_choice_only_where_every_member_predicts_it_no_slower():
    formed = [_fake("pow2/memory", "pow2", 1.0), _fake("fine/load", "fine", 1.0)]
    scored = [
        Scored("pow2/memory", np.array([3.0, 3.0, 3.0]), True), Scored("fine/load", np.array([2.9, 3.4, 3.6]), False),
        Scored("static", np.array([3.2, 3.2, 3.2]), True), Scored("mcore", np.array([3.1, 2.9, 2.97]), True),
    ]  # fmt: skip
    lift, twin = _fake("fine/load/x1.1", "fine", 1.1), _fake("fine/load/x1.1/bal", "fine", 1.1, balanced=True)
    # faster under the planner's own model, but the third member predicts it slower than the choice: the choice stays
    lifted = [(lift, np.array([2.7, 2.9, 3.1])), (twin, np.array([2.6, 2.8, 3.05]))]
    new_formed, new_scored, pick = hydra._with_lifts(formed, scored, lifted, 0)
    assert [s.name for s in new_scored] == ["pow2/memory", "fine/load", lift.name, twin.name, "static", "mcore"]
    assert new_formed == [*formed, lift, twin] and pick == 0
    assert hydra._with_lifts(formed, scored, lifted, 3)[2] == 5  # Megatron's placement chosen: still it, moved
    # no slower under any member: the fastest such lift under the planner's model
    lifted = [(lift, np.array([2.7, 2.9, 2.95])), (twin, np.array([2.6, 2.8, 3.0]))]
    assert hydra._with_lifts(formed, scored, lifted, 0)[2] == 3
    assert hydra._with_lifts(formed, scored, lifted, 3)[2] == 2  # the twin: slower than Megatron's under one member
    # Megatron's placement is kept unless beaten by the margin under the planner's own model
    close = [(lift, np.array([3.1 * (1 - hydra.MCORE_MARGIN / 2), 2.9, 2.95]))]
    assert hydra._with_lifts(formed, scored, close, 3)[2] == 4 and hydra._with_lifts(formed, scored, close, 0)[2] == 0
    ahead = [(lift, np.array([3.0 * (1 - hydra.MCORE_MARGIN / 2), 2.9, 2.95]))]  # barely, against a formation
    assert hydra._with_lifts(formed, scored, ahead, 0)[2] == 2
    assert hydra._with_lifts(formed, scored, [], 1) == (formed, scored, 1)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_model_that_makes_short_rings_free_takes_no_lift(seed):
    """Counterexamples kept: a model whose refit put ``ring_exposure`` at 0 (rings timed only where attention hid
    them; ``tests/test_truth_family.py`` has its story) ranks the lifted ``fine`` formations first (32 ranks x 32K
    standard-library lengths, 4 microbatches). Before the guard hydra took them, and the ``share50`` truth timed them
    0.73x (seed 0) and 0.87x (seed 3) the choice without them; the member that charges exposed rings predicts them
    slower than that choice, and hydra keeps it."""
    fitted = llama8b_cost().replace(
        ring_exposure=0.0, intra_node_bandwidth=74e9, bin_overhead=0.034, rings_measured=True,
        intra_rings_measured=True, inter_rings_measured=True,
    )  # fmt: skip
    batch = cell_batches("stdlib", 32, "32K", range(seed, seed + 1), 0.75, 4)[0]
    req = plan_request(batch, fitted, 32, "32K", 4)  # the request plan_batch builds
    choice = hydra._choice(req)
    own = {s.name: s.spans for s in choice.scored}
    lift = next(f.name for f in choice.formed if f.name.startswith("fine/load/x"))  # kept: the model ranks it first
    pick = choice.scored[choice.hedged]
    assert not pick.name.startswith("fine/load/x") and choice.pick == choice.hedged
    assert own[lift][0] < pick.spans[0]  # the planner's own model prefers the lift: a member turns it down
    assert (own[lift] > pick.spans).any()
    hw = truth("share50", LLAMA_8B.num_layers)
    chosen = plan_batch(batch, "hydra", fitted, 32, "32K", 4)[0]
    lifted = hydra.candidate_plans(req)[lift]
    assert efficiency(lifted, hw)[0] < 0.9 * efficiency(chosen, hw)[0]


def test_the_fine_formation_is_lifted_within_its_budget(monkeypatch):
    """Each lift is a valid plan of the whole batch and spends no more ranks per token than the unlifted ``fine``
    formation; above ``FINE_LIFT_BUDGET`` none is formed."""
    batch = cell_batches("lognormal", 64, "32K", range(3, 4))[0]
    req = plan_request(batch, llama8b_cost(), 64, "32K")
    formed = {f.name: f for f in hydra.candidates(req)}
    lifted = [f"fine/load/x{lift:g}" for lift in hydra.LIFTS]
    assert set(lifted) <= set(formed)

    def ranks_per_token(name: str) -> float:
        plan = formed[name].plan(req)
        plan.check(req.lengths.tolist(), req.capacity)
        return float((plan.sequence_degrees() * req.lengths).sum() / req.lengths.sum())

    unlifted = ranks_per_token("fine/load")
    assert all(ranks_per_token(name) <= unlifted + 1e-9 for name in lifted)
    monkeypatch.setattr(hydra, "FINE_LIFT_BUDGET", batch.size * math.sqrt(64) - 1)
    assert not {f.name for f in hydra.candidates(req)} & set(lifted)


CALIBRATED = dict(
    attn=1.7666e-09, linear=6.0711e-05, seq_overhead=0.0, length_overhead=1.8118e-06, bin_overhead=0.034275,
    intra_node_bandwidth=4.0034e11, a2a_latency=1.8986e-3, p2p_latency=1.0317e-3, ring_share=0.0, ring_exposure=0.51807,
    rings_measured=True, intra_rings_measured=True, inter_rings_measured=True, exposure_measured=True,
)  # fmt: skip
"""The model the closed loop of 64 ranks x 32K lognormal lengths under the ``base`` truth fits (rounded): rings timed
on both links, their exposure checked."""


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000), dist=st.sampled_from(["lognormal", "pareto", "stdlib"]),
    context=st.sampled_from(["32K", "256K"]), calibrated=st.booleans(),
)  # fmt: skip
@example(seed=0, dist="lognormal", context="32K", calibrated=False)  # no lift kept
@example(seed=2, dist="lognormal", context="32K", calibrated=False)  # kept, not chosen
@example(seed=1000, dist="lognormal", context="32K", calibrated=True)  # kept and chosen
def test_the_choice_is_the_one_without_lifts_or_a_lift_none_predicts_slower(seed, dist, context, calibrated):
    """Over random batches, under the analytic model and a calibrated one: the choice forms and scores what it did
    without the lifts, plus at most one lift and its twin, which its own model predicts faster than every other
    formation; it chooses what it chose without them, or a lift that every member of the ensemble predicts no slower
    than that choice; the plan it makes is a valid plan of the whole batch."""
    cost = llama8b_cost().replace(**CALIBRATED) if calibrated else llama8b_cost()
    req = plan_request(cell_batches(dist, 64, context, range(seed, seed + 1))[0], cost, 64, context)
    choice = hydra._choice(req)
    budget = hydra.FINE_LIFT_BUDGET
    try:
        hydra.FINE_LIFT_BUDGET = 0
        before = hydra._choice(req)
    finally:
        hydra.FINE_LIFT_BUDGET = budget
    names = [s.name for s in choice.scored]
    lifts = [n for n in names if n.startswith("fine/load/x")]
    assert len(lifts) in (0, 2) and all(n.removesuffix("/bal") == lifts[0] for n in lifts)  # the lift and its twin
    if lifts:  # kept only ahead of every other formation under the planner's own model
        own = {s.name: float(s.spans[0]) for s in choice.scored}
        assert own[lifts[0]] < min(own[f.name] for f in choice.formed if not f.balanced and f.name != lifts[0])
    assert [n for n in names if n not in lifts] == [s.name for s in before.scored]
    for mine, theirs in zip([s for s in choice.scored if s.name not in lifts], before.scored, strict=True):
        assert np.array_equal(mine.spans, theirs.spans)
    was, now = before.scored[before.hedged], choice.scored[choice.hedged]
    if now.name != was.name:
        assert now.name in lifts and now.spans[0] < was.spans[0]
        assert np.all(now.spans <= was.spans * (1 + TIE))
    plan = hydra.schedule_hydra(req)
    plan.check(req.lengths.tolist(), req.capacity)
    assert plan.stats["candidate"] == now.name


@pytest.mark.parametrize(
    ("seed", "calibrated", "kept", "chosen"),
    [(0, False, False, False), (2, False, True, False), (1000, True, True, True)],
)
def test_the_property_s_examples_reach_each_outcome(seed, calibrated, kept, chosen):
    """The three examples of the property above reach its three outcomes: no lift kept, a lift kept but the choice
    without it standing, and a lift chosen (64 ranks x 32K lognormal lengths)."""
    cost = llama8b_cost().replace(**CALIBRATED) if calibrated else llama8b_cost()
    batch = cell_batches("lognormal", 64, "32K", range(seed, seed + 1))[0]
    choice = hydra._choice(plan_request(batch, cost, 64, "32K"))
    names = [s.name for s in choice.scored]
    assert any(n.startswith("fine/load/x") for n in names) == kept
    assert names[choice.hedged].startswith("fine/load/x") == chosen


def test_after_a_closed_loop_hydra_takes_a_fine_lift_the_truth_times_faster(monkeypatch):
    """64 ranks x 32K lognormal lengths under the ``base`` truth, held-out batch 1000: after the closed loop hydra
    chooses the ``fine`` formation lifted, which the truth times at least 1% faster than hydra's choice without the
    lifts (its own closed loop) and than Megatron's plan."""
    hw = truth("base", LLAMA_8B.num_layers)
    loop = cell_batches("lognormal", 64, "32K", range(2000, 2008))
    batch = cell_batches("lognormal", 64, "32K", range(1000, 1001))[0]
    cost = closed_loop(loop, hw, 64, "32K")
    plan, _ = plan_batch(batch, "hydra", cost, 64, "32K")
    with monkeypatch.context() as m:
        m.setattr(hydra, "FINE_LIFT_BUDGET", 0)
        before, _ = plan_batch(batch, "hydra", closed_loop(loop, hw, 64, "32K"), 64, "32K")
    megatron, _ = plan_batch(batch, "mcore", cost, 64, "32K")
    assert str(plan.stats["candidate"]).startswith("fine/load/x")
    assert not str(before.stats["candidate"]).startswith("fine/load/x")
    mine = efficiency(plan, hw)[0]
    assert mine > 1.01 * efficiency(before, hw)[0] and mine > 1.01 * efficiency(megatron, hw)[0]
