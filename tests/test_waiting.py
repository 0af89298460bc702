"""sim/waiting.py: a step split into useful work, overhead and the causes of its waiting."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hydra.bench.robust import LLAMA_8B, breakdown
from lightning_hydra.bench.schedule import CONTEXTS, analytic_cost
from lightning_hydra.planner import Group, Plan, schedule
from lightning_hydra.sim.family import truth
from lightning_hydra.sim.waiting import CAUSES, waiting


def _plan() -> Plan:
    """Four ranks, two microbatches: a 2-rank CP group and two single-rank bins, then four single-rank bins."""
    first = [Group((0, 1), 2, 1, (0,)), Group((2,), 1, 1, (1,)), Group((3,), 1, 1, (2,))]
    second = [Group((r,), 1, 1, (3 + r,)) for r in range(4)]
    return Plan(lengths=(8, 2, 2, 2, 2, 2, 2), world_size=4, ranks_per_node=4, microbatches=[first, second])


def test_each_cause_is_the_waiting_its_rule_names():
    # microbatch 0: the group's ranks take 10 and 9, the bins 2 and 3: mean 6, step mean 5, group 10
    # microbatch 1: bins 5, 3, 4, 4: mean 4, no group, slowest 5
    times = np.array([[10.0, 9.0, 2.0, 3.0], [5.0, 3.0, 4.0, 4.0]])
    w = waiting(_plan(), times, useful=30.0)
    assert w.total == 4 * (10 + 5)
    assert w.overhead == times.sum() - 30.0
    np.testing.assert_allclose(w.cp_groups, [4 * (10 - 6), 0])  # the group above max(step mean 5, its mean 6)
    np.testing.assert_allclose(w.microbatch_split, [0, 0])  # its microbatch is above the step's mean
    np.testing.assert_allclose(w.single_bins, [0, 4 * (5 - 4)])
    shares = w.shares()
    assert sum(shares.values()) == pytest.approx(1.0)
    assert "model_unseen" not in shares
    assert w.no_token_room == 0.0  # no capacity given


def test_waiting_on_full_ranks_has_no_token_room():
    times = np.array([[10.0, 9.0, 2.0, 3.0], [5.0, 3.0, 4.0, 4.0]])
    # tokens: microbatch 0 holds 4, 4, 2, 2 (the group splits 8); microbatch 1 holds 2 each. At capacity 4 only
    # the group's ranks are full, and of them rank 1 waits 1; at capacity 3 the 2-token ranks have room for none
    # of the 2-token sequences either
    assert waiting(_plan(), times, useful=30.0, capacity=4).no_token_room == pytest.approx(1.0)
    assert waiting(_plan(), times, useful=30.0, capacity=3).no_token_room == pytest.approx(1 + 8 + 7 + 0 + 2 + 1 + 1)


def test_a_group_in_a_light_microbatch_is_the_split():
    # microbatch 0: group 6, bins 0: mean 3; microbatch 1: all 7: mean 7; step mean 5
    times = np.array([[6.0, 6.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    w = waiting(_plan(), times, useful=40.0, predicted=times)
    np.testing.assert_allclose(w.cp_groups, [4 * (6 - 5), 0])
    np.testing.assert_allclose(w.microbatch_split, [4 * (5 - 3), 0])
    np.testing.assert_allclose(w.single_bins, [0, 0])
    assert w.shares()["model_unseen"] == pytest.approx(0.0)  # the model predicted these very times


def test_waiting_the_model_did_not_predict_is_unseen():
    times = np.array([[6.0, 6.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    even = np.full((2, 4), 5.0)
    w = waiting(_plan(), times, useful=40.0, predicted=even)
    assert w.model_unseen == pytest.approx(1 - times.sum() / (4 * 13))


def test_waiting_rejects_times_of_another_shape():
    with pytest.raises(ValueError, match="shape"):
        waiting(_plan(), np.zeros((3, 4)), useful=1.0)


def test_breakdown_adds_up_on_a_planned_batch():
    longest, capacity = CONTEXTS["32K"]
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(7.5, 1.2, 300).astype(np.int64) + 1, longest)
    cost = analytic_cost()
    plan = schedule(
        lengths, world_size=64, num_microbatches=4, max_tokens_per_rank=capacity, cost=cost, num_heads=32,
        num_kv_heads=8, max_seq_len=longest,
    )  # fmt: skip
    shares = breakdown(plan, truth("worst", 32), LLAMA_8B, cost, capacity)
    assert set(shares) == {"useful", *CAUSES, "waiting"}
    assert shares["waiting"] == pytest.approx(shares["single_bins"] + shares["cp_groups"] + shares["microbatch_split"])
    assert 0 <= shares["communication"] <= shares["overhead"] + 1e-12
    parts = [shares[k] for k in ("useful", "single_bins", "cp_groups", "microbatch_split", "overhead")]
    assert sum(parts) == pytest.approx(1.0)
    assert min(parts) >= -1e-12
    assert 0 <= shares["no_token_room"] <= 1 - shares["useful"] - shares["overhead"] + 1e-12
