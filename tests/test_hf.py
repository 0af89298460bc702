"""Hugging Face models through the attention registry: same results as transformers' own attention."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hydra.cp.context import CPContext
from lightning_hydra.models.hf import HFCausalLM, apply_hf, remove_hf

CONFIG = dict(
    vocab_size=258,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def test_packed_documents_match_separate_sdpa_runs() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa")).eval()
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
