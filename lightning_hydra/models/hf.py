"""Hugging Face causal LMs under HydraStrategy, through the transformers attention-function registry.

Importing this module registers the attention implementation ``"hydra"``. :func:`apply_hf` switches a model to it
and gives each attention module a ``hydra_cp`` context (the strategy later points them at its own); the function
reads the current CP group from the module it is called for, never from a global. :func:`remove_hf` undoes it.
Packed bins are one batch row with true per-document positions; documents never attend to each other.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from typing_extensions import override

from lightning_hydra.cp.context import CPContext
from lightning_hydra.data.packing import IGNORE_INDEX, RankMicrobatch
from lightning_hydra.errors import ConfigError
from lightning_hydra.models.losses import chunked_cross_entropy
from lightning_hydra.models.module import HydraModule
from lightning_hydra.models.stages import keep_stage_layers

__all__ = ["HFCausalLM", "apply_hf", "hydra_hf_attention", "remove_hf", "unsupported_attention"]

IMPLEMENTATION = "hydra"


def hydra_hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: ``[1, H, S, D]`` in, ``[1, S, H, D]`` out, through the CP engine.

    The engine computes document-masked causal (or, with ``is_causal=False``, bidirectional) softmax attention. What a
    model asks beyond that (its own mask or bias, a sliding window, logit soft-capping, attention sinks, dropout) is
    refused with an error rather than dropped: dropped, it would train other attention than the model's, silently.
    Under autocast the engine casts q, k and v to autocast's dtype (transformers' rotary tables take the hidden
    states' dtype: float32 under ``bf16-mixed`` without FSDP, beside a bf16 value projection), as SDPA does.
    """
    cp = getattr(module, "hydra_cp", None)
    if cp is None:
        raise RuntimeError(f"{type(module).__name__} has no CP context: wrap the model with apply_hf() first")
    if query.shape[0] != 1:
        raise ValueError(f"hydra attention takes one packed row, got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError("attention dropout is not supported by the CP engine")
    if attention_mask is not None:
        raise ValueError(
            f"{type(module).__name__} passes its own attention mask or bias, which the CP engine cannot apply (it "
            "computes document-masked attention from the packed documents' boundaries)"
        )
    for name, what in _NOT_COMPUTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} asks for {what} ({name}={_brief(kwargs[name])}), which the CP engine does "
                "not compute"
            )
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    out = cp.attention(q, k, v, causal=getattr(module, "is_causal", True), scale=scaling)
    return out.unsqueeze(0), None


_NOT_COMPUTED = {"sliding_window": "a sliding window", "softcap": "logit soft-capping", "s_aux": "attention sinks"}
"""Keyword arguments of transformers' attention functions that change the result and that the engine does not
compute (found by running 71 architectures through it: Mistral, Qwen2/3, Gemma 2/3, gpt-oss and others)."""


def _brief(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


AttentionInterface.register(IMPLEMENTATION, hydra_hf_attention)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and (hasattr(m, "head_dim") or hasattr(m, "head_size"))
    ]


_DROPOUT_NAMES = ("attention_dropout", "attn_dropout", "attn_pdrop", "dropout")
"""Attributes under which transformers' attention modules keep the dropout on attention probabilities (a rate or an
``nn.Dropout``; ``dropout`` only as a rate, as OPT and BioGPT keep it: as a module it may drop the output, like
``resid_dropout``, which the engine does not touch)."""


def _attention_dropout(module: nn.Module) -> dict[str, float]:
    """The attention-probability dropout rates ``module`` keeps, by attribute name."""
    found = {}
    for name in _DROPOUT_NAMES:
        value = getattr(module, name, None)
        rate = value.p if isinstance(value, nn.Dropout) and name != "dropout" else value
        if isinstance(rate, int | float) and not isinstance(rate, bool):
            found[name] = float(rate)
    return found


_ROW_ROPE = frozenset({"dynamic", "longrope"})
"""Rotary scalings that choose their frequencies from ``max(position_ids) + 1`` of the row (transformers'
``dynamic_rope_update``): under CP each rank sees its own shard's largest position, and the packed row's longest
document sets them for all its documents (Phi-3 with ``longrope``, Llama with dynamic NTK scaling trained 4-8e-5
apart from one process on 4 ranks). The static scalings (linear, llama3, yarn) read positions token by token."""


