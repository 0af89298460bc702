"""Dtype rules that a GPU run depends on, checked on CPU: RoPE angles in float32, cos/sin in the activations'
dtype (bf16 q and k stay bf16 for the flash kernels), q, k and v in autocast's dtype once the engine takes them, no
floating buffer a precision plugin could round."""

from __future__ import annotations

import math

import torch

from lightning_hydra import DecoderLM
from lightning_hydra.cp import CPContext
from lightning_hydra.models.decoder import RotaryEmbedding


class _Spy(CPContext):
    """A degree-1 context that records the dtypes attention receives."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []
        self.out: list[torch.dtype] = []

    def attention(self, q, k, v, *, causal=True, scale=None):
        self.seen.append((q.dtype, k.dtype, v.dtype))
        out = super().attention(q, k, v, causal=causal, scale=scale)
        self.out.append(out.dtype)
        return out


def _tiny() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


def test_bf16_model_feeds_bf16_queries_and_keys_to_attention() -> None:
    model = _tiny().to(torch.bfloat16)
    spy = _Spy()
    for layer in model.layers:
        layer.attn.hydra_cp = spy
    ids = torch.randint(0, 64, (24,))
    pos = torch.arange(24)
    with spy.use(CPContext.local_group(), [0, 10, 24]):
        logits = model(ids, pos)
    assert logits.dtype == torch.bfloat16
    assert spy.seen and all(d == (torch.bfloat16,) * 3 for d in spy.seen), spy.seen


def test_autocast_over_a_float32_model_reaches_attention_in_mixed_dtypes_the_engine_unifies() -> None:
    """``bf16-mixed`` without FSDP: the float32 residual stream makes float32 cos/sin, so q and k arrive float32
    beside the bf16 v of an autocast projection; the engine casts all three (as SDPA does) and returns bf16, and the
    backward reaches the float32 parameters through the casts."""
    model = _tiny()
    spy = _Spy()
    for layer in model.layers:
        layer.attn.hydra_cp = spy
    ids = torch.randint(0, 64, (24,))
    with torch.autocast("cpu", dtype=torch.bfloat16), spy.use(CPContext.local_group(), [0, 10, 24]):
        loss = model(ids, torch.arange(24), labels=ids)
    loss.backward()
    assert spy.seen == [(torch.float32, torch.float32, torch.bfloat16)] * 2
    assert spy.out == [torch.bfloat16] * 2
    q_proj = model.layers[0].attn.q_proj.weight
    assert q_proj.dtype == q_proj.grad.dtype == torch.float32 and bool(q_proj.grad.abs().sum() > 0)


def test_no_floating_buffer_for_a_precision_plugin_to_round() -> None:
    model = _tiny()
    assert not [name for name, b in model.named_buffers() if b.is_floating_point()]
    model = model.to(torch.bfloat16)  # what Lightning's bf16-true plugin does to the module
    cos, _ = model.rope(torch.tensor([262_143]), torch.float32)
    assert cos.dtype == model.rope.inv_freq(torch.device("cpu")).dtype == torch.float32


def test_rope_phase_stays_accurate_at_256k_positions() -> None:
    rope = RotaryEmbedding(128, 500_000.0)
    pos = torch.tensor([1, 65_537, 262_143])
    cos, sin = rope(pos, torch.float32)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (3, 1, 128)
    # exact angles in float64 for comparison; float32 angles lose ~1e-2 rad at 2.6e5 rad, a bf16 inv_freq ~10^3 rad
    for i, p in enumerate(pos.tolist()):
        for j in (0, 1, 17, 63):
            angle = p * 500_000.0 ** (-2 * j / 128)
            assert abs(float(cos[i, 0, j]) - math.cos(angle)) < 0.05
            assert abs(float(sin[i, 0, j]) - math.sin(angle)) < 0.05
    bf16_cos, _ = rope(pos, torch.bfloat16)
    assert bf16_cos.dtype == torch.bfloat16
