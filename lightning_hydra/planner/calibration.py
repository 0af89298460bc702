"""Closed-loop calibration: refit the cost model's compute coefficients from measured microbatch times.

Every rank measures its busy time in every microbatch; the pairs ``(features, time)`` of all ranks are gathered,
so every rank holds the same data and this pure function refits the same coefficients everywhere (the next plan's
digest check would catch any divergence). The features of a rank's bin ``Ls`` at degree ``d`` are linear in the
fitted coefficients::

    compute = attn * sum(L**2 / d_eff) + linear * sum(L / d_eff) + seq_overhead * len(Ls)

             + a2a_latency * [u > 1] + p2p_latency * (r - 1)

with ``d_eff`` the tile-bounded effective degree of :meth:`CostModel.effective_degree`. The two latencies are the
fixed per-bin costs of CP (collective launches, the engine's per-step work), which a CPU timer sees as busy time.
The last feature is the bin's bandwidth-bound communication as the current model predicts it (exposed ring
traffic, all-to-all volume). Where the device's timer includes communication (CUDA events) the fit also scales it:
one factor on the predicted communication, applied to the model as bandwidths divided by that factor (an
approximation: exposure is not linear in bandwidth). A CPU thread timer excludes communication, and the factor
stays 1.

The fit is a relative least-squares over a sliding window of steps, in column-normalised coordinates, with a ridge
pulling towards the current coefficients: directions the data does not determine (for example ``seq_overhead``
when every bin holds one sequence) stay where they were instead of swinging on noise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_hydra.planner.cost import CostModel

__all__ = ["FITTED", "NUM_FEATURES", "CostCalibrator", "bin_features", "predict", "relative_error"]

FITTED = ("attn", "linear", "seq_overhead", "a2a_latency", "p2p_latency")
"""The coefficients calibration refits, in feature order."""
NUM_FEATURES = len(FITTED) + 1
"""Features per (rank, microbatch): one per fitted coefficient, then the predicted communication seconds."""


def bin_features(cost: CostModel, lengths: np.ndarray | list[int], ulysses: int, ring: int) -> np.ndarray:
    """Features of one rank's work on a bin: ``[sum L^2/d_eff, sum L/d_eff, count, [u > 1], r - 1, comm seconds]``.

    Args:
        cost: The cost model that predicts the communication (and the tile bound of ``d_eff``).
        lengths: Lengths of the bin's sequences (empty: an idle rank, all zero).
        ulysses: Ulysses degree of the group.
        ring: Ring degree of the group.
    """
    lens = np.asarray(lengths, dtype=np.float64)
    out = np.zeros(NUM_FEATURES)
    if lens.size == 0:
        return out
    d_eff = cost.effective_degree(lens, ulysses * ring)
    out[0] = float(np.sum(lens * lens / d_eff))
    out[1] = float(np.sum(lens / d_eff))
    out[2] = float(lens.size)
    out[3] = 1.0 if ulysses > 1 else 0.0
    out[4] = float(max(ring - 1, 0))
    out[5] = cost.bin_time(lens, ulysses, ring) - float(predict(cost, out[None, :], includes_comm=False)[0])
    return out


def predict(cost: CostModel, features: np.ndarray, *, includes_comm: bool) -> np.ndarray:
    """Predicted seconds of every row of ``features`` (``[n, NUM_FEATURES]``): compute, plus the predicted
    communication when the measured time includes it."""
    f = np.asarray(features, dtype=np.float64).reshape(-1, NUM_FEATURES)
    theta = np.array([getattr(cost, name) for name in FITTED])
    return f[:, : len(FITTED)] @ theta + (f[:, -1] if includes_comm else 0.0)


def relative_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    """``sum |predicted - measured| / sum measured`` over the busy entries (``nan`` when nothing was measured)."""
    pred = np.asarray(predicted, dtype=np.float64).ravel()
    meas = np.asarray(measured, dtype=np.float64).ravel()
    busy = meas > 0
    total = float(meas[busy].sum())
    return float(np.abs(pred[busy] - meas[busy]).sum() / total) if total > 0 else float("nan")


@dataclass(kw_only=True)
class CostCalibrator:
    """Sliding-window least-squares refit of the compute coefficients of a :class:`CostModel`."""

    window: int = 16
    """Steps of measurements the fit uses (older ones are dropped: the machine's speed may drift)."""
    ridge: float = 1e-3
    """Weight of the pull towards the current coefficients, in coordinates where every feature column has unit
    norm: directions of the data with less weight than this stay near the current values."""
    min_rows: int = 4
    """Fewest busy (rank, microbatch) measurements before a first refit."""
    max_condition: float = 1e8
    """Largest condition number of the normalised design accepted; worse fits are skipped."""
    max_change: float = 100.0
    """Largest factor by which one refit may move a coefficient (a guard against a corrupt measurement)."""
    _rows: deque = field(default_factory=deque, init=False, repr=False)
    comm_scale: float = field(default=1.0, init=False)
    """Fitted factor on communication time relative to the bandwidths of the first model refitted."""
    _bandwidths: tuple[float, float] | None = field(default=None, init=False, repr=False)
    refits: int = field(default=0, init=False)
    """Refits applied so far."""
    skipped: int = field(default=0, init=False)
    """Refits skipped as ill-conditioned or non-physical."""

    def add(self, features: np.ndarray, times: np.ndarray, *, includes_comm: bool) -> None:
        """Add one step's measurements: ``features`` ``[n, NUM_FEATURES]`` and measured seconds ``[n]``."""
        f = np.asarray(features, dtype=np.float64).reshape(-1, NUM_FEATURES)
        t = np.asarray(times, dtype=np.float64).ravel()
        busy = (t > 0) & (f[:, 2] > 0)
        # communication in the units of the first model (later rows were planned with rescaled bandwidths)
        comm = f[busy, -1] / self.comm_scale if includes_comm else np.zeros(int(busy.sum()))
        self._rows.append((f[busy, : len(FITTED)], t[busy], comm))
        while len(self._rows) > self.window:
            self._rows.popleft()

    def refit(self, cost: CostModel) -> CostModel:
        """The cost model with its compute coefficients refitted to the window (``cost`` itself when the data
        cannot support a fit)."""
        if not self._rows:
            return cost
        if self._bandwidths is None:
            self._bandwidths = (cost.intra_node_bandwidth, cost.inter_node_bandwidth)
        x = np.concatenate([np.column_stack([r[0], r[2]]) for r in self._rows])  # fitted features, communication
        t = np.concatenate([r[1] for r in self._rows])
        if len(t) < self.min_rows:
            return cost
        w = 1.0 / t  # relative errors: a short microbatch counts as much as a long one
        a = x * w[:, None]
        b = t * w
        norms = np.linalg.norm(a, axis=0)
        theta0 = np.array([*(getattr(cost, name) for name in FITTED), self.comm_scale])
        theta = theta0.copy()
        free = norms > 0  # a feature absent from the window leaves its coefficient alone
        rates = np.isin(np.arange(len(theta)), (0, 1, len(FITTED)))  # attn, linear, communication: positive
        # active set: a coefficient the unconstrained fit drives below zero is pinned (rates at their current
        # value, overheads at zero) and the others are refitted without it
        for _ in range(len(theta)):
            if not free.any():
                break
            pinned = ~free
            z = a[:, free] / norms[free]
            rhs_data = b - a[:, pinned] @ theta[pinned]
            lam = np.sqrt(self.ridge)
            design = np.vstack([z, lam * np.eye(z.shape[1])])
            rhs = np.concatenate([rhs_data, lam * theta0[free] * norms[free]])
            if np.linalg.cond(design) > self.max_condition:
                self.skipped += 1
                return cost
            sol, *_ = np.linalg.lstsq(design, rhs, rcond=None)
            theta[free] = sol / norms[free]
            negative = free & (theta < 0) | free & rates & (theta <= 0)
            if not negative.any():
                break
            theta[negative] = np.where(rates, theta0, 0.0)[negative]
            free &= ~negative
        low, high = theta0[rates] / self.max_change, theta0[rates] * self.max_change
        if np.any(theta[rates] <= 0) or np.any((theta[rates] < low) | (theta[rates] > high)):
            self.skipped += 1
            return cost
        self.refits += 1
        self.comm_scale = float(theta[-1])
        intra, inter = self._bandwidths
        return cost.replace(
            **{name: float(v) for name, v in zip(FITTED, theta[:-1], strict=True)},
            intra_node_bandwidth=intra / self.comm_scale,
            inter_node_bandwidth=inter / self.comm_scale,
        )

    def state_dict(self) -> dict[str, Any]:
        """The window and counters (plain lists, for checkpoints)."""
        return {
            "rows": [[r[0].tolist(), r[1].tolist(), r[2].tolist()] for r in self._rows],
            "comm_scale": self.comm_scale,
            "bandwidths": list(self._bandwidths) if self._bandwidths else None,
            "refits": self.refits,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self._rows = deque(
            (np.asarray(x, dtype=np.float64).reshape(-1, len(FITTED)), np.asarray(t), np.asarray(y))
            for x, t, y in state["rows"]
        )
        self.comm_scale = float(state.get("comm_scale", 1.0))
        self._bandwidths = tuple(state["bandwidths"]) if state.get("bandwidths") else None  # type: ignore[assignment]
        self.refits = int(state.get("refits", 0))
        self.skipped = int(state.get("skipped", 0))
