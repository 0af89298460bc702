"""Device rules of the hot path, checked without a GPU.

- Static: every tensor factory call in the hot-path modules names a device (or is allow-listed with a reason).
  :func:`unplaced_factory_calls` is reusable: add modules to :data:`HOT_PATH_MODULES`.
- Dynamic: the whole engine (Ulysses, ring, merge, forward and backward) runs on the ``meta`` device with a stand-in
  CUDA kernel and stand-in transfers. A tensor created on the CPU and mixed in, or a read of device data back to
  the host (``.item()``, ``.tolist()``: a host synchronisation on CUDA), raises there.
- Overlap: the backward ring posts the next KV transfer and the previous step's dK/dV transfer before computing a
  block and waits for them after; dK/dV travel in float32.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_hydra.cp.ring as ring_module
from lightning_hydra.cp import CPGroup
from lightning_hydra.cp.attention import attend, check_inputs, plan_for
from lightning_hydra.cp.cpu_kernel import CpuKernel
from lightning_hydra.cp.cuda_kernels import TorchFlashKernel
from lightning_hydra.cp.groups import BufferPool, CommClock
from lightning_hydra.cp.layout import zigzag_shard
from lightning_hydra.cp.plan import AttentionPlan, MicrobatchLayout
from tests.varlen_fakes import FakeAtenOps

ROOT = Path(__file__).resolve().parents[1]

HOT_PATH_MODULES = [
    "lightning_hydra/cp/attention.py",
    "lightning_hydra/cp/blocks.py",
    "lightning_hydra/cp/context.py",
    "lightning_hydra/cp/cpu_kernel.py",
    "lightning_hydra/cp/cuda_kernels.py",
    "lightning_hydra/cp/groups.py",
    "lightning_hydra/cp/kernels.py",
    "lightning_hydra/cp/layout.py",
    "lightning_hydra/cp/plan.py",
    "lightning_hydra/cp/ring.py",
    "lightning_hydra/cp/ulysses.py",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_hydra" / "strategy").glob("*.py")),
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_hydra" / "metrics").glob("*.py")),
    "lightning_hydra/models/checkpointing.py",
    "lightning_hydra/models/decoder.py",
    "lightning_hydra/models/hf.py",
    "lightning_hydra/models/losses.py",
    "lightning_hydra/models/module.py",
    "lightning_hydra/models/stages.py",
]
"""Modules whose tensors must take their device from an input or the strategy's root device (paths relative to the
repository root): the engine, the strategy and its runtime (collectives get tensors on the backend's device), the
metrics' gathers, the models. The data modules build host tensors by contract (the loader packs on the CPU; the
batch moves to the device in the strategy's transfer hook), so they are not listed."""

FACTORIES = {
    "arange", "as_tensor", "empty", "empty_strided", "eye", "from_numpy", "full", "linspace", "logspace", "ones",
    "rand", "randint", "randn", "randperm", "scalar_tensor", "tensor", "zeros",
}  # fmt: skip
"""``torch.*`` functions that create a tensor on the default (CPU) device unless told otherwise. ``*_like`` and
``Tensor.new_*`` inherit their source's device and are fine; ``from_numpy`` is always CPU."""

ALLOWED = {
    ("lightning_hydra/models/decoder.py", "ones"): "RMSNorm's weight at construction: a parameter, moved with the "
    "module by the strategy's model_to_device",
    ("lightning_hydra/cp/layout.py", "from_numpy"): "zigzag indices are host data by contract (the data module packs "
    "on the CPU); shard/unshard move them to the tensor's device",
    ("lightning_hydra/cp/blocks.py", "from_numpy"): "to_device: CPU branch returns host arrays as CPU tensors, "
    "other devices copy them with .to(device)",
    ("lightning_hydra/cp/cpu_kernel.py", "from_numpy"): "the CPU kernel only runs on CPU tensors (select_kernel)",
    ("lightning_hydra/cp/cpu_kernel.py", "zeros"): "the CPU kernel's masks live on the CPU like its inputs",
}
"""``(module, factory) -> reason`` for calls without a device that are right by construction."""


def unplaced_factory_calls(path: Path, allowed: dict[tuple[str, str], str] | None = None) -> list[str]:
    """``torch.<factory>(...)`` calls in ``path`` without a ``device=`` keyword, minus ``allowed`` ones.

    Args:
        path: A Python source file inside the repository.
        allowed: ``(module, factory) -> reason`` exemptions (default :data:`ALLOWED`).

    Returns:
        ``"module:line torch.name"`` for every offending call.
    """
    rel = path.resolve().relative_to(ROOT).as_posix()
    allowed = ALLOWED if allowed is None else allowed
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if (
            isinstance(func.value, ast.Name)
            and func.value.id == "torch"
            and func.attr in FACTORIES
            and not any(kw.arg == "device" for kw in node.keywords)
            and (rel, func.attr) not in allowed
        ):
            found.append(f"{rel}:{node.lineno} torch.{func.attr}")
    return found


def test_hot_path_factories_name_a_device() -> None:
    offenders = [hit for module in HOT_PATH_MODULES for hit in unplaced_factory_calls(ROOT / module)]
    assert not offenders, "tensor factories without device=:\n" + "\n".join(offenders)


def test_the_checker_finds_an_unplaced_index() -> None:
    """The check would have caught the ring's CPU row indices (``torch.arange`` without a device)."""
    bad = ROOT / "tests" / "_device_rule_probe.py"
    bad.write_text("import torch\n\ndef rows(a, n):\n    return torch.arange(a, a + n, dtype=torch.int64)\n")
    try:
        assert unplaced_factory_calls(bad) == ["tests/_device_rule_probe.py:4 torch.arange"]
    finally:
        bad.unlink()


def _patch_transfers(monkeypatch: pytest.MonkeyPatch, log: list | None = None) -> None:
    """Single-process stand-ins: a transfer copies what is sent into the receive buffer."""

    class Work:
        def __init__(self, tag):
            self.tag = tag

        def wait(self):
            if log is not None:
                log.append(("wait", self.tag))

    def exchange(send, recv, nxt, prv, group):
        recv.copy_(send)
        tag = ("kv" if send.dim() == 4 else "dkv", send.dtype)  # KV blocks are [2, t, H, D], dK/dV flat
        if log is not None:
            log.append(("post", tag))
        return [Work(tag)]

    monkeypatch.setattr(ring_module, "_exchange", exchange)
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, x, group=None: out.copy_(x))


