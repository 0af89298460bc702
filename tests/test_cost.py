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


@pytest.mark.parametrize("tp", [2, 8])
def test_tensor_parallel_collectives_counted_with_and_without_sequence_parallelism(tp: int) -> None:
    """Per block and token, TP's collectives send all-reduce equivalents of ``2 (T - 1) / T`` of ``hidden`` elements:
    7 without sequence parallelism (forward o, down; backward q, k, v, gate, up), 4 with it (2 all-gathers and 2
    reduce-scatters forward, the same backward: each pair one all-reduce's traffic); nothing at TP 1."""
    hidden, layers, heads, kv, ffn, vocab, rate, bw = 256, 4, 8, 2, 1024, 1000, 1e12, 1e11
    shape = (hidden, layers, heads, kv, ffn, vocab)
    kv_dim = kv * hidden // heads
    blocks = layers * (hidden * (hidden + 2 * kv_dim) + hidden * hidden + 3 * hidden * ffn)
    compute = 6 * (blocks / tp + hidden * vocab) / rate
    all_reduce = hidden * 2 * layers * 2 * (tp - 1) / tp / bw  # seconds per token of one all-reduce per block
    for sp, count in ((False, 7), (True, 4)):
        cost = CostModel.for_transformer(
            *shape, flops_per_second=rate, intra_node_bandwidth=bw, tensor_parallel=tp, sequence_parallel=sp
        )
        assert cost.linear == pytest.approx(compute + count * all_reduce)
    assert CostModel.for_transformer(*shape, tensor_parallel=tp).to_dict() == (
        CostModel.for_transformer(*shape, tensor_parallel=tp, sequence_parallel=True).to_dict()
    )  # on by default, as HydraStrategy(sequence_parallel=None) at T > 1
    assert CostModel.for_transformer(*shape, sequence_parallel=False).to_dict() == (
        CostModel.for_transformer(*shape).to_dict()
    )  # unused at TP 1


def test_one_rank_has_no_communication(cost: CostModel) -> None:
    assert float(cost.comm(50_000, 1, 1)) == 0.0
    assert float(cost.sequence(50_000)) == pytest.approx(float(cost.useful(50_000)) + cost.seq_overhead)


def test_splitting_divides_compute_and_charges_communication(cost: CostModel) -> None:
    length = 131072
    one = float(cost.sequence(length))
    eight = float(cost.sequence(length, 8, 1))
    # hand-worked: Ulysses over 8 ranks (no ring) divides the useful work by 8 and adds the all-to-all of the
    # rank's 1/8 of the tokens, 7/8 of which leave the rank, and its latency; the per-sequence overhead stays
    a2a = cost.a2a_bytes_per_token * (length / 8) * 7 / 8 / cost.intra_node_bandwidth
    assert float(cost.comm(length, 8, 1)) == pytest.approx(a2a + cost.a2a_latency, rel=1e-12)
    assert eight == pytest.approx(float(cost.useful(length)) / 8 + cost.seq_overhead + a2a + cost.a2a_latency)
    # so the split costs exactly the communication (and 7 more per-sequence overheads) in rank-time
    assert 8 * eight - one == pytest.approx(8 * (a2a + cost.a2a_latency) + 7 * cost.seq_overhead, rel=1e-9)


def test_new_terms_of_the_form(cost: CostModel) -> None:
    length, u, r = 40000, 2, 4
    traffic, hideable = (float(x) for x in cost.ring_steps(length, u, r))
    base = float(cost.bin_time([length], u, r))
    # per-token chunk overhead: every rank pays it on the whole sequence, not divided by the degree
    assert float(cost.replace(length_overhead=1e-9).bin_time([length], u, r)) == pytest.approx(base + 1e-9 * length)
    # per-microbatch overhead: once per busy rank, nothing for an idle one
    assert float(cost.replace(bin_overhead=1e-3).bin_time([length], u, r)) == pytest.approx(base + 1e-3)
    assert cost.replace(bin_overhead=1e-3).bin_time([], u, r) == 0.0
    # a fixed share of the ring traffic is exposed whatever the attention hides; the exposure weight scales the rest
    shared = cost.replace(ring_share=0.5, ring_exposure=0.0)
    assert float(shared.bin_time([length], u, r)) == pytest.approx(base - max(traffic - hideable, 0) + 0.5 * traffic)


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


