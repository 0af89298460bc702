"""Memory per rank, and the token capacity (``max_tokens_per_rank="auto"``) that follows from it.

Pure arithmetic over a model's shape, shared by :class:`~lightning_hydra.HydraStrategy` (at set-up) and
``lightning-hydra plan --memory``. A rank's budget pays for, in order:

1. **Model state** (bytes per parameter, ``S`` the ranks a state is sharded over: the pool for ``zero2``/``zero3``,
   the node for ``hsdp``, 1 for ``none``):

   ======================  =========================  ====================================================
   precision               sharded state              held unsharded during a step
   ======================  =========================  ====================================================
   ``32-true``             (4 + 4 + 8) / S            4 (params, zero2/hsdp) + 4 (gradients, zero2/hsdp)
   ``bf16-mixed``          (4 + 4 + 8) / S            2 (bf16 params) + 4 (float32 accumulated gradients)
   ``bf16-true``           (2 + 2 + 4) / S            2 + 2
   ======================  =========================  ====================================================

   (AdamW keeps two moments in the parameters' dtype; plain SGD none.) A replica under ``bf16-mixed`` also holds
   autocast's bf16 weight copies (2 bytes). ``zero3`` holds unsharded only the root's parameters (embedding, head)
   and two blocks at a time (the current one and the prefetched one); its gradients are reduce-scattered every
   microbatch. Without gradient accumulation (one microbatch) no accumulated gradient is kept.
2. **Communicators**: ``communicator_bytes`` (NCCL, about 0.5 GB each measured on A100s) for the world, the FSDP
   mesh dimensions, each Ulysses block the rank belongs to, and two ring neighbours.
3. **A margin** (``margin`` of the budget: allocator fragmentation with shapes that change every step).
4. **Activations**, per token (the capacity divides what is left by this). Per transformer block, with ``A`` the
   activation element size (2 for bf16 compute, 4 for float32), ``h`` the width, ``kv`` the key/value width, ``f``
   the MLP width and ``H`` the heads: the norms keep their float32 input and normalised output, the projections
   their inputs, the CP attention q/k/v, its output (also the output projection's input: one tensor) and float32
   log-sum-exp, the MLP four ``f``-wide tensors::

       none:       8 h + A (6 h + 2 kv + 4 f) + 4 H
       selective:  A (3 h + 2 kv) + 4 H          (block input, q/k/v, attention output, LSE; see
                                                  lightning_hydra.models.decoder.Block)

   plus, once: the final norm and the head's input (``4 h + 2 A h``), RoPE's cos and sin (``2 A h / H``), one
   block's full activations recomputed or differentiated at a time, the Ulysses all-to-all's packed and gathered
   copies (``2 A (h + 2 kv)``) and the ring's KV buffers (four in ``A``, two dK/dV in float32: ``8 A kv + 16 kv``).

**Tensor parallelism** ``T`` (``HydraStrategy(tensor_parallel=T)``, no sequence parallelism): a rank holds ``1 / T``
of every block's projections (the norms, embedding and head stay whole) and of the activations the heads and the
MLP width split: per block the norms' float32 inputs and their outputs stay whole (``8 h + 4 A h``, or the block
input ``A h`` when selective), q/k/v, the attention output, the LSE and the MLP's tensors divide by ``T``, as do
the CP buffers; the final norm, head input and RoPE tables stay whole. The TP group is one more communicator.

**Sequence parallelism** (``sequence_parallel=True``, ``HydraStrategy``'s default under TP): the residual stream
between blocks and the norms run on ``1 / T`` of the tokens, so per block the norms' float32 inputs and
normalised outputs divide by ``T`` (``(8 h + 2 A h) / T``) while their all-gathered outputs, the projections'
inputs, stay whole (``2 A h``); with selective checkpointing the block input kept is ``A h / T``. The final norm
and head run on the gathered tokens (unchanged)::

    none:       (8 h + 2 A h) / T + 2 A h + (A (2 h + 2 kv) + 4 H + 4 A f) / T
    selective:  (A h + A (2 h + 2 kv) + 4 H) / T

Selective checkpointing by units (``ModelMemoryShape.selective="units"``: Hugging Face layers, each norm and the
MLP recomputed alone) keeps both norms' inputs and their (gathered) outputs, the projections' inputs, per block::

    selective:  2 A h / T' + 2 A h + (A (2 h + 2 kv) + 4 H) / T      (T' = T with sequence parallelism, else 1)

Of these only ``"block"``'s recompute repeats TP collectives: with sequence parallelism it re-gathers both norms'
outputs and reduce-scatters o's output again (without it, all-reduces o's). ``"block_tp"``
(``DecoderLM(selective_checkpointing="block_tp")``) keeps instead, under TP (``T > 1``), the residual after
attention (``A h / T'``, o's collective runs once) and, with sequence parallelism, both norms' gathered outputs
(``2 A h``), per block::

    selective:  2 A h / T' + 2 A h + (A (2 h + 2 kv) + 4 H) / T      (sequence parallelism: as "units")
                2 A h + (A (2 h + 2 kv) + 4 H) / T                  (TP without it)

Everything here is an estimate: on a GPU the true peak also depends on the allocator and kernels' workspaces
(the margin covers them); it has not been checked against a GPU's measured peak yet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "LLAMA3_8B",
    "MEMORY_PRECISIONS",
    "SHARDING_MODES",
    "MemoryBreakdown",
    "ModelMemoryShape",
    "activation_bytes_per_token",
    "memory_capacity",
    "model_state_bytes",
    "parse_bytes",
]

SHARDING_MODES = ("none", "zero2", "zero3", "hsdp")
"""Values of ``HydraStrategy(sharding=...)``: what the memory model charges for each (the strategy re-exports it)."""

MEMORY_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
"""Trainer precisions the memory model knows (``16-mixed`` is treated as ``bf16-mixed``)."""

GIB = 1 << 30

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1 << 10, "mib": 1 << 20, "gib": GIB}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from a number or a string such as ``"80GB"``, ``"141 GiB"``, ``"64e9"``.

    Raises:
        ValueError: A malformed or non-positive size.
    """
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be a number of bytes or a string like '80GB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a memory size: use bytes or e.g. '80GB', '141GiB'")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return int(size)