@pytest.mark.parametrize(("ulysses", "ring", "member"), [(1, 1, 0), (1, 4, 2), (2, 2, 3), (4, 1, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_engine_runs_on_the_meta_device(
    monkeypatch: pytest.MonkeyPatch, ulysses: int, ring: int, member: int, causal: bool
) -> None:
    _patch_transfers(monkeypatch)
    degree = ulysses * ring
    lengths = [37, 5, 64, 2, 19, 19, 0, 1]
    cu = [0, *itertools.accumulate(lengths)]
    layout = MicrobatchLayout(cu, ulysses, ring, member)
    t = layout.meta.shard_len
    meta = torch.device("meta")
    q = torch.empty((t, 8, 16), dtype=torch.bfloat16, device=meta, requires_grad=True)
    k = torch.empty((t, 2, 16), dtype=torch.bfloat16, device=meta, requires_grad=True)
    v = torch.empty((t, 2, 16), dtype=torch.bfloat16, device=meta, requires_grad=True)
    ops = FakeAtenOps()
    kernel = TorchFlashKernel(ops.forward, ops.backward, native_gqa=True)
    ranks = tuple(range(degree))
    blocks = {ranks[s : s + ulysses]: None for s in range(0, degree, ulysses)}
    group = CPGroup(ranks, ulysses, ring, blocks, BufferPool(), CommClock())
    check_inputs(q, k, v, group, layout)
    plan = plan_for(layout, kernel, q, k, causal, ulysses)
    out = attend(q, k, v, group=group, rank=member, plan=plan, scale=0.25)
    assert out.device == meta and out.shape == q.shape and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad.device == meta and k.grad.shape == k.shape
    assert {name for name, _ in ops.calls} == {"forward", "backward"}


def test_backward_overlaps_both_transfers_with_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list = []
    _patch_transfers(monkeypatch, log)
    kernel = CpuKernel(gather_limit=0)  # every sequence around the ring
    original = kernel.backward

    def logged_backward(*args, **kwargs):
        log.append(("compute",))
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "backward", logged_backward)
    r = 4
    cu = [0, *itertools.accumulate([40, 9, 23])]
    layout = MicrobatchLayout(cu, 1, r, 1)
    x = torch.randn(cu[-1], 4, 8, dtype=torch.bfloat16)
    q, k, v = (zigzag_shard(x, cu, r, 1).requires_grad_() for _ in range(3))
    plan = AttentionPlan.build(layout, kernel, q.device, causal=True, heads=4, kv_heads=4)
    out = ring_module.ring_attention(q, k, v, plan, (0, 1, 2, 3), scale=0.3, pool=BufferPool())
    log.clear()
    out.float().sum().backward()
    computes = [i for i, e in enumerate(log) if e == ("compute",)]
    assert len(computes) == r
    kv_posts = [i for i, e in enumerate(log) if e[0] == "post" and e[1][0] == "kv"]
    dkv_posts = [i for i, e in enumerate(log) if e[0] == "post" and e[1][0] == "dkv"]
    kv_waits = [i for i, e in enumerate(log) if e[0] == "wait" and e[1][0] == "kv"]
    dkv_waits = [i for i, e in enumerate(log) if e[0] == "wait" and e[1][0] == "dkv"]
    assert len(dkv_posts) == r and len(dkv_waits) == r and len(kv_posts) == r - 1
    for s in range(1, r):
        # the previous step's dK/dV transfer is in flight while block s is computed, and waited for after it
        assert dkv_posts[s - 1] < computes[s] < dkv_waits[s - 1]
    for s in range(r - 1):
        assert kv_posts[s] < computes[s] < kv_waits[s]
    assert all(e[1][1] == torch.float32 for e in log if e[0] == "post" and e[1][0] == "dkv")
    assert all(e[1][1] == torch.bfloat16 for e in log if e[0] == "post" and e[1][0] == "kv")
