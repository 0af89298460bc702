"""Attention kernels on CPU: the CPU op's runs on awkward bins, and the CUDA kernels' argument building, log-sum-exp
layouts, GQA handling and flash-attn version dispatch through stand-ins of each signature (tests/varlen_fakes.py).

The CUDA kernels have not run on a GPU here; these tests check everything around the CUDA call."""

from __future__ import annotations

import importlib.util
import itertools
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_hydra.cp import KERNEL_NAMES, CPContext, CPGroup, available_kernels, kernels, select_kernel
from lightning_hydra.cp.blocks import ring_segments
from lightning_hydra.cp.cpu_kernel import CpuKernel
from lightning_hydra.cp.cuda_kernels import AtenSchemaError, FlashAttnKernel, TorchFlashKernel, check_aten_schemas
from lightning_hydra.cp.layout import ZigzagMeta, zigzag_shard
from lightning_hydra.cp.plan import AttentionPlan, MicrobatchLayout, gathered_order
from tests.varlen_fakes import FakeAtenOps, aten_packets, flash_interface

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
AWKWARD = [0, 1, 2, 3, 5, 8, 8, 8, 0, 13, 1, 1, 40, 16, 16, 200]
"""Empty documents, documents shorter than 2d, runs of equal lengths, longer documents (one call per local chunk
when gathered)."""


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_ring(kernel, lengths, ring, causal, heads=8, kv_heads=2, dtype=torch.float32, tol=1e-5) -> None:
    gpu_check = _gpu_check()
    cu = [0, *itertools.accumulate(lengths)]
    g = torch.Generator().manual_seed(ring)
    q, k, v, dout = (torch.randn(cu[-1], h, 16, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads, heads))
    ref_out, ref_grads = gpu_check.reference_attention(q, k, v, dout, cu, causal)
    got = gpu_check.emulate(q, k, v, dout, cu, ring, causal, kernel)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref_out, *ref_grads], strict=True):
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        assert err <= tol, f"{name}: relative error {err}"


@pytest.mark.parametrize("ring", [1, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gather_limit", [0, 32, 2048])
def test_cpu_kernel_on_awkward_bins(ring: int, causal: bool, gather_limit: int) -> None:
    """Every sequence around the ring (0), the short ones gathered (32: a mix), or all gathered (2048)."""
    _check_ring(CpuKernel(gather_limit), AWKWARD, ring, causal)


@pytest.mark.parametrize("gather_limit", [0, 2048])
def test_cpu_kernel_bf16_and_many_short_documents(gather_limit: int) -> None:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 12, size=30)]
    _check_ring(CpuKernel(gather_limit), lengths, 4, True, dtype=torch.bfloat16, tol=2e-2)
    _check_ring(CpuKernel(gather_limit), lengths, 2, False, heads=4, kv_heads=4)


def test_the_gathered_split_is_a_suffix_of_short_sequences() -> None:
    cu = [0, *itertools.accumulate(AWKWARD)]
    layout = MicrobatchLayout(cu, 1, 4, 2)
    plan = AttentionPlan.build(layout, CpuKernel(32), torch.device("cpu"), causal=True, heads=2, kv_heads=1)
    n_ring = layout.ring_sequences(32)
    assert 0 < n_ring < len(AWKWARD) and plan.split == 2 * int(layout.ring_chunks[:n_ring].sum())
    assert (2 * 4 * layout.ring_chunks[n_ring:] <= 32).all() and (2 * 4 * layout.ring_chunks[:n_ring] > 32).all()
    assert plan.gather_index.shape == (4, layout.rows - plan.split)
    assert sorted(plan.gather_index.reshape(-1).tolist()) == list(range(plan.gather_index.numel()))


def test_awkward_bins_have_queries_without_keys() -> None:
    """The non-causal cases above do exercise empty key sets (rows that must end with lse -inf in a step)."""
    meta = ZigzagMeta.from_cu_seqlens([0, *itertools.accumulate(AWKWARD)], 4)
    empty = 0
    for pos, src in itertools.product(range(4), range(4)):
        seg = ring_segments(meta.shard_lengths, meta.shard_chunks, 4, pos, src, causal=False)
        if seg is not None:
            empty += int(((seg.q_len > 0) & (seg.k_len == 0)).sum())
    assert empty > 0


