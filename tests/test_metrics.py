"""Step metrics and calibration arithmetic (pure numpy; hand-worked cases)."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hydra.metrics import StepRecord, balance, bubble_dp, degree_histogram, replay_step_time, step_metrics
from lightning_hydra.metrics.record import rank_row
from lightning_hydra.planner import CostModel
from lightning_hydra.planner.calibration import (
    INTER,
    INTRA,
    NUM_FEATURES,
    CostCalibrator,
    bin_features,
    excess_error,
    predict,
    relative_error,
    ring_links,
)
from lightning_hydra.planner.robust import EXPOSED_SHARE_WEIGHT, MEASURED_SHARE_WEIGHT, ensemble, member_weights

COST = CostModel.for_transformer(256, 4, 8, flops_per_second=1e12, intra_node_bandwidth=1e9)


def test_balance_and_dp_bubble_hand_worked():
    busy = np.array([[1.0, 2.0], [3.0, 0.0]])  # rank 0 busy 4 s, rank 1 busy 2 s
    assert balance(busy) == pytest.approx(4 / 3)
    assert bubble_dp(busy, step_time=5.0) == pytest.approx(1 - 3 / 5)


def test_replay_waits_for_group_members():
    # microbatch 0: ranks 0,1 separate groups (1 s, 3 s); microbatch 1: one group of both (2 s each).
    busy = np.array([[1.0, 3.0], [2.0, 2.0]])
    leader = np.array([[0, 1], [0, 0]])
    assert replay_step_time(busy, leader) == pytest.approx(5.0)  # rank 0 waits 2 s for rank 1 before mb 1
    leader_separate = np.array([[0, 1], [0, 1]])
    assert replay_step_time(busy, leader_separate) == pytest.approx(5.0)
    assert replay_step_time(np.array([[1.0, 3.0], [4.0, 1.0]]), leader_separate) == pytest.approx(5.0)
    assert replay_step_time(np.array([[1.0, 3.0], [4.0, 1.0]]), leader) == pytest.approx(7.0)


def _record(busy, leader, degree, features=None, wall=None) -> StepRecord:
    busy = np.asarray(busy, dtype=float)
    m, n = busy.shape
    feats = np.zeros((m, n, NUM_FEATURES)) if features is None else np.asarray(features, dtype=float)
    rows = [
        rank_row(
            list(busy[:, r]),
            [0.1] * m,
            list(busy[:, r] * 1.1),
            [(int(leader[k][r]), int(degree[k][r])) for k in range(m)],
            feats[:, r],
            float(wall[r]) if wall is not None else 10.0,
            3.0 + r,
        )
        for r in range(n)
    ]
    return StepRecord.from_table(np.stack(rows), step=7, num_microbatches=m, trained_tokens=1000, includes_comm=False)


def test_record_round_trip_and_step_metrics():
    busy = [[1.0, 3.0], [2.0, 2.0]]
    leader = [[0, 1], [0, 0]]
    degree = [[1, 1], [2, 2]]
    feats = np.zeros((2, 2, NUM_FEATURES))
    feats[..., 2] = 1  # every group holds a sequence
    rec = _record(busy, leader, degree, feats, wall=[8.0, 10.0])
    assert rec.busy.tolist() == busy and rec.leader.tolist() == leader and rec.degree.tolist() == degree
    assert rec.schedule_ms == 4.0 and rec.wall.tolist() == [8.0, 10.0]
    assert degree_histogram(rec) == {1: 2, 2: 1}
    wall = step_metrics(rec, pipeline_stages=1)
    assert wall["bubble/dp"] == pytest.approx(1 - 4 / 10)
    assert wall["bubble/pp"] == pytest.approx(0.0)  # one stage: no pipeline bubble
    assert wall["throughput/tokens_per_s"] == pytest.approx(100.0)
    assert wall["cost_model/error"] == pytest.approx(0.1)
    assert wall["cp/comm_ms"] == pytest.approx(200.0)
    replay = step_metrics(rec, replay=True)
    assert replay["bubble/dp"] == pytest.approx(1 - 4 / 5)
    # 2 microbatches of 3 s and 2 s on 4 stages (F = t / 12, B = t / 6 per stage): stage 0 finishes B1 at 10/3 s
    # (hand-worked 1F1B), each stage is useful (3 + 2) / 4 s: bubble 1 - 1.25 / (10 / 3)
    assert replay["bubble/pp"] == pytest.approx(1 - 1.25 / (10 / 3), rel=1e-12)


def test_bin_features_reproduce_bin_time():
    for lengths, u, r in [([4000, 700, 30], 2, 2), ([16000], 1, 4), ([50, 60], 4, 1), ([], 2, 1)]:
        f = bin_features(COST, lengths, u, r)
        assert predict(COST, f[None], includes_comm=True)[0] == pytest.approx(COST.bin_time(lengths, u, r), rel=1e-12)


def _synthetic(true: CostModel, rng: np.random.Generator, n: int = 40, noise: float = 0.0):
    feats, times = [], []
    for _ in range(n):
        lengths = rng.integers(64, 8192, size=rng.integers(1, 5))
        u, r = [(1, 1), (2, 1), (2, 2), (4, 1)][rng.integers(0, 4)]
        f = bin_features(true, lengths, u, r)
        feats.append(f)
        times.append(predict(true, f[None], includes_comm=False)[0] * (1 + noise * rng.standard_normal()))
    return np.array(feats), np.array(times)


def test_calibrator_recovers_a_three_x_wrong_coefficient():
    rng = np.random.default_rng(0)
    true = COST.replace(seq_overhead=2e-4)
    wrong = true.replace(attn=3 * true.attn)
    cal = CostCalibrator(window=4)
    feats, times = _synthetic(true, rng, noise=0.02)
    before = relative_error(predict(wrong, feats, includes_comm=False), times)
    cal.add(feats, times, includes_comm=False)
    fitted = cal.refit(wrong)
    after = relative_error(predict(fitted, feats, includes_comm=False), times)
    assert before > 0.5 and after < 0.03
    assert fitted.attn == pytest.approx(true.attn, rel=0.1)
    assert fitted.linear == pytest.approx(true.linear, rel=0.1)


def test_calibrator_guards():
    cal = CostCalibrator(min_rows=4)
    assert cal.refit(COST) is COST  # no data
    f = bin_features(COST, [1000], 1, 1)
    cal.add(np.stack([f] * 2), np.array([1.0, 1.0]), includes_comm=False)
    assert cal.refit(COST) is COST  # too few rows
    # identical rows: only one direction is determined; the ridge keeps the others near the current values
    cal = CostCalibrator()
    t = predict(COST, f[None], includes_comm=False)[0]
    cal.add(np.stack([f] * 10), np.full(10, 2 * t), includes_comm=False)
    fitted = cal.refit(COST)
    assert predict(fitted, f[None], includes_comm=False)[0] == pytest.approx(2 * t, rel=0.05)
    assert fitted.seq_overhead >= 0
    # a corrupt measurement that would move a coefficient more than max_change is refused
    cal = CostCalibrator(max_change=2.0)
    cal.add(np.stack([f] * 10), np.full(10, 1000 * t), includes_comm=False)
    assert cal.refit(COST) is COST and cal.skipped == 1


def test_rows_that_are_no_measurement_are_left_out_of_the_fit():
    """A time below a nanosecond, NaN or infinite (a timer's zero or garbage), in ``times`` or ``comm``, is left out
    like an idle rank's row: the refit is the one without those rows (a time of 1e-150 s overflowed the normal
    equations and raised ``LinAlgError``: found by fuzzing)."""
    rng = np.random.default_rng(5)
    true = COST.replace(seq_overhead=2e-4)
    feats, times = _synthetic(true, rng, noise=0.02)
    comm = np.full(times.size, 1e-4)
    clean = CostCalibrator()
    clean.add(feats, times, includes_comm=False, comm=comm)
    for bad_time, bad_comm in ((1e-150, 1e-4), (np.nan, 1e-4), (np.inf, 1e-4), (1e-3, np.nan), (1e-3, np.inf)):
        cal = CostCalibrator()
        cal.add(
            np.concatenate([feats, feats[:1]]), np.r_[times, bad_time], includes_comm=False, comm=np.r_[comm, bad_comm]
        )
        assert cal.refit(COST) == clean.refit(COST)


def test_a_refinement_the_window_cannot_tell_apart_keeps_its_coefficient():
    """Every measured bin has ``u > 1``: the all-to-all latency's column is the fixed cost's, so the fixed cost goes
    to ``bin_overhead`` (bins with ``u = 1`` pay it too, as far as anything measured says) and ``a2a_latency`` keeps
    its value; the ridge alone would split it between them. Once bins with ``u = 1`` are measured, both are fitted."""
    rng = np.random.default_rng(3)
    start = COST.replace(a2a_latency=30e-6, bin_overhead=0.0)
    true = start.replace(bin_overhead=5e-3, a2a_latency=1e-3)

    def measure(degrees: list[int]) -> tuple[np.ndarray, np.ndarray]:
        feats, times = [], []
        for _ in range(60):
            lengths = rng.integers(256, 8192, size=rng.integers(1, 4))
            u = int(rng.choice(degrees))
            feats.append(bin_features(start, lengths, u, 1))
            times.append(true.bin_time(lengths, u, 1))
        return np.array(feats), np.array(times)

    only_ulysses = measure([2, 4])
    cal, split = CostCalibrator(), CostCalibrator(min_separation=0.0)
    for c in (cal, split):
        c.add(*only_ulysses, includes_comm=True)
    fitted, ridge = cal.refit(start), split.refit(start)
    assert fitted.a2a_latency == start.a2a_latency
    assert fitted.bin_overhead == pytest.approx(6e-3 - 30e-6, rel=0.02)
    assert ridge.a2a_latency > 2e-3 and ridge.bin_overhead < 4e-3  # what the rule prevents
    for model in (fitted, ridge):  # both explain what was measured
        assert relative_error(predict(model, only_ulysses[0], includes_comm=True), only_ulysses[1]) < 0.01
    # a latency held at a value left from earlier windows that the fixed cost cannot make up (bin_overhead would
    # go negative and is pinned at 0) is refitted after all
    stale = start.replace(a2a_latency=2e-3)
    small = COST.replace(a2a_latency=0.3e-3, bin_overhead=0.2e-3)
    feats = np.array([bin_features(stale, rng.integers(256, 8192, size=2), 2, 1) for _ in range(60)])
    times = predict(small, feats, includes_comm=True)
    held = CostCalibrator()
    held.add(feats, times, includes_comm=True)
    refitted = held.refit(stale)
    assert refitted.bin_overhead == 0.0 and refitted.a2a_latency < 1e-3
    assert relative_error(predict(refitted, feats, includes_comm=True), times) < 1e-3
    cal.add(*measure([1, 2, 4]), includes_comm=True)
    fitted = cal.refit(start)
    assert 0.5e-3 < fitted.a2a_latency < 2e-3 and fitted.bin_overhead > 4e-3
    single = measure([1])
    assert relative_error(predict(fitted, single[0], includes_comm=True), single[1]) < 0.01


def test_the_refit_model_knows_whether_rings_were_measured():
    """``rings_measured`` is set by the first refit whose window held ring traffic (and kept after), never by a
    window of bins without rings or by busy times that exclude communication; it travels with the model's dict."""
    rng = np.random.default_rng(4)

    def measure(ring: int) -> tuple[np.ndarray, np.ndarray]:
        feats = [bin_features(COST, rng.integers(256, 8192, size=2), 2, ring) for _ in range(20)]
        return np.array(feats), predict(COST, np.array(feats), includes_comm=True) * 1.2

    cal = CostCalibrator()
    cal.add(*measure(1), includes_comm=True)
    without = cal.refit(COST)
    assert without is not COST and not without.rings_measured
    thread_timer = CostCalibrator()
    thread_timer.add(*measure(4), includes_comm=False)  # a CPU timer without comm=: the ring is not seen
    refit = thread_timer.refit(COST)
    assert refit is not COST and not refit.rings_measured
    cal.add(*measure(4), includes_comm=True)
    measured = cal.refit(without)
    assert measured.rings_measured
    assert CostModel.from_dict(measured.to_dict()).rings_measured is True
    assert CostModel.from_dict(without.to_dict()).rings_measured is False
    # a dict saved before the flag: a ring coefficient off its analytic value was fitted to measured rings
    old = {k: v for k, v in COST.to_dict().items() if k != "rings_measured"}
    assert CostModel.from_dict(old).rings_measured is False
    assert CostModel.from_dict({**old, "ring_share": 0.1}).rings_measured is True
    for _ in range(cal.window):  # the rings leave the window; the coefficients fitted to them stay
        cal.add(*measure(1), includes_comm=True)
    assert cal.refit(measured).rings_measured


