"""``DecoderLM``: a Llama-style reference decoder whose attention runs through the CP engine."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from lightning_hydra.cp.context import CPContext
from lightning_hydra.data.packing import IGNORE_INDEX, RankMicrobatch
from lightning_hydra.errors import check_int, check_number
from lightning_hydra.models.checkpointing import check_checkpointing_mode, checkpoint_keeping_gathers
from lightning_hydra.models.init import fill_
from lightning_hydra.models.losses import chunked_cross_entropy
from lightning_hydra.models.module import HydraModule
from lightning_hydra.models.stages import keep_stage_layers

__all__ = ["DecoderLM"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # one float32 copy, shared by both uses (autograd keeps it once)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """RoPE tables of a packed shard: angles in float32 from each token's true position, cos/sin returned in the
    activations' dtype (so that ``q * cos`` keeps bf16 activations bf16 for the flash kernels). Under autocast over
    a float32 residual stream (``bf16-mixed`` without FSDP) the tables are float32, so q and k leave RoPE in float32
    beside a bf16 v; the CP engine casts all three to autocast's dtype, as torch's SDPA does
    (:func:`~lightning_hydra.cp.attention.autocast_inputs`).

    The inverse frequencies are recomputed in float32 on the positions' device at every call (``head_dim / 2``
    values, once per forward, shared by every layer) instead of living in a buffer: precision plugins cast a
    module's floating buffers (``bf16-true`` would round them to bf16, a large phase error at 256K positions).
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        """Args:
        head_dim: Dimension of one attention head (even).
        theta: RoPE base.
        """
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.theta = float(theta)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """``theta ** (-2i / head_dim)`` in float32 on ``device``."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return self.theta ** (-exponent)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[t, 1, head_dim]`` in ``dtype`` for positions ``[t]``."""
        freqs = position_ids.to(torch.float32)[:, None] * self.inv_freq(position_ids.device)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class CPAttention(nn.Module):
    """Grouped-query self-attention with RoPE on true positions; the attention itself goes through ``hydra_cp``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, cp: CPContext) -> None:
        super().__init__()
        if hidden % heads or heads % kv_heads:
            raise ValueError(
                f"num_heads={heads} must divide hidden_size={hidden}, and num_kv_heads={kv_heads} must divide num_heads"
            )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.hydra_cp = cp

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections and RoPE: ``[t, H, D]`` queries and ``[t, Hkv, D]`` keys and values."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The CP attention of this rank's shard: ``[t, H * D]`` (the only part that communicates)."""
        return self.hydra_cp.attention(q, k, v, causal=True).reshape(q.shape[0], self.heads * self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.core(*self.qkv(x, cos, sin)))


