"""Choosing among candidate plans by their worst case over an ensemble of cost models.

A plan balanced to one model's exact numbers loses its balance under a truth of a different form; calibration
refits coefficients but cannot repair a form it lacks. So every candidate is scored under :func:`ensemble`: the
planner's model and variants that charge, each in one direction, what a truth of another form may charge more
(communication twice as slow, a share of ring traffic exposed whatever attention hides, attention below peak on
short per-rank chunks, per-sequence and per-microbatch overheads, ring transfers hidden no better than perfect
overlap and, over links on which calibration timed no plain ring, as slow as it found the all-to-all, the link
between nodes at most twice as slow). The chosen
candidate minimises its largest *regret* (span under a model over the best candidate's span under that model; the
member with slower communication counts half once calibration has measured rings, :func:`member_weights`) among the
candidates that the planner's own model predicts no worse than the baselines and that no member predicts more than
:data:`BASELINE_SLACK` slower than its fastest baseline: by construction the chosen
plan is never predicted worse than its baseline candidates (:data:`~lightning_hydra.planner.hydra.MCORE_MARGIN`
may then keep Megatron's plan instead, which is never predicted worse than static's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_hydra.planner.cost import CostModel

__all__ = [
    "BASELINE_SLACK",
    "EXPOSED_SHARE_WEIGHT",
    "MEASURED_COMM_WEIGHT",
    "MEASURED_SHARE_WEIGHT",
    "TIE",
    "UNTIMED_INTER_NODE_SLOWDOWN",
    "Scored",
    "choose",
    "ensemble",
    "member_weights",
    "span_of",
    "spans_of",
    "standing",
    "worst_ratio",
]

MEASURED_COMM_WEIGHT = 0.5
"""Weight in the regret of the member whose communication runs twice as slow, once calibration has measured ring
traffic (``CostModel.rings_measured``): a candidate's regret under it counts half. That member hedges a bandwidth
the planner only assumed; a loop that timed rings has fitted the links, and where the calibrated model then
predicted a candidate 2-3% faster and the member charged it 3% more, the member's full weight cost up to 2.2% under
the truth (Llama-3-70B shape, 512 ranks, 256K lognormal, ``worst``: the calibrated model within 0.02% of the truth,
hydra 1.024x mcore with full weight, 1.046x with half). Half, not zero: where the fit extrapolates (a ring shape or
link the loop never ran), the member still steers (64 ranks, 32K, 4 microbatches: halving the member's slowdown to
1.5x instead put one cell at 0.925x mcore: hydra took the fine candidate on one of its two batches). Before any ring
was measured the member weighs in full. The member stops slowing a ring link once the window has timed plain rings
on it (:func:`_comm_member`). See the robustness benchmark (`bench.robust`)."""

_COMM_MEMBER = 1
"""Index in :func:`ensemble` of the member whose links run at half their bandwidth."""

MEASURED_SHARE_WEIGHT = 0.5
"""Weight in the regret of the member that exposes a quarter more of all ring traffic whatever attention hides,
once the calibration window has timed plain rings (without a Ulysses level) on every ring link the model has
(:attr:`CostModel.intra_rings_measured` and :attr:`CostModel.inter_rings_measured`; only the inter-node one without
a node size): the ring's share and exposure were then fitted on such rings, and the member hedges a measurement, as
:data:`MEASURED_COMM_WEIGHT`'s member does once rings were timed. Found by drawn truths at 2,048 ranks x 256K
lognormal (``bench.robust --truths --random-truths 40 --seed-offset 5000 --world-sizes 2048 --contexts 256K
--distributions lognormal``): after loops that timed plain rings on both links, and whose models were within 0.3% of
the truth, this member alone charged the fine candidate 6.7-7.3% more and hydra took its memory-driven formation in
7 of 40 truths, timed up to 5.6% slower than the fine one (hydra 1.016x mcore at worst). At half weight that row's
worst is 1.037 and its mean 1.0706 -> 1.0734 (4 cells up, 2 down by at most 0.9%: the loop's path). On the grid's
256K commands, the 70B and 1B shapes, half and 90% fill, 4 and 16 microbatches, the 8 device truths and 12 drawn
truths at 64 and 512 ranks, 60 of the 256K cells rose (by up to 2.6%) and 7 fell (by up to 1.3%: 2,048 x 256K
stdlib under ``worst``, 1.146 -> 1.134, where the loop's path changed the candidates themselves); every row's worst
stayed or rose but that one, and no 32K cell moved (the robustness benchmark (`bench.robust`)). Half, not zero, for the
reason :data:`MEASURED_COMM_WEIGHT` gives."""

EXPOSED_SHARE_WEIGHT = 0.0
"""Weight of the ring-share member once the window has timed plain rings on every ring link and also checked their
exposed traffic (:attr:`CostModel.exposure_measured`: bins of plain rings whose traffic their attention did not hide,
at least 1% of their time, predicted within 1% by the refitted model); the ring member then keeps the fitted
exposure too (:func:`_ring_member`). Both members hedge the ring's form on rings the window did not hold; a window
that held such rings and predicts them has checked the share and exposure on them, and the members, which add a
quarter to the share and charge exposure 1, hedged the measurement itself. Found on drawn truths no change had been
measured on (``bench.robust --truths --random-truths 10 --first-random-truth 40 --seed-offset 9000 --world-sizes
2048 --contexts 256K``): under ``random42`` (lognormal) the loop's model was within 0.01% of the truth and ranked the
fine candidate 2.7% ahead of the memory-driven formation (the truth: 2.6%), the ring-share member at half weight
charged it 8.4% more and hydra took the memory-driven formation, 1.014x mcore where the fine candidate reached
1.041x; under ``random46`` and the earlier set's ``random9`` (512 ranks) the ring member decided with it. Zero: the
member adds nothing a checked fit does not already say, and at half weight it alone still kept ``random42`` out.
Measured on 19 rows of the robustness benchmark (`bench.robust`) and 270 cells of those fresh truths (1,282 cells,
when the change "A checked exposure is not hedged back" was made): 26 cells up by up to 5.1%, 2 down by at most
0.3%, no row's worst lower, ``random42`` 1.014 -> 1.040 (its best candidate)."""

_SHARE_MEMBER = 2
"""Index in :func:`ensemble` of the member that adds a quarter to the ring's always-exposed share."""

UNTIMED_INTER_NODE_SLOWDOWN = 2.0
"""Most by which the ring member (:func:`_ring_member`) slows an inter-node ring link the calibration window timed no
plain ring on: the slowing it applies to the intra-node ring link, the all-to-all's fitted rate against the ring's,
but at most this (the halving :func:`_comm_member` applies to any link it was not told was timed). The all-to-all
runs inside a node and its fit says nothing of the link between nodes; taken whole there it compounded with the
fitted all-to-all's folded-in latencies. Found by drawn truths at 2,048 ranks x 256K standard-library lengths
(``bench.robust --truths --random-truths 40 --seed-offset 5000 --world-sizes 2048 --contexts 256K --distributions
stdlib``): loops of load-driven power-of-two plans, which hold rings only under a Ulysses level, fitted the
all-to-all at 95-170 GB/s against the ring's assumed 400 GB/s, the member ran the 50 GB/s inter-node link at 12-21
GB/s and charged the fine candidate 16-61% more where the truth (22-42 GB/s between nodes) timed it 4.7-5.6%
faster (measured with the robustness benchmark, `bench.robust`, when the change "An untimed inter-node link slowed
by the all-to-all's factor" was made)."""

BASELINE_SLACK = 0.10
"""Largest share by which any member of the ensemble may predict a chosen candidate slower than the fastest baseline
under that member (the excess weighted as in the regret, :func:`member_weights`): a plan that one plausible model
says loses more than this to Megatron's or static's plan is not worth the gain the others promise. Measured on the
closed loop's early steps (512 ranks, 32K standard-library lengths): a window of one step of Megatron's plan fits
ring costs to its few Ulysses-8 rings (ring traffic free, a large per-step latency); the next step's fine
candidate, all-ring groups of 3-11 ranks the window never held, was predicted at 0.80 efficiency and timed at 0.41
under ``bw0.5`` (0.46 under ``worst``, 0.62-0.75 under ``base``, ``share0``, ``share25``, ``seq50``,
``a2a-full``) against 0.73-0.76 for the memory-driven formation, which the ring member (transfers hidden no better
than perfect overlap) predicted 12-17% faster. Falling back to a baseline on the worst regret alone (against the best
candidate, not the baselines) also fixed those steps but cost 13% at 2,048 x 256K stdlib x ``bw0.5``, whose
load-driven power-of-two candidate had a worst regret of 1.105 while every member predicted it faster than every
baseline. The bound does not catch a model that errs beyond every member: at half fill the fine candidate was
predicted 23% faster than Megatron's plan and at most 4% slower by any member, and timed 8-48% slower (the
robustness benchmark (`bench.robust`))."""

TIE = 1e-12
"""Relative difference below which two spans or regrets count as equal (rounding, not a difference of plans)."""


def ensemble(cost: CostModel) -> list[CostModel]:
    """The planner's model first, then the perturbed models a plan must also do well under.

    The last member charges rings what a closed loop may not have measured (:func:`_ring_member`). A fitted
    exposure below 1 says attention hid more ring traffic than the steps' own attention could; it is learnt from the
    rings the loop ran (large rings over long sequences, mostly hidden) and says nothing of rings whose traffic
    nothing hides (small rings over short sequences), which a fit may even make free (exposure 0, with their cost
    laid on another term): in 512 x 32K stdlib batches at 16 microbatches the fine candidate's short rings were timed
    14-53% slower per group than such a model said, and hydra took it (0.887x mcore under ``share50``). A loop that
    ran no ring at all (Megatron's plans at 32K) leaves the ring's terms analytic while it may find the link they
    share with the all-to-all slower than assumed: at 90% fill under ``worst`` the fine candidate's rings of 3-10
    ranks were timed 4-28% slower per group than the model said, and hydra took it (0.962x mcore). With this member
    it keeps Megatron's plan in both.

    Args:
        cost: The planner's (possibly calibrated) model.
    """
    return [
        cost,
        _comm_member(cost),
        cost.replace(ring_share=cost.ring_share + 0.25),
        cost.replace(length_overhead=cost.length_overhead + 512 * cost.attn),
        cost.replace(seq_overhead=cost.seq_overhead + 50e-6, bin_overhead=cost.bin_overhead + 1e-3),
        _ring_member(cost),
    ]


def member_weights(models: list[CostModel]) -> np.ndarray:
    """Weight of each member's regret in :func:`choose` (the planner's own model and every perturbed member 1, but
    the member with slower communication :data:`MEASURED_COMM_WEIGHT` once calibration has measured ring traffic,
    and the member with a larger ring share :data:`MEASURED_SHARE_WEIGHT` once it has timed plain rings on every ring
    link, :data:`EXPOSED_SHARE_WEIGHT` once it has also checked their exposed traffic). The first member stops
    slowing a ring link once the window has timed plain rings on it (:func:`_comm_member`); where it slows one, the
    fit extrapolates to it, and the weight is a half, not zero, so the member still steers there.

    Args:
        models: The :func:`ensemble` the candidates were scored under (the planner's own model first).
    """
    weights = np.ones(len(models))
    own = models[0]
    if own.rings_measured:
        weights[_COMM_MEMBER] = MEASURED_COMM_WEIGHT
    if own.plain_rings_timed:
        weights[_SHARE_MEMBER] = EXPOSED_SHARE_WEIGHT if own.exposure_measured else MEASURED_SHARE_WEIGHT
    return weights


def _comm_member(cost: CostModel) -> CostModel:
    """``cost`` with its links at half their bandwidth: the all-to-all's always, each ring link unless the
    calibration window timed rings without a Ulysses level on it (:attr:`CostModel.intra_rings_measured`,
    :attr:`CostModel.inter_rings_measured`).

    A ring link timed so has its cost fitted (the ring's share and exposure on that traffic), and halving it would
    hedge a measurement: at 2,048 ranks, 256K lognormal batches, under 10 of 40 drawn truths with faster compute or
    links than assumed, this member charged the fine candidate 25-38% more after a loop that had timed its rings,
    and hydra took a power-of-two candidate 4-9% slower under the truth. Rings timed only with a Ulysses level
    (Megatron's plans) leave the link halved: their exposure, fitted on 1/u of the bytes behind long attention, said
    the fine candidate's plain rings were 3.5% faster than Megatron's plan where the truth timed them 15% slower
    (64 ranks, 32K, 4 microbatches, ``bw0.5``). The all-to-all stays halved although its bandwidth is fitted: nearly
    every plan times it, and sparing it while the rings stay halved turned this member towards Ulysses-heavy
    candidates (a 64 x 32K cell at 4 microbatches, ``share0``, fell from 1.071x to 1.051x mcore)."""
    half = {True: 1.0, False: 0.5}
    return cost.replace(
        intra_node_bandwidth=cost.intra_node_bandwidth / 2,
        inter_node_bandwidth=cost.inter_node_bandwidth * half[cost.inter_rings_measured],
        intra_node_ring_bandwidth=cost.intra_node_ring_bandwidth * half[cost.intra_rings_measured],
    )


def _ring_member(cost: CostModel) -> CostModel:
    """``cost`` with ring transfers hidden no better than perfect overlap (``ring_exposure`` at least 1, unless the
    window checked the fitted one on plain rings whose traffic attention did not hide:
    :attr:`CostModel.exposure_measured`) and each ring
    link on which the calibration window timed no plain ring (:attr:`CostModel.intra_rings_measured`,
    :attr:`CostModel.inter_rings_measured`) slowed by as much as the all-to-all runs below the ring's intra-node link
    (the same link; calibration refits the one, not the other), the inter-node link to no less than half its
    bandwidth (:data:`UNTIMED_INTER_NODE_SLOWDOWN`).

    Rings timed only with a Ulysses level (``rings_measured`` set by Megatron's Ulysses-8 rings at 32K) move a
    fraction of the bytes behind long attention and say little of a plain ring. Before, they stopped the slowing: at
    512 ranks, 32K standard library, 50% fill, such a loop fitted ring exposure 0, and hydra took the fine
    candidate's plain rings of 7-11 ranks across nodes, predicted 21% faster than Megatron's plan and timed 29% slower
    under ``share50`` (0.889x mcore; ``tile512`` 0.921x); slowed, hydra keeps Megatron's plan there (1.000, 0.999).
    Measured on the robustness grid (180 cells) and at 50% and 90% fill (120 cells, 512 ranks): no worst cell fell,
    three cells rose (those two and ``share25`` 0.9996 -> 1.000), 16 fell by 0.03-0.6% (fifteen 512 x 32K
    standard-library cells from 1.0003-1.0025 to Megatron's plan, and 64 x 256K lognormal ``worst`` 1.060 -> 1.054);
    after 24 loop steps that half-fill row's worst rose from 0.815 to 0.998. The Llama-3-70B shape's 512 x 32K
    standard-library row fell 0.7-0.9% in all ten cells (worst 0.9967 -> 0.9893): its loop fitted another model and
    took the memory-driven formation where Megatron's plan was best; the model's error there was the token-wise work
    charged at the tile-bounded degree, and with it at ``L / d`` the row is at 1.000 (measured with ``bench.robust``
    when the change "The token-wise work at ``L / d``" was made)."""
    member = cost.replace(ring_exposure=cost.ring_exposure if cost.exposure_measured else max(cost.ring_exposure, 1.0))
    slow = min(1.0, cost.intra_node_bandwidth / cost.intra_node_ring_bandwidth)
    return member.replace(
        intra_node_ring_bandwidth=cost.intra_node_ring_bandwidth * (1.0 if cost.intra_rings_measured else slow),
        inter_node_bandwidth=cost.inter_node_bandwidth
        * (1.0 if cost.inter_rings_measured else max(slow, 1.0 / UNTIMED_INTER_NODE_SLOWDOWN)),
    )


def span_of(
    cost: CostModel, lengths: np.ndarray, mb: np.ndarray, ulysses: np.ndarray, ring: np.ndarray, seq: np.ndarray,
    gid: np.ndarray, num_microbatches: int, pipeline_stages: int = 1, crosses: np.ndarray | None = None,
) -> float:  # fmt: skip
    """Predicted step time from flat arrays (see :meth:`Plan.flat`): the sum over microbatches of the largest group
    load, plus, through ``P`` pipeline stages under 1F1B, ``P - 1`` times the largest microbatch (the warm-up and
    cool-down a step cannot hide; equal microbatches of time ``t`` take ``(M + P - 1) t``). ``crosses``: whether
    each group spans nodes (:meth:`CostModel.crossing` of its layout; ``None``: see
    :meth:`CostModel.ring_bandwidth`)."""
    loads = cost.group_loads(lengths[seq], gid, ulysses, ring, crosses)
    return _span(loads, mb, num_microbatches, pipeline_stages)


def spans_of(
    models: list[CostModel], lengths: np.ndarray, mb: np.ndarray, ulysses: np.ndarray, ring: np.ndarray,
    seq: np.ndarray, gid: np.ndarray, num_microbatches: int, pipeline_stages: int = 1,
    crosses: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """:func:`span_of` under every model of ``models`` (an :func:`ensemble`; equal up to rounding, which
    :func:`choose` treats as a tie): the plan's per-group sums of what
    the models weigh (compute, all-to-all bytes, ring bytes, hideable attention) are taken once, and each model's
    group loads are a weighted sum of them. Models with another kernel tile than the first are scored one by one.
    """
    lens = np.asarray(lengths, dtype=np.float64)[seq]
    n = np.asarray(ulysses).size
    u_g = np.asarray(ulysses, dtype=np.float64)
    r_g = np.asarray(ring, dtype=np.float64)
    u, r = u_g[gid], r_g[gid]
    d = u * r
    tile = models[0].min_chunk_tokens
    d_eff = models[0].effective_degree(lens, d)
    steps = np.maximum(r - 1, 0.0)

    def total(x: np.ndarray) -> np.ndarray:
        return np.bincount(gid, weights=x, minlength=n)

    quad, lin, tokens = total(lens * lens / d_eff), total(lens / d), total(lens)
    count = np.bincount(gid, minlength=n).astype(np.float64)
    a2a = total(np.where(u > 1, (lens / d) * (u - 1) / u, 0.0))  # all-to-all bytes per byte-per-token
    ring_tokens = total(steps * (lens / r) / u)  # ring bytes per byte-per-token
    hide = total(steps * lens * lens / (u * r * r))  # hideable attention per unit of ``attn``
    busy = count > 0
    segments = _segments(mb)
    out = np.empty(len(models))
    for i, c in enumerate(models):
        if c.min_chunk_tokens != tile:
            out[i] = span_of(c, lengths, mb, ulysses, ring, seq, gid, num_microbatches, pipeline_stages, crosses)
            continue
        traffic = c.ring_bytes_per_token * ring_tokens / c.ring_bandwidth(u_g * r_g, crosses)
        loads = (
            c.attn * quad
            + c.linear * lin
            + c.seq_overhead * count
            + c.length_overhead * tokens
            + c.a2a_bytes_per_token * a2a / c.intra_node_bandwidth
            + c.exposed(traffic, c.attn * hide)
            + c.fixed(u_g, r_g)
        )
        out[i] = _span(np.where(busy, loads, 0.0), mb, num_microbatches, pipeline_stages, segments)
    return out


def _segments(mb: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Where each microbatch's groups start and which microbatch that is, when ``mb`` is sorted (formations list
    their groups microbatch by microbatch); ``None`` otherwise."""
    if mb.size == 0 or (mb[1:] < mb[:-1]).any():
        return None
    starts = np.flatnonzero(np.r_[True, mb[1:] != mb[:-1]])
    return starts, mb[starts]


def _span(
    loads: np.ndarray, mb: np.ndarray, num_microbatches: int, pipeline_stages: int,
    segments: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:  # fmt: skip
    """Sum over microbatches of the largest group load, plus ``P - 1`` times the largest microbatch (``segments``:
    :func:`_segments` of ``mb``, when sorted)."""
    per_mb = np.zeros(max(num_microbatches, int(mb.max()) + 1 if mb.size else 1))
    if segments is None:
        np.maximum.at(per_mb, mb, loads)
    else:
        per_mb[segments[1]] = np.maximum(np.maximum.reduceat(loads, segments[0]), 0.0)
    return float(per_mb.sum() + (pipeline_stages - 1) * per_mb.max())


@dataclass
class Scored:
    """A candidate's spans under every model of the ensemble."""

    name: str
    """The candidate."""
    spans: np.ndarray
    """Span under each model (the planner's own first)."""
    baseline: bool
    """Whether hydra must never be predicted worse than this one."""


def choose(
    scored: list[Scored], weights: np.ndarray | None = None, slack: float | None = None
) -> tuple[int, dict[str, float]]:
    """Index of the candidate with the smallest worst-case regret among those the planner's model predicts no
    worse than every baseline and, with ``slack``, that no model predicts more than ``slack`` slower than that
    model's fastest baseline (ties within :data:`TIE`: the smaller predicted span, then the earlier candidate), and
    the regrets.

    A candidate's regret under a model is its span over the best candidate's span under that model; with
    ``weights`` the excess over 1 is scaled per model (``1 + w * (ratio - 1)``, :func:`member_weights`), and its
    regret is the largest over the models.

    Args:
        scored: Every candidate with its spans.
        weights: Weight of each model's regret, one per model (:func:`member_weights`). ``None``: all 1.
        slack: Largest share by which a model may predict a chosen candidate that is not a baseline slower than
            that model's fastest baseline, the excess weighted as in the regret (the planner passes
            :data:`BASELINE_SLACK`; ``None``: no bound).
    """
    regret, feasible = standing(scored, weights, slack)
    spans = np.stack([s.spans for s in scored])
    key = np.where(feasible, regret, np.inf)
    # ties within rounding (the spans of equal plans may differ in the last bits): the smaller predicted span, then
    # the earlier candidate
    tied = key <= key.min() * (1 + TIE)
    own = np.where(tied, spans[:, 0], np.inf)
    pick = int(np.flatnonzero(own <= own.min() * (1 + TIE))[0])
    return pick, {s.name: float(r) for s, r in zip(scored, regret, strict=True)}


def standing(
    scored: list[Scored], weights: np.ndarray | None = None, slack: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`choose` chooses by: every candidate's worst-case regret and whether it may be chosen (the
    planner's model predicts it no worse than every baseline and, with ``slack``, no model predicts it more than
    ``slack`` slower than that model's fastest baseline; a baseline always may).

    Args:
        scored: Every candidate with its spans.
        weights: Weight of each model's regret (:func:`member_weights`; ``None``: all 1).
        slack: The baseline slack (``None``: no bound).

    Returns:
        ``(regret, feasible)``, one entry per candidate.
    """
    spans = np.stack([s.spans for s in scored])
    w = np.ones(spans.shape[1]) if weights is None else np.asarray(weights, dtype=np.float64)
    regret = worst_ratio(spans, spans.min(axis=0), w)
    base = np.array([s.baseline for s in scored])
    bound = spans[base, 0].min() if base.any() else np.inf
    feasible = spans[:, 0] <= bound * (1 + TIE)
    if slack is not None and base.any():
        feasible &= base | (worst_ratio(spans, spans[base].min(axis=0), w) <= 1.0 + slack)
    return regret, feasible


def worst_ratio(spans: np.ndarray, reference: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each row's largest weighted ratio to ``reference``: ``max_k 1 + w_k * (spans[:, k] / reference[k] - 1)``
    (the regret against the best spans; a reference of 0 counts as 1).

    Args:
        spans: Spans ``[candidates, models]`` (or one candidate's ``[models]``).
        reference: One span per model.
        weights: Weight of each model (:func:`member_weights`).
    """
    return (1.0 + (spans / np.where(reference > 0, reference, 1.0) - 1.0) * weights).max(axis=-1)
