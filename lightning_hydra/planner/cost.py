"""The cost model: predicted per-rank time of a sequence, or a bin, at a CP degree ``d = ulysses * ring``.

One :class:`CostModel` object is shared by the scheduler, the metrics and the simulator. Its coefficients are plain
fields so that calibration (a later refit from measured times) can hand new values to the planner as data.

Per sequence of length ``L`` on a group of degree ``d = u * r`` (DESIGN.md section 3)::

    compute(L, d) = (attn * L**2 + linear * L) / min(d, max(1, L / min_chunk_tokens)) + seq_overhead
    a2a(L, d, u)  = a2a_bytes_per_token * (L / d) * (u - 1) / u / intra_bw                         (if u > 1)
    step_comm     = ring_bytes_per_token * (L / r) / u / inter_bw     one KV block hop, fwd + bwd
    step_attn     = attn * L**2 / (d * r)                             the attention one hop can hide behind

A *bin* (the sequences one group processes together) moves all its KV blocks in one batched transfer per ring
step and computes all their attention while it travels, so exposure and latencies are per bin::

    bin(Ls, u, r) = sum(compute + a2a) + [u > 1] a2a_latency
                    + [r > 1] (r - 1) * (max(0, sum(step_comm) - sum(step_attn)) + p2p_latency)

A short sequence sharing a ring group with a long one therefore hides its KV transfer behind the long one's
attention, while a bin of short sequences alone exposes its ring traffic. Kernels work in tiles: splitting a
sequence below ``min_chunk_tokens`` per rank buys no more speed (the effective degree in ``compute`` saturates),
while the split still pays communication and overheads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel"]

ArrayLike = np.ndarray | float | int


@dataclass(kw_only=True)
class CostModel:
    """Predicted time (seconds) of a rank's work in one microbatch.

    All coefficients are per *training* pass (forward plus backward) and are plain floats so they can be refitted.
    """

    attn: float
    """Seconds per ``L**2`` of one sequence on one rank (causal attention, forward plus backward)."""
    linear: float
    """Seconds per token on one rank (GEMMs, norms, MLP, LM head; forward plus backward)."""
    seq_overhead: float = 0.0
    """Seconds per sequence per rank that do not shrink with the degree (kernel launches, bookkeeping)."""
    a2a_bytes_per_token: float = 0.0
    """Bytes one rank exchanges per local token in the Ulysses all-to-alls of all layers, forward plus backward
    (q, k, v and the output, before the ``(u - 1) / u`` share that leaves the rank)."""
    ring_bytes_per_token: float = 0.0
    """Bytes of KV (forward) plus KV and dKV (backward) of all layers per token of one ring block, all heads."""
    intra_node_bandwidth: float = 400e9
    """Bytes per second one rank achieves in an all-to-all inside a node (NVLink class)."""
    inter_node_bandwidth: float = 50e9
    """Bytes per second one rank achieves on point-to-point transfers between nodes (InfiniBand class)."""
    a2a_latency: float = 0.0
    """Fixed seconds per microbatch for the Ulysses all-to-alls of all layers (latency, not bandwidth)."""
    min_chunk_tokens: float = 128.0
    """Per-rank chunk below which splitting a sequence further buys no speed (a kernel tile)."""
    p2p_latency: float = 0.0
    """Fixed seconds per ring step for the P2P transfers of all layers."""

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
        intra_node_bandwidth: float = 400e9,
        inter_node_bandwidth: float = 50e9,
        seq_overhead: float = 20e-6,
        a2a_latency: float = 30e-6,
        p2p_latency: float = 20e-6,
        min_chunk_tokens: float = 128.0,
    ) -> CostModel:
        """Derive coefficients from a causal decoder's shape and an achieved FLOP rate.

        Training FLOPs per token are ``6 * params`` for the linear part; causal attention adds
        ``6 * L * hidden * layers`` per token (DESIGN.md section 3), i.e. ``6 * hidden * layers`` per ``L**2``.

        Args:
            hidden_size: Model width (query heads times head dimension).
            num_layers: Number of transformer blocks.
            num_heads: Query heads.
            num_kv_heads: Key/value heads (GQA); defaults to ``num_heads``.
            ffn_hidden_size: SwiGLU inner width; defaults to ``4 * hidden_size``.
            vocab_size: Vocabulary size (LM head GEMM).
            flops_per_second: Achieved (not peak) FLOP rate of one rank.
            bytes_per_element: Activation element size on the wire (2 for bf16).
            intra_node_bandwidth: All-to-all bytes/s per rank inside a node.
            inter_node_bandwidth: P2P bytes/s per rank between nodes.
            seq_overhead: Seconds per sequence per rank that do not shrink with the degree.
            a2a_latency: Fixed seconds of the Ulysses all-to-alls per microbatch (all layers).
            p2p_latency: Fixed seconds per ring step (all layers).
            min_chunk_tokens: Per-rank chunk below which splitting buys no speed (a kernel tile).

        Returns:
            The analytic cost model.
        """
        if min(hidden_size, num_layers, num_heads) <= 0:
            raise ValueError("hidden_size, num_layers and num_heads must be positive")
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        ffn = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
        head_dim = hidden_size // num_heads
        kv_dim = kv_heads * head_dim
        per_layer = hidden_size * (hidden_size + 2 * kv_dim) + hidden_size * hidden_size + 3 * hidden_size * ffn
        params = num_layers * per_layer + hidden_size * vocab_size
        # Ulysses moves q, k, v in and the output back, forward; the same volume again backward (gradients).
        a2a_elems = 2 * (hidden_size + 2 * kv_dim + hidden_size)
        # The ring moves k and v forward; backward it moves k, v again plus dk, dv.
        ring_elems = 2 * kv_dim + 4 * kv_dim
        return cls(
            attn=6.0 * hidden_size * num_layers / flops_per_second,
            linear=6.0 * params / flops_per_second,
            seq_overhead=seq_overhead,
            a2a_bytes_per_token=float(a2a_elems * bytes_per_element * num_layers),
            ring_bytes_per_token=float(ring_elems * bytes_per_element * num_layers),
            intra_node_bandwidth=intra_node_bandwidth,
            inter_node_bandwidth=inter_node_bandwidth,
            a2a_latency=a2a_latency,
            p2p_latency=p2p_latency,
            min_chunk_tokens=min_chunk_tokens,
        )

    def replace(self, **changes: float) -> CostModel:
        """Return a copy with some coefficients changed (for example after a refit)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, float]:
        """Coefficients as a plain dict (checkpoints, JSON)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, float]) -> CostModel:
        """Inverse of :meth:`to_dict`."""
        return cls(**values)

    # ------------------------------------------------------------------ predictions
    def useful(self, length: ArrayLike) -> ArrayLike:
        """Useful compute of a whole sequence on one rank: ``attn * L**2 + linear * L`` (no overheads)."""
        length = np.asarray(length, dtype=np.float64)
        return self.attn * length * length + self.linear * length

    def effective_degree(self, length: ArrayLike, degree: ArrayLike) -> ArrayLike:
        """The degree compute scales with: ``degree``, but no finer than ``min_chunk_tokens`` per rank."""
        length = np.asarray(length, dtype=np.float64)
        return np.minimum(np.asarray(degree, dtype=np.float64), np.maximum(1.0, length / self.min_chunk_tokens))

    def compute(self, length: ArrayLike, degree: ArrayLike) -> ArrayLike:
        """Per-rank compute of a sequence split over ``degree`` ranks, per-sequence overhead included."""
        return self.useful(length) / self.effective_degree(length, degree) + self.seq_overhead

    def a2a(self, length: ArrayLike, ulysses: ArrayLike, ring: ArrayLike) -> ArrayLike:
        """Per-rank Ulysses all-to-all time of a sequence (bandwidth only; the latency is per bin)."""
        length = np.asarray(length, dtype=np.float64)
        u = np.asarray(ulysses, dtype=np.float64)
        d = u * np.asarray(ring, dtype=np.float64)
        return np.where(u > 1, self.a2a_bytes_per_token * (length / d) * (u - 1) / u / self.intra_node_bandwidth, 0.0)

    def ring_steps(self, length: ArrayLike, ulysses: ArrayLike, ring: ArrayLike) -> tuple[ArrayLike, ArrayLike]:
        """``(r - 1) * step_comm`` and ``(r - 1) * step_attn`` of a sequence: its ring traffic and the attention
        that traffic can hide behind, summed over the ring's steps (zero without a ring)."""
        length = np.asarray(length, dtype=np.float64)
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        steps = np.maximum(r - 1, 0.0)
        comm = steps * self.ring_bytes_per_token * (length / r) / u / self.inter_node_bandwidth
        attn = steps * self.attn * length * length / (u * r * r)
        return comm, attn

    def latency(self, ulysses: ArrayLike, ring: ArrayLike) -> ArrayLike:
        """Fixed per-bin time of the collectives: the all-to-all latency and one P2P latency per ring step."""
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        return np.where(u > 1, self.a2a_latency, 0.0) + np.maximum(r - 1, 0.0) * self.p2p_latency

    def comm(self, length: ArrayLike, ulysses: ArrayLike, ring: ArrayLike) -> ArrayLike:
        """Exposed per-rank CP communication of a sequence that has its group to itself (latencies included)."""
        step_comm, step_attn = self.ring_steps(length, ulysses, ring)
        return self.a2a(length, ulysses, ring) + np.maximum(step_comm - step_attn, 0.0) + self.latency(ulysses, ring)

    def sequence(self, length: ArrayLike, ulysses: ArrayLike = 1, ring: ArrayLike = 1) -> ArrayLike:
        """Per-rank time of one sequence alone on a group of ``ulysses * ring`` ranks: compute plus exposed
        communication."""
        u = np.asarray(ulysses, dtype=np.float64)
        r = np.asarray(ring, dtype=np.float64)
        return self.compute(length, u * r) + self.comm(length, u, r)

    def parts(
        self, lengths: np.ndarray, ulysses: np.ndarray, ring: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Additive parts of bin time for every degree ``k`` and length ``i``: ``[K, n]`` arrays of
        ``compute + a2a``, ring traffic and hideable attention (see :meth:`bin_time`)."""
        lens = np.asarray(lengths, dtype=np.float64)[None, :]
        u = np.asarray(ulysses, dtype=np.float64)[:, None]
        r = np.asarray(ring, dtype=np.float64)[:, None]
        d = u * r
        a2a = np.where(u > 1, self.a2a_bytes_per_token * (u - 1) / u / self.intra_node_bandwidth, 0.0)
        d_eff = np.minimum(d, np.maximum(1.0, lens / self.min_chunk_tokens))
        base = lens * ((self.linear + self.attn * lens) / d_eff + a2a / d) + self.seq_overhead
        steps = np.maximum(r - 1, 0.0)
        comm = lens * (steps * self.ring_bytes_per_token / (r * u) / self.inter_node_bandwidth)
        attn = lens * lens * (steps * self.attn / (u * r * r))
        return base, comm, attn

    def table(self, lengths: np.ndarray, ulysses: np.ndarray, ring: np.ndarray) -> np.ndarray:
        """:meth:`sequence` for every degree ``(ulysses[k], ring[k])`` and length ``lengths[i]``: ``[K, n]``."""
        base, comm, attn = self.parts(lengths, ulysses, ring)
        lat = self.latency(np.asarray(ulysses), np.asarray(ring))[:, None]
        return base + np.maximum(comm - attn, 0.0) + lat

    def bin_time(self, lengths: ArrayLike, ulysses: int = 1, ring: int = 1) -> float:
        """Predicted time of one rank of a group that processes ``lengths`` together at ``ulysses * ring``.

        Compute and all-to-all volume add up; the ring's traffic is exposed only where the bin's total traffic
        exceeds the bin's total attention, and latencies are paid once per bin.
        """
        lengths = np.asarray(lengths, dtype=np.float64)
        if lengths.size == 0:
            return 0.0
        base = self.compute(lengths, ulysses * ring) + self.a2a(lengths, ulysses, ring)
        step_comm, step_attn = self.ring_steps(lengths, ulysses, ring)
        exposed = max(0.0, float(np.sum(step_comm)) - float(np.sum(step_attn)))
        return float(np.sum(base)) + exposed + float(self.latency(ulysses, ring))