def _rope_types(config: PretrainedConfig) -> set[str]:
    """The ``rope_type`` of every rotary embedding ``config`` describes (``rope_parameters``, or ``rope_scaling``
    before it; one dict, or one per layer type)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return set()
    params = [rope] if ("rope_type" in rope or "type" in rope) else [v for v in rope.values() if isinstance(v, dict)]
    return {str(p.get("rope_type", p.get("type"))) for p in params}


def _attention_changes(config: PretrainedConfig) -> tuple[list[str], list[str]]:
    """What in ``config`` makes the model's attention other than full causal attention, and every config change
    that makes it that: a user who wants full attention gets all of them at once (Gemma 2 needs two:
    ``layer_types`` all full attention, since its layer types do not follow ``sliding_window``, and no attention
    soft-capping, which the attention function would refuse at the first step)."""
    reasons, fixes = [], []
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        if other:
            reasons.append(f"its layers include {', '.join(other)} layers")
            fixes.append(f"layer_types=['full_attention'] * {len(layer_types)}")
    elif getattr(config, "sliding_window", None) is not None:
        reasons.append(f"it applies a sliding window of {config.sliding_window} tokens")
        fixes.append("sliding_window=None")
    if getattr(config, "attention_chunk_size", None) is not None:
        reasons.append(f"it applies chunked attention ({config.attention_chunk_size} tokens)")
        fixes.append("attention_chunk_size=None")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        reasons.append(f"it soft-caps its attention logits (attn_logit_softcapping={config.attn_logit_softcapping})")
        fixes.append("attn_logit_softcapping=None")
    return reasons, fixes


def unsupported_attention(model: PreTrainedModel) -> str | None:
    """Why the CP engine cannot compute ``model``'s attention (``None``: it can). transformers' own rule for context
    parallelism (``PreTrainedModel.supports_context_parallel`` where it exists): every layer of ``layer_types`` full
    attention (not sliding-window, chunked, linear or convolutional), and without ``layer_types`` no
    ``sliding_window`` (models before ``layer_types`` apply it to every layer, some only through the mask), nor an
    ``attention_chunk_size``; no attention soft-capping (``attn_logit_softcapping``, Gemma 2's); and no rotary
    scaling that reads the row's largest position (:data:`_ROW_ROPE`). The reason names every config change that
    gives full attention (:func:`_attention_changes`)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    reasons, fixes = _attention_changes(config)
    if reasons:
        return (
            f"{' and '.join(reasons)}, and the CP engine computes full causal attention within each document, "
            f"without a window or soft-capping (if that is what the model should learn, build it with "
            f"{', '.join(fixes)} in its config)"
        )
    position_dependent = sorted(_rope_types(config) & _ROW_ROPE)
    if position_dependent:
        return (
            f"its rotary embedding ({', '.join(position_dependent)}) picks its frequencies from the largest position "
            "in the packed row, which a rank's shard does not hold"
        )
    if getattr(model, "supports_context_parallel", True) is False:
        return "transformers marks it as not supporting context parallelism"
    return None


def _pretrained_on_meta(path: str, overrides: dict[str, Any] | None) -> PreTrainedModel:
    """The directory's model (config with ``overrides``) built on the meta device in float32 (the master weights'
    dtype, whatever the files hold), its weights' shapes checked against the config."""
    from lightning_hydra.models.pretrained import check_buffers, check_pretrained_dir, check_weights, read_config

    where = check_pretrained_dir(path)
    try:
        config = read_config(where, overrides)
    except (ValueError, KeyError, TypeError) as error:
        refused = f"pretrained={path!r}: its config (with overrides {overrides or {}}) is refused: {error}"
        raise ConfigError(refused) from None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    unknown = sorted(_rope_types(config) - set(ROPE_INIT_FUNCTIONS) - {"default"})
    if unknown:
        raise ConfigError(
            f"pretrained={path!r}: unknown rope_type {', '.join(unknown)} (transformers knows default, "
            f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))})"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    check_weights(model, where)
    check_buffers(model, where)
    return model


def apply_hf(model: PreTrainedModel, context: CPContext) -> int:
    """Route ``model``'s attention through the CP engine; returns how many attention modules were wrapped.

    Raises:
        ValueError: The model has no attention modules, its attention is not what the engine computes
            (:func:`unsupported_attention`: trained through the engine it would silently become full causal
            attention), it applies dropout to attention probabilities, or it does not take attention implementations
            from transformers' registry (its attention would never reach the engine).
    """
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"found no attention modules in {type(model).__name__}")
    reason = unsupported_attention(model)
    if reason is not None:
        raise ValueError(f"{type(model).__name__} cannot run under context parallelism: {reason}")
    dropout = {name: p for m in modules for name, p in _attention_dropout(m).items() if p > 0}
    if dropout:
        name, p = next(iter(dropout.items()))
        raise ValueError(
            f"{type(model).__name__} applies dropout to its attention probabilities ({name}={p}), which the CP engine "
            "does not compute: set the config's attention dropout to 0"
        )
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:  # transformers keeps its own and only logs a warning
        model.set_attn_implementation(previous)
        raise ValueError(
            f"{type(model).__name__} does not take attention implementations from transformers' registry (it kept "
            f"{model.config._attn_implementation!r}): its attention would never reach the CP engine"
        )
    if not hasattr(model, "_hydra_previous_attn"):
        object.__setattr__(model, "_hydra_previous_attn", previous)
    for m in modules:
        object.__setattr__(m, "hydra_cp", context)
    return len(modules)