@dataclass(frozen=True, kw_only=True)
class ModelMemoryShape:
    """What memory depends on in a causal decoder."""

    num_params: int
    """Trainable parameters."""
    hidden_size: int
    """Model width ``h``."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Query heads ``H``."""
    num_kv_heads: int
    """Key/value heads."""
    ffn_hidden_size: int
    """MLP width ``f``."""
    vocab_size: int
    """Vocabulary (the embedding and head stay unsharded under zero3)."""
    selective: str = "block"
    """What selective checkpointing keeps of a block: ``"block"`` (the reference decoder's
    :class:`~lightning_hydra.models.decoder.Block` recomputes its norms with q/k/v and the MLP, keeping the block
    input and attention's outputs), ``"block_tp"`` (the same, keeping under TP what the recompute would communicate
    for: the residual after attention and the norms' gathered outputs) or ``"units"``
    (:func:`~lightning_hydra.models.checkpointing.selective_units`, Hugging Face layers: each norm and the MLP
    recompute alone, so the norms' inputs and their outputs, the projections' inputs, stay saved too: ``2 A h`` more
    per block, and the norm inputs ``A h`` each)."""

    @classmethod
    def for_decoder(
        cls, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int,
        vocab_size: int, *, tied_embeddings: bool = False,
    ) -> ModelMemoryShape:  # fmt: skip
        """A Llama-style decoder's shape with its parameter count (q/k/v/o projections, SwiGLU MLP, two RMSNorms per
        block, a final norm, an embedding and, unless tied, a separate head): Llama-3-8B counts 8,030,261,248."""
        kv = hidden_size // num_heads * num_kv_heads
        block = 2 * hidden_size * hidden_size + 2 * hidden_size * kv + 3 * hidden_size * ffn_hidden_size
        block += 2 * hidden_size
        embeddings = (1 if tied_embeddings else 2) * vocab_size * hidden_size
        return cls(
            num_params=num_layers * block + embeddings + hidden_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            ffn_hidden_size=ffn_hidden_size,
            vocab_size=vocab_size,
        )

    @property
    def kv_size(self) -> int:
        """Key/value width ``kv``."""
        return self.hidden_size // self.num_heads * self.num_kv_heads

    @property
    def projection_params(self) -> int:
        """Parameters of one block's q/k/v/o projections and MLP (what tensor parallelism splits)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return 2 * h * h + 2 * h * self.kv_size + 3 * h * f

    @property
    def block_params(self) -> float:
        """Parameters of one block (everything but embedding and head, spread evenly)."""
        rest = self.num_params - 2 * self.vocab_size * self.hidden_size
        return max(rest, 0) / max(self.num_layers, 1)


LLAMA3_8B = ModelMemoryShape.for_decoder(4096, 32, 32, 8, 14336, 128256)
"""Llama-3-8B (untied embeddings, vocabulary 128,256): the shape the docs' sizing uses."""


