"""The efficiency ceiling: no plan of any policy beats it under any truth, and it is exact where a plan can reach it."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hydra.bench.batches import make_batch
from lightning_hydra.bench.robust import LLAMA_8B, efficiency, plan_request
from lightning_hydra.bench.schedule import CONTEXTS, llama8b_cost
from lightning_hydra.planner import schedule
from lightning_hydra.planner.hydra import candidate_plans
from lightning_hydra.sim import bin_time
from lightning_hydra.sim.ceiling import efficiency_ceiling, span_floor
from lightning_hydra.sim.family import TRUTHS, truth
from lightning_hydra.sim.truth import group_times


def _floor(lengths, world, capacity, hw, **kw):
    return span_floor(
        np.asarray(lengths), world_size=world, capacity=capacity, model=LLAMA_8B, hardware=hw, layers=32,
        head_share=1.0, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("world", "context", "dist"), [(16, "256K", "lognormal"), (32, "32K", "pareto"), (64, "256K", "stdlib")]
)
def test_no_plan_beats_the_ceiling_under_any_truth(world, context, dist):
    """Every candidate hydra forms, static's and mcore's plans, timed by every truth, stay at or below the ceiling
    (a floor that missed a cost some plan avoids would fail here)."""
    longest, capacity = CONTEXTS[context]
    lengths = make_batch(
        dist, world_size=world, capacity=capacity, num_microbatches=4, fill=0.75, context=longest, seed=5
    )
    plans = dict(candidate_plans(plan_request(lengths, llama8b_cost(), world, context, microbatches=4)))
    plans["mcore"] = schedule(
        lengths, world_size=world, num_microbatches=4, max_tokens_per_rank=capacity, cost=llama8b_cost(),
        policy="mcore", ranks_per_node=8, num_heads=32, num_kv_heads=8, max_seq_len=longest,
    )  # fmt: skip
    for name in TRUTHS:
        hw = truth(name, LLAMA_8B.num_layers)
        ceiling = efficiency_ceiling(lengths, world_size=world, capacity=capacity, model=LLAMA_8B, hardware=hw)
        for policy, plan in plans.items():
            assert efficiency(plan, hw)[0] <= ceiling * (1 + 1e-9), (name, policy)
        assert 0 < ceiling < 1


def test_the_floor_is_exact_where_a_plan_reaches_it():
    """One full rank per sequence in one microbatch: every rank runs what the floor charges. A sequence over four
    ranks as one ring: the floor is the ring's time but for the per-step latencies, which it leaves out."""
    hw = truth("share50", LLAMA_8B.num_layers)
    capacity = 4096
    one = bin_time(np.asarray([capacity]), 1, 1, model=LLAMA_8B, hardware=hw, layers=32, head_share=1.0)
    assert _floor([capacity] * 8, 8, capacity, hw) == pytest.approx(one, rel=1e-12)
    ring = bin_time(np.asarray([4 * capacity]), 1, 4, model=LLAMA_8B, hardware=hw, layers=32, head_share=1.0)
    latencies = 32 * 3 * (2 * hw.p2p_latency + hw.ring_step_overhead)
    assert _floor([4 * capacity], 4, capacity, hw, ulysses=[1]) == pytest.approx(ring - latencies, rel=1e-12)
    # with Ulysses allowed the floor takes the cheaper factorisation (it is a floor over every plan)
    assert _floor([4 * capacity], 4, capacity, hw) <= (ring - latencies) * (1 + 1e-12)


@pytest.mark.parametrize(("name", "engine", "ulysses", "ring"), [
    ("seq50", "hydra", 2, 1),  # per-sequence bookkeeping on every rank, all-to-all bytes at (u - 1) / u
    ("worst", "hydra", 2, 2),  # no GQA saving, a fixed ring share, the tile floor, per-sequence bookkeeping
    ("share25", "te-p2p", 1, 4),  # Transformer Engine's ring: dK and dV in the activation dtype
])  # fmt: skip
def test_the_floor_is_exact_for_every_term_where_one_group_reaches_it(name, engine, ulysses, ring):
    """A lone sequence on ``u * r`` ranks inside a node, only that factorisation allowed: the floor is the truth's
    time of the group but for its latencies (all-to-all and ring steps), which a plan may share and it leaves out."""
    hw = truth(name, LLAMA_8B.num_layers)
    capacity, d = 4096, ulysses * ring
    length = d * capacity
    group = bin_time(
        np.asarray([length]), ulysses, ring, model=LLAMA_8B, hardware=hw, layers=32, head_share=1.0, engine=engine
    )
    latencies = 32 * (4 * hw.a2a_latency * (ulysses > 1) + (ring - 1) * (2 * hw.p2p_latency + hw.ring_step_overhead))
    floor = _floor([length], d, capacity, hw, ulysses=[ulysses], engine=engine)
    assert floor == pytest.approx(group - latencies, rel=1e-12)


def test_a_ring_inside_a_node_is_charged_the_faster_link():
    """A group of up to a node's ranks may be laid out across two nodes; where the inter-node link is the faster one
    (not the case in the truth family) the floor charges that one, and stays below the crossing ring's time."""
    hw = truth("share50", LLAMA_8B.num_layers).replace(intra_node_bandwidth=100e9, inter_node_bandwidth=800e9)
    length, capacity = 4 * 4096, 4096
    crossing = group_times(
        np.asarray([float(length)]), np.zeros(1, dtype=np.int64), np.asarray([1]), np.asarray([4]), model=LLAMA_8B,
        hardware=hw, layers=32, head_share=1.0, crosses=np.asarray([True]),
    )[0]  # fmt: skip
    assert _floor([length], 4, capacity, hw, ulysses=[1]) <= crossing
    with pytest.raises(ValueError, match="at least one"):
        _floor([length], 4, capacity, hw, ulysses=[])


def test_ring_share_raises_the_floor_only_for_sequences_that_need_rings():
    short, long_ = [2048] * 16, [65536] * 2
    low, high = truth("share0", LLAMA_8B.num_layers), truth("share50", LLAMA_8B.num_layers)
    assert _floor(short, 16, 4096, low) == pytest.approx(_floor(short, 16, 4096, high), rel=1e-12)
    assert _floor(long_, 32, 4096, high, ulysses=[1]) > _floor(long_, 32, 4096, low, ulysses=[1])


def test_bad_input_is_refused():
    hw = truth("base", LLAMA_8B.num_layers)
    with pytest.raises(ValueError, match="needs 5 ranks"):
        _floor([5 * 4096], 4, 4096, hw)
    with pytest.raises(ValueError, match="positive"):
        _floor([0, 10], 4, 4096, hw)
    with pytest.raises(ValueError, match="engine"):
        _floor([10], 4, 4096, hw, engine="nccl")
    assert _floor([], 4, 4096, hw) == 0.0
