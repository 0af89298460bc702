"""The memory model behind max_tokens_per_rank="auto": its activation term against the bytes autograd really saves,
its model-state arithmetic, the capacities it gives, and the strategy's use of it."""

from __future__ import annotations

import pytest
import torch

from lightning_hydra import DecoderLM, HydraStrategy
from lightning_hydra.cp import CPContext
from lightning_hydra.planner.memory import (
    LLAMA3_8B,
    activation_bytes_per_token,
    memory_capacity,
    model_state_bytes,
    parse_bytes,
)
from lightning_hydra.strategy.capacity import configure_cuda_allocator, memory_shape


def _saved_bytes_per_token(model: DecoderLM, tokens: int) -> float:
    """Bytes of the distinct tensors autograd saves in one forward (parameters excluded), per token."""
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, 250, (tokens,))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x),
        model.local_cp.use(CPContext.local_group(), [0, tokens]),
    ):
        model(ids, torch.arange(tokens), labels=ids)
    return sum(v for k, v in seen.items() if k not in params) / tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_activation_model_matches_what_autograd_saves(dtype: torch.dtype, checkpointing: str) -> None:
    torch.manual_seed(0)
    model = DecoderLM(hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=384).to(dtype)
    model.set_activation_checkpointing(checkpointing)
    measured = _saved_bytes_per_token(model, 512)
    precision = "32-true" if dtype == torch.float32 else "bf16-true"
    predicted = activation_bytes_per_token(memory_shape(model), checkpointing=checkpointing, precision=precision)
    assert predicted["blocks"] + predicted["once"] == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_activation_model_matches_a_hugging_face_model(checkpointing: str) -> None:
    """A Hugging Face Llama recomputes each norm and its MLP alone under selective checkpointing (``"units"``): it
    keeps the norms' inputs and outputs too, which the memory model counts for it (58% more than the reference
    decoder's block-wise recompute at this shape)."""
    from lightning_hydra.models.hf import HFCausalLM

    torch.manual_seed(0)
    config = {"model_type": "llama", "vocab_size": 258, "hidden_size": 128, "intermediate_size": 384,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    model = HFCausalLM(config=config)
    model.set_activation_checkpointing(checkpointing)
    shape = memory_shape(model)
    assert shape.selective == "units"
    predicted = activation_bytes_per_token(shape, checkpointing=checkpointing, precision="32-true")
    assert predicted["blocks"] + predicted["once"] == pytest.approx(_saved_bytes_per_token(model, 512), rel=0.02)


def test_model_state_shards_with_the_mode() -> None:
    kw = {"precision": "bf16-mixed", "world_size": 64, "ranks_per_node": 8, "num_microbatches": 8}
    replica = model_state_bytes(LLAMA3_8B, sharding="none", **kw)
    zero2 = model_state_bytes(LLAMA3_8B, sharding="zero2", **kw)
    hsdp = model_state_bytes(LLAMA3_8B, sharding="hsdp", **kw)
    n = LLAMA3_8B.num_params
    assert replica["params"] == replica["grads"] == 4 * n and replica["optimizer"] == 8 * n
    assert zero2["optimizer"] == 8 * n / 64 and hsdp["optimizer"] == 8 * n / 8
    assert zero2["unsharded"] == n * (2 + 4)  # bf16 params for the step, float32 accumulated gradients
    sgd = model_state_bytes(LLAMA3_8B, sharding="zero2", optimizer="sgd", **kw)
    assert sgd["optimizer"] == 0
    staged = model_state_bytes(LLAMA3_8B, sharding="zero2", pipeline_stages=4, **kw)
    assert staged["optimizer"] == pytest.approx(zero2["optimizer"] / 4)  # a stage holds a quarter of the model
    assert staged["unsharded"] == pytest.approx(zero2["unsharded"] / 4)


def test_llama3_8b_fits_an_80gb_gpu_at_64_ranks() -> None:
    def capacity(sharding: str, checkpointing: str, budget: str = "80GB") -> int:
        return memory_capacity(
            LLAMA3_8B,
            budget=parse_bytes(budget),
            sharding=sharding,
            precision="bf16-mixed",
            checkpointing=checkpointing,
            world_size=64,
            ranks_per_node=8,
            num_microbatches=8,
        ).capacity

    assert capacity("none", "selective") == 0  # 16 bytes per parameter: a replica does not fit
    assert capacity("zero3", "selective") >= 16384
    assert capacity("zero3", "selective") > capacity("zero2", "selective") > capacity("hsdp", "selective")
    assert capacity("zero2", "selective") > capacity("zero2", "none")
    assert capacity("zero2", "selective", "141GB") > capacity("zero2", "selective")
    assert capacity("zero3", "selective") % 256 == 0


@pytest.mark.parametrize(
    ("text", "value"), [("80GB", 80e9), ("141 GiB", 141 * 2**30), ("64e9", 64e9), (2048, 2048), ("1.5kb", 1500)]
)
def test_sizes_parse(text, value) -> None:
    assert parse_bytes(text) == int(value)


@pytest.mark.parametrize("bad", ["lots", "-5GB", "0", 0, "12 parsecs", True])
def test_bad_sizes_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(bad)


def _strategy(**kw) -> HydraStrategy:
    from lightning.fabric.plugins.environments import LightningEnvironment

    env = LightningEnvironment()
    env.set_world_size(4)
    env.set_global_rank(0)
    strategy = HydraStrategy(parallel_devices=[torch.device("cpu")] * 4, cluster_environment=env, **kw)
    strategy.connect(DecoderLM(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2))
    return strategy


def test_auto_capacity_follows_the_budget() -> None:
    small = _strategy(max_tokens_per_rank="auto", memory_budget="64MB", sharding="zero2", ranks_per_node=4)
    small._resolve_capacity(ulysses_blocks=2)
    large = _strategy(max_tokens_per_rank="auto", memory_budget="256MB", sharding="zero2", ranks_per_node=4)
    large._resolve_capacity(ulysses_blocks=2)
    assert 0 < small.planner_config.max_tokens_per_rank < large.planner_config.max_tokens_per_rank
    assert small.planner_config.max_tokens_per_rank == small.memory.capacity
    assert any("per token" in line for line in small.memory.lines())
    tiny = _strategy(max_tokens_per_rank="auto", memory_budget="1MB")
    with pytest.raises(ValueError, match="the model state does not fit"):
        tiny._resolve_capacity(ulysses_blocks=2)
    explicit = _strategy(max_tokens_per_rank=512, memory_budget="1MB")
    assert explicit.planner_config.max_tokens_per_rank == 512 and not explicit.auto_capacity


def test_cuda_allocator_gets_expandable_segments_unless_configured(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert not configure_cuda_allocator(torch.device("cpu"))
    assert configure_cuda_allocator(torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert not configure_cuda_allocator(torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]
