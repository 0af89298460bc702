"""``bf16-mixed``: the CP engine takes q, k, v in autocast's dtype (as torch's SDPA does), so runs without FSDP (whose
bf16 parameters hid the float32 q and k that RoPE's float32 tables make of a float32 residual stream) train end to
end, and FSDP2's sums of sequence-parallel norm gradients over the TP group are float32.

The multi-rank runs compare with one ``bf16-mixed`` process within bf16's precision, not to 1e-6: a pool runs other
GEMM shapes than one process (a CP shard, a TP shard of the heads), and each bf16 output rounds on its own."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.cp import CPContext, hydra_attn_func
from lightning_hydra.cp.cuda_kernels import TorchFlashKernel
from lightning_hydra.testing import quiet_trainer, run_world
from tests.test_strategy import make_dataset
from tests.varlen_fakes import FakeAtenOps

BF16_EPS = 2.0**-8
"""bf16's machine epsilon (8 significant bits): the relative spacing of bf16 numbers."""

LOSS_RTOL = 1e-4
"""Losses of a pool against one process. Measured at most 6.1e-6 relative over 3 steps (every layout below): at
initialisation the logits are tiny (``init_std=0.02``), every token loss is close to ``ln(vocab)`` whatever the
rounding, and the bf16 one-process run itself is 3.3e-6 from a float32 one. 1e-4 leaves a 16x margin and still
catches a wrong normalisation or a lost microbatch (percent-level changes of a step's loss)."""

UPDATE_RTOL = 8 * BF16_EPS
"""Parameters of a pool against one process, as ``|p_pool - p_one| <= UPDATE_RTOL |p_one - p_initial|`` per tensor
after 3 SGD steps (lr 1): the difference relative to what training changed. Measured worst: 5.8e-3 (pool 2), 9.0e-3
(TP 2), 8.7e-3 (TP 2 x pool 2), 1.15e-2 (the same under zero3), 6.9e-3 (a Hugging Face Llama, pool 2), i.e. 1.5-2.9
bf16 epsilons, the size of the one-process bf16 run's distance from a float32 one (8.7e-3; 1.0e-2 for the Llama):
rounding, not a different computation. 8 epsilons (3.1e-2) leave a 2.7x margin or more; a gradient not summed over
the pool, or summed twice, moves parameters by a sizeable fraction of their update."""

HF_CONFIG = {
    "model_type": "llama", "vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
}  # fmt: skip


