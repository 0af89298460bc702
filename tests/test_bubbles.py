"""The projected 1F1B pipeline bubble against its closed form and a hand-worked irregular case; its floor against
the projected and the replayed (measured) bubble."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hydra.metrics import one_f_one_b_order, pipeline_bubble
from lightning_hydra.metrics.bubbles import min_pipeline_bubble, pipeline_bubble_floor, stage_split
from lightning_hydra.metrics.loads import measured_pipeline_bubble, step_metrics
from tests.test_pipeline import _record


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


def test_the_closed_form_is_no_floor_once_microbatches_differ() -> None:
    # a long first microbatch and a shorter last one: the fill (its forward) and the drain (the last backward) are
    # shorter than equal microbatches' would be, so the bubble is below (P - 1) / (M + P - 1)
    times = [1.75, 1.17]
    assert pipeline_bubble(times, 2) < min_pipeline_bubble(2, 2) - 0.01
    assert pipeline_bubble(times, 2) >= pipeline_bubble_floor(*stage_split(times, 2), 2)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 5])
def test_the_floor_of_equal_microbatches_is_the_closed_form(stages: int, microbatches: int) -> None:
    floor = pipeline_bubble_floor(*stage_split([3.0] * microbatches, stages), stages)
    assert floor == pytest.approx(min_pipeline_bubble(microbatches, stages))


def test_no_bubble_falls_below_its_floor() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        stages, pool, m = int(rng.integers(2, 5)), int(rng.integers(1, 3)), int(rng.integers(1, 6))
        forward = rng.uniform(0.01, 2.0, size=(m, stages * pool))
        forward[rng.uniform(size=forward.shape) < 0.2] = 0.0  # idle ranks
        backward = forward * rng.uniform(1.0, 3.0)
        floor = pipeline_bubble_floor(forward, backward, stages)
        if np.isfinite(floor):  # unequal stages and microbatches, replayed in 1F1B order
            assert measured_pipeline_bubble(_record(forward, backward, stages), replay=True) >= floor - 1e-12
        times = rng.uniform(0.05, 2.0, size=m)  # the projection: each microbatch split evenly over the stages
        assert pipeline_bubble(times, stages) >= pipeline_bubble_floor(*stage_split(times, stages), stages) - 1e-12


def test_a_run_without_stages_reports_the_projection_beside_its_floor() -> None:
    record = _record(np.array([[1.0], [0.5], [0.0]]), np.array([[2.0], [1.0], [0.0]]), 1)
    metrics = step_metrics(record, pipeline_stages=4)
    assert "plan/pipeline_stages" not in metrics  # a projection: the summary says so
    assert metrics["bubble/pp"] == pytest.approx(pipeline_bubble([3.0, 1.5], 4))
    assert metrics["bubble/pp_min"] == pytest.approx(pipeline_bubble_floor(*stage_split([3.0, 1.5], 4), 4))
    assert metrics["bubble/pp"] >= metrics["bubble/pp_min"]
