"""Hugging Face models through the attention registry: same results as transformers' own attention."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hydra.cp.context import CPContext
from lightning_hydra.models.hf import HFCausalLM, apply_hf, remove_hf, unsupported_attention

CONFIG = dict(
    vocab_size=258,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _gpt_neox() -> torch.nn.Module:
    """GPT-NeoX (Pythia): partial rotary, parallel residual; its attention modules name their width ``head_size``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt_neox", vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, rotary_pct=0.5, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize(
    "build",
    [lambda: LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa")), _gpt_neox],
    ids=["llama", "gpt_neox"],
)
def test_packed_documents_match_separate_sdpa_runs(build) -> None:
    torch.manual_seed(0)
    model = build().eval()
    docs = [torch.randint(0, 258, (n,)) for n in (13, 40, 1, 7)]
    with torch.no_grad():
        separate = torch.cat([model(d[None]).logits[0] for d in docs])
    context = CPContext()
    assert apply_hf(model, context) == 2
    ids = torch.cat(docs)
    pos = torch.cat([torch.arange(d.numel()) for d in docs])
    cu = [0]
    for d in docs:
        cu.append(cu[-1] + d.numel())
    # degree 1: the shard is the bin with odd documents padded to even length
    from lightning_hydra.cp.layout import ZigzagMeta, zigzag_positions, zigzag_source_index

    meta = ZigzagMeta.from_cu_seqlens(cu, 1)
    source = zigzag_source_index(meta, 0)[1]
    shard_ids = torch.where(source >= 0, ids[source.clamp_min(0)], torch.zeros_like(source))
    with torch.no_grad(), context.use(CPContext.local_group(), cu):
        packed = model(shard_ids[None], position_ids=zigzag_positions(cu, 1, 0)[None]).logits[0]
    real = source >= 0  # the shard lists documents by decreasing chunk size: compare token by token
    torch.testing.assert_close(packed[real], separate[source[real]], rtol=1e-5, atol=1e-5)
    remove_hf(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any("hydra_cp" in m.__dict__ for m in model.modules())
    del pos


def test_hf_llama_trains_exactly_on_four_ranks(tmp_path: Path) -> None:
    import tests.test_strategy as T

    torch.manual_seed(7)
    # plain SGD: parameter differences are lr x gradient differences (Adam would amplify round-off on rows whose
    # gradient is nearly zero)
    base = HFCausalLM(config={"model_type": "llama", **CONFIG}, lr=1.0, max_grad_norm=None, optimizer="sgd")
    ref_rows, ref_model = T._reference(tmp_path, copy.deepcopy(base), steps=3)
    model = copy.deepcopy(base)
    runs = T._hydra_run(tmp_path, model, "hydra", steps=3)
    T._assert_same_training(ref_rows, ref_model, runs, model)
    used = {tuple(g) for rank in runs for row in rank[:-1] for g in row["groups"]}
    assert any(u > 1 for _, u, _ in used) and any(r > 1 for _, _, r in used), used


def test_hf_llama_trains_exactly_sharded_on_four_ranks(tmp_path: Path) -> None:
    """Under sharded state a rank runs the microbatches it sits out on an empty shard, to take part in FSDP's
    collectives; transformers' models reshape with ``-1`` and crashed on it (every sharding mode, every Hugging Face
    model: found by training five architectures under zero2, zero3 and hsdp). Now a one-token shard with its label
    ignored: zero3 (every rank runs every microbatch) with selective checkpointing trains what one process trains."""
    import tests.test_strategy as T

    torch.manual_seed(7)
    base = HFCausalLM(config={"model_type": "llama", **CONFIG}, lr=1.0, max_grad_norm=None, optimizer="sgd")
    ref_rows, ref_model = T._reference(tmp_path, copy.deepcopy(base), steps=3)
    model = copy.deepcopy(base)
    runs = T._hydra_run(tmp_path, model, "hydra", steps=3, sharding="zero3", activation_checkpointing="selective")
    T._assert_same_training(ref_rows, ref_model, runs, model)


SMALL = dict(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def test_the_refusal_s_advice_gives_full_attention() -> None:
    """Gemma 2 built as its refusal advises (``layer_types`` all full attention and no attention soft-capping; a
    window of ``None`` alone left its sliding layers) is accepted and runs through the engine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", **SMALL, head_dim=8, sliding_window=None)
    assert "its layers include sliding_attention layers" in unsupported_attention(
        AutoModelForCausalLM.from_config(config)
    )
    advised = AutoConfig.for_model("gemma2", **SMALL, head_dim=8, layer_types=["full_attention"] * 2,
                                   attn_logit_softcapping=None)  # fmt: skip
    model = HFCausalLM(config=advised)
    ids = torch.randint(0, 258, (16,))
    with torch.no_grad(), model.local_cp.use(CPContext.local_group(), [0, 16]):
        assert torch.isfinite(model(ids, torch.arange(16), labels=ids))


@pytest.mark.parametrize(
    ("model_type", "extra", "said"),
    [
        ("mistral", {"sliding_window": 8}, "it applies a sliding window of 8 tokens"),
        ("gemma2", {"sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"]},
         r"its layers include sliding_attention layers and it soft-caps its attention logits "
         r"\(attn_logit_softcapping=50.0\), .*build it with layer_types=\['full_attention'\] \* 2, "
         r"attn_logit_softcapping=None in its config\)$"),
        ("mistral", {"sliding_window": 8}, r"build it with sliding_window=None in its config\)$"),
        ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 4,
                        "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
         "its layers include linear_attention layers"),
        ("bloom", {"n_head": 4}, "does not take attention implementations from transformers' registry"),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
         r"its rotary embedding \(dynamic\) picks its frequencies from the largest position in the packed row"),
        ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4}, r"to its attention probabilities \(attn_dropout=0.1\)"),
        ("llama", {"attention_dropout": 0.1}, r"\(attention_dropout=0.1\), which the CP engine does not compute"),
    ],
)  # fmt: skip
def test_attention_the_engine_does_not_compute_is_refused(model_type: str, extra: dict, said: str) -> None:
    """Found by running 71 architectures through the engine: sliding windows (Mistral, Qwen2/3, Gemma 2/3, ...),
    chunked, linear and convolutional layers were wrapped and silently trained as full causal attention (logits off by
    2-4.5 where documents outgrow the window), and models outside transformers' attention registry (Bloom, MPT,
    Falcon) kept their own attention while ``apply_hf`` counted them as wrapped."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SMALL, **extra})
    model = AutoModelForCausalLM.from_config(config)
    previous = model.config._attn_implementation
    with pytest.raises(ValueError, match=said):
        apply_hf(model, CPContext())
    assert model.config._attn_implementation == previous  # left as it was
    assert not any("hydra_cp" in m.__dict__ for m in model.modules())


def test_what_a_model_asks_beyond_document_masked_attention_is_refused() -> None:
    """Soft-capping (Gemma 2), attention sinks (gpt-oss), a window, or a model's own mask or bias (Doge) reach the
    attention function as arguments; dropped, they would train other attention than the model's."""
    from lightning_hydra.models.hf import hydra_hf_attention

    module = torch.nn.Module()
    module.hydra_cp = CPContext()  # type: ignore[assignment]
    q = torch.zeros(1, 4, 8, 16)
    kv = torch.zeros(1, 2, 8, 16)
    for kwargs, said in (
        ({"softcap": 50.0}, r"logit soft-capping \(softcap=50.0\)"),
        ({"s_aux": torch.zeros(4)}, r"attention sinks \(s_aux=a tensor of shape \(4,\)\)"),
        ({"sliding_window": 8}, r"a sliding window \(sliding_window=8\)"),
        ({"attention_mask": torch.zeros(1, 4, 8, 8)}, "passes its own attention mask or bias"),
    ):
        with pytest.raises(ValueError, match=said):
            hydra_hf_attention(module, q, kv, kv, **{"attention_mask": None, **kwargs})


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {}),
        ("granite", {"logits_scaling": 8.0}),
        ("cohere", {"logit_scale": 0.0625}),
        ("gemma2", {"final_logit_softcapping": 0.2, "attn_logit_softcapping": None, "head_dim": 8,
                    "layer_types": ["full_attention"] * 2}),
    ],
)  # fmt: skip
@pytest.mark.parametrize("staged", [False, True])
def test_the_chunked_loss_is_the_models_own(model_type: str, extra: dict, staged: bool) -> None:
    """The loss is chunked over tokens from the decoder's output and the LM head; the Granite family divides its
    logits by ``logits_scaling`` (8-16 in released models), which the chunked loss ignored (the summed loss 0.5%
    off at a scaling of 8 on random weights, found by checking 29 architectures), and so did the last pipeline
    stage; Gemma 2 soft-caps its final logits (the chunked loss caps them element-wise)."""
    import torch.nn.functional as F
    from transformers import AutoConfig

    torch.manual_seed(0)
    model = HFCausalLM(config=AutoConfig.for_model(model_type, **{**SMALL, **extra})).eval()
    if staged:
        model.pipeline_stage(0, 1)  # one stage: the stage's path, with the head
    ids, labels = torch.randint(3, 258, (24,)), torch.randint(3, 258, (24,))
    positions = torch.arange(24)
    with torch.no_grad(), model.local_cp.use(CPContext.local_group(), [0, 24]):
        loss = model(ids, positions, labels=labels)
        logits = model.model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
        staged_logits = model(ids, positions) if staged else logits
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), labels, reduction="sum"), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(staged_logits, logits, rtol=1e-5, atol=1e-5)


def test_a_router_load_balancing_loss_is_refused() -> None:
    """The loss is the sum of token losses; transformers' router load-balancing loss (a product of averages over
    the row) was never added, with or without CP, though the config asked for it (found by training MoE models
    on 4 ranks)."""
    from transformers import AutoConfig

    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "output_router_logits": True}
    with pytest.raises(ValueError, match=r"load-balancing loss \(output_router_logits=True\), which HFCausalLM"):
        HFCausalLM(config=AutoConfig.for_model("olmoe", **{**SMALL, **moe}))
