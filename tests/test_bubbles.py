"""The projected 1F1B pipeline bubble against its closed form and a hand-worked irregular case."""

from __future__ import annotations

import pytest

from lightning_hydra.metrics import one_f_one_b_order, pipeline_bubble


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 3, 8, 16])
def test_equal_microbatches_match_the_closed_form(stages: int, microbatches: int) -> None:
    expected = (stages - 1) / (microbatches + stages - 1)
    assert pipeline_bubble([2.0] * microbatches, stages) == pytest.approx(expected)


def test_hand_worked_irregular_case() -> None:
    # P=2, times [3, 6]: per stage F=[0.5, 1], B=[1, 2]. Stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1:
    # S0.F0 0-0.5, S1.F0 0.5-1, S0.F1 0.5-1.5, S1.B0 1-2, S0.B0 2-3, S1.F1 2-3, S1.B1 3-5, S0.B1 5-7.
    # makespan 7, useful per stage (3 + 6) / 2 = 4.5
    assert pipeline_bubble([3.0, 6.0], 2) == pytest.approx(1 - 4.5 / 7)


def test_one_slow_microbatch_costs_more_than_its_share() -> None:
    even = pipeline_bubble([4.0] * 8, 4)
    skewed = pipeline_bubble([4.0] * 7 + [12.0], 4)
    assert skewed > even


def test_1f1b_order() -> None:
    assert one_f_one_b_order(0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert one_f_one_b_order(1, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    order = one_f_one_b_order(0, 4, 3)
    assert sorted(order) == sorted([("F", m) for m in range(3)] + [("B", m) for m in range(3)])


@pytest.mark.parametrize(("times", "stages"), [([], 2), ([1.0], 0), ([-1.0], 2)])
def test_bad_input(times, stages) -> None:
    with pytest.raises(ValueError):
        pipeline_bubble(times, stages)
