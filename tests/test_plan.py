"""Plan invariants: every violation the check must name, and the digest."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_hydra.planner import CostModel, Group, Plan, PlanError


def _plan(groups: list[list[Group]], lengths: tuple[int, ...] = (10, 20, 30), world: int = 4) -> Plan:
    return Plan(lengths=lengths, world_size=world, ranks_per_node=4, microbatches=groups)


def _valid() -> Plan:
    return _plan([[Group((0, 1), 2, 1, (0, 1)), Group((2,), 1, 1, (2,)), Group((3,), 1, 1, ())]])


def test_valid_plan_passes_and_reports_per_rank_views(cost: CostModel) -> None:
    plan = _valid()
    plan.check([10, 20, 30], max_tokens_per_rank=64)
    tokens = plan.tokens()
    assert tokens.tolist() == [[6 + 10, 6 + 10, 30, 0]]  # zigzag shards: 10 -> 2*ceil(10/4)=6, 20 -> 10
    loads = plan.loads(cost)
    assert loads.shape == (1, 4)
    assert loads[0, 3] == 0.0 and loads[0, 0] == loads[0, 1] > 0
    assert plan.degree_histogram() == {1: 1, 2: 2}
    assert plan.sequence_degrees().tolist() == [2, 2, 1]


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([[Group((0, 1), 2, 1, (0,)), Group((2, 3), 2, 1, (2,))]], "lost"),
        ([[Group((0, 1), 2, 1, (0, 1)), Group((2, 3), 2, 1, (1, 2))]], "duplicated"),
        ([[Group((0, 1), 2, 1, (0, 1, 2)), Group((1, 2, 3), 1, 3, ())]], "two groups"),
        ([[Group((0, 1), 2, 1, (0, 1, 2))]], "in no group"),
        ([[Group((0, 1, 2, 3), 2, 1, (0, 1, 2))]], "not ulysses"),
        ([[Group((0, 2), 2, 1, (0, 1, 2)), Group((1,), 1, 1, ()), Group((3,), 1, 1, ())]], "misaligned"),
        ([[Group((1, 2), 2, 1, (0, 1, 2)), Group((0,), 1, 1, ()), Group((3,), 1, 1, ())]], "crosses a node"),
        ([[Group((0,), 1, 1, (0, 1, 2)), Group((1, 2, 3), 1, 3, ())]], "capacity"),
    ],
)
def test_check_names_each_violation(groups: list[list[Group]], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        _plan(groups).check([10, 20, 30], max_tokens_per_rank=40)


def test_check_rejects_other_lengths() -> None:
    with pytest.raises(PlanError, match="different lengths"):
        _valid().check([10, 20, 31], max_tokens_per_rank=64)
    with pytest.raises(PlanError, match="different lengths"):
        _valid().check(np.array([10, 20, 31]), max_tokens_per_rank=64)
    for same in ((10, 20, 30), np.array([10, 20, 30]), [10.0, 20, np.int32(30)]):  # lengths as int64
        _valid().check(same, max_tokens_per_rank=64)


def test_digest_is_stable_and_sensitive() -> None:
    a, b = _valid(), _valid()
    assert a.digest() == b.digest()
    assert len(a.digest()) == 64
    c = _plan([[Group((0, 1), 2, 1, (1, 0)), Group((2,), 1, 1, (2,)), Group((3,), 1, 1, ())]])
    assert c.digest() != a.digest()
    a.stats["anything"] = 1.0  # diagnostics are not part of the digest
    assert a.digest() == b.digest()


def test_group_lookup() -> None:
    plan = _valid()
    assert plan.group_of(0, 1).ranks == (0, 1)
    assert plan.microbatches[0][0].index(1) == 1
    with pytest.raises(ValueError, match="not a member"):
        plan.microbatches[0][0].index(3)


def test_group_views_of_a_nested_group() -> None:
    # 8 ranks from 8: ulysses 2 x ring 4; members j = p * u + i
    g = Group(tuple(range(8, 16)), 2, 4, (3, 1))
    assert g.ulysses_blocks() == [(8, 9), (10, 11), (12, 13), (14, 15)]
    assert g.ulysses_block(13) == (12, 13)
    assert g.ring_peers(13) == (9, 11, 13, 15)
    assert g.ring_peers(10) == (8, 10, 12, 14)
    assert g.layout == Group(tuple(range(8, 16)), 2, 4) and hash(g.layout) == hash(Group(tuple(range(8, 16)), 2, 4))
    with pytest.raises(ValueError, match="not a member"):
        g.ring_peers(3)


def test_shard_tokens_scalar_and_vectorised_agree() -> None:
    import numpy as np

    from lightning_hydra.planner import shard_tokens

    assert shard_tokens(10, 2) == 6 and isinstance(shard_tokens(10, 2), int)  # pad 10 -> 12, two chunks of 3
    assert shard_tokens(1, 8) == 2  # a sequence shorter than 2d still gives every member two (padded) tokens
    lengths = np.array([1, 7, 16, 17, 262144])
    degrees = np.array([1, 2, 3, 8])
    table = shard_tokens(lengths[None, :], degrees[:, None])
    assert table.dtype == np.int64
    assert table.tolist() == [[shard_tokens(int(n), int(d)) for n in lengths] for d in degrees]
    pairs = shard_tokens(lengths[:4], degrees)  # element-wise (not a table)
    assert pairs.tolist() == [shard_tokens(int(n), int(d)) for n, d in zip(lengths[:4], degrees, strict=True)]
    assert shard_tokens(lengths[:, None], degrees[None, :]).tolist() == table.T.tolist()  # a table the other way


def test_stable_argsort_is_numpys_stable_argsort() -> None:
    from lightning_hydra.planner.order import stable_argsort

    rng = np.random.default_rng(0)
    for high in (3, 300, 70_000, 1 << 31, 1 << 40):  # one pass, two passes, NumPy's own sort above 32 bits
        for n in (0, 1, 17, 5000):
            keys = rng.integers(0, high, n)
            for dtype in (np.int64, np.uint32) if high < 1 << 32 else (np.int64,):
                k = keys.astype(dtype)
                assert np.array_equal(stable_argsort(k), np.argsort(k, kind="stable")), (high, n, dtype)
    assert np.array_equal(stable_argsort(np.array([2, -1, 2, 0])), [1, 3, 0, 2])  # negative keys: NumPy's sort
    for dtype in (np.int8, np.uint8, np.int16, np.uint16, np.bool_):  # short keys: NumPy's own (radix) sort
        k = rng.integers(0, 2, 300).astype(dtype)
        assert np.array_equal(stable_argsort(k), np.argsort(k, kind="stable")), dtype


def test_descending_order_is_numpys_stable_descending_argsort() -> None:
    from lightning_hydra.planner.order import descending_order

    rng = np.random.default_rng(1)
    for n in (0, 1, 2, 9, 4000):
        for values in (rng.integers(0, 5, n), rng.random(n), -np.sort(-rng.integers(0, 5, n)), np.sort(rng.random(n))):
            expected = np.argsort(-values, kind="stable")
            assert np.array_equal(descending_order(values), expected), (n, values[:5])
    assert descending_order(np.array([3.0, 3.0, 1.0, 1.0])).tolist() == [0, 1, 2, 3]  # sorted, ties: the identity


def test_descending_order_of_two_is_the_stable_sort_of_the_concatenation() -> None:
    from lightning_hydra.planner.order import descending_order_of_two

    rng = np.random.default_rng(2)
    for n, m in ((0, 0), (0, 5), (5, 0), (7, 300), (300, 7), (50, 4000)):
        for draw in (lambda k: rng.integers(0, 6, k), lambda k: rng.random(k)):
            first, second = draw(n), draw(m)
            for tail in (second, -np.sort(-second)):  # unsorted (the fallback) and non-increasing (the merge)
                expected = np.argsort(-np.concatenate([first, tail]), kind="stable")
                assert np.array_equal(descending_order_of_two(first, tail), expected), (n, m)


def test_prefix_within_is_the_cumsum_search() -> None:
    from lightning_hydra.planner.formation import _prefix_within

    rng = np.random.default_rng(3)
    values = rng.integers(1, 9000, 20000)
    for size in (0, 1, 900, 1024, 1025, 5000, 20000):
        index = rng.permutation(values.size)[:size]
        total = int(values[index].sum())
        for budget in (0.0, 0.5, 8999.0, total * 0.3, total - 0.5, float(total), total * 2.0):
            expected = int(np.searchsorted(np.cumsum(values[index]), budget, "right"))
            assert _prefix_within(values, index, budget) == expected, (size, budget)


def test_group_fast_constructor_makes_the_same_group() -> None:
    fast, slow = Group._of((4, 5), 2, 1, (7,)), Group((4, 5), 2, 1, (7,))
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert vars(fast) == vars(slow) and type(fast) is Group
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.ring = 2  # type: ignore[misc]
