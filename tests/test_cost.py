"""The cost model: coefficients from the model shape, predictions, and the vectorised table."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hydra.planner import CostModel


def test_for_transformer_coefficients_follow_flop_counts() -> None:
    hidden, layers, heads, kv, ffn, vocab, rate = 256, 4, 8, 2, 1024, 1000, 1e12
    cost = CostModel.for_transformer(hidden, layers, heads, kv, ffn, vocab, flops_per_second=rate)
    kv_dim = kv * hidden // heads
    params = layers * (hidden * (hidden + 2 * kv_dim) + hidden * hidden + 3 * hidden * ffn) + hidden * vocab
    assert cost.linear == pytest.approx(6 * params / rate)
    assert cost.attn == pytest.approx(6 * hidden * layers / rate)
    assert float(cost.useful(1000)) == pytest.approx(cost.attn * 1e6 + cost.linear * 1e3)


def test_one_rank_has_no_communication(cost: CostModel) -> None:
    assert float(cost.comm(50_000, 1, 1)) == 0.0
    assert float(cost.sequence(50_000)) == pytest.approx(float(cost.useful(50_000)) + cost.seq_overhead)


def test_splitting_divides_compute_and_charges_communication(cost: CostModel) -> None:
    length = 131072
    one = float(cost.sequence(length))
    eight = float(cost.sequence(length, 8, 1))
    assert float(cost.comm(length, 8, 1)) > 0
    assert eight * 8 > one - 8 * cost.seq_overhead  # communication makes the split cost more rank-time
    assert eight < one / 4  # but each rank finishes much sooner


def test_short_sequences_expose_ring_communication(cost: CostModel) -> None:
    # ring steps hide behind attention for long sequences, not for short ones
    exposed_short = float(cost.comm(2048, 1, 4)) / float(cost.compute(2048, 4))
    exposed_long = float(cost.comm(262144, 1, 4)) / float(cost.compute(262144, 4))
    assert exposed_short > exposed_long


def test_table_matches_broadcast_sequence(cost: CostModel) -> None:
    lengths = np.array([1, 17, 4096, 100_000, 262_144])
    u = np.array([1, 2, 8, 8, 1, 4])
    r = np.array([1, 1, 1, 4, 5, 3])
    expected = cost.sequence(lengths[None, :].astype(float), u[:, None], r[:, None])
    np.testing.assert_allclose(cost.table(lengths, u, r), expected, rtol=1e-12)


def test_bin_time_pays_ulysses_latency_once(cost: CostModel) -> None:
    one = cost.bin_time([1000], 2, 1)
    two = cost.bin_time([1000, 1000], 2, 1)
    assert two == pytest.approx(2 * one - cost.a2a_latency)
    assert cost.bin_time([], 8, 1) == 0.0


def test_round_trip_and_replace(cost: CostModel) -> None:
    again = CostModel.from_dict(cost.to_dict())
    assert again == cost
    assert cost.replace(attn=cost.attn * 3).attn == pytest.approx(cost.attn * 3)


def test_bad_shape_is_rejected() -> None:
    with pytest.raises(ValueError):
        CostModel.for_transformer(0, 2, 2)


def test_splitting_below_a_kernel_tile_buys_no_speed(cost: CostModel) -> None:
    tile = cost.min_chunk_tokens
    # 1024 tokens: compute keeps shrinking down to 128 tokens per rank (degree 8), then stops
    assert float(cost.compute(1024, 8)) < float(cost.compute(1024, 4))
    assert float(cost.compute(1024, 16)) == pytest.approx(float(cost.compute(1024, 8)))
    assert float(cost.effective_degree(100, 32)) == 1.0
    assert float(cost.effective_degree(64 * tile, 8)) == 8.0