@pytest.mark.parametrize("padded_lse", [False, True])
@pytest.mark.parametrize("native_gqa", [True, False])
def test_torch_kernel_arguments_layouts_and_gqa(padded_lse: bool, native_gqa: bool) -> None:
    ops = FakeAtenOps(padded_lse=padded_lse, gqa=native_gqa)
    kernel = TorchFlashKernel(forward_op=ops.forward, backward_op=ops.backward, native_gqa=native_gqa)
    _check_ring(kernel, AWKWARD, 4, True)
    _check_ring(kernel, AWKWARD, 2, False)
    heads = {info["heads"] for _, info in ops.calls}
    assert heads == ({(8, 2)} if native_gqa else {(8, 8)})
    assert {name for name, _ in ops.calls} == {"forward", "backward"}


@pytest.mark.parametrize("takes_gqa", [True, False])
def test_torch_kernel_probes_native_gqa_whatever_the_version(monkeypatch: pytest.MonkeyPatch, takes_gqa: bool) -> None:
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu126" if takes_gqa else "2.13.0")  # the version decides nothing
    ops = FakeAtenOps(gqa=takes_gqa)
    kernel = TorchFlashKernel(ops.forward, ops.backward)
    assert kernel.native_gqa is None  # probed on first use, on the inputs' device
    _check_ring(kernel, AWKWARD, 2, True)
    assert kernel.native_gqa is takes_gqa
    assert {info["heads"] for _, info in ops.calls[1:]} == ({(8, 2)} if takes_gqa else {(8, 8)})


@pytest.mark.parametrize("version", ["2.5", "2.6", "2.7"])
def test_flash_kernel_binds_the_backward_of_each_version(version: str) -> None:
    calls: list = []
    kernel = FlashAttnKernel(interface=flash_interface(version, calls), version=f"{version}.3")
    _check_ring(kernel, AWKWARD, 2, True)
    backward = [info for name, info in calls if name == "backward"]
    assert backward, calls
    key = {"2.5": "window_size", "2.6": "softcap", "2.7": "window_size_left"}[version]
    assert all(key in info for info in backward)


def test_flash_kernel_rejects_what_it_cannot_call() -> None:
    interface = flash_interface("2.6", [])

    def backward_with_new_argument(dout, q, k, v, out, softmax_lse, dq, dk, dv, sink_tokens):
        raise AssertionError("never called")

    with pytest.raises(RuntimeError, match="unknown parameters"):
        FlashAttnKernel(
            interface=type(interface)(**{**vars(interface), "_flash_attn_varlen_backward": backward_with_new_argument}),
            version="2.6.3",
        )
    with pytest.raises(RuntimeError, match="too old"):
        FlashAttnKernel(interface=interface, version="2.4.2")


def test_aten_schema_check() -> None:
    forward = torch.ops.aten._flash_attention_forward.default._schema
    check_aten_schemas(forward, torch.ops.aten._flash_attention_backward.default._schema)
    older = torch._C.parse_schema(
        "aten::b(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, "
        "Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
        "Tensor philox_seed, Tensor philox_offset, *, float? scale=None) -> (Tensor, Tensor, Tensor)"
    )
    check_aten_schemas(forward, older)
    changed = torch._C.parse_schema("aten::f(Tensor query, Tensor key, Tensor value, *, float? scale=None) -> Tensor")
    with pytest.raises(RuntimeError, match="unsupported signature"):
        check_aten_schemas(changed, older)
    text = str(forward)
    for before, after in (
        ("SymInt max_q", "Tensor max_q"),  # the same names and count, another type
        ("bool is_causal", "int is_causal"),
        ("float? scale=None", "bool? scale=None"),
        ("*, float? scale=None", "*, float? scale=None, Tensor sink"),  # a new required keyword
        ("-> (Tensor output, Tensor softmax_logsumexp", "-> (Tensor output, int softmax_logsumexp"),
    ):
        assert before in text
        with pytest.raises(RuntimeError, match="unsupported signature"):
            check_aten_schemas(torch._C.parse_schema(text.replace(before, after)), older)


def _as_if_cuda(monkeypatch: pytest.MonkeyPatch, ops: FakeAtenOps, replace, flash_installed: bool) -> list:
    """Select kernels on CPU as on a CUDA build: torch's flash ops are ``ops`` (forward schema edited by
    ``replace``), flash-attn 2.6 is a stand-in (installed or not). Returns the flash stand-in's call record."""
    forward, backward = aten_packets(ops, replace)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward)
    monkeypatch.setattr(kernels, "_torch_flash_available", lambda: True)
    monkeypatch.setattr(kernels, "_flash_attn_installed", lambda: flash_installed)
    calls: list = []
    monkeypatch.setattr(
        kernels, "FlashAttnKernel", lambda: FlashAttnKernel(interface=flash_interface("2.6", calls), version="2.6.3")
    )
    return calls