# ---------------------------------------------------------------------------------------------- the engine's entry
def _shards(length: int = 24, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    """What a layer of a float32 residual stream under autocast hands attention: float32 q and k (rotated by float32
    cos/sin), bf16 v (straight out of its autocast projection)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(length, heads, dim, generator=g).requires_grad_()
    k = torch.randn(length, kv_heads, dim, generator=g).requires_grad_()
    v = torch.randn(length, kv_heads, dim, generator=g).to(torch.bfloat16).requires_grad_()
    return q, k, v


def test_autocast_casts_q_k_v_like_sdpa_and_gradients_reach_float32_inputs() -> None:
    q, k, v = _shards()
    cu = [0, 10, 24]
    group = CPContext.local_group()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hydra_attn_func(q, k, v, cu, group=group, kernel="cpu")
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q[:10].transpose(0, 1), k[:10].transpose(0, 1), v[:10].transpose(0, 1), is_causal=True, enable_gqa=True
        )
    assert out.dtype == sdpa.dtype == torch.bfloat16  # torch's own rule for attention under autocast
    torch.testing.assert_close(out[:10], sdpa.transpose(0, 1), rtol=2 * BF16_EPS, atol=2 * BF16_EPS)
    out.float().square().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)

    # the same as casting by hand outside autocast: forward and gradients bit for bit
    q2, k2, v2 = (x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    out2 = hydra_attn_func(q2, k2, v2, cu, group=group, kernel="cpu")
    assert torch.equal(out, out2)
    out2.float().square().sum().backward()
    for x, x2 in ((q, q2), (k, k2), (v, v2)):
        assert torch.equal(x.grad, x2.grad.to(x.grad.dtype))


def test_mixed_dtypes_outside_autocast_are_a_clear_type_error() -> None:
    q, k, v = _shards()
    context = CPContext("cpu")
    mixed = r"q, k, v must have one dtype; got torch\.float32, torch\.float32, torch\.bfloat16"
    with pytest.raises(TypeError, match=mixed):
        hydra_attn_func(q, k, v, [0, 10, 24], group=CPContext.local_group(), kernel="cpu")
    with context.use(CPContext.local_group(), [0, 10, 24]), pytest.raises(TypeError, match=r"under torch\.autocast"):
        context.attention(q, k, v)
    # autocast leaves float64 alone (as it does for SDPA): the kernel refuses it, with its own message
    q, k, v = (x.detach().double() for x in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="cpu attention kernel takes"):
        hydra_attn_func(q, k, v, [0, 10, 24], group=CPContext.local_group(), kernel="cpu")


def test_cuda_kernel_path_gets_the_autocast_dtype_without_a_gpu() -> None:
    """The ``torch`` CUDA kernel takes float16 and bf16 only (float32 q raised its ``TypeError`` under
    ``bf16-mixed``): on stand-in aten ops, CPU tensors and CPU autocast, the kernel receives bf16 q, k, v and the
    float32 inputs get float32 gradients."""
    ops = FakeAtenOps()
    seen = []

    def forward(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return ops.forward(query, key, value, *args, **kwargs)

    kernel = TorchFlashKernel(forward, ops.backward, native_gqa=True)
    with pytest.raises(TypeError, match="float32"):
        kernel.check_dtype(torch.float32)
    q, k, v = _shards()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hydra_attn_func(q, k, v, [0, 10, 24], group=CPContext.local_group(), kernel=kernel)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert [name for name, _ in ops.calls] == ["forward", "backward"]
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)


def _hf_model(**kw):
    from lightning_hydra.models.hf import HFCausalLM

    torch.manual_seed(7)
    return HFCausalLM(config=dict(HF_CONFIG), **kw)


@pytest.mark.parametrize("kind", ["decoder", "hf"])
def test_models_train_one_step_under_cpu_autocast(kind: str) -> None:
    """Both attention paths (the reference decoder's layers and transformers' attention registry) go through the
    engine's entry: forward and backward under CPU autocast, float32 gradients for float32 parameters."""
    if kind == "hf":
        pytest.importorskip("transformers")
        model = _hf_model()
    else:
        torch.manual_seed(0)
        model = DecoderLM(vocab_size=258, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 258, (24,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(10), torch.arange(14)])
    with torch.autocast("cpu", dtype=torch.bfloat16), model.local_cp.use(CPContext.local_group(), [0, 10, 24]):
        loss = model(ids, positions, labels=ids)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in grads)


