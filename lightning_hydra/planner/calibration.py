"""Closed-loop calibration: refit the cost model's coefficients from measured microbatch times.

Every rank measures its busy time in every microbatch; the pairs ``(features, time)`` of all ranks are gathered,
so every rank holds the same data and this pure function refits the same coefficients everywhere (the next plan's
digest check would catch any divergence). The features of a rank's bin ``Ls`` at degree ``d = u * r`` are linear
in the fitted coefficients (:data:`FITTED`, one feature each, in this order)::

    busy  = attn * sum(L**2 / d_eff) + linear * sum(L) / d + seq_overhead * len(Ls)
            + length_overhead * sum(L) + bin_overhead + a2a_latency * [u > 1] + p2p_latency * (r - 1)
    comm  = a2a_bytes / intra_node_bandwidth + ring_share * traffic + ring_exposure * max(0, traffic - hideable)

with ``d_eff`` the tile-bounded effective degree of :meth:`CostModel.effective_degree`, ``a2a_bytes`` the bytes
that leave the rank in the Ulysses all-to-alls, ``traffic`` the ring's transfer seconds at the model's (fixed)
ring bandwidths (the intra-node ring link for a group inside one node, the inter-node link for one across nodes:
:meth:`CostModel.ring_bandwidth`) and ``hideable`` the attention that overlaps them (:meth:`CostModel.ring_steps`).
The
features are rich enough to fit truths of a different form than the analytic start: kernels that slow down on
short per-rank chunks (``sum(L)``: attention at efficiency ``chunk / (chunk + h)`` costs ``attn * h * L`` more per
rank; a tile floor is linear in ``L`` too), a per-microbatch fixed cost (GEMMs below peak on few tokens, launches),
communication that is a fixed share of the ring traffic rather than what attention fails to hide, and an
all-to-all volume with or without the GQA saving (one coefficient on the bytes).

What is fitted depends on what was measured (:meth:`CostCalibrator.add`):

- ``includes_comm=True`` (CUDA events around the whole microbatch): every coefficient, on ``busy + comm``;
- ``includes_comm=False`` with ``comm=`` (a CPU thread timer plus the wall time in CP collectives): the busy
  coefficients on the busy time and the communication coefficients on the measured communication, separately;
- ``includes_comm=False`` alone: only the busy coefficients (communication keeps its current coefficients).

The fit is a relative least-squares over a sliding window of steps, in column-normalised coordinates, with a ridge
pulling towards the current coefficients: directions the data does not determine stay where they were instead of
swinging on noise. A feature that refines a more general one (:data:`REFINEMENTS`: the all-to-all latency, paid by
bins with ``u > 1``, refines the per-microbatch fixed cost; ``seq_overhead`` refines it too when every bin holds one
sequence) and that the window cannot tell apart from the others keeps its coefficient, and the general feature takes
the cost: the ridge alone would split it between them, and shapes the window never held (bins with ``u = 1`` after a
loop of Megatron's plans) would be predicted without their share. The refitted model records whether a window ever
held ring traffic (:attr:`CostModel.rings_measured`): until one has, the ring's coefficients are the analytic ones,
and the planner's robust choice weighs slower rings too. It also records which ring links the current window timed
with rings without a Ulysses level (inside a node, across nodes: :func:`ring_links` tells a ring's link from its
features), so the robust choice stops hedging a ring link a measurement has fitted; and whether the window held plain
rings whose traffic their attention did not hide, enough of it to matter, which the refitted model predicts closely
(:attr:`CostModel.exposure_measured`), so the robust choice stops hedging an exposure and a ring share it checked.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.plan import Plan

__all__ = [
    "BUSY",
    "COMM",
    "FEATURE_FORM",
    "FITTED",
    "INTER",
    "INTRA",
    "NUM_FEATURES",
    "REFINEMENTS",
    "CostCalibrator",
    "bin_features",
    "excess_error",
    "plain_rings_readable",
    "plan_features",
    "predict",
    "relative_error",
    "ring_links",
]

FITTED = (
    "attn",
    "linear",
    "seq_overhead",
    "length_overhead",
    "bin_overhead",
    "a2a_latency",
    "p2p_latency",
    "intra_node_bandwidth",
    "ring_share",
    "ring_exposure",
)
"""The cost-model fields calibration refits, in feature order (``intra_node_bandwidth`` is fitted as its
inverse, seconds per all-to-all byte)."""
NUM_FEATURES = len(FITTED)
"""Features per (rank, microbatch): one per fitted coefficient."""
FEATURE_FORM = 3
"""Version of how the features are computed (3: the token-wise column ``sum(L) / d`` without the tile floor; 2: that
column tile-bounded like attention's, ``sum(L / d_eff)``, ring traffic at the link of each group's layout; 1: every
ring at the inter-node link). A checkpointed window of another form is dropped on load."""
BUSY = np.arange(7)
"""Feature columns of the work a thread timer sees (compute, overheads, collective launches)."""
COMM = np.arange(7, NUM_FEATURES)
"""Feature columns of bandwidth-bound communication (what a thread timer does not see)."""
_POSITIVE = np.isin(np.arange(NUM_FEATURES), (0, 1, 7))  # rates: attn, linear, seconds per all-to-all byte
_MIN_SECONDS = 1e-9
"""Shortest measured time (of a row's busy time or its communication) that counts as a measurement: a timer's zero
or garbage below a nanosecond is dropped like an idle row (each equation is divided by its time, and a time of
1e-150 s overflowed the normal equations)."""
REFINEMENTS = (2, 3, 5, 6)
"""Feature columns that refine a more general one: the per-sequence cost (``seq_overhead``), the all-to-all and
ring-step latencies (``a2a_latency``, ``p2p_latency``) split the per-microbatch fixed cost (``bin_overhead``) by
what the bin holds, and ``length_overhead`` splits the per-token cost (``linear``) by the degree. A refinement is
fitted only where the window tells it apart from the other features (:attr:`CostCalibrator.min_separation`)."""


def coefficients(cost: CostModel) -> np.ndarray:
    """The fitted coefficients of ``cost`` as a vector in feature order."""
    theta = np.array([float(getattr(cost, name)) for name in FITTED])
    theta[7] = 1.0 / cost.intra_node_bandwidth
    return theta


def bin_features(
    cost: CostModel, lengths: np.ndarray | list[int], ulysses: int, ring: int, *, crosses: bool | None = None
) -> np.ndarray:
    """Features of one rank's work on a bin (see the module docstring; all zero for an idle rank).

    Index 2 is the number of sequences, so ``features[..., 2] > 0`` marks a rank that held work.

    Args:
        cost: The cost model that predicts the ring's traffic and hidden attention (and the tile bound).
        lengths: Lengths of the bin's sequences (empty: an idle rank).
        ulysses: Ulysses degree of the group.
        ring: Ring degree of the group.
        crosses: Whether the group's ranks span nodes (``None``: see :meth:`CostModel.ring_bandwidth`).
    """
    lens = np.asarray(lengths, dtype=np.float64)
    out = np.zeros(NUM_FEATURES)
    if lens.size == 0:
        return out
    d_eff = cost.effective_degree(lens, ulysses * ring)
    traffic, hideable = cost.ring_steps(lens, ulysses, ring, crosses)
    out[0] = float(np.sum(lens * lens / d_eff))
    out[1] = float(lens.sum()) / (ulysses * ring)
    out[2] = float(lens.size)
    out[3] = float(lens.sum())
    out[4] = 1.0
    out[5] = 1.0 if ulysses > 1 else 0.0
    out[6] = float(max(ring - 1, 0))
    out[7] = float(np.sum(cost.a2a_bytes(lens, ulysses, ring)))
    out[8] = float(np.sum(traffic))
    out[9] = max(0.0, out[8] - float(np.sum(hideable)))
    return out


def plan_features(plan: Plan, cost: CostModel) -> np.ndarray:
    """:func:`bin_features` of every rank in every microbatch of ``plan``, vectorised: ``[M * N, NUM_FEATURES]``
    with row ``m * N + rank`` (idle ranks all zero); a ring that crosses nodes in the plan's layout is charged the
    inter-node link (:meth:`CostModel.crossing`)."""
    mb, start, u, r, seq, gid = plan.flat()
    n_groups = u.size
    lens = np.asarray(plan.lengths, dtype=np.float64)[seq]
    us, rs = u[gid], r[gid]
    d_eff = cost.effective_degree(lens, us * rs)
    traffic, hideable = cost.ring_steps(lens, us, rs, cost.crossing(start, u * r)[gid])
    per = np.zeros((n_groups, NUM_FEATURES))
    for col, values in enumerate((lens * lens / d_eff, lens / (us * rs), np.ones_like(lens), lens)):
        per[:, col] = np.bincount(gid, weights=values, minlength=n_groups)
    busy = per[:, 2] > 0
    per[:, 4] = busy
    per[:, 5] = busy & (u > 1)
    per[:, 6] = np.where(busy, np.maximum(r - 1, 0), 0)
    per[:, 7] = np.bincount(gid, weights=cost.a2a_bytes(lens, us, rs), minlength=n_groups)
    per[:, 8] = np.bincount(gid, weights=traffic, minlength=n_groups)
    per[:, 9] = np.maximum(per[:, 8] - np.bincount(gid, weights=hideable, minlength=n_groups), 0.0)
    size = u * r
    rows = np.repeat(mb * plan.world_size + start, size) + (
        np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
    )
    out = np.zeros((plan.num_microbatches * plan.world_size, NUM_FEATURES))
    out[rows] = np.repeat(per, size, axis=0)
    return out


INTRA, INTER = 1, 2
"""Codes of :func:`ring_links`: a ring inside one node, a ring across nodes (0: no ring traffic, -1: not told)."""


_LINK_RTOL = 1e-6
"""Relative tolerance within which a row's ring traffic reads as a whole Ulysses degree at a link
(:func:`ring_links`)."""


def plain_rings_readable(cost: CostModel) -> bool:
    """Whether :func:`ring_links` can tell which link a plain ring (no Ulysses level) ran on under ``cost``: not where
    the two ring links run at the same rate (within :data:`_LINK_RTOL`), where such a row reads as ``u = 1`` at both
    and counts as neither, so that no window would mark either link timed (without a node size every ring crosses
    nodes and is told)."""
    return not cost.ranks_per_node or not np.isclose(
        cost.intra_node_ring_bandwidth, cost.inter_node_bandwidth, rtol=_LINK_RTOL, atol=0.0
    )


def ring_links(cost: CostModel, features: np.ndarray) -> np.ndarray:
    """Which link each row's ring traffic used: :data:`INTRA`, :data:`INTER`, 0 (no ring traffic) or -1 (the row
    fits neither link, or both).

    The traffic feature of a bin of ``sum(L)`` tokens on a ring of ``r`` ranks with Ulysses degree ``u`` is
    ``(r - 1) / r * ring_bytes_per_token * sum(L) / (u * bandwidth)`` at the link its group uses (the ring
    bandwidths are never refitted, so ``cost``'s are the ones the features were computed with). A link is the
    row's where that gives a whole Ulysses degree that divides the node, is above 1 exactly where the row's
    all-to-all feature says so, and does not exceed the degree the row's compute features imply (``sum(L)`` over the
    token-wise column ``sum(L) / d``: ``u * r``). With the default links (400 and 50 GB/s) every row is told; links
    whose ratio is a ratio of two Ulysses degrees above 1 can leave rows untold, which then count as neither link.

    Args:
        cost: The model the features were computed with (its ring bandwidths and bytes per token).
        features: ``[n, NUM_FEATURES]`` rows (:func:`bin_features`, :func:`plan_features`).
    """
    f = np.asarray(features, dtype=np.float64).reshape(-1, NUM_FEATURES)
    out = np.zeros(f.shape[0], dtype=np.int64)
    ring = (f[:, 8] > 0) & (f[:, 6] > 0) & (f[:, 3] > 0) & (f[:, 1] > 0)
    if not ring.any() or cost.ring_bytes_per_token <= 0:
        return out
    r = f[ring, 6] + 1.0
    u_times_bw = (r - 1.0) / r * cost.ring_bytes_per_token * f[ring, 3] / f[ring, 8]
    degree = f[ring, 3] / f[ring, 1]  # the group's degree, u * r
    node = int(cost.ranks_per_node)
    fits = []
    for link, bandwidth in ((INTRA, cost.intra_node_ring_bandwidth), (INTER, cost.inter_node_bandwidth)):
        if link == INTRA and not node:  # without a topology every ring crosses nodes
            fits.append(np.zeros(r.size, dtype=bool))
            continue
        u = u_times_bw / bandwidth
        whole = np.round(u)
        ok = (whole >= 1) & np.isclose(u, whole, rtol=_LINK_RTOL, atol=0.0)
        ok &= (whole > 1) == (f[ring, 5] > 0)
        ok &= degree <= whole * r * (1 + 1e-9)
        if node:
            ok &= np.mod(node, np.maximum(whole, 1)) == 0
        fits.append(ok)
    intra, inter = fits
    out[ring] = np.where(intra & ~inter, INTRA, np.where(inter & ~intra, INTER, -1))
    return out


def predict(cost: CostModel, features: np.ndarray, *, includes_comm: bool) -> np.ndarray:
    """Predicted seconds of every row of ``features`` (``[n, NUM_FEATURES]``): the busy part, plus the
    communication when the measured time includes it (then it equals :meth:`CostModel.bin_time`)."""
    f = np.asarray(features, dtype=np.float64).reshape(-1, NUM_FEATURES)
    theta = coefficients(cost)
    cols = np.arange(NUM_FEATURES) if includes_comm else BUSY
    return f[:, cols] @ theta[cols]


def _busy(predicted: np.ndarray, measured: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """The predicted and measured times of the busy entries (measured above 0), and their summed measured time."""
    pred = np.asarray(predicted, dtype=np.float64).ravel()
    meas = np.asarray(measured, dtype=np.float64).ravel()
    busy = meas > 0
    return pred[busy], meas[busy], float(meas[busy].sum())


def relative_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    """``sum |predicted - measured| / sum measured`` over the busy entries (``nan`` when nothing was measured)."""
    pred, meas, total = _busy(predicted, measured)
    return float(np.abs(pred - meas).sum() / total) if total > 0 else float("nan")


def excess_error(predicted: np.ndarray, measured: np.ndarray, base_predicted: np.ndarray, base: np.ndarray) -> float:
    """How much worse ``predicted`` matches ``measured`` than ``base_predicted`` matches ``base``, with the scatter
    both share taken out: ``sqrt(max(0, ms - ms_base))``, ``ms`` the time-weighted mean squared relative error
    ``sum (p - m)**2 / m / sum m`` over the busy entries (``nan`` where either has none).

    Independent timer noise of relative scale ``s`` adds about ``s**2`` to both mean squares, and a model that misses
    the first entries by a relative ``b`` adds ``b**2`` to the first only: the result estimates ``b`` (on a
    noise-free timer with ``base`` fitted exactly, the root mean square of the first's relative error).

    Args:
        predicted: Predicted times of the entries examined.
        measured: Their measured times.
        base_predicted: Predicted times of the entries the scatter is read from.
        base: Their measured times.
    """

    def mean_square(predicted: np.ndarray, measured: np.ndarray) -> float:
        pred, meas, total = _busy(predicted, measured)
        return float(((pred - meas) ** 2 / meas).sum() / total) if total > 0 else float("nan")

    excess = mean_square(predicted, measured) - mean_square(base_predicted, base)
    return float("nan") if np.isnan(excess) else float(np.sqrt(max(excess, 0.0)))


def _timed(features: np.ndarray, comm: np.ndarray | None, joint: bool) -> np.ndarray:
    """Which rows of a window entry had their communication measured: all of them where the time includes it
    (``joint``), those with a separate measurement above 0 where one was given, else none."""
    return np.full(len(features), joint) if comm is None else comm > 0


@dataclass(kw_only=True)
class CostCalibrator:
    """Sliding-window least-squares refit of the coefficients of a :class:`CostModel`."""

    window: int = 16
    """Steps of measurements the fit uses (older ones are dropped: the machine's speed may drift)."""
    ridge: float = 1e-3
    """Weight of the pull towards the current coefficients, in coordinates where every feature column has unit
    norm: directions of the data with less weight than this stay near the current values."""
    min_rows: int = 4
    """Fewest busy (rank, microbatch) measurements before a first refit."""
    max_condition: float = 1e8
    """Largest condition number of the normalised design accepted; worse fits are skipped."""
    min_separation: float = 0.01
    """Smallest part of a refinement's column (:data:`REFINEMENTS`, in coordinates where every column has unit norm)
    that must lie outside the span of the other fitted columns for it to be fitted; below it the refinement keeps its
    current coefficient and the general feature takes the cost. Where every measured bin had ``u > 1`` (a closed
    loop that ran only Megatron's plans) the all-to-all latency's column equals the fixed cost's, and the ridge would
    split the fixed cost between them: bins with ``u = 1``, never measured, would then be predicted without half of
    it (measured: 64 ranks, 32K stdlib, 4 microbatches, ``base``: the fine candidate's single ranks and rings
    predicted 5-36% fast, hydra at 0.98x mcore)."""
    max_change: float = 100.0
    """Largest factor by which one refit may move a rate (``attn``, ``linear``, the all-to-all bandwidth): a guard
    against a corrupt measurement."""
    min_exposed_share: float = 0.01
    """Least exposed ring traffic (at ``ring_exposure`` 1, summed) as a share of the summed measured time of the bins
    of plain rings whose attention did not hide it, for the window to count as having timed exposed rings
    (:attr:`CostModel.exposure_measured`)."""
    max_exposed_error: float = 0.01
    """Largest relative error (:func:`relative_error`) of the refitted model on those bins for
    :attr:`CostModel.exposure_measured`, or largest excess of their error over the window's other bins
    (:func:`excess_error`: a timer that scatters by a few percent per bin puts every bin's relative error above 1%,
    and the excess takes that scatter out): where the model's form misses what they cost, the robust choice keeps
    hedging them."""
    _rows: deque = field(default_factory=deque, init=False, repr=False)
    _links_of: deque = field(default_factory=deque, init=False, repr=False)
    """Per entry of ``_rows``, its rows' plain-ring links once read (``(key, links)``, ``key`` the ring constants they
    were read with; :meth:`_row_links`), else ``None``: each step is read once, not at every refit of its window."""
    _first_bandwidth: float = field(default=0.0, init=False, repr=False)
    _bandwidth: float = field(default=0.0, init=False, repr=False)
    refits: int = field(default=0, init=False)
    """Refits applied so far."""
    skipped: int = field(default=0, init=False)
    """Refits skipped as ill-conditioned or non-physical."""

    def add(
        self, features: np.ndarray, times: np.ndarray, *, includes_comm: bool, comm: np.ndarray | None = None
    ) -> None:
        """Add one step's measurements.

        Args:
            features: ``[n, NUM_FEATURES]`` rows from :func:`bin_features` (one per rank and microbatch).
            times: ``[n]`` measured seconds of each row: the microbatch's busy time on that rank. Rows of an idle
                rank (no work) and rows whose time (or ``comm``) is not a finite measurement of at least a
                nanosecond are left out of the fit.
            includes_comm: Whether ``times`` include the time spent in CP communication (CUDA events around the
                whole microbatch: ``True``; a CPU thread timer: ``False``).
            comm: Optional ``[n]`` wall seconds the rank spent *inside CP collectives* in that microbatch (the
                Ulysses all-to-alls and the ring's send/receive waits: what ``CommClock`` accumulates), same rows as
                ``times``. With it the communication coefficients are fitted too; when ``includes_comm`` is also
                ``True`` it is taken to be part of ``times``.
        """
        f = np.asarray(features, dtype=np.float64).reshape(-1, NUM_FEATURES)
        t = np.asarray(times, dtype=np.float64).ravel()
        c = None if comm is None else np.asarray(comm, dtype=np.float64).ravel()
        if c is not None and c.shape != t.shape:
            raise ValueError(f"comm has {c.size} rows, times has {t.size}")
        busy = np.isfinite(t) & (t >= _MIN_SECONDS) & (f[:, 2] > 0)
        if c is not None:
            busy &= np.isfinite(c)
        if c is not None and includes_comm:
            t = t - c  # the thread's own work; the communication is fitted from ``comm``
        self._rows.append((f[busy], t[busy], None if c is None else c[busy], bool(includes_comm and c is None)))
        self._links_of.append(None)
        while len(self._rows) > self.window:
            self._rows.popleft()
            self._links_of.popleft()

    def _system(self) -> tuple[np.ndarray, np.ndarray]:
        """Stacked equations ``a @ theta = b`` of the window, each row divided by its measured time."""
        eqs: list[np.ndarray] = []
        rhs: list[np.ndarray] = []
        for f, t, c, joint in self._rows:
            if joint:  # the time includes communication: one equation over every coefficient
                eqs.append(f)
                rhs.append(t)
                continue
            busy = f.copy()
            busy[:, COMM] = 0.0
            eqs.append(busy)
            rhs.append(t)
            if c is not None:
                keep = c >= _MIN_SECONDS
                only = np.zeros_like(f[keep])
                only[:, COMM] = f[keep][:, COMM]
                eqs.append(only)
                rhs.append(c[keep])
        a = np.concatenate(eqs) if eqs else np.zeros((0, NUM_FEATURES))
        b = np.concatenate(rhs) if rhs else np.zeros(0)
        ok = b >= _MIN_SECONDS  # the thread's own time (``times - comm``) may fall below
        return a[ok] / b[ok, None], np.ones(int(ok.sum()))

    def refit(self, cost: CostModel) -> CostModel:
        """The cost model with its coefficients refitted to the window (``cost`` itself when the data cannot
        support a fit)."""
        if not self._rows:
            return cost
        a, b = self._system()
        if len(b) < self.min_rows:
            return cost
        norms = np.linalg.norm(a, axis=0)
        theta0 = coefficients(cost)
        theta = theta0.copy()
        free = norms > 0  # a feature absent from the window leaves its coefficient alone
        scale = np.where(norms > 0, norms, 1.0)
        gram = (a.T @ a) / np.outer(scale, scale)  # of the normalised columns: unit diagonal where one is present
        held = self._inseparable(gram, free)
        free &= ~held
        # active set: a coefficient the unconstrained fit drives below zero is pinned (rates at their current
        # value, the others at zero) and the rest is refitted without it
        for _ in range(NUM_FEATURES):
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
            negative = free & ((theta < 0) | (_POSITIVE & (theta <= 0)))
            if not negative.any():
                break
            theta[negative] = np.where(_POSITIVE, theta0, 0.0)[negative]
            free &= ~negative
            # a refinement held because it matched a column now pinned is told apart again, and refitted
            released = held & ~self._inseparable(gram, free | held)
            free |= released
            held &= ~released
        low, high = theta0[_POSITIVE] / self.max_change, theta0[_POSITIVE] * self.max_change
        if np.any(theta[_POSITIVE] <= 0) or np.any((theta[_POSITIVE] < low) | (theta[_POSITIVE] > high)):
            self.skipped += 1
            return cost
        self.refits += 1
        values = {name: float(v) for name, v in zip(FITTED, theta, strict=True)}
        values["intra_node_bandwidth"] = cost.intra_node_bandwidth if theta[7] == theta0[7] else float(1.0 / theta[7])
        values["rings_measured"] = bool(cost.rings_measured or norms[8] > 0)
        values["intra_rings_measured"], values["inter_rings_measured"] = self._links(cost)
        self._first_bandwidth = self._first_bandwidth or cost.intra_node_bandwidth
        self._bandwidth = values["intra_node_bandwidth"]
        refitted = cost.replace(**values)
        return refitted.replace(exposure_measured=self._exposure_checked(cost, refitted))

    def _exposure_checked(self, cost: CostModel, refitted: CostModel) -> bool:
        """Whether the window's bins of rings without a Ulysses level (on a link :func:`ring_links` tells, their
        communication measured: :meth:`_row_links`) whose traffic their attention did not hide carry exposed traffic
        (at ``ring_exposure`` 1) of at least :attr:`min_exposed_share` of their measured time, and ``refitted``
        predicts their times within :attr:`max_exposed_error`: by :func:`relative_error`, or, where the timer
        scatters, by the :func:`excess_error` of those bins over the window's other bins whose communication was
        measured (scatter the two share; a form that misses exposed rings adds to the first only). The features
        were computed with ``cost``'s ring constants (never refitted)."""
        exposed, measured, predicted, rest = 0.0, [], [], []
        for (f, t, c, joint), links in zip(self._rows, self._row_links(cost), strict=True):
            rows = (links > 0) & (f[:, 9] > 0)
            rest.append(_timed(f, c, joint) & ~rows)
            if not rows.any():
                continue
            total = t[rows] if joint else t[rows] + c[rows]
            exposed += float(f[rows, 9].sum())
            measured.append(total)
            predicted.append(predict(refitted, f[rows], includes_comm=True))
        if not measured:
            return False
        total = np.concatenate(measured)
        if exposed < self.min_exposed_share * float(total.sum()):
            return False
        guess = np.concatenate(predicted)
        if relative_error(guess, total) <= self.max_exposed_error:
            return True
        entries = [
            (f[r], t[r] if joint else t[r] + c[r])
            for (f, t, c, joint), r in zip(self._rows, rest, strict=True)
            if r.any()  # rows without a timed communication have no ``c`` to add
        ]
        if not entries:
            return False
        other = np.concatenate([m for _, m in entries])
        other_guess = np.concatenate([predict(refitted, f, includes_comm=True) for f, _ in entries])
        return excess_error(guess, total, other_guess, other) <= self.max_exposed_error

    def _links(self, cost: CostModel) -> tuple[bool, bool]:
        """Whether the window timed rings without a Ulysses level inside a node and across nodes (:meth:`_row_links`).
        A nested ring moves 1/u of the bytes per rank, mostly behind attention, and says little of a plain ring on the
        same link."""
        links = self._row_links(cost)
        return any(bool((x == INTRA).any()) for x in links), any(bool((x == INTER).any()) for x in links)

    def _row_links(self, cost: CostModel) -> list[np.ndarray]:
        """Per window entry, each row's ring link (:func:`ring_links`) where it is a ring without a Ulysses level and
        its communication was fitted (a time that includes it, or a separate measurement of it), else 0; read once
        per entry and ring constants, not at every refit of its window."""
        key = (
            cost.ring_bytes_per_token,
            cost.intra_node_ring_bandwidth,
            cost.inter_node_bandwidth,
            cost.ranks_per_node,
        )
        out = []
        for i, (f, _, c, joint) in enumerate(self._rows):
            known = self._links_of[i]
            if known is None or known[0] != key:
                plain = _timed(f, c, joint) & (f[:, 5] == 0)
                links = np.zeros(len(f), dtype=np.int64)
                links[plain] = ring_links(cost, f[plain])
                known = (key, links)
                self._links_of[i] = known
            out.append(known[1])
        return out

    def _inseparable(self, gram: np.ndarray, free: np.ndarray) -> np.ndarray:
        """Refinements (:data:`REFINEMENTS`, in that order) among ``free`` whose normalised column lies within
        :attr:`min_separation` of the span of the other ``free`` columns (those not yet held), from the Gram matrix
        of the normalised columns (computed once per refit)."""
        out = np.zeros(NUM_FEATURES, dtype=bool)
        fitted = free.copy()
        for j in REFINEMENTS:
            if not fitted[j]:
                continue
            others = fitted.copy()
            others[j] = False
            if not others.any():
                continue
            # squared distance of column j from the span of the others: 1 - its projection (a Schur complement)
            coef, *_ = np.linalg.lstsq(gram[np.ix_(others, others)], gram[others, j], rcond=None)
            if 1.0 - float(gram[j, others] @ coef) < self.min_separation**2:
                out[j] = True
                fitted[j] = False
        return out

    @property
    def comm_scale(self) -> float:
        """All-to-all bandwidth of the first model refitted over the current one (1: communication as first
        assumed; 2: twice as slow)."""
        return self._first_bandwidth / self._bandwidth if self._first_bandwidth else 1.0

    def state_dict(self) -> dict[str, Any]:
        """The window and counters (plain lists, for checkpoints)."""
        return {
            "num_features": NUM_FEATURES,
            "feature_form": FEATURE_FORM,
            "rows": [
                [f.tolist(), t.tolist(), None if c is None else c.tolist(), joint] for f, t, c, joint in self._rows
            ],
            "refits": self.refits,
            "skipped": self.skipped,
            "bandwidths": [float(self._first_bandwidth), float(self._bandwidth)],  # plain floats: weights_only loads
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (a window saved with other features, or features computed another way, is
        dropped: it cannot be refitted with today's)."""
        self._rows = deque()
        self._links_of = deque()
        if state.get("num_features") == NUM_FEATURES and state.get("feature_form", 1) == FEATURE_FORM:
            for f, t, c, joint in state["rows"]:
                self._rows.append(
                    (
                        np.asarray(f, dtype=np.float64).reshape(-1, NUM_FEATURES),
                        np.asarray(t, dtype=np.float64),
                        None if c is None else np.asarray(c, dtype=np.float64),
                        bool(joint),
                    )
                )
                self._links_of.append(None)
        self.refits = int(state.get("refits", 0))
        self.skipped = int(state.get("skipped", 0))
        self._first_bandwidth, self._bandwidth = (float(x) for x in state.get("bandwidths", (0.0, 0.0)))