def _fallback_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == kernels.__name__ and r.levelno >= logging.WARNING]


def test_auto_takes_the_torch_kernel_where_the_schemas_match(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ops = FakeAtenOps()
    flash_calls = _as_if_cuda(monkeypatch, ops, None, flash_installed=True)
    kernel = select_kernel(torch.device("cuda"), "auto")
    assert isinstance(kernel, TorchFlashKernel) and not _fallback_records(caplog)
    _check_ring(kernel, AWKWARD, 2, True)
    assert ops.calls and not flash_calls


@pytest.mark.parametrize(
    "replace",
    [("SymInt max_q", "Tensor max_q"), ("float? scale=None", "bool? scale=None"), ("float? scale=None, ", "")],
)
def test_auto_falls_back_to_flash_on_a_schema_mismatch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, replace: tuple[str, str]
) -> None:
    """Same names and counts but another type, another keyword type, no ``scale``: ``auto`` says so in one line
    and runs flash-attn; ``kernel='torch'`` keeps the one-line error."""
    ops = FakeAtenOps()
    flash_calls = _as_if_cuda(monkeypatch, ops, replace, flash_installed=True)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        kernel = select_kernel(torch.device("cuda"), "auto")
    assert isinstance(kernel, FlashAttnKernel)
    (record,) = _fallback_records(caplog)
    message = record.getMessage()
    assert "\n" not in message and "_flash_attention_forward" in message and "falls back to the 'flash'" in message
    assert "expects (tensor, tensor, tensor, tensor, tensor, int, int, float, bool, bool; *, scale: float)" in message
    _check_ring(kernel, AWKWARD, 2, True)
    assert flash_calls and not ops.calls
    with pytest.raises(AtenSchemaError, match="unsupported signature") as error:
        select_kernel(torch.device("cuda"), "torch")
    assert "\n" not in str(error.value)
    assert isinstance(select_kernel(torch.device("cuda"), "flash"), FlashAttnKernel)


def test_auto_fallback_is_logged_on_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _as_if_cuda(monkeypatch, FakeAtenOps(), ("SymInt max_q", "Tensor max_q"), flash_installed=True)
    monkeypatch.setattr(kernels.dist, "is_initialized", lambda: True)
    for rank, logged in ((1, 0), (0, 1)):
        monkeypatch.setattr(kernels.dist, "get_rank", lambda rank=rank: rank)
        caplog.clear()
        assert isinstance(select_kernel(torch.device("cuda"), "auto"), FlashAttnKernel)
        assert len(_fallback_records(caplog)) == logged


def test_auto_without_a_fallback_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """No flash-attn: CUDA has no other kernel (the CPU kernel takes CPU tensors only), so ``auto`` raises."""
    _as_if_cuda(monkeypatch, FakeAtenOps(), ("SymInt max_q", "Tensor max_q"), flash_installed=False)
    with pytest.raises(ValueError, match=r"_flash_attention_forward.*no other CUDA attention kernel") as error:
        select_kernel(torch.device("cuda"), "auto")
    assert "\n" not in str(error.value)
    with pytest.raises(AtenSchemaError, match="unsupported signature"):
        select_kernel(torch.device("cuda"), "torch")