def _precision(precision: str) -> str:
    precision = "bf16-mixed" if precision in ("16-mixed", "bf16") else precision
    if precision in ("32", "32-true"):
        precision = "32-true"
    if precision not in MEMORY_PRECISIONS:
        raise ValueError(f"the memory model knows precisions {list(MEMORY_PRECISIONS)}, not {precision!r}")
    return precision


def model_state_bytes(
    shape: ModelMemoryShape,
    *,
    sharding: str,
    precision: str,
    world_size: int,
    ranks_per_node: int,
    num_microbatches: int = 1,
    optimizer: str = "adamw",
    pipeline_stages: int = 1,
    tensor_parallel: int = 1,
) -> dict[str, float]:
    """Bytes per rank of parameters, gradients, optimizer state and what a step holds unsharded (``world_size``:
    ranks of one pipeline stage's pool; a stage holds ``1 / pipeline_stages`` of the parameters, a TP rank ``1 /
    tensor_parallel`` of every block's projections and of an untied LM head, which TP splits by vocabulary rows).

    Returns:
        ``{"params", "grads", "optimizer", "unsharded"}``.
    """
    precision = _precision(precision)
    if sharding not in SHARDING_MODES:
        raise ValueError(f"unknown sharding {sharding!r}")
    if pipeline_stages < 1:
        raise ValueError(f"pipeline_stages must be positive, got {pipeline_stages}")
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be positive, got {tensor_parallel}")
    split = shape.num_layers * shape.projection_params * (1 - 1 / tensor_parallel)  # other TP ranks' share
    head = shape.vocab_size * shape.hidden_size
    # an untied head (the parameters count a second vocabulary matrix beside the blocks' projections) is split by
    # vocabulary rows under TP when T divides them (tensor.parallelize); a tied one stays whole with the embedding
    untied = shape.num_params >= shape.num_layers * shape.projection_params + 2 * head
    divides = shape.vocab_size % tensor_parallel == 0
    head_split = head * (1 - 1 / tensor_parallel) if untied and divides else 0.0
    split += head_split
    n = (float(shape.num_params) - split) / pipeline_stages
    master, grad = (2.0, 2.0) if precision == "bf16-true" else (4.0, 4.0)
    moments = 0.0 if optimizer == "sgd" else 2 * master
    compute = 4.0 if precision == "32-true" else 2.0
    if sharding == "none":
        unsharded = n * 2.0 if precision == "bf16-mixed" else 0.0  # autocast's bf16 weight copies
        return {"params": n * master, "grads": n * grad, "optimizer": n * moments, "unsharded": unsharded}
    shards = min(ranks_per_node, world_size) if sharding == "hsdp" else world_size
    accumulated = 4.0 if precision == "bf16-mixed" else grad
    if sharding == "zero3":
        root = (2 * head - head_split) / pipeline_stages
        blocks = split - head_split
        unsharded = (root + 2 * (shape.block_params - blocks / shape.num_layers)) * (compute + grad)
    else:
        unsharded = n * (compute + (accumulated if num_microbatches > 1 else compute))
    return {
        "params": n * master / shards,
        "grads": n * grad / shards,
        "optimizer": n * moments / shards,
        "unsharded": unsharded,
    }