class SwiGLU(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: attention and SwiGLU MLP.

    With :attr:`checkpointed` (selective activation checkpointing) the block runs as three pieces: the norm,
    projections and RoPE before attention, recomputed in backward; the CP attention, never recomputed (its output
    and log-sum-exp are kept, so backward communicates once); the output projection, norm and MLP after it,
    recomputed. What a block keeps per token is then its input, q/k/v and the attention's output and LSE, instead of
    every norm and MLP intermediate. Under tensor parallelism the recompute repeats the norms' all-gathers (sequence
    parallelism) and o's reduce-scatter or all-reduce.

    With :attr:`keep_tp` as well (``DecoderLM(selective_checkpointing="block_tp")``) and the block split by TP, the
    recompute repeats no TP collective: o and its collective run once, outside the recomputed pieces (the residual
    after it is kept: what the MLP's piece starts from), and the norms' gathered outputs are kept
    (:func:`~lightning_hydra.models.checkpointing.keep_gathers_policy`), ``2 A h + A h / T`` bytes more per token.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, cp: CPContext, eps: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = CPAttention(hidden, heads, kv_heads, cp)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, ffn)
        self.checkpointed = False
        """Recompute norms, projections and MLP in backward (never the attention)."""
        self.keep_tp = False
        """Under TP, keep what the recompute would communicate for (see the class docstring)."""

    def _before(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.attn.qkv(self.attn_norm(x), cos, sin)

    def _after(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return self._mlp(x + self.attn.o_proj(attended))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not (self.checkpointed and torch.is_grad_enabled()):
            return self._after(x, self.attn.core(*self._before(x, cos, sin)))
        if self.keep_tp and isinstance(self.attn.o_proj.weight, DTensor):  # split by TP
            q, k, v = checkpoint_keeping_gathers(self._before, x, cos, sin)
            x = x + self.attn.o_proj(self.attn.core(q, k, v))  # o's collective runs once
            return checkpoint_keeping_gathers(self._mlp, x)
        q, k, v = checkpoint(self._before, x, cos, sin, use_reentrant=False)
        attended = self.attn.core(q, k, v)
        return checkpoint(self._after, x, attended, use_reentrant=False)


class DecoderLM(HydraModule):
    """A Llama-style decoder (RMSNorm, RoPE on true positions, GQA, SwiGLU) packaged as a LightningModule.

    Its input is a packed shard of token ids with every token's position inside its own document; attention is
    document-masked and runs through the CP engine, so the same module trains on one process or under
    :class:`~lightning_hydra.HydraStrategy`.
    """

    selective_checkpointing = "block"
    """What selective checkpointing recomputes (the memory model's ``ModelMemoryShape.selective``): ``"block"``, a
    block's norms with q/k/v and the MLP (see :class:`Block`); ``"block_tp"``, the same, keeping under TP what the
    recompute would communicate for (set by the constructor's ``selective_checkpointing``)."""

    def __init__(
        self,
        vocab_size: int = 258,
        hidden_size: int = 256,
        num_layers: int = 4,
        num_heads: int = 8,
        num_kv_heads: int = 4,
        ffn_hidden_size: int | None = None,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float | None = 1.0,
        optimizer: str = "adamw",
        flops_per_second: float | None = None,
        selective_checkpointing: str = "block",
        init_device: str | None = None,
    ) -> None:
        """Build the decoder.

        Args:
            vocab_size: Vocabulary size (258: bytes plus PAD and EOS of the embedded corpus).
            hidden_size: Model width.
            num_layers: Transformer blocks.
            num_heads: Query heads.
            num_kv_heads: Key/value heads (GQA).
            ffn_hidden_size: SwiGLU inner width (default ``8/3 * hidden`` rounded up to 64).
            rope_theta: RoPE base.
            norm_eps: RMSNorm epsilon.
            init_std: Standard deviation of the weight initialisation.
            lr: Learning rate.
            weight_decay: AdamW weight decay.
            warmup_steps: Linear warm-up steps.
            max_grad_norm: Gradient clipping (``None``: off).
            optimizer: ``"adamw"`` or ``"sgd"``.
            flops_per_second: Achieved FLOP rate assumed by the default cost model (``None``: the device's, see
                :func:`~lightning_hydra.models.module.device_rates`).
            selective_checkpointing: Under ``activation_checkpointing="selective"``: ``"block"`` recomputes a block's
                norms with q/k/v, o and the MLP, which under tensor parallelism repeats the norms' all-gathers and
                o's reduce-scatter (or all-reduce); ``"block_tp"`` repeats no TP collective, keeping ``2 A h + A h /
                T`` bytes more per token and block under sequence parallelism (see :class:`Block`). Without TP both
                are the same.
            init_device: ``"meta"``: build without memory; :class:`~lightning_hydra.HydraStrategy` lays the model
                out, allocates each rank's shards and initialises them to exactly what a construction without it
                gives (:meth:`init_weights`), so no rank ever holds the whole model (``None``: built and initialised
                here, on the default device).
        """
        super().__init__(
            lr=lr,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            optimizer=optimizer,
            flops_per_second=flops_per_second,
        )
        for name, value in (
            ("vocab_size", vocab_size), ("hidden_size", hidden_size), ("num_layers", num_layers),
            ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
        ):  # fmt: skip
            check_int(name, value)
        check_int("ffn_hidden_size", ffn_hidden_size, low=0, none=True)  # 0 and None: the default width
        check_number("rope_theta", rope_theta, low=0.0, low_open=True)
        check_number("norm_eps", norm_eps, low=0.0, low_open=True)
        check_number("init_std", init_std, low=0.0)
        if selective_checkpointing not in ("block", "block_tp"):
            raise ValueError(f"selective_checkpointing must be 'block' or 'block_tp', got {selective_checkpointing!r}")
        self.selective_checkpointing = selective_checkpointing
        self.save_hyperparameters()
        ffn = ffn_hidden_size or 64 * -(-(8 * hidden_size // 3) // 64)
        self.ffn_hidden_size = ffn
        if init_device not in (None, "meta"):
            raise ValueError(f"init_device must be None or 'meta', got {init_device!r}")
        with torch.device("meta") if init_device == "meta" else nullcontext():
            self.embed = nn.Embedding(vocab_size, hidden_size)
            self.layers = nn.ModuleList(
                Block(hidden_size, num_heads, num_kv_heads, ffn, self.local_cp, norm_eps) for _ in range(num_layers)
            )
            self.norm = RMSNorm(hidden_size, norm_eps)
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.rope = RotaryEmbedding(hidden_size // num_heads, rope_theta)
        if init_device is None:
            self.init_weights()

    @override
    def init_weights(self) -> None:
        """Every weight from its own generator (:mod:`lightning_hydra.models.init`): projections and the
        embedding ``N(0, init_std)``, norms ones; shard by shard after a layout. Drawn in float32, then cast."""
        std = float(self.hparams.init_std)

        def normal(t: torch.Tensor, generator: torch.Generator) -> None:
            if t.dtype == torch.float32:  # drawn in place: no second full-size copy
                t.normal_(0.0, std, generator=generator)
                return
            t.copy_(torch.empty(t.shape, dtype=torch.float32, device=t.device).normal_(0.0, std, generator=generator))

        def ones(t: torch.Tensor, generator: torch.Generator) -> None:
            t.fill_(1.0)

        for module_name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                draw = ones
            elif isinstance(module, nn.Linear | nn.Embedding):
                draw = normal
            else:
                continue
            for name, param in module.named_parameters(recurse=False):
                fill_(param, self.init_seed, f"{module_name}.{name}", draw)

    @override
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[t, vocab]`` of a packed shard, or with ``labels`` the sum of its token losses (computed in
        chunks: the ``[t, vocab]`` float32 logits are never materialised). Run inside a CP context (see
        :class:`CPContext`).

        After :meth:`pipeline_stage` only this stage's blocks run: from ``hidden`` (the previous stage's
        activations) unless it is the first stage, returning activations unless it is the last.
        """
        x = self.embed(input_ids) if hidden is None else hidden
        cos, sin = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            if isinstance(layer, Block):
                x = layer(x, cos, sin)
        if self.lm_head is None:
            return x  # not the last pipeline stage
        x = self.norm(x)
        if labels is None:
            return self.lm_head(x)
        return chunked_cross_entropy(x, self.lm_head.weight, labels, ignore_index=IGNORE_INDEX)

    @override
    def microbatch_loss(self, mb: RankMicrobatch) -> torch.Tensor:
        return self(mb.input_ids, mb.position_ids, labels=mb.labels)

    @override
    def transformer_blocks(self) -> list[nn.Module]:
        return [layer for layer in self.layers if isinstance(layer, Block)]

    @override
    def set_activation_checkpointing(self, mode: str) -> int:
        check_checkpointing_mode(mode)
        blocks = self.transformer_blocks()
        for layer in blocks:
            layer.checkpointed = mode == "selective"
            layer.keep_tp = self.selective_checkpointing == "block_tp"
        return len(blocks) if mode == "selective" else 0

    @override
    def pipeline_stage(self, stage: int, stages: int) -> None:
        h = self.hparams
        keep_stage_layers(self.layers, stage, stages, head_flops=6.0 * h.vocab_size * h.hidden_size)
        if stage > 0:
            self.embed = None
        if stage < stages - 1:
            self.norm = None
            self.lm_head = None

    @override
    def stage_forward(self, mb: RankMicrobatch, hidden: torch.Tensor | None) -> torch.Tensor:
        labels = mb.labels if self.lm_head is not None else None
        return self(mb.input_ids, mb.position_ids, labels=labels, hidden=hidden)

    @override
    def attention_heads(self) -> tuple[int | None, int | None]:
        return self.hparams.num_heads, self.hparams.num_kv_heads

    EXPORT_MAX_POSITIONS = 131072
    """``max_position_embeddings`` of the exported config (the decoder has no limit of its own; with the default
    RoPE transformers computes nothing from it)."""

    @override
    def export_spec(self) -> dict[str, Any]:
        """A ``LlamaForCausalLM``: the architecture this decoder computes exactly (RMSNorm in float32, RoPE with
        ``rotate_half`` on true positions, GQA, SwiGLU, an untied head; checked by ``tests/test_sharding.py``)."""
        h = self.hparams
        config = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": h.vocab_size,
            "hidden_size": h.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": h.num_layers,
            "num_attention_heads": h.num_heads,
            "num_key_value_heads": h.num_kv_heads,
            "head_dim": h.hidden_size // h.num_heads,
            "rms_norm_eps": h.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(h.rope_theta)},
            "max_position_embeddings": self.EXPORT_MAX_POSITIONS,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "initializer_range": h.init_std,
        }
        layer = r"^layers\.(\d+)\."
        rename = [
            [r"^embed\.", "model.embed_tokens."],
            [layer + r"attn_norm\.", r"model.layers.\1.input_layernorm."],
            [layer + r"attn\.", r"model.layers.\1.self_attn."],
            [layer + r"mlp_norm\.", r"model.layers.\1.post_attention_layernorm."],
            [layer + r"mlp\.(gate|up|down)\.", r"model.layers.\1.mlp.\2_proj."],
            [r"^norm\.", "model.norm."],
        ]
        return {"config": config, "rename": rename, "generation_config": None, "source": None}

    @override
    def model_shape(self) -> dict[str, int | None]:
        h = self.hparams
        return {
            "hidden_size": h.hidden_size,
            "num_layers": h.num_layers,
            "num_heads": h.num_heads,
            "num_kv_heads": h.num_kv_heads,
            "ffn_hidden_size": self.ffn_hidden_size,
            "vocab_size": h.vocab_size,
        }