def test_the_refit_model_knows_which_links_its_window_timed():
    """:func:`ring_links` tells each row's ring link from its features (inside a node, across nodes, none); the
    refit flags each ring link its current window timed with rings without a Ulysses level (only rows whose
    communication it fits, and not after they leave the window, unlike ``rings_measured``); the flags travel with
    the model's dict, and the ensemble's slower-communication member halves the all-to-all and the ring links not
    timed."""
    cost = COST.replace(ranks_per_node=8)
    rng = np.random.default_rng(5)
    rows = np.array(
        [
            bin_features(cost, [4096, 2048], 1, 4, crosses=False),  # a ring of 4 inside a node
            bin_features(cost, [4096], 1, 4, crosses=True),  # the same ring laid across two nodes
            bin_features(cost, [8192, 300], 2, 4),  # 8 ranks divide the node: inside (a tile-bound short one too)
            bin_features(cost, [8192], 8, 2),  # 16 ranks: across
            bin_features(cost, [8192], 4, 1),  # Ulysses only: no ring
            np.zeros(NUM_FEATURES),  # an idle rank
        ]
    )
    assert ring_links(cost, rows).tolist() == [INTRA, INTER, INTRA, INTER, 0, 0]
    assert ring_links(cost.replace(ranks_per_node=0), rows[3:4]).tolist() == [INTER]  # no topology: all cross

    def measure(u: int, r: int, crosses: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        feats = np.array(
            [bin_features(cost, rng.integers(256, 8192, size=2), u, r, crosses=crosses) for _ in range(20)]
        )
        return feats, predict(cost, feats, includes_comm=True) * 1.2

    def links(model: CostModel) -> tuple[bool, bool]:
        return model.intra_rings_measured, model.inter_rings_measured

    assert links(cost) == (False, False)
    cal = CostCalibrator(window=4)
    cal.add(*measure(2, 4), includes_comm=True)  # a nested ring (Ulysses 2 inside): 1/2 of the bytes, not counted
    nested = cal.refit(cost)
    assert links(nested) == (False, False) and nested.rings_measured
    cal.add(*measure(1, 4, crosses=False), includes_comm=False)  # a thread timer: the ring's time is not seen
    assert links(cal.refit(cost)) == (False, False)
    cal.add(*measure(1, 4, crosses=False), includes_comm=True)
    inside = cal.refit(cost)
    assert links(inside) == (True, False)
    feats, times = measure(1, 3, crosses=True)
    cal.add(feats, times * 0.9, includes_comm=False, comm=times * 0.1)  # communication measured apart: timed
    both = cal.refit(inside)
    assert links(both) == (True, True)
    restored = CostCalibrator(window=4)
    restored.load_state_dict(cal.state_dict())  # a resumed run reads the same links from the restored window
    assert links(restored.refit(inside)) == (True, True)
    assert links(CostModel.from_dict(both.to_dict())) == (True, True)
    assert links(CostModel.from_dict({k: v for k, v in both.to_dict().items() if "rings_measured" not in k})) == (
        False,
        False,
    )
    # only Ulysses bins left in the window: the rings are no longer timed (bins of two Ulysses degrees, so that the
    # fit tells the all-to-all's bytes from the token-wise work, which one degree alone makes proportional)
    for step in range(cal.window):
        cal.add(*measure(2 * (1 + step % 2), 1), includes_comm=True)
    after = cal.refit(both)
    assert links(after) == (False, False) and after.rings_measured
    # the slower-communication member halves the all-to-all and the ring links not timed, and only those
    for model, halved in ((cost, (True, True)), (inside, (False, True)), (both, (False, False))):
        slow = ensemble(model)[1]
        assert slow.intra_node_bandwidth == model.intra_node_bandwidth / 2
        ratios = (
            slow.intra_node_ring_bandwidth / model.intra_node_ring_bandwidth,
            slow.inter_node_bandwidth / model.inter_node_bandwidth,
        )
        assert ratios == tuple(0.5 if h else 1.0 for h in halved)


def test_the_refit_model_knows_whether_it_checked_exposed_rings():
    """``exposure_measured`` is set where the window timed plain rings whose traffic attention did not hide (enough
    of it to matter) and the refitted model predicts those bins within ``max_exposed_error``; not for rings its
    attention hid, nested rings, busy times without communication, or a truth whose form the model misses (10%
    per-bin noise); it travels with the model's dict. Set, the ring member keeps the fitted exposure instead of
    charging 1, and the ring-share member counts ``EXPOSED_SHARE_WEIGHT`` once both links were timed."""
    cost = COST.replace(ranks_per_node=8)
    truth = cost.replace(ring_share=0.1, ring_exposure=0.3, attn=cost.attn * 1.1)
    rng = np.random.default_rng(6)

    def measure(u: int, r: int, low: int, high: int, crosses: bool = False) -> tuple[np.ndarray, np.ndarray]:
        feats = np.array(
            [bin_features(cost, rng.integers(low, high, size=2), u, r, crosses=crosses) for _ in range(24)]
        )
        return feats, predict(truth, feats, includes_comm=True)

    def checked(*steps: tuple[tuple[np.ndarray, np.ndarray], dict]) -> bool:
        cal = CostCalibrator()
        cal.add(*measure(2, 1, 256, 8192), includes_comm=True)  # Ulysses bins: the busy terms have data
        for (feats, times), how in steps:
            cal.add(feats, times, **how)
        return cal.refit(cost).exposure_measured

    short = measure(1, 4, 128, 2048)  # plain rings inside a node, their traffic mostly exposed
    feats, times = short
    assert (feats[:, 9] > 0.01 * times).all() and not cost.exposure_measured
    assert checked((short, {"includes_comm": True}))
    assert checked(((feats, times * 0.8), {"includes_comm": False, "comm": times * 0.2}))  # communication apart
    assert not checked((short, {"includes_comm": False}))  # a thread timer: the rings' time is not seen
    noisy = (feats, times * rng.uniform(0.9, 1.1, size=times.size))
    assert not checked((noisy, {"includes_comm": True}))  # the model's form misses what they cost
    hidden = measure(1, 4, 8192, 16384, crosses=True)  # long rings across nodes: attention hides the traffic
    assert (hidden[0][:, 9] == 0).all() and not checked((hidden, {"includes_comm": True}))
    nested = measure(2, 4, 128, 2048)  # a Ulysses level above the ring: not a plain ring
    assert (nested[0][:, 9] > 0).any() and not checked((nested, {"includes_comm": True}))
    cal = CostCalibrator()
    cal.add(*measure(2, 1, 256, 8192), includes_comm=True)
    cal.add(*short, includes_comm=True)
    fitted = cal.refit(cost)
    assert fitted.exposure_measured and relative_error(predict(fitted, short[0], includes_comm=True), short[1]) <= 0.01
    assert CostModel.from_dict(fitted.to_dict()).exposure_measured is True
    assert (
        CostModel.from_dict({k: v for k, v in fitted.to_dict().items() if k != "exposure_measured"}).exposure_measured
        is False
    )
    # the ring member keeps a checked exposure, else charges at least 1; the share member's weight
    assert ensemble(fitted)[-1].ring_exposure == fitted.ring_exposure
    assert ensemble(fitted.replace(exposure_measured=False))[-1].ring_exposure == 1.0
    timed = fitted.replace(intra_rings_measured=True, inter_rings_measured=True)
    assert member_weights(ensemble(timed))[2] == EXPOSED_SHARE_WEIGHT
    assert member_weights(ensemble(timed.replace(exposure_measured=False)))[2] == MEASURED_SHARE_WEIGHT


def test_a_scattering_timer_does_not_hide_a_checked_exposure():
    """A timer that scatters every bin by about 3% (lognormal, as a device's does) puts the exposed plain rings'
    relative error above ``max_exposed_error`` even where the model's form is right; the excess of their error over
    the other bins' (:func:`excess_error`) takes the shared scatter out, so the exposure still counts as checked.
    Where the rings scatter by 10% more than the rest (the form misses them) it does not."""
    cost = COST.replace(ranks_per_node=8)
    truth = cost.replace(ring_share=0.1, ring_exposure=0.3, attn=cost.attn * 1.1)
    rng = np.random.default_rng(11)

    def measure(u: int, r: int, spread: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        feats = np.array([bin_features(cost, rng.integers(128, 2048, size=2), u, r) for _ in range(48)])
        times = predict(truth, feats, includes_comm=True) * rng.uniform(1 - spread, 1 + spread, size=len(feats))
        return feats, times * rng.lognormal(-0.5 * 0.03**2, 0.03, size=len(feats))

    def refit(spread: float) -> tuple[CostModel, list[tuple[np.ndarray, np.ndarray]]]:
        cal, rings = CostCalibrator(), []
        for _ in range(8):
            cal.add(*measure(2, 1), includes_comm=True)
            rings.append(measure(1, 4, spread))
            cal.add(*rings[-1], includes_comm=True)
        return cal.refit(cost), rings

    fitted, rings = refit(0.0)
    feats, times = (np.concatenate(x) for x in zip(*rings, strict=True))
    assert relative_error(predict(fitted, feats, includes_comm=True), times) > CostCalibrator().max_exposed_error
    assert fitted.exposure_measured
    assert not refit(0.1)[0].exposure_measured
    # the excess: the root mean square relative error where the base is exact, nothing below the base's
    m = np.array([1.0, 2.0, 4.0])
    assert excess_error(m * 1.02, m, m, m) == pytest.approx(0.02)
    assert excess_error(m * 1.02, m, m * 1.03, m) == 0.0
    assert np.isnan(excess_error(m, m, m, np.zeros(3)))


def test_calibrator_state_round_trip():
    rng = np.random.default_rng(1)
    feats, times = _synthetic(COST, rng, n=10)
    cal = CostCalibrator(window=2)
    for _ in range(3):
        cal.add(feats, times, includes_comm=False)
    other = CostCalibrator(window=2)
    other.load_state_dict(cal.state_dict())
    assert other.refit(COST.replace(linear=2 * COST.linear)) == cal.refit(COST.replace(linear=2 * COST.linear))


def test_calibrator_scales_communication_when_the_timer_includes_it():
    rng = np.random.default_rng(2)
    start = COST.replace(seq_overhead=1e-4)
    true = start.replace(intra_node_bandwidth=start.intra_node_bandwidth / 2)  # communication twice as slow
    cal = CostCalibrator()
    feats, times, bins, degrees = [], [], [], []
    for _ in range(60):
        lengths = rng.integers(256, 8192, size=rng.integers(1, 4))
        u = int(rng.choice([1, 2, 4]))  # Ulysses only: communication linear in 1 / bandwidth
        bins.append(lengths)
        degrees.append(u)
        feats.append(bin_features(start, lengths, u, 1))
        times.append(true.bin_time(lengths, u, 1))
    feats, times = np.array(feats), np.array(times)
    cal.add(feats, times, includes_comm=True)
    fitted = cal.refit(start)
    assert cal.comm_scale == pytest.approx(2.0, rel=0.05)
    assert fitted.intra_node_bandwidth == pytest.approx(true.intra_node_bandwidth, rel=0.05)
    refeatured = np.array([bin_features(fitted, f, u, 1) for f, u in zip(bins, degrees, strict=True)])
    assert relative_error(predict(fitted, refeatured, includes_comm=True), times) < 0.01