def test_dkv_travel_in_float32(cost: CostModel) -> None:
    # k, v forward and again backward at 2 bytes, dK, dV at 4 bytes: (4 * 2 + 2 * 4) bytes per KV element per layer
    assert cost.ring_bytes_per_token == 32 * (4 * 2 + 2 * 4) * 8 * 128
    bf16_grads = CostModel.for_transformer(4096, 32, 32, 8, 14336, 128256, grad_bytes_per_element=2)
    assert bf16_grads.ring_bytes_per_token == 32 * 6 * 2 * 8 * 128


def test_bin_time_pays_ulysses_latency_once(cost: CostModel) -> None:
    one = cost.bin_time([1000], 2, 1)
    two = cost.bin_time([1000, 1000], 2, 1)
    assert two == pytest.approx(2 * one - cost.a2a_latency)
    assert cost.bin_time([], 8, 1) == 0.0


def test_round_trip_and_replace(cost: CostModel) -> None:
    again = CostModel.from_dict(cost.to_dict())
    assert again == cost
    tripled = cost.replace(attn=cost.attn * 3)
    assert cost.to_dict() == again.to_dict()  # the original is unchanged
    assert {k: v for k, v in tripled.to_dict().items() if v != again.to_dict()[k]} == {"attn": cost.attn * 3}
    # the copy computes with the new coefficient: one rank's attention (L**2 at degree 1) costs three times as much
    length = 4096.0
    assert tripled.sequence(length) - cost.sequence(length) == pytest.approx(2 * cost.attn * length**2)


def test_bad_shape_is_rejected() -> None:
    with pytest.raises(ValueError):
        CostModel.for_transformer(0, 2, 2)


@pytest.mark.parametrize("field", ["intra_node_bandwidth", "inter_node_bandwidth", "intra_node_ring_bandwidth"])
@pytest.mark.parametrize("value", [0.0, -1e9, float("nan")])
def test_a_link_without_bandwidth_is_rejected(cost: CostModel, field: str, value: float) -> None:
    # a zero bandwidth gave NaN even for bins that never use the link (0 bytes / 0 B/s), found by fuzzing
    with pytest.raises(ValueError, match=field):
        cost.replace(**{field: value})
    with pytest.raises(ValueError, match=field):
        CostModel.from_dict({**cost.to_dict(), field: value})
    assert cost.replace(**{field: float("inf")}).bin_time([1000], 1, 1) == cost.bin_time([1000], 1, 1)


def test_splitting_below_a_kernel_tile_buys_attention_no_speed(cost: CostModel) -> None:
    tile = cost.min_chunk_tokens
    # 1024 tokens: attention keeps shrinking down to 128 tokens per rank (degree 8), then stops; the token-wise work
    # (GEMMs on the tokens a rank holds) keeps shrinking with the degree
    assert float(cost.compute(1024, 8)) < float(cost.compute(1024, 4))
    below = float(cost.compute(1024, 16)) - float(cost.compute(1024, 8))
    assert below == pytest.approx(cost.linear * 1024 * (1 / 16 - 1 / 8))
    attention = cost.replace(linear=0.0)
    assert float(attention.compute(1024, 16)) == pytest.approx(float(attention.compute(1024, 8)))
    assert float(cost.effective_degree(100, 32)) == 1.0
    assert float(cost.effective_degree(64 * tile, 8)) == 8.0


@pytest.mark.parametrize(("ulysses", "ring"), [(1, 1), (4, 1), (2, 4)])
def test_longest_within_is_the_boundary_of_the_budget(cost: CostModel, ulysses: int, ring: int) -> None:
    model = cost.replace(length_overhead=1e-10, ring_share=0.2)
    budget = np.array([0.03, 0.3, 2.0])
    longest = model.longest_within(budget, ulysses, ring)
    d = ulysses * ring

    def alone(length: np.ndarray) -> np.ndarray:  # what the bound counts: compute, all-to-all, the exposed share
        traffic, _ = model.ring_steps(length, ulysses, ring)
        return model.compute(length, d) + model.a2a(length, ulysses, ring) + model.ring_share * traffic

    below, above = np.floor(longest), np.floor(longest) + 1
    assert np.all(below * 1.0 >= d * model.min_chunk_tokens)  # every case above the tile floor
    assert np.all(alone(below) <= budget) and np.all(alone(above) > budget)
    # nothing fits a budget below the per-sequence overhead; an unbounded budget fits anything
    assert float(model.longest_within(model.seq_overhead / 2, ulysses, ring)) == 0.0
    assert float(model.longest_within(np.inf, ulysses, ring)) == np.inf
    # the groups' quadratic computed once answers every budget the same way
    quad, per_token = model.length_quadratic(np.full(3, ulysses), np.full(3, ring))
    assert np.array_equal(model.longest_under(budget, quad, per_token), longest)