# ---------------------------------------------------------------------------------------------- real processes
class Record(pl.Callback):
    """Every rank writes its losses, the largest CP degree it ran and its full (gathered) parameters."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []
        self.degree = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.degree = max([self.degree, *(len(mb.ranks) for mb in batch.microbatches if mb.num_tokens)])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.tensor import DTensor

        params = {}
        for name, p in module.named_parameters():
            assert p.dtype == torch.float32, (name, p.dtype)  # bf16-mixed keeps float32 master weights
            params[name] = (p.full_tensor() if isinstance(p, DTensor) else p.detach()).tolist()  # collective
        row = {"losses": self.losses, "degree": self.degree, "params": params}
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(row))


def _decoder() -> DecoderLM:
    torch.manual_seed(1234)
    return DecoderLM(
        vocab_size=258, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, lr=1.0, optimizer="sgd",
        max_grad_norm=None,
    )  # fmt: skip


def _fit(tmp: Path, name: str, model: pl.LightningModule, devices: int, strategy=None) -> list[dict]:
    out = tmp / f"{name}.json"
    trainer = quiet_trainer(devices, strategy, callbacks=[Record(out)], max_steps=3, precision="bf16-mixed")
    trainer.fit(model, HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5))
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)]


def _strategy(model: pl.LightningModule, **kw) -> HydraStrategy:
    return HydraStrategy(
        policy="hydra",
        max_tokens_per_rank=kw.pop("capacity", 160),
        num_microbatches=3,
        ranks_per_node=kw.pop("ranks_per_node", 2),
        sharding=kw.pop("sharding", "none"),
        start_method="forkserver",
        kernel="cpu",
        cost=model.cost_model().replace(min_chunk_tokens=16),
        monitor=False,
        **kw,
    )


def _assert_within_bf16(ranks: list[dict], ref: dict, initial: pl.LightningModule) -> None:
    for rank in ranks[1:]:  # replicas (or TP shards gathered) hold one model: the same sums on every rank
        assert rank["params"] == ranks[0]["params"]
        assert rank["losses"] == ranks[0]["losses"]
    assert ranks[0]["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
    start = {name: p.detach() for name, p in initial.named_parameters()}
    for name, values in ref["params"].items():
        expected = torch.tensor(values)
        update = (expected - start[name]).norm()
        diff = (torch.tensor(ranks[0]["params"][name]) - expected).norm()
        assert update > 0, name
        assert diff <= UPDATE_RTOL * update, f"{name}: {float(diff / update):.2e} of the update apart"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One ``bf16-mixed`` process, 3 SGD steps."""
    return _fit(tmp_path_factory.mktemp("ref"), "ref", _decoder(), 1)[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("devices", "kw"),
    [
        (2, {}),  # a pool of 2: CP groups of degree 2 (a 230-token sequence does not fit one rank's 160)
        (2, {"tensor_parallel": 2, "capacity": 240}),  # TP 2 x pool 1 (with sequence-parallel norms)
        (4, {"tensor_parallel": 2, "ranks_per_node": 4}),  # TP 2 x pool 2
    ],
    ids=["pool2", "tp2", "tp2-pool2"],
)
def test_bf16_mixed_without_fsdp_trains_like_one_process(tmp_path: Path, reference: dict, devices: int, kw: dict):
    """``sharding="none"``: nothing casts the parameters, so q and k reach attention in float32 beside a bf16 v
    (this crashed the kernels: "expected scalar type Float but found BFloat16" on CPU, a ``TypeError`` on CUDA)."""
    ranks = _fit(tmp_path, "pool", _decoder(), devices, _strategy(_decoder(), **kw))
    if "tensor_parallel" not in kw or devices == 4:
        assert max(r["degree"] for r in ranks) == 2  # the ring ran
    _assert_within_bf16(ranks, reference, _decoder())


@pytest.mark.timeout(120)
def test_bf16_mixed_zero3_with_sequence_parallel_trains_like_one_process(tmp_path: Path, reference: dict) -> None:
    """zero3 over TP 2 x pool 2 with sequence-parallel norms: FSDP2's bf16 parameters, and the norms' partial
    gradients summed over TP in float32 inside its post-backward
    (:func:`~lightning_hydra.strategy.sharding.sum_partial_gradients_in_reduce_dtype`), through the whole step."""
    strategy = _strategy(_decoder(), tensor_parallel=2, ranks_per_node=4, sharding="zero3")
    ranks = _fit(tmp_path, "zero3", _decoder(), 4, strategy)
    _assert_within_bf16(ranks, reference, _decoder())


@pytest.mark.timeout(120)
def test_hf_llama_bf16_mixed_without_fsdp_trains_like_one_process(tmp_path: Path) -> None:
    """transformers' Llama hands the engine float32 q and k under autocast as well (its rotary tables take the
    float32 hidden states' dtype)."""
    pytest.importorskip("transformers")

    def model():
        return _hf_model(lr=1.0, max_grad_norm=None, optimizer="sgd")

    ref = _fit(tmp_path, "ref", model(), 1)[0]
    ranks = _fit(tmp_path, "pool", model(), 2, _strategy(model()))
    assert max(r["degree"] for r in ranks) == 2
    _assert_within_bf16(ranks, ref, model())


# ---------------------------------------------------------------------------------------------- FSDP2 x TP sums
HIDDEN = 40
"""Width of the probe's model: the only all-reduced tensors of this size are the norm weights' gradients."""