def remove_hf(model: PreTrainedModel) -> None:
    """Undo :func:`apply_hf`: the previous attention implementation, no CP contexts."""
    previous = getattr(model, "_hydra_previous_attn", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        object.__delattr__(model, "_hydra_previous_attn")
    for m in _attention_modules(model):
        if "hydra_cp" in m.__dict__:
            object.__delattr__(m, "hydra_cp")


class HFCausalLM(HydraModule):
    """A Hugging Face causal LM as a :class:`HydraModule`: built from a config (random weights, no download), or
    from a local pretrained directory's weights (:meth:`from_pretrained`, ``pretrained=``), which each rank reads
    slice by slice after the strategy has laid the model out (:mod:`lightning_hydra.models.pretrained`)."""

    def __init__(
        self,
        model: PreTrainedModel | None = None,
        *,
        config: dict | PretrainedConfig | None = None,
        pretrained: str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float | None = 1.0,
        optimizer: str = "adamw",
        flops_per_second: float | None = None,
    ) -> None:
        """Wrap a Hugging Face causal language model.

        Args:
            model: A causal LM instance; or ``None`` to build one from ``config`` or ``pretrained``.
            config: A ``PretrainedConfig`` or a dict with ``model_type`` (for example ``{"model_type": "llama", ...}``);
                with ``pretrained``, a dict of overrides of the directory's config (``rope_theta``, ``rope_scaling``
                such as ``{"rope_type": "llama3", ...}``, ``max_position_embeddings``, ...; see
                :func:`~lightning_hydra.models.pretrained.read_config`).
            pretrained: A local Hugging Face checkpoint directory (``config.json`` and ``*.safetensors``): the model
                is built on the meta device and takes these weights when it is materialised (by
                :class:`~lightning_hydra.HydraStrategy` after its layout, each rank reading only its slices; in one
                process by ``configure_model`` or :meth:`materialize`). Bad input (not such a directory, weights
                that disagree with the config, attention the CP engine refuses) is a one-line
                :class:`~lightning_hydra.errors.ConfigError` here, before any rank starts.
            lr: Learning rate.
            weight_decay: AdamW weight decay.
            warmup_steps: Linear warm-up steps.
            max_grad_norm: Gradient clipping (``None``: off).
            optimizer: ``"adamw"`` or ``"sgd"``.
            flops_per_second: Achieved FLOP rate assumed by the default cost model (``None``: the device's, see
                :func:`~lightning_hydra.models.module.device_rates`).
        """
        super().__init__(
            lr=lr,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            optimizer=optimizer,
            flops_per_second=flops_per_second,
        )
        self.pretrained = pretrained
        """The pretrained directory whose weights :meth:`materialize` loads (``None``: built from a config)."""
        self.loaded_bytes = 0
        """Bytes this process read from the pretrained files when it materialised the model (a rank: its slices
        of its stage's tensors)."""
        if pretrained is not None:
            if model is not None:
                raise ConfigError("HFCausalLM takes a model or pretrained=, not both")
            if config is not None and not isinstance(config, dict):
                raise ConfigError("with pretrained=, config is a dict of overrides of the directory's config.json")
            model = _pretrained_on_meta(pretrained, config)
        elif model is None:
            if config is None:
                raise ValueError("HFCausalLM needs a model, a config or pretrained=")
            if isinstance(config, dict):
                config = AutoConfig.for_model(**config)
            model = AutoModelForCausalLM.from_config(config)
        if getattr(model.config, "output_router_logits", False):
            # transformers' load-balancing loss averages router probabilities over every token of the row: a product
            # of averages, which neither the chunked loss computes nor CP shards can sum to
            raise ValueError(
                f"{type(model).__name__} asks for the router's load-balancing loss (output_router_logits=True), which "
                "HFCausalLM does not add: set output_router_logits to False (the loss is the sum of token losses)"
            )
        self.model = model
        self._stages: tuple[int, int] | None = None
        self._stage_factor = 1.0
        """The factor on the last stage's logits (:meth:`_linear_head`)."""
        try:
            apply_hf(self.model, self.local_cp)
        except ValueError as error:
            if pretrained is None:
                raise
            raise ConfigError(str(error)) from None  # the refusal of the same model built from its config

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> HFCausalLM:
        """``HFCausalLM(pretrained=path, ...)``: keyword arguments that the constructor takes (``lr``,
        ``optimizer``, ...) go to it, every other one overrides the directory's config (``rope_theta=...``,
        ``rope_scaling={"rope_type": "yarn", ...}``, ``max_position_embeddings=...``).

        Args:
            path: A local Hugging Face checkpoint directory.
            **kwargs: Constructor arguments and config overrides.
        """
        own = set(inspect.signature(cls.__init__).parameters) - {"self", "model", "config", "pretrained"}
        overrides = {k: v for k, v in kwargs.items() if k not in own}
        return cls(pretrained=path, config=overrides or None, **{k: v for k, v in kwargs.items() if k in own})

    @override
    def materialize(self, device: torch.device | str) -> None:
        """Allocate the meta-built model on ``device`` (laid out or not) and fill it from :attr:`pretrained`, each
        rank reading only the slices of the shards it holds (:func:`~lightning_hydra.models.pretrained.
        load_pretrained`); without a pretrained directory, :meth:`init_weights` (which HFCausalLM lacks)."""
        if self.pretrained is None:
            super().materialize(device)
            return
        from lightning_hydra.models.init import to_empty_keeping_ties
        from lightning_hydra.models.pretrained import load_pretrained

        to_empty_keeping_ties(self, device)
        self.loaded_bytes = load_pretrained(self.model, self.pretrained)

    def materialize_buffers(self, device: torch.device | str) -> None:
        """Allocate the buffers still on the meta device (the rotary tables of a model whose parameters were
        assigned, such as the trained weights that the spawn launcher hands back to the main process) on
        ``device`` and compute them again from the config."""
        from lightning_hydra.models.pretrained import reinit_buffers

        for module in self.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device=device)
        reinit_buffers(self.model)

    @override
    def export_spec(self) -> dict[str, Any]:
        """The wrapped model as it trained: its own config (the run's overrides included, such as a changed rotary
        scaling), its parameter names without this module's ``model.`` prefix, the pretrained directory's
        ``generation_config.json`` and the directory itself, whose tokenizer files the export copies (see
        :mod:`lightning_hydra.export`)."""
        from lightning_hydra.models.pretrained import generation_config

        config = {k: v for k, v in self.model.config.to_dict().items() if not k.startswith("_")}
        config.pop("attn_implementation", None)  # the CP engine's, registered in this process only
        return {
            "config": config,
            "rename": [[r"^model\.", ""]],
            "generation_config": generation_config(self.pretrained) if self.pretrained is not None else None,
            "source": self.pretrained,
        }

    def _linear_head(self) -> tuple[nn.Linear, float] | None:
        """``(head, factor)`` when the model's logits are exactly ``factor * head(last_hidden_state)``, so the loss
        can be chunked over tokens (``factor``: Cohere's ``logit_scale``, the Granite family's ``1 /
        logits_scaling``; ignoring it trained Granite on logits 8-16x too large), soft-capped or not
        (:meth:`_softcap`: the chunked losses cap element-wise); ``None`` otherwise (a biased head, or a factor and a
        cap together, whose order this does not know)."""
        head = self.model.get_output_embeddings()
        config = self.model.config
        if not isinstance(head, nn.Linear) or head.bias is not None or not hasattr(self.model, "base_model"):
            return None
        scale, scaling = getattr(config, "logit_scale", None), getattr(config, "logits_scaling", None)
        factor = (1.0 if scale is None else float(scale)) / (1.0 if scaling is None else float(scaling))
        if factor != 1.0 and self._softcap() is not None:
            return None
        return head, factor

    def _softcap(self) -> float | None:
        """The final logits' soft-capping (Gemma 2's ``final_logit_softcapping``: ``c tanh(logits / c)``), or
        ``None``."""
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return None if cap is None else float(cap)

    @override
    def output_head(self) -> nn.Linear | None:
        """The CausalLM's ``lm_head`` when its logits are a linear head's times a factor, soft-capped or not
        (:meth:`_linear_head`): the chunked loss then reads a vocabulary-split weight shard by shard (the factor
        scales the hidden states and the cap is element-wise, so both compose with the split); ``None`` otherwise (a
        biased head: its loss is computed from full logits, the head stays whole) and on a pipeline stage without
        the head."""
        linear = self._linear_head()
        return None if linear is None else linear[0]

    def _chunked_loss(self, hidden: torch.Tensor, head: nn.Linear, factor: float, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss of ``factor * head(hidden)`` without its ``[t, vocab]`` float32 logits (the factor
        scales the hidden states: ``(f h) W^T = f (h W^T)``)."""
        if factor != 1.0:
            hidden = hidden * factor
        return chunked_cross_entropy(hidden, head.weight, labels, ignore_index=IGNORE_INDEX, softcap=self._softcap())

    @override
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[t, vocab]`` of a packed shard, or with ``labels`` the sum of its token losses (chunked over
        tokens when the head allows it: no ``[t, vocab]`` float32 logits). Run inside a CP context. After
        :meth:`pipeline_stage`, this stage's layers only (see :class:`~lightning_hydra.HydraModule`)."""
        if self._stages is not None:
            return self._stage_run(input_ids, position_ids, labels, hidden)
        linear = self._linear_head() if labels is not None else None
        if linear is None:
            logits = self.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False).logits[0]
            if labels is None:
                return logits
            return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        base = self.model.base_model
        hidden = base(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False).last_hidden_state
        return self._chunked_loss(hidden[0], *linear, labels)

    @override
    def microbatch_loss(self, mb: RankMicrobatch) -> torch.Tensor:
        return self(mb.input_ids, mb.position_ids, labels=mb.labels)

    # ------------------------------------------------------------------ pipeline stages (Llama-family layout)
    def _decoder(self) -> nn.Module:
        base = getattr(self.model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(self.model, "lm_head"):
            raise NotImplementedError(
                f"{type(self.model).__name__} does not have the Llama-family layout (model.embed_tokens, "
                "model.layers, model.norm, model.rotary_emb, lm_head) that pipeline stages split"
            )
        return base

    @override
    def transformer_blocks(self) -> list[nn.Module]:
        """The decoder layers this model holds (after :meth:`pipeline_stage`, this stage's: the others are
        ``nn.Identity``, which tensor parallelism and sharding skip)."""
        return [block for block in super().transformer_blocks() if not isinstance(block, nn.Identity)]

    @override
    def pipeline_stage(self, stage: int, stages: int) -> None:
        base = self._decoder()
        if stages > 1 and getattr(self.model.config, "tie_word_embeddings", False):
            raise ValueError("a model with tied input and output embeddings cannot be split into pipeline stages")
        linear = self._linear_head()
        if linear is None:
            raise NotImplementedError(
                f"{type(self.model).__name__}'s logits are not a linear head's (a biased head, or a scale and "
                "soft-capping together): its last pipeline stage cannot compute them from the decoder's output"
            )
        self._stage_factor = linear[1]
        c = self.model.config
        keep_stage_layers(base.layers, stage, stages, head_flops=6.0 * c.vocab_size * c.hidden_size)
        if stage > 0:
            base.embed_tokens = None
        if stage < stages - 1:
            base.norm = None
            self.model.lm_head = None
        self._stages = (stage, stages)

    def _stage_run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None, hidden
    ) -> torch.Tensor:
        base = self._decoder()
        x = base.embed_tokens(input_ids[None]) if hidden is None else hidden[None]
        positions = position_ids[None]
        embeddings = base.rotary_emb(x, position_ids=positions)
        for layer in base.layers:
            if not isinstance(layer, nn.Identity):
                x = layer(x, attention_mask=None, position_embeddings=embeddings, position_ids=positions)
        if self.model.lm_head is None:
            return x[0]
        x = base.norm(x)[0]
        head, factor = self.model.lm_head, self._stage_factor
        if labels is None:
            logits = head(x) * factor if factor != 1.0 else head(x)
            cap = self._softcap()
            return logits if cap is None else cap * torch.tanh(logits / cap)
        return self._chunked_loss(x, head, factor, labels)

    @override
    def stage_forward(self, mb: RankMicrobatch, hidden: torch.Tensor | None) -> torch.Tensor:
        labels = mb.labels if self.model.lm_head is not None else None
        return self(mb.input_ids, mb.position_ids, labels=labels, hidden=hidden)

    @override
    def attention_heads(self) -> tuple[int | None, int | None]:
        c = self.model.config
        return c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @override
    def model_shape(self) -> dict[str, int | None]:
        c = self.model.config
        return {
            "hidden_size": c.hidden_size,
            "num_layers": c.num_hidden_layers,
            "num_heads": c.num_attention_heads,
            "num_kv_heads": getattr(c, "num_key_value_heads", None),
            "ffn_hidden_size": getattr(c, "intermediate_size", None),
            "vocab_size": c.vocab_size,
        }