def activation_bytes_per_token(
    shape: ModelMemoryShape,
    *,
    checkpointing: str,
    precision: str,
    tensor_parallel: int = 1,
    sequence_parallel: bool = True,
) -> dict[str, float]:
    """Activation bytes per token on a rank (of a TP group of ``tensor_parallel``).

    Args:
        shape: The model.
        checkpointing: ``"none"`` or ``"selective"``.
        precision: The Trainer's precision.
        tensor_parallel: TP degree ``T``.
        sequence_parallel: The norms and the residual stream split by tokens over the TP group (no effect at
            ``T = 1``); see the module docstring. On by default, as ``HydraStrategy`` runs TP and
            :meth:`~lightning_hydra.planner.CostModel.for_transformer` counts TP's collectives.

    Returns:
        ``{"blocks", "once", "transient", "cp_buffers", "total"}`` (see the module docstring).
    """
    precision = _precision(precision)
    a = 4.0 if precision == "32-true" else 2.0
    h, kv, f, heads = shape.hidden_size, shape.kv_size, shape.ffn_hidden_size, shape.num_heads
    t = tensor_parallel
    if t < 1:
        raise ValueError(f"tensor_parallel must be positive, got {t}")
    split = a * (2 * h + 2 * kv) + 4 * heads  # q/k/v, attention output, LSE: split by TP with the heads
    norms = 1 / t if sequence_parallel else 1.0  # the share of the tokens the norms and the residual stream see
    # the norms' float32 inputs and normalised outputs (on the token shard under SP), their (gathered) outputs
    full = (8 * h + 2 * a * h) * norms + 2 * a * h + (split + a * 4 * f) / t
    if checkpointing == "selective" and shape.selective == "units":  # two norm inputs, two gathered norm outputs
        block = 2 * a * h * norms + 2 * a * h + split / t
    elif checkpointing == "selective" and shape.selective == "block_tp" and t > 1:
        # the block input and the residual after attention; with SP both norms' gathered outputs
        block = 2 * a * h * norms + (2 * a * h if sequence_parallel else 0.0) + split / t
    elif checkpointing == "selective":
        block = a * h * norms + split / t
    elif checkpointing == "none":
        block = full
    else:
        raise ValueError(f"unknown activation_checkpointing {checkpointing!r}")
    out = {
        "blocks": shape.num_layers * block,
        "once": 4 * h + 2 * a * h + 2 * a * (h // heads),
        "transient": full,
        "cp_buffers": (2 * a * (h + 2 * kv) + 8 * a * kv + 16 * kv) / t,
    }
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """A rank's budget, what pays for what, and the token capacity that is left."""

    budget: float
    """Bytes of the rank's device (or the given budget)."""
    state: dict[str, float]
    """Model state (:func:`model_state_bytes`)."""
    communicators: float
    """Bytes charged for communicators."""
    margin: float
    """Bytes kept free."""
    per_token: dict[str, float]
    """Activation bytes per token (:func:`activation_bytes_per_token`)."""
    capacity: int
    """Tokens one rank may hold in one microbatch (0: the model state does not fit)."""

    @property
    def available(self) -> float:
        """Bytes left for activations."""
        return self.budget - sum(self.state.values()) - self.communicators - self.margin

    def lines(self) -> list[str]:
        """A readable breakdown, one item per line (GiB)."""

        def g(x: float) -> str:
            return f"{x / GIB:8.2f} GiB"

        rows = [f"budget             {g(self.budget)}"]
        rows += [f"  {name:<16} -{g(value)}" for name, value in self.state.items()]
        rows += [f"  communicators    -{g(self.communicators)}", f"  margin           -{g(self.margin)}"]
        rows += [f"  activations       {g(max(self.available, 0.0))}"]
        rows += [f"per token          {self.per_token['total'] / 2**20:8.3f} MiB"]
        rows += [f"capacity           {self.capacity:8d} tokens per rank"]
        return rows


def memory_capacity(
    shape: ModelMemoryShape,
    *,
    budget: float,
    sharding: str,
    precision: str,
    checkpointing: str,
    world_size: int,
    ranks_per_node: int,
    num_microbatches: int = 1,
    optimizer: str = "adamw",
    ulysses_blocks: int = 3,
    communicator_bytes: float = 0.5e9,
    margin: float = 0.1,
    multiple_of: int = 256,
    pipeline_stages: int = 1,
    tensor_parallel: int = 1,
    sequence_parallel: bool = True,
) -> MemoryBreakdown:
    """The token capacity of a rank: what its budget leaves after model state, communicators and the margin,
    divided by activation bytes per token, rounded down to ``multiple_of``.

    Args:
        shape: The model.
        budget: Bytes of the rank's memory.
        sharding: ``"none"``, ``"zero2"``, ``"zero3"`` or ``"hsdp"``.
        precision: The Trainer's precision.
        checkpointing: ``"none"`` or ``"selective"``.
        world_size: Ranks in the pool.
        ranks_per_node: Ranks per node.
        num_microbatches: Microbatches per step (accumulation keeps gradients).
        optimizer: ``"adamw"`` or ``"sgd"``.
        ulysses_blocks: Ulysses communicators this rank belongs to.
        communicator_bytes: Bytes per communicator (0 on CPU/gloo).
        margin: Share of the budget kept free.
        multiple_of: Round the capacity down to a multiple of this (kernel tiles).
        pipeline_stages: Pipeline stages: a stage holds ``1 / P`` of the model state; under 1F1B the first stage
            keeps ``P`` microbatches' activations of its ``L / P`` blocks in flight, as many per token as the whole
            model without a pipeline, so the activation term is unchanged (``world_size`` is one stage's pool).
        tensor_parallel: TP degree: state and activations per rank as the module docstring says, and the TP
            group's communicator.
        sequence_parallel: Sequence-parallel norms under TP (:func:`activation_bytes_per_token`; no effect at
            ``T = 1``).
    """
    if budget <= 0 or not 0 <= margin < 1:
        raise ValueError(f"budget must be positive and margin in [0, 1), got {budget} and {margin}")
    state = model_state_bytes(
        shape,
        sharding=sharding,
        precision=precision,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        num_microbatches=num_microbatches,
        optimizer=optimizer,
        pipeline_stages=pipeline_stages,
        tensor_parallel=tensor_parallel,
    )
    mesh_dims = {"none": 0, "zero2": 1, "zero3": 1, "hsdp": 2}[sharding]
    stage_links = 2 if pipeline_stages > 1 else 0
    tp_group = 1 if tensor_parallel > 1 else 0
    if tensor_parallel > 1 and sharding == "hsdp":
        tp_group += 1  # the mesh's flattened "pool" of (replicate, shard): the gradient and loss sums
    communicators = communicator_bytes * (1 + mesh_dims + ulysses_blocks + 2 + stage_links + tp_group)
    per_token = activation_bytes_per_token(
        shape,
        checkpointing=checkpointing,
        precision=precision,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
    )
    kept = budget * margin
    left = budget - sum(state.values()) - communicators - kept
    tokens = int(left // per_token["total"]) if left > 0 else 0
    capacity = tokens // multiple_of * multiple_of if tokens >= multiple_of else tokens
    return MemoryBreakdown(
        budget=float(budget),
        state=state,
        communicators=communicators,
        margin=kept,
        per_token=per_token,
        capacity=max(capacity, 0),
    )