def test_float64_is_refused_before_any_work() -> None:
    """The log-sum-exp, the ring's merges and dK/dV sums are float32; float64 activations crashed in the CPU op's
    backward at every degree and in the forward merge at ring degree 2 and up (found by fuzzing the engine). They
    are refused up front; float32 runs."""
    from lightning_hydra.cp import hydra_attn_func

    q = torch.randn(10, 2, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32 or lower"):
        hydra_attn_func(q, q, q, [0, 4, 10], group=CPGroup((0,), 1, 1))
    q32 = q.float().requires_grad_()
    hydra_attn_func(q32, q32, q32, [0, 4, 10], group=CPGroup((0,), 1, 1)).sum().backward()
    assert q32.grad is not None and torch.isfinite(q32.grad).all()


def test_kernel_names_and_selection() -> None:
    assert KERNEL_NAMES == ("auto", "cpu", "torch", "flash")
    cpu = torch.device("cpu")
    assert select_kernel(cpu, "auto").name == "cpu" and "cpu" in available_kernels()
    for name in ("torch", "flash"):
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            select_kernel(cpu, name)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        select_kernel(cpu, "sdpa")
    with pytest.raises(ValueError, match="unknown attention kernel"):
        CPContext("sdpa")
    ops = FakeAtenOps()
    with pytest.raises(TypeError):
        TorchFlashKernel(ops.forward, ops.backward).check_dtype(torch.float32)
    TorchFlashKernel(ops.forward, ops.backward).check_dtype(torch.bfloat16)
    CpuKernel().check_dtype(torch.bfloat16)


def _python_source_index(meta: ZigzagMeta, index: int):
    """The pre-vectorisation loop (in shard order)."""
    positions, sources = [], []
    starts = np.cumsum(meta.length_array) - meta.length_array
    for seq in meta.order:
        n, c = int(meta.length_array[seq]), int(meta.chunk_array[seq])
        for chunk in (index, 2 * meta.degree - 1 - index):
            pos = list(range(chunk * c, (chunk + 1) * c))
            positions += pos
            sources += [p + int(starts[seq]) if p < n else -1 for p in pos]
    return positions, sources


def _python_gathered_order(meta: ZigzagMeta, u: int) -> list[int]:
    t, out, off = meta.shard_len, [], 0
    for c in meta.shard_chunks.tolist():
        for i in range(u):
            out += range(i * t + off, i * t + off + c)
        for i in reversed(range(u)):
            out += range(i * t + off + c, i * t + off + 2 * c)
        off += 2 * c
    return out


@pytest.mark.parametrize("degree", [1, 2, 4, 6])
def test_vectorised_indices_equal_the_loops(degree: int) -> None:
    cu = [0, *itertools.accumulate(AWKWARD)]
    meta = ZigzagMeta.from_cu_seqlens(cu, degree)
    assert list(meta.shard_chunks) == sorted(meta.shard_chunks, reverse=True)
    for j in range(degree):
        positions, source = meta.source_index(j)
        assert (positions.tolist(), source.tolist()) == _python_source_index(meta, j)
    for u in (1, 2, degree):
        if degree % u == 0:
            assert gathered_order(meta, u).tolist() == _python_gathered_order(meta, u)


def test_plan_is_built_once_per_microbatch(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = []
    original = AttentionPlan.build.__func__

    def counting(cls, *args, **kwargs):
        builds.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AttentionPlan, "build", classmethod(counting))
    cu = [0, *itertools.accumulate([7, 30, 1, 12])]
    x = torch.randn(cu[-1], 4, 8)
    context = CPContext("cpu")
    for _ in range(2):  # two microbatches, three layers each, forward and backward
        leaf = zigzag_shard(x, cu, 1, 0).requires_grad_()
        with context.use(CPGroup((0,), 1, 1), cu) as mb:
            h = leaf
            for _ in range(3):
                h = context.attention(h, h, h)
            assert len(mb.plans) == 1
        h.sum().backward()
    assert len(builds) == 2


def test_layout_of_every_member_is_consistent() -> None:
    """Every member's ring layout sees the same sequences in the same order (the order depends on lengths only)."""
    cu = [0, *itertools.accumulate(AWKWARD)]
    layouts = [MicrobatchLayout(cu, 2, 2, j) for j in range(4)]
    assert all(np.array_equal(lay.meta.order, layouts[0].meta.order) for lay in layouts)
    assert [lay.pos for lay in layouts] == [0, 0, 1, 1]


def test_ulysses_reorders_have_exact_gradients() -> None:
    from lightning_hydra.cp.ulysses import _GatherSplit, _PermuteRows

    x = torch.randn(12, 7, 3, dtype=torch.float64, requires_grad=True)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(12)
    torch.autograd.gradcheck(lambda y: _GatherSplit.apply(y, order, inverse, (4, 2, 1)), (x,))
    torch.autograd.gradcheck(lambda y: _PermuteRows.apply(y, order, inverse), (x,))


@pytest.mark.parametrize("cu", [[0], [0, 0], [0, 0, 0]])
def test_empty_bin_keeps_every_input_in_the_graph(cu: list[int]) -> None:
    """A zero-token pass (idle ranks under ZeRO-3) must reach the same modules in the backward as a real one."""
    from lightning_hydra.cp import hydra_attn_func

    q, k, v = (torch.zeros(0, h, 8, requires_grad=True) for h in (4, 2, 2))
    out = hydra_attn_func(q, k, v, cu, group=CPGroup((0,), 1, 1))
    assert out.shape == (0, 4, 8)
    out.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v))
