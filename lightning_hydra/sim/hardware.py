"""Hardware and model descriptions of the simulator, with the source of every constant.

The simulator's *truth* (:mod:`lightning_hydra.sim.truth`) times kernels from these constants; the planner never
sees them (it starts from its own analytic :class:`~lightning_hydra.planner.CostModel`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_hydra.planner.devices import GPU_RATES

__all__ = ["PRESETS", "Hardware", "ModelShape"]


@dataclass(kw_only=True)
class Hardware:
    """One accelerator (or CPU rank) and its links.

    Achieved efficiencies follow a saturating curve ``max_eff * n / (n + half)`` in the kernel's size ``n``
    (tokens of a GEMM, per-rank chunk length of an attention): short kernels run far below peak.
    """

    name: str
    """Label."""
    peak_flops: float
    """Dense peak FLOP/s of one device in the training dtype."""
    gemm_efficiency: float
    """Achieved share of peak of large GEMMs."""
    gemm_half_tokens: float
    """Tokens at which GEMM efficiency is half of ``gemm_efficiency``."""
    attn_efficiency: float
    """Achieved share of peak of long attention kernels (forward plus backward)."""
    attn_half_len: float
    """Per-rank chunk length at which attention efficiency is half of ``attn_efficiency``."""
    intra_node_bandwidth: float
    """All-to-all bytes/s one device achieves inside a node."""
    inter_node_bandwidth: float
    """Point-to-point bytes/s one device achieves between nodes."""
    gpus_per_node: int
    """Devices per node."""
    a2a_latency: float = 0.0
    """Seconds per all-to-all call."""
    p2p_latency: float = 0.0
    """Seconds per ring step's P2P exchange."""
    tp_latency: float = 0.0
    """Seconds per tensor-parallel collective call (an all-reduce, or with sequence parallelism an all-gather or a
    reduce-scatter, inside a node), whatever its size."""
    tp_half_bytes: float = 0.0
    """Bytes one device sends in a tensor-parallel collective at which the collective reaches half of
    ``intra_node_bandwidth`` (small collectives run below the link's rate; 0: every size at the full rate)."""
    layer_overhead: float = 0.0
    """Seconds per layer per microbatch, forward plus backward, independent of size (launches, framework)."""
    seq_overhead: float = 0.0
    """Seconds per sequence per layer (varlen bookkeeping, position handling)."""
    ring_step_overhead: float = 0.0
    """Seconds per ring step per layer of local work besides the kernel (block selection, softmax merge)."""
    attn_tile_tokens: float = 0.0
    """Per-rank chunk below which attention runs no faster (a kernel tile floor; 0: none)."""
    ring_share: float | None = None
    """Exposed share of every ring transfer whatever attention hides (``None``: exposed is what the step's
    attention fails to hide)."""
    a2a_full_heads: bool = False
    """Ulysses moves k and v at the full hidden size (no GQA saving) rather than at the KV heads."""
    memory_bytes: float = 80e9
    """Device memory."""
    timer_includes_comm: bool = True
    """Whether a measured busy time includes communication (CUDA events) or excludes it (CPU thread time)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each constant comes from (datasheet, measured here, assumed)."""

    def gemm_eff(self, tokens: float) -> float:
        """Achieved share of peak of a GEMM over ``tokens`` rows."""
        return self.gemm_efficiency * tokens / (tokens + self.gemm_half_tokens) if tokens > 0 else 0.0

    def replace(self, **changes: Any) -> Hardware:
        """A copy with some constants changed."""
        return dataclasses.replace(self, **changes)


@dataclass(kw_only=True)
class ModelShape:
    """A causal decoder's shape (Llama-style: GQA, SwiGLU)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    bytes_per_element: int = 2
    """Activation element size on the wire and in memory (2: bf16)."""

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and values) of one layer."""
        return self.num_kv_heads * (self.hidden_size // self.num_heads)

    @property
    def layer_params(self) -> int:
        """Parameters of one block (attention projections and SwiGLU MLP)."""
        h = self.hidden_size
        return h * (h + 2 * self.kv_dim) + h * h + 3 * h * self.ffn_hidden_size

    @property
    def params(self) -> int:
        """All parameters (blocks and the LM head; tied embeddings assumed)."""
        return self.num_layers * self.layer_params + self.hidden_size * self.vocab_size

    def cost_model_args(self) -> dict[str, int]:
        """Keyword arguments of :meth:`CostModel.for_transformer`."""
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "ffn_hidden_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
        }


_RATES = GPU_RATES["h100"]
"""The H100's datasheet figures, shared with the default cost model (:mod:`lightning_hydra.planner.devices`)."""

_H100 = Hardware(
    name="h100-sxm",
    peak_flops=_RATES.peak_flops,
    gemm_efficiency=0.75,
    gemm_half_tokens=512,
    attn_efficiency=0.45,
    attn_half_len=1024,
    intra_node_bandwidth=_RATES.intra_node_bandwidth,
    inter_node_bandwidth=_RATES.inter_node_bandwidth,
    gpus_per_node=8,
    a2a_latency=15e-6,
    p2p_latency=10e-6,
    tp_latency=15e-6,
    tp_half_bytes=4e6,
    layer_overhead=100e-6,
    seq_overhead=5e-6,
    ring_step_overhead=20e-6,
    memory_bytes=_RATES.memory_bytes,
    sources={
        **{k: v for k, v in _RATES.sources.items() if k != "achieved_share"},
        "gemm_efficiency": "assumed (large BF16 GEMMs typically reach 70-80% of peak)",
        "gemm_half_tokens": "assumed",
        "attn_efficiency": "assumed (flash-attn 2 forward+backward on H100: roughly 40-50% of peak)",
        "attn_half_len": "assumed",
        "a2a_latency": "assumed",
        "p2p_latency": "assumed",
        "tp_latency": "assumed (not measured): an NCCL collective inside an NVLink node, launch plus ring start",
        "tp_half_bytes": "assumed (not measured): NCCL's bus bandwidth inside a node nears its peak only for "
        "collectives of several MB",
        "layer_overhead": "assumed (about 20 kernel launches per layer, forward plus backward)",
        "seq_overhead": "assumed",
        "ring_step_overhead": "assumed",
    },
)

PRESETS: dict[str, Hardware] = {
    "h100": _H100,
    "h200": _H100.replace(
        name="h200",
        memory_bytes=GPU_RATES["h200"].memory_bytes,
        sources={**_H100.sources, "memory_bytes": GPU_RATES["h200"].sources["memory_bytes"]},
    ),
}
"""Named hardware descriptions (GPU constants are datasheet figures or assumptions: no GPU was measured)."""
