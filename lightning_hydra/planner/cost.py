"""The cost model: predicted per-rank time of a sequence, or a bin, at a CP degree ``d = ulysses * ring``.

One :class:`CostModel` object is shared by the scheduler, the metrics and the simulator. Its coefficients are plain
fields so that calibration (a later refit from measured times) can hand new values to the planner as data.

Per sequence of length ``L`` on a group of degree ``d = u * r`` (docs/design.md section 3)::

    compute(L, d) = attn * L**2 / d_eff + linear * L / d + seq_overhead + length_overhead * L
                    d_eff = min(d, max(1, L / min_chunk_tokens))
    a2a(L, d, u)  = [u > 1] a2a_bytes_per_token * (L / d) * (u - 1) / u / intra_node_bandwidth
    traffic       = (r - 1) * ring_bytes_per_token * (L / r) / u / ring_bandwidth(d)      (all KV hops, fwd + bwd)
    hideable      = (r - 1) * attn * L**2 / (u * r**2)                          (the attention those hops overlap)

with ``ring_bandwidth(d)`` the intra-node ring link for a group inside one node and the inter-node link for a group
whose ranks span nodes (a ring runs at its slowest hop). Where the layout is known (a plan's first ranks,
:meth:`CostModel.crossing`) it decides. Before it is (while planning), only a group whose size divides the node
counts as inside one: aligned, such groups always tile a node, while a group of 3, 5, 6 or 7 ranks in a node of 8
stays inside one only where single ranks fill the rest (the layout tries), so planning assumes it crosses and the
plans' scores and calibration see where it did not.

A *bin* (the sequences one group processes together) moves all its KV blocks in one batched transfer per ring
step and computes all their attention while it travels, so exposure and fixed costs are per bin::

    bin(Ls, u, r) = sum(compute + a2a + ring_share * traffic)
                    + ring_exposure * max(0, sum(traffic) - sum(hideable))
                    + bin_overhead + [u > 1] a2a_latency + (r - 1) * p2p_latency

A short sequence sharing a ring group with a long one therefore hides its KV transfer behind the long one's
attention, while a bin of short sequences alone exposes its ring traffic. The form has a term for every effect
calibration must be able to learn from measured times: kernels that run below peak on short per-rank chunks
(``length_overhead``: attention at an efficiency ``chunk / (chunk + h)`` costs ``attn * (L**2 / d + h * L)``;
``min_chunk_tokens``: a tile floor), the fixed part of every microbatch (``bin_overhead``: launches, the
size-independent part of GEMMs), per-sequence bookkeeping, communication that overlaps with attention
(``ring_exposure``) or does not (``ring_share``), and the all-to-all volume (``intra_node_bandwidth``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel"]

ArrayLike = np.ndarray | float | int


@dataclass(kw_only=True)
class CostModel:
    """Predicted time (seconds) of a rank's work in one microbatch.

    All coefficients are per *training* pass (forward plus backward) and are plain floats so they can be refitted
    (``ranks_per_node`` is an int and the ``*_measured`` fields flags; :meth:`from_dict` restores them from floats).
    """

    attn: float
    """Seconds per ``L**2`` of one sequence on one rank (causal attention, forward plus backward)."""
    linear: float
    """Seconds per token on one rank (GEMMs, norms, MLP, LM head; forward plus backward)."""
    seq_overhead: float = 0.0
    """Seconds per sequence per rank that do not shrink with the degree (kernel launches, bookkeeping)."""
    length_overhead: float = 0.0
    """Seconds per token of every sequence a rank works on, not divided by the degree: kernels on short per-rank
    chunks run below peak (attention at efficiency ``chunk / (chunk + h)`` costs ``attn * h`` per token more)."""
    bin_overhead: float = 0.0
    """Seconds per microbatch of every busy rank (launches of all layers, the size-independent part of GEMMs)."""
    a2a_bytes_per_token: float = 0.0
    """Bytes one rank exchanges per local token in the Ulysses all-to-alls of all layers, forward plus backward
    (q, k, v and the output, before the ``(u - 1) / u`` share that leaves the rank)."""
    ring_bytes_per_token: float = 0.0
    """Bytes of KV (forward) plus KV and dKV (backward) of all layers per token of one ring block, all heads."""
    intra_node_bandwidth: float = 400e9
    """Bytes per second one rank achieves in an all-to-all inside a node (NVLink class)."""
    inter_node_bandwidth: float = 50e9
    """Bytes per second one rank achieves on point-to-point transfers between nodes (InfiniBand class)."""
    intra_node_ring_bandwidth: float = 400e9
    """Bytes per second one rank achieves on the point-to-point transfers of a ring inside a node (not refitted:
    calibration fits the ring's share and exposure on traffic computed at these fixed bandwidths)."""
    ranks_per_node: int = 0
    """Ranks per node: the ring of a group inside one node moves its KV blocks at ``intra_node_ring_bandwidth``,
    one across nodes at ``inter_node_bandwidth`` (:meth:`ring_bandwidth`); ``0``: every ring crosses nodes (the
    conservative default, for a cost model that does not know the topology)."""
    a2a_latency: float = 0.0
    """Fixed seconds per microbatch for the Ulysses all-to-alls of all layers (latency, not bandwidth)."""
    min_chunk_tokens: float = 128.0
    """Per-rank chunk below which splitting a sequence further buys its attention no speed (a kernel tile); the
    token-wise work (GEMMs, ``linear``) runs on the tokens each rank holds, ``L / d``, however short."""
    p2p_latency: float = 0.0
    """Fixed seconds per ring step for the P2P transfers of all layers."""
    ring_share: float = 0.0
    """Share of all ring traffic that is exposed whatever attention hides (imperfect overlap, contention)."""
    ring_exposure: float = 1.0
    """Weight of the ring traffic that the bin's attention fails to hide (1: transfers and attention overlap
    perfectly, the rest is exposed)."""
    rings_measured: bool = False
    """Whether a calibration window has held ring traffic, so that ``ring_share`` (and ``ring_exposure`` where the
    traffic exceeded its attention) were fitted to measured rings; ``False``: they are the analytic ones. Rings that
    attention hid entirely set it as well, though they say little of what an exposed ring costs; the robust choice
    reads :attr:`intra_rings_measured` and :attr:`inter_rings_measured` for whether a link's plain rings were timed
    (:func:`~lightning_hydra.planner.robust.ensemble`)."""
    intra_rings_measured: bool = False
    """Whether the last refit's window held timed traffic of rings without a Ulysses level inside a node (nested
    rings move a fraction of the bytes, mostly hidden, and do not count); then the robust choice's
    slower-communication and ring members leave that link alone (:func:`~lightning_hydra.planner.robust.ensemble`)."""
    inter_rings_measured: bool = False
    """Whether the last refit's window held timed traffic of rings without a Ulysses level across nodes (see
    :attr:`intra_rings_measured`)."""
    exposure_measured: bool = False
    """Whether the last refit's window held rings without a Ulysses level whose traffic their attention did not hide,
    enough of it to matter, and the refitted model predicts those bins' times closely
    (:meth:`~lightning_hydra.planner.calibration.CostCalibrator.refit`): ``ring_share`` and ``ring_exposure`` were
    then fitted, and checked, on the rings the robust choice's ring members hedge
    (:func:`~lightning_hydra.planner.robust.ensemble`)."""

    @property
    def plain_rings_timed(self) -> bool:
        """Whether the last refit's window timed rings without a Ulysses level on every ring link the model tells
        apart: across nodes (:attr:`inter_rings_measured`), and inside a node where it knows the node's ranks
        (:attr:`intra_rings_measured`)."""
        return bool(self.inter_rings_measured and (self.intra_rings_measured or not self.ranks_per_node))

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_transformer(
        cls,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        ffn_hidden_size: int | None = None,
        vocab_size: int = 32000,
        *,
        flops_per_second: float = 400e12,
        bytes_per_element: int = 2,
        grad_bytes_per_element: int = 4,
        intra_node_bandwidth: float = 400e9,
        inter_node_bandwidth: float = 50e9,
        seq_overhead: float = 20e-6,
        a2a_latency: float = 30e-6,
        p2p_latency: float = 20e-6,
        min_chunk_tokens: float = 128.0,
        ranks_per_node: int = 0,
        tensor_parallel: int = 1,
        sequence_parallel: bool = True,
    ) -> CostModel:
        """Derive coefficients from a causal decoder's shape and an achieved FLOP rate.

        Training FLOPs per token are ``6 * params`` for the linear part; causal attention adds
        ``6 * L * hidden * layers`` per token (docs/design.md section 3), i.e. ``6 * hidden * layers`` per ``L**2``.

        Args:
            hidden_size: Model width (query heads times head dimension).
            num_layers: Number of transformer blocks.
            num_heads: Query heads.
            num_kv_heads: Key/value heads (GQA); defaults to ``num_heads``.
            ffn_hidden_size: SwiGLU inner width; defaults to ``4 * hidden_size``.
            vocab_size: Vocabulary size (LM head GEMM).
            flops_per_second: Achieved (not peak) FLOP rate of one rank.
            bytes_per_element: Activation element size on the wire (2 for bf16): q, k, v, the output and the KV
                blocks of the ring.
            grad_bytes_per_element: Element size of dK/dV on the ring (4: the engine accumulates and sends them in
                float32 so that every rank sums them exactly).
            intra_node_bandwidth: All-to-all and ring P2P bytes/s per rank inside a node.
            inter_node_bandwidth: P2P bytes/s per rank between nodes.
            seq_overhead: Seconds per sequence per rank that do not shrink with the degree.
            a2a_latency: Fixed seconds of the Ulysses all-to-alls per microbatch (all layers).
            p2p_latency: Fixed seconds per ring step (all layers).
            min_chunk_tokens: Per-rank chunk below which splitting buys attention no speed (a kernel tile).
            ranks_per_node: Ranks per node (a ring inside one node uses the intra-node link); ``0``: unknown, every
                ring crosses nodes.
            tensor_parallel: TP degree ``T`` of a CP rank (one device of a TP group, see
                :mod:`lightning_hydra.strategy.tensor`): it computes ``1 / T`` of the blocks' GEMMs and attention
                (the head stays whole), moves ``1 / T`` of the all-to-all and ring bytes, and pays TP's own ring
                collectives of ``[tokens, hidden]`` activations inside the node, counted in all-reduce equivalents
                of ``2 (T - 1) / T`` of the tensor's bytes each (see ``sequence_parallel``).
            sequence_parallel: Whether the TP group runs sequence parallelism (``HydraStrategy(sequence_parallel=
                ...)``, on by default at ``T > 1``; unused at ``T = 1``). Without it, 7 all-reduces per block: forward
                the outputs of o and down (2), backward the input gradients of q, k, v, gate and up (5, each
                projection reduces its own). With it, per block forward an all-gather before attention and before
                the MLP and a reduce-scatter after o and after down; backward each one's transpose (so q/k/v's
                input gradient is reduce-scattered once, summed, and gate/up's once). A reduce-scatter and an
                all-gather each send ``(T - 1) / T`` of the tensor, together one all-reduce's traffic: 4 pairs, 2
                all-reduce equivalents forward and 2 backward, 4 instead of 7 (latency, one more call, is left to
                calibration's overheads). Selective checkpointing repeats the recomputed pieces' forward collectives
                in backward (the reference decoder's block: 2 more all-reduce equivalents; a Hugging Face layer's
                MLP: 1); they are not counted here (nor by the simulator's truth): calibration absorbs them.

        Returns:
            The analytic cost model.
        """
        if min(hidden_size, num_layers, num_heads) <= 0:
            raise ValueError("hidden_size, num_layers and num_heads must be positive")
        if not 0 < flops_per_second < math.inf:  # NaN too: every coefficient would be infinite or NaN
            raise ValueError(f"flops_per_second must be a positive, finite FLOP rate, got {flops_per_second}")
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        ffn = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
        head_dim = hidden_size // num_heads
        kv_dim = kv_heads * head_dim
        per_layer = hidden_size * (hidden_size + 2 * kv_dim) + hidden_size * hidden_size + 3 * hidden_size * ffn
        params = num_layers * per_layer + hidden_size * vocab_size
        # Ulysses moves q, k, v in and the output back, forward; the same volume again backward (gradients).
        a2a_elems = 2 * (hidden_size + 2 * kv_dim + hidden_size)
        # The ring moves k and v forward; backward it moves k, v again (activation dtype) plus dK, dV (float32).
        ring_bytes = 4 * kv_dim * bytes_per_element + 2 * kv_dim * grad_bytes_per_element
        attn = 6.0 * hidden_size * num_layers / flops_per_second
        linear = 6.0 * params / flops_per_second
        a2a_bytes, ring_bytes_per_token = (
            float(a2a_elems * bytes_per_element * num_layers),
            float(ring_bytes * num_layers),
        )
        if tensor_parallel > 1:
            t = tensor_parallel
            linear = 6.0 * (num_layers * per_layer / t + hidden_size * vocab_size) / flops_per_second
            all_reduces = 4 if sequence_parallel else 7  # per block, forward plus backward (see the docstring)
            reduced = all_reduces * hidden_size * bytes_per_element * num_layers * 2 * (t - 1) / t  # bytes per token
            linear += reduced / intra_node_bandwidth
            attn, a2a_bytes, ring_bytes_per_token = attn / t, a2a_bytes / t, ring_bytes_per_token / t
        elif tensor_parallel != 1:
            raise ValueError(f"tensor_parallel must be positive, got {tensor_parallel}")
        return cls(
            attn=attn,
            linear=linear,
            seq_overhead=seq_overhead,
            a2a_bytes_per_token=a2a_bytes,
            ring_bytes_per_token=ring_bytes_per_token,
            intra_node_bandwidth=intra_node_bandwidth,
            inter_node_bandwidth=inter_node_bandwidth,
            intra_node_ring_bandwidth=intra_node_bandwidth,
            ranks_per_node=ranks_per_node,
            a2a_latency=a2a_latency,
            p2p_latency=p2p_latency,
            min_chunk_tokens=min_chunk_tokens,
        )

    def __post_init__(self) -> None:
        """Refuse a link without bandwidth (zero, negative or NaN: every prediction would be NaN) and a negative
        node size."""
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "intra_node_ring_bandwidth"):
            value = getattr(self, name)
            if not value > 0:  # NaN too
                raise ValueError(f"{name} must be positive bytes per second (inf: a free link), got {value}")
        if self.ranks_per_node < 0:
            raise ValueError(f"ranks_per_node must be non-negative (0: unknown), got {self.ranks_per_node}")

    def replace(self, **changes: float) -> CostModel:
        """Return a copy with some coefficients changed (for example after a refit)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, float]:
        """Coefficients as a plain dict (checkpoints, JSON)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, float]) -> CostModel:
        """Inverse of :meth:`to_dict` (fields a dict from an older version lacks keep their defaults, but the ring's
        intra-node link defaults to the dict's all-to-all bandwidth, as :meth:`for_transformer` sets it, and
        ``rings_measured`` to whether a ring coefficient is off its analytic value)."""
        values = dict(values)
        if "ranks_per_node" in values:
            values["ranks_per_node"] = int(values["ranks_per_node"])
        for flag in ("intra_rings_measured", "inter_rings_measured", "exposure_measured"):
            if flag in values:
                values[flag] = bool(values[flag])
        if "rings_measured" in values:
            values["rings_measured"] = bool(values["rings_measured"])
        else:  # a dict from before the flag: a ring term off its analytic value was fitted to measured rings
            values["rings_measured"] = values.get("ring_share", 0.0) != 0.0 or values.get("ring_exposure", 1.0) != 1.0
        if "intra_node_ring_bandwidth" not in values and "intra_node_bandwidth" in values:
            values["intra_node_ring_bandwidth"] = values["intra_node_bandwidth"]
        return cls(**values)

    def ring_bandwidth(self, degree: ArrayLike, crosses: ArrayLike | None = None) -> ArrayLike:
        """Bytes/s of the ring's transfers of a group of ``degree`` ranks.

        Args:
            degree: Ranks of the group.
            crosses: Whether the group's ranks span nodes (:meth:`crossing` of a laid-out plan); ``None``: unless
                its size divides the node (see the module docstring).
        """
        if not self.ranks_per_node:
            return np.full(np.shape(degree), self.inter_node_bandwidth)
        across = self.spans_nodes(degree) if crosses is None else np.asarray(crosses, dtype=bool)
        return np.where(across, self.inter_node_bandwidth, self.intra_node_ring_bandwidth)

    def spans_nodes(self, degree: ArrayLike) -> np.ndarray:
        """Whether a group of ``degree`` ranks spans nodes where no layout tells (:meth:`crossing` does): unless its
        size divides the node, as the contiguous layout places it (every group without ``ranks_per_node``)."""
        d = np.asarray(degree)  # degrees are at least 1
        node = self.ranks_per_node
        if not node:
            return np.ones(d.shape, dtype=bool)
        return ~((d <= node) & (node % d == 0))

    def crossing(self, start: np.ndarray, size: np.ndarray) -> np.ndarray:
        """Whether each group of ``size`` ranks from rank ``start`` spans two nodes (every group does without
        ``ranks_per_node``)."""
        start = np.asarray(start, dtype=np.int64)
        if not self.ranks_per_node:
            return np.ones(start.shape, dtype=bool)
        node = int(self.ranks_per_node)
        return start // node != (start + np.asarray(size, dtype=np.int64) - 1) // node

    # ------------------------------------------------------------------ per sequence
    def useful(self, length: ArrayLike) -> ArrayLike:
        """Useful compute of a whole sequence on one rank: ``attn * L**2 + linear * L`` (no overheads)."""
        length = np.asarray(length, dtype=np.float64)
        return self.attn * length * length + self.linear * length

    def effective_degree(self, length: ArrayLike, degree: ArrayLike) -> ArrayLike:
        """The degree attention scales with: ``degree``, but no finer than ``min_chunk_tokens`` per rank."""
        length = np.asarray(length, dtype=np.float64)
        return np.minimum(np.asarray(degree, dtype=np.float64), np.maximum(1.0, length / self.min_chunk_tokens))

    def compute(self, length: ArrayLike, degree: ArrayLike) -> ArrayLike:
        """Per-rank compute of a sequence split over ``degree`` ranks, per-sequence overheads included."""
        length = np.asarray(length, dtype=np.float64)
        return (
            self.attn * length * length / self.effective_degree(length, degree)
            + self.linear * length / np.asarray(degree, dtype=np.float64)
            + self.seq_overhead
            + self.length_overhead * length
        )

    def a2a(self, length: ArrayLike, ulysses: ArrayLike, ring: ArrayLike) -> ArrayLike:
        """Per-rank Ulysses all-to-all time of a sequence (bandwidth only; the latency is per bin)."""
        return self.a2a_bytes(length, ulysses, ring) / self.intra_node_bandwidth

    def a2a_bytes(self, length: ArrayLike, ulysses: ArrayLike, ring: ArrayLike) -> ArrayLike:
        """Bytes that leave one rank in the Ulysses all-to-alls of a sequence (all layers, forward plus backward)."""
        length = np.asarray(length, dtype=np.float64)
        u = np.asarray(ulysses, dtype=np.float64)
        d = u * np.asarray(ring, dtype=np.float64)
        return np.where(u > 1, self.a2a_bytes_per_token * (length / d) * (u - 1) / u, 0.0)

    def ring_steps(
        self, length: ArrayLike, ulysses: ArrayLike, ring: ArrayLike, crosses: ArrayLike | None = None
    ) -> tuple[ArrayLike, ArrayLike]:
        """``(r - 1) * step_comm`` and ``(r - 1) * step_attn`` of a sequence: its ring traffic and the attention
        that traffic can hide behind, summed over the ring's steps (zero without a ring). ``crosses``: whether the
        group spans nodes (``None``: see :meth:`ring_bandwidth`)."""
        length = np.asarray(length, dtype=np.float64)
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        steps = np.maximum(r - 1, 0.0)
        comm = steps * self.ring_bytes_per_token * (length / r) / u / self.ring_bandwidth(u * r, crosses)
        attn = steps * self.attn * length * length / (u * r * r)
        return comm, attn

    def length_quadratic(self, ulysses: ArrayLike, ring: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``(quad, per_token)`` of a group of ``ulysses * ring`` ranks: alone on the group, a sequence of length ``L``
        takes at least ``quad * L**2 + per_token * L + seq_overhead`` of each rank (compute at the full degree, the
        all-to-all and the always-exposed ring share; in a bin, ring traffic its attention hides may make it add
        less). What :meth:`longest_within` inverts; compute it once where many budgets are asked of the same groups.

        Args:
            ulysses: Ulysses degree of the group.
            ring: Ring degree of the group.
        """
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        d = u * r
        quad = self.attn / d
        per_token = (
            self.linear / d
            + self.length_overhead
            + np.where(u > 1, self.a2a_bytes_per_token * (u - 1) / u / d / self.intra_node_bandwidth, 0.0)
            + self.ring_share * np.maximum(r - 1, 0.0) * self.ring_bytes_per_token / d / self.ring_bandwidth(d)
        )
        return quad, per_token

    def longest_within(self, budget: ArrayLike, ulysses: ArrayLike, ring: ArrayLike) -> ArrayLike:
        """Longest sequence whose per-rank time on a group of ``ulysses * ring`` ranks stays within ``budget``:
        compute at the full degree (the tile floor not reached), all-to-all, and the always-exposed ring share, but
        neither the bin's fixed costs nor the traffic the bin's attention may hide. The root of a quadratic in the
        length; ``0`` where even a token does not fit.

        Args:
            budget: Seconds the sequence may add to a rank.
            ulysses: Ulysses degree of the group.
            ring: Ring degree of the group.
        """
        return self.longest_under(budget, *self.length_quadratic(ulysses, ring))

    def longest_under(self, budget: ArrayLike, quad: np.ndarray, per_token: np.ndarray) -> ArrayLike:
        """:meth:`longest_within` from the groups' :meth:`length_quadratic` (computed once for many budgets)."""
        spare = np.asarray(budget, dtype=np.float64) - self.seq_overhead
        with np.errstate(divide="ignore", invalid="ignore"):
            root = np.where(
                quad > 0,
                2 * spare / (per_token + np.sqrt(per_token * per_token + 4 * quad * np.maximum(spare, 0.0))),
                spare / per_token,
            )
        return np.where(np.isposinf(spare), np.inf, np.where(spare > 0, root, 0.0))

    def fixed(self, ulysses: ArrayLike, ring: ArrayLike) -> ArrayLike:
        """Fixed per-bin time of a busy rank: ``bin_overhead``, the all-to-all latency and one P2P latency per
        ring step."""
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        return self.bin_overhead + np.where(u > 1, self.a2a_latency, 0.0) + np.maximum(r - 1, 0.0) * self.p2p_latency

    def exposed(self, traffic: ArrayLike, hideable: ArrayLike) -> ArrayLike:
        """Exposed ring time of a bin from its summed ring traffic and hideable attention."""
        traffic = np.asarray(traffic, dtype=np.float64)
        return self.ring_exposure * np.maximum(traffic - np.asarray(hideable), 0.0) + self.ring_share * traffic

    def comm(self, length: ArrayLike, ulysses: ArrayLike, ring: ArrayLike) -> ArrayLike:
        """Exposed per-rank CP communication of a sequence that has its group to itself (latencies included)."""
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        traffic, hideable = self.ring_steps(length, u, r)
        latency = np.where(u > 1, self.a2a_latency, 0.0) + np.maximum(r - 1, 0.0) * self.p2p_latency
        return self.a2a(length, u, r) + self.exposed(traffic, hideable) + latency

    def sequence(self, length: ArrayLike, ulysses: ArrayLike = 1, ring: ArrayLike = 1) -> ArrayLike:
        """Per-rank time of one sequence alone on a group of ``ulysses * ring`` ranks: compute, exposed
        communication and the bin's fixed overhead."""
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        return self.compute(length, u * r) + self.comm(length, u, r) + self.bin_overhead

    # ------------------------------------------------------------------ tables and bins
    def parts(self, lengths: np.ndarray, ulysses: np.ndarray, ring: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Additive parts of bin time for every degree ``k`` and length ``i``, ``[K, n]`` arrays: ``base`` (compute,
        all-to-all and the always-exposed ring share) and ``net`` (ring traffic minus the attention that can hide
        it). A bin's time is ``sum(base) + ring_exposure * max(0, sum(net)) + fixed(u, r)``."""
        lens = np.asarray(lengths, dtype=np.float64)[None, :]
        u = np.asarray(ulysses, dtype=np.float64)[:, None]
        r = np.asarray(ring, dtype=np.float64)[:, None]
        d = u * r
        a2a = np.where(u > 1, self.a2a_bytes_per_token * (u - 1) / u / self.intra_node_bandwidth, 0.0)
        steps = np.maximum(r - 1, 0.0)
        traffic = lens * (steps * self.ring_bytes_per_token / (r * u) / self.ring_bandwidth(d))
        # base = lens * (attn * lens / d_eff + (linear + a2a) / d + length_overhead) + seq_overhead
        #        + ring_share * traffic, evaluated in that order in one [K, n] buffer (tables are large)
        base = np.minimum(d, np.maximum(1.0, lens / self.min_chunk_tokens))  # d_eff
        np.divide(self.attn * lens, base, out=base)
        base += (self.linear + a2a) / d
        base += self.length_overhead
        base *= lens
        base += self.seq_overhead
        if self.ring_share:
            base += self.ring_share * traffic
        traffic -= (lens * lens) * (steps * self.attn / (u * r * r))  # the net: traffic minus hideable attention
        return base, traffic

    def pair_parts(self, lengths: np.ndarray, ulysses: np.ndarray, ring: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`parts` element-wise: ``base`` and ``net`` of sequence ``i`` at degree ``(ulysses[i], ring[i])``."""
        lens = np.asarray(lengths, dtype=np.float64)
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        traffic, hideable = self.ring_steps(lens, u, r)
        base = self.compute(lens, u * r) + self.a2a(lens, u, r) + self.ring_share * traffic
        return base, traffic - hideable

    def table(self, lengths: np.ndarray, ulysses: np.ndarray, ring: np.ndarray) -> np.ndarray:
        """:meth:`sequence` for every degree ``(ulysses[k], ring[k])`` and length ``lengths[i]``: ``[K, n]``."""
        base, net = self.parts(lengths, ulysses, ring)
        fixed = self.fixed(np.asarray(ulysses), np.asarray(ring))[:, None]
        return base + self.ring_exposure * np.maximum(net, 0.0) + fixed

    def group_loads(
        self, lengths: np.ndarray, group: np.ndarray, ulysses: np.ndarray, ring: np.ndarray,
        crosses: np.ndarray | None = None,
    ) -> np.ndarray:  # fmt: skip
        """Per-rank time of every group ``[G]`` from flat arrays: the length and group index of every placed
        sequence, and each group's Ulysses and ring degrees (a group without sequences costs nothing); ``crosses``:
        whether each group spans nodes (:meth:`crossing`; ``None``: see :meth:`ring_bandwidth`)."""
        lens = np.asarray(lengths, dtype=np.float64)
        gid = np.asarray(group, dtype=np.int64)
        u_g = np.asarray(ulysses, dtype=np.float64)
        r_g = np.asarray(ring, dtype=np.float64)
        n = u_g.size
        u, r = u_g[gid], r_g[gid]
        base = self.compute(lens, u * r) + self.a2a(lens, u, r)
        traffic, hideable = self.ring_steps(lens, u, r, None if crosses is None else np.asarray(crosses)[gid])
        sums = np.bincount(gid, weights=base, minlength=n)
        exposed = self.exposed(
            np.bincount(gid, weights=traffic, minlength=n), np.bincount(gid, weights=hideable, minlength=n)
        )
        busy = np.bincount(gid, minlength=n) > 0
        return np.where(busy, sums + exposed + self.fixed(u_g, r_g), 0.0)

    def bin_time(self, lengths: ArrayLike, ulysses: int = 1, ring: int = 1, crosses: bool | None = None) -> float:
        """Predicted time of one rank of a group that processes ``lengths`` together at ``ulysses * ring``.

        Compute and all-to-all volume add up; the ring's traffic is exposed only where the bin's total traffic
        exceeds the bin's total attention (plus the always-exposed share), and fixed costs are paid once per bin.
        ``crosses``: whether the group spans nodes (``None``: see :meth:`ring_bandwidth`).
        """
        lens = np.asarray(lengths, dtype=np.float64).ravel()
        if lens.size == 0:
            return 0.0
        return float(
            self.group_loads(
                lens,
                np.zeros(lens.size, dtype=np.int64),
                np.asarray([ulysses]),
                np.asarray([ring]),
                None if crosses is None else np.asarray([crosses]),
            )[0]
        )