def _norm_gradient_sums(rank: int, world: int, fix: bool) -> dict:
    """One zero3 ``bf16-mixed`` forward and backward of a TP 2 sequence-parallel decoder (pool of 1): the dtype of
    every all-reduce of a norm-sized tensor (DTensor's ``Partial -> Replicate`` over TP, inside FSDP2's
    post-backward), its inputs (this rank's partial gradients) and every gradient FSDP2 produced. With ``fix``
    False, the float32 sum (:func:`~lightning_hydra.strategy.sharding.sum_partial_gradients_in_reduce_dtype`) is
    left out."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    import lightning_hydra.strategy.sharding as sharding
    from lightning_hydra.strategy.tensor import parallelize, tensor_mesh

    class AllReduces(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.inputs: list[torch.Tensor] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops._c10d_functional.all_reduce.default and args[0].numel() == HIDDEN:
                self.inputs.append(args[0].detach().clone())
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=258, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96)
    mesh = tensor_mesh("cpu", stages=1, pool=world // 2, tensor=2)
    parallelize(model, mesh["tp"], sequence_parallel=True)
    keep = sharding.sum_partial_gradients_in_reduce_dtype
    if not fix:
        sharding.sum_partial_gradients_in_reduce_dtype = lambda module: 0
    try:
        plan = sharding.shard_model(model, "zero3", mesh["pool"], mixed_precision=True)
    finally:
        sharding.sum_partial_gradients_in_reduce_dtype = keep
    ids = torch.randint(0, 258, (64,), generator=torch.Generator().manual_seed(1))
    spy = AllReduces()
    with spy:
        with torch.autocast("cpu", dtype=torch.bfloat16), model.local_cp.use(CPContext.local_group(), [0, 64]):
            loss = model(ids, torch.arange(64), labels=ids)
        loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if isinstance(p.grad, DTensor)}
    assert len(grads) == len(list(model.parameters())) and len(plan.modules) == 3
    return {"partials": spy.inputs, "grads": grads}


@pytest.mark.timeout(120)
def test_sequence_parallel_norm_gradients_sum_in_float32_under_zero3() -> None:
    """FSDP2 completes a partial gradient over TP before casting it to its float32 reduce dtype: under zero3 (and a
    zero2 rank's only backward of a step) the SP norms' sums were bf16 (measured: every such all-reduce bf16, each
    norm gradient equal to the bf16 rounding of its partials' sum). With the sum moved into FSDP's float32
    accumulator, each norm gradient is the exact float32 sum of the same two bf16 partials, and no other gradient
    changes by a bit."""
    rank0, rank1 = run_world(2, _sequence_parallel_gradients_both_ways, timeout=110)
    assert rank0 == rank1


def _sequence_parallel_gradients_both_ways(rank: int, world: int) -> dict:
    before = _norm_gradient_sums(rank, world, fix=False)
    after = _norm_gradient_sums(rank, world, fix=True)
    norms = [name for name in after["grads"] if ".attn_norm." in name or ".mlp_norm." in name]
    assert len(norms) == 4  # two SP norms in each of two blocks
    assert len(before["partials"]) == len(after["partials"]) == 4, "one TP sum per SP norm"
    assert {p.dtype for p in before["partials"]} == {torch.bfloat16}  # what FSDP2 does on its own
    assert {p.dtype for p in after["partials"]} == {torch.float32}
    # the partials are the same bf16 values either way (the fix changes nothing before the sum); gather the peer's
    mine = torch.stack([p.float() for p in before["partials"]])
    assert torch.equal(mine, torch.stack(after["partials"]))
    both = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(both, mine)
    sums = both[0] + both[1]  # exact float32 sums (bf16 partials: no rounding in float32)
    for name in norms:
        exact = [i for i in range(len(sums)) if torch.equal(after["grads"][name], sums[i])]
        rounded = [i for i in range(len(sums)) if torch.equal(before["grads"][name], sums[i].bfloat16().float())]
        assert exact and exact == rounded, name  # float32 now, the bf16 rounding of the same sum before
        assert not torch.equal(after["grads"][name], before["grads"][name]), name
    for name, grad in after["grads"].items():
        if name not in norms:
            assert torch.equal(grad, before["grads"][name]), name
    return {name: grad.tolist() for name, grad in after["grads"].items()}
