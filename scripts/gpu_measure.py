"""Measurements for a GPU window, shared by ``scripts/gpu_check.py`` and ``scripts/multi_gpu_check.py``: each check
prints one JSON line with its figure and the bound it is held to (``ok``), or ``"ok": true`` with ``skipped`` saying
why it cannot run here. Each is meant to take seconds on an H100.

**Not run on a GPU yet** (none was available to this project): on CPU the test suite runs every check below that a
CPU can run (``tests/test_gpu_check_script.py``; ``flash_vs_aten`` through stand-ins of the CUDA ops); the CUDA
branches (the ``torch``/``flash`` baselines, ``torch.cuda``'s peak memory, NCCL kernels in the profile, the CUDA
bounds' values) wait for a device, and a first GPU run may show a bound to revise: its row says by how much.

Checks and bounds:

1. ``flash_vs_aten`` (gpu_check): the engine at degree 1 with the ``flash`` kernel (flash-attn) and with the
   ``torch`` kernel (aten's packed flash attention) on the same bins: outputs and q/k/v gradients of each against a
   per-document float32 reference (``BF16_BOUND``, bf16's precision), of the two against each other (the same
   bound), and the time of a forward and backward (median of ``reps``). Time bound (CUDA only):
   ``1 / TIME_SPREAD <= flash / torch <= TIME_SPREAD`` (1.5): both are FlashAttention-2 kernels with native GQA on
   the same packed layout; a wider gap means one of them does work the other avoids (replicated KV heads, a padded
   log-sum-exp layout, an old build) and ``kernel="auto"`` may pick the slower. Skipped without CUDA, flash-attn or
   torch's flash ops.
2. ``engine_vs_varlen`` (gpu_check): the engine at degree 1 (a prebuilt plan, as every layer of a microbatch shares
   it; the plan's build time is reported apart, ``plan_seconds``) against one variable-length call of the same
   library on the whole bin (``torch``: ``torch.nn.attention.varlen.varlen_attn``; ``flash``:
   ``flash_attn_varlen_func``), forward and backward: the time ratio ``engine / direct`` and the largest relative
   error between them (``BF16_BOUND``). Bound (CUDA only): ratio ``<= ENGINE_OVERHEAD`` (1.5). At degree 1 the
   engine calls the same op once per direction and adds row writes and log-sum-exp layout copies (a few memory
   passes over q-sized tensors) and a few dozen small kernel launches; past 1.5 that plumbing costs more than half
   the attention itself, which the cost model does not charge. On CPU the baseline is per-document
   ``scaled_dot_product_attention`` (there is no CPU varlen op) and no time bound applies (shared cores, another
   algorithm): the row checks the outputs and reports the ratio.
3. ``peak_memory`` (gpu_check, the one-rank world): ``DecoderLM`` trained with ``max_tokens_per_rank="auto"`` under
   a ``memory_budget`` chosen so that the memory model's capacity is the check's token count (``MEMORY_SHAPES``;
   CUDA: 2048 wide, 8 blocks, 16 heads over 4 KV heads, a 32,000-token vocabulary, 486M parameters, ``bf16-true``,
   AdamW, 16,384 tokens: a 22.8 GB budget, 17.5 GB predicted; CPU: small ones in float32). The third step's peak
   against :meth:`~lightning_hydra.HydraStrategy.memory_breakdown`'s prediction for the tokens the step ran
   (its largest microbatch on the rank): model state plus activation bytes per token times tokens (communicators
   are not allocator memory). Bounds: ``measured <= predicted + margin`` (the model's own margin, 10% of the budget,
   kept for what it does not count: the loss chunk's logits, kernels' workspaces, the optimizer step's temporaries;
   a step past it can run out of memory at the capacity ``"auto"`` picks) and ``measured >= PEAK_LOW * predicted``
   (0.7): further below, the model overcharges by more than 30% and ``"auto"`` leaves that much memory unused.
   CUDA: ``torch.cuda.max_memory_allocated`` over the step, less what was allocated before the run (earlier
   checks' tensors); CPU (no allocator counters): the bytes of the parameters, gradients and optimizer state alive
   at the step's start plus the largest rise of the allocations and frees ``torch.profiler`` records during the
   step (allocator independent).
4. ``comm_profile``: the :class:`~lightning_hydra.cp.groups.CommClock` (host clock on CPU, CUDA events on GPU)
   against ``torch.profiler`` over the same window. The profiler's communication time is the union of the spans of
   the communication events: on CPU gloo's work spans (``gloo:*``, from issue to completion) and c10d's host ops
   (``c10d::*``), on CUDA the NCCL kernels. The clock times this rank's waits (exposed time), inside those spans, so
   it cannot exceed the communication in flight: ``clock <= COMM_UPPER * profiler + intervals * COMM_SLACK`` (1.1,
   and per timed interval 2 ms on CPU for a thread's wake-up on a loaded host, 0.2 ms on CUDA for c10d's launch
   before the kernel starts). A blocking collective (an all-to-all) is timed whole, its spans inside the clock's
   interval, so there ``clock >= COMM_LOWER * profiler`` too (0.8; a ring's waits overlap its compute, and its
   clock may read far less than its transfers took: only the upper bound applies). gpu_check (the one-rank world):
   the fourth training step of the ``peak_memory`` run (a one-rank world sends nothing for CP: the clock must read
   nothing) and a probe of 5 all-to-alls on the world, each timed by a clock (both bounds). multi_gpu_check: one CP
   forward and backward over every rank as Ulysses (all-to-alls: both bounds) and as a ring (the upper bound;
   ``exposed`` is the share of the ring's transfer time the clock saw as waits), on every rank.
   On a CPU host with more ranks than cores the bounds are reported (``bounds_held``), not enforced: the scheduler
   parks ranks inside the clock's intervals.
"""

from __future__ import annotations

import gc
import inspect
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from gpu_check import (  # beside this script
    BF16_BOUND,
    WORLD_MEASURES,
    ReferenceAttention,
    reference_attention,
    relative_error,
)

from lightning_hydra.cp.attention import attend, plan_for
from lightning_hydra.cp.groups import CommClock, CPGroup, GroupCache
from lightning_hydra.cp.kernels import AttentionKernel, select_kernel
from lightning_hydra.cp.layout import ZigzagMeta, zigzag_shard, zigzag_source_index
from lightning_hydra.cp.plan import MicrobatchLayout

TIME_SPREAD = 1.5
"""``flash_vs_aten``: the two kernels' forward and backward times within this factor of each other (CUDA)."""
ENGINE_OVERHEAD = 1.5
"""``engine_vs_varlen``: the engine at degree 1 at most this many times one varlen call on the bin (CUDA)."""
PEAK_LOW = 0.7
"""``peak_memory``: the measured peak at least this share of the prediction."""
COMM_UPPER = 1.1
"""``comm_profile``: the clock at most this many times the profiler's communication time (plus the slack)."""
COMM_LOWER = 0.8
"""``comm_profile``: a blocking collective's clock at least this share of the profiler's time."""
COMM_SLACK = {"cpu": 2e-3, "cuda": 2e-4}
"""``comm_profile``: seconds allowed per timed interval, by device."""

BINS = {
    "mixed": [1500, 37, 4096, 2, 611, 64, 64, 64, 9, 1000],
    "long": [8192, 4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1],
}
"""The kernel measurements' bins on CUDA (``mixed``: gpu_check's ring bin)."""
QUICK_BINS = {"mixed": [40, 7, 1, 16, 130]}
"""The bins of ``--quick`` (the CPU test)."""
CPU_BINS = {"mixed": [300, 7, 96, 64, 3, 180, 41, 120, 12, 77]}
"""The bins on CPU without ``--quick``."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` runs after ``warmup`` (the device synchronised around each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- kernels
def _inputs(lengths: Sequence[int], heads: int, kv_heads: int, dim: int, device: torch.device, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return [torch.randn(total, h, dim, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)]


class EngineRun:
    """The engine at degree 1 on one bin with ``kernel``: a plan built once (:attr:`plan_seconds`), then
    :meth:`__call__` runs a forward and backward through :func:`~lightning_hydra.cp.attention.attend` (what a layer
    runs inside :class:`~lightning_hydra.cp.CPContext`)."""

    def __init__(self, kernel: AttentionKernel, x: Sequence[torch.Tensor], cu: list[int], causal: bool) -> None:
        q = x[0]
        self.cu, self.meta = cu, ZigzagMeta.from_cu_seqlens(cu, 1)
        self.shard = [zigzag_shard(t, cu, 1, 0).contiguous() for t in x]
        self.leaves = [t.clone().requires_grad_() for t in self.shard[:3]]
        self.scale = q.shape[-1] ** -0.5
        self.group = CPGroup((0,), 1, 1)
        _sync(q.device)
        start = time.perf_counter()
        self.plan = plan_for(MicrobatchLayout(cu, 1, 1, 0), kernel, self.shard[0], self.shard[1], causal, 1)
        _sync(q.device)
        self.plan_seconds = time.perf_counter() - start
        self.out: torch.Tensor | None = None

    def __call__(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None
        out = attend(*self.leaves, group=self.group, rank=0, plan=self.plan, scale=self.scale)
        out.backward(self.shard[3])
        self.out = out.detach()

    def results(self) -> list[torch.Tensor]:
        """Output and q/k/v gradients of the last call, in bin order (padding dropped)."""
        source = zigzag_source_index(self.meta, 0)[1].to(self.shard[0].device)
        keep = source >= 0
        got = [self.out, *(leaf.grad for leaf in self.leaves)]
        outs = []
        for x in got:
            assert x is not None
            full = torch.zeros((self.meta.total, *x.shape[1:]), dtype=x.dtype, device=x.device)
            full[source[keep]] = x[keep]
            outs.append(full)
        return outs


def _errors(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> dict[str, float]:
    return {n: relative_error(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)}


def _skip(check: str, reason: str) -> dict:
    return {"check": check, "ok": True, "skipped": reason}


def kernel_pair(device: torch.device) -> tuple[dict[str, AttentionKernel] | None, str | None]:
    """The ``torch`` and ``flash`` kernels on ``device``, or ``None`` and why not."""
    if device.type != "cuda":
        return None, "needs CUDA: flash-attn and aten's flash ops are CUDA kernels"
    kernels = {}
    for name in ("torch", "flash"):
        try:
            kernels[name] = select_kernel(device, name)
        except (ValueError, RuntimeError) as error:  # not installed, no flash build, other aten schemas
            return None, f"{name} kernel unavailable: {error}"
    return kernels, None


def flash_vs_aten(
    device: torch.device,
    *,
    bins: dict[str, list[int]],
    shape: tuple[int, int, int],
    reps: int,
    warmup: int = 1,
    kernels: dict[str, AttentionKernel] | None = None,
) -> dict:
    """``flash_vs_aten`` (see the module docstring); ``kernels`` (``{"torch": ..., "flash": ...}``) replaces the
    device's (the tests pass stand-ins on CPU)."""
    if kernels is None:
        kernels, reason = kernel_pair(device)
        if kernels is None:
            return _skip("flash_vs_aten", str(reason))
    timed = device.type == "cuda"
    heads, kv_heads, dim = shape
    rows, ok = {}, True
    for index, (name, lengths) in enumerate(bins.items()):
        x = _inputs(lengths, heads, kv_heads, dim, device, torch.bfloat16, seed=index)
        cu = [0, *itertools.accumulate(lengths)]
        ref_out, ref_grads = reference_attention(*x, cu, True)
        got, seconds, errors = {}, {}, {}
        for kname, kernel in kernels.items():
            run = EngineRun(kernel, x, cu, True)
            seconds[kname] = median_seconds(run, device, reps, warmup)
            got[kname] = run.results()
            errors[kname] = max(_errors(got[kname], [ref_out, *ref_grads]).values())
        errors["between"] = max(_errors(got["flash"], got["torch"]).values())
        ratio = seconds["flash"] / max(seconds["torch"], 1e-12)
        within = max(errors.values()) <= BF16_BOUND
        if timed:
            within = within and 1 / TIME_SPREAD <= ratio <= TIME_SPREAD
        ok = ok and within
        rows[name] = {"tokens": cu[-1], "errors": errors, "seconds": seconds, "time_ratio": round(ratio, 3)}
    return {
        "check": "flash_vs_aten",
        "shape": {"heads": heads, "kv_heads": kv_heads, "dim": dim},
        "bins": rows,
        "worst_error": max(max(r["errors"].values()) for r in rows.values()),
        "bounds": {"error": BF16_BOUND, "time_ratio": [round(1 / TIME_SPREAD, 3), TIME_SPREAD] if timed else None},
        "ok": ok,
    }


def direct_attention(
    kernel: str, cu: list[int], device: torch.device
) -> tuple[str, Callable[..., torch.Tensor] | None, str | None]:
    """One attention call on the whole packed bin ``cu`` by the library of ``kernel``: ``(name, fn, reason)`` where
    ``fn(q, k, v, causal, scale)`` returns the output (differentiable; the boundaries are on the device already, as
    the engine's plan is), or ``fn`` is ``None`` and ``reason`` says why. **Not run on a GPU yet** for ``torch``
    and ``flash``."""
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    if kernel == "flash":
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as error:
            return "flash_attn_varlen_func", None, f"flash-attn is not importable: {error}"

        def flash(q, k, v, causal, scale):
            return flash_attn_varlen_func(q, k, v, cu_t, cu_t, longest, longest, softmax_scale=scale, causal=causal)

        return "flash_attn_varlen_func", flash, None
    if kernel == "torch":
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return "varlen_attn", None, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
        params = inspect.signature(varlen_attn).parameters

        def aten(q, k, v, causal, scale):
            kw: dict[str, Any] = {"scale": scale} if "scale" in params else {}
            if "is_causal" in params:
                kw["is_causal"] = causal
            else:  # torch 2.13: a window; (-1, 0) is causal
                kw["window_size"] = (-1, 0) if causal else (-1, -1)
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            elif k.shape[1] != q.shape[1]:
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            return varlen_attn(q, k, v, cu_t, cu_t, longest, longest, **kw)

        return "varlen_attn", aten, None

    def per_document(q, k, v, causal, scale):  # CPU: no varlen op: gpu_check's per-document SDPA
        return ReferenceAttention(cu).attention(q, k, v, causal=causal, scale=scale)

    return "sdpa_per_document", per_document, None


def engine_vs_varlen(
    device: torch.device,
    kernel: AttentionKernel,
    dtype: torch.dtype,
    *,
    bins: dict[str, list[int]],
    shape: tuple[int, int, int],
    reps: int,
) -> dict:
    """``engine_vs_varlen`` (see the module docstring)."""
    timed = device.type == "cuda"
    bound = BF16_BOUND if dtype in (torch.bfloat16, torch.float16) else 1e-4
    heads, kv_heads, dim = shape
    rows, ok = {}, True
    for index, (name, lengths) in enumerate(bins.items()):
        x = _inputs(lengths, heads, kv_heads, dim, device, dtype, seed=10 + index)
        cu = [0, *itertools.accumulate(lengths)]
        baseline, direct, reason = direct_attention(kernel.name, cu, device)
        if direct is None:
            return _skip("engine_vs_varlen", str(reason))
        run = EngineRun(kernel, x, cu, True)
        engine_seconds = median_seconds(run, device, reps)
        leaves = [t.clone().requires_grad_() for t in x[:3]]
        box: dict[str, torch.Tensor] = {}

        def call(leaves=leaves, box=box, x=x, direct=direct, scale=run.scale) -> None:
            for leaf in leaves:
                leaf.grad = None
            out = direct(*leaves, True, scale)
            out.backward(x[3])
            box["out"] = out.detach()

        direct_seconds = median_seconds(call, device, reps)
        error = max(_errors(run.results(), [box["out"], *(leaf.grad for leaf in leaves)]).values())
        ratio = engine_seconds / max(direct_seconds, 1e-12)
        within = error <= bound and (ratio <= ENGINE_OVERHEAD if timed else True)
        ok = ok and within
        rows[name] = {
            "tokens": cu[-1],
            "engine_seconds": round(engine_seconds, 6),
            "direct_seconds": round(direct_seconds, 6),
            "plan_seconds": round(run.plan_seconds, 6),
            "ratio": round(ratio, 3),
            "error": error,
        }
    return {
        "check": "engine_vs_varlen",
        "kernel": kernel.name,
        "baseline": baseline,
        "dtype": str(dtype),
        "shape": {"heads": heads, "kv_heads": kv_heads, "dim": dim},
        "bins": rows,
        "ratio": max(r["ratio"] for r in rows.values()),
        "bounds": {"error": bound, "ratio": ENGINE_OVERHEAD if timed else None},
        "ok": ok,
    }


def engine_checks(device: torch.device, kernel: str, dtype: torch.dtype, quick: bool) -> list[dict]:
    """gpu_check's kernel measurements: ``flash_vs_aten`` and ``engine_vs_varlen`` (one row each)."""
    cuda = device.type == "cuda"
    bins = QUICK_BINS if quick else (BINS if cuda else CPU_BINS)
    shape = (16, 4, 128) if cuda and not quick else (8, 2, 64)
    reps = 10 if cuda else (1 if quick else 3)
    rows = []
    for name, run in (
        ("flash_vs_aten", lambda: flash_vs_aten(device, bins=bins, shape=shape, reps=reps)),
        (
            "engine_vs_varlen",
            lambda: engine_vs_varlen(device, select_kernel(device, kernel), dtype, bins=bins, shape=shape, reps=reps),
        ),
    ):
        try:
            rows.append(run())
        except Exception as error:  # one line per failed check, then the others
            rows.append({"check": name, "ok": False, "error": f"{type(error).__name__}: {error}"[:2000]})
    return rows


# ---------------------------------------------------------------------------------------------- profiles
class CountingSource:
    """A :class:`~lightning_hydra.cp.groups.CommClock` source that counts the marks of another (two per timed
    interval)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.immediate = getattr(inner, "immediate", False)
        self.marks = 0

    def mark(self) -> Any:
        """The inner source's mark, counted."""
        self.marks += 1
        return self.inner.mark()

    def elapsed(self, start: Any, end: Any) -> float:
        """The inner source's seconds between two marks."""
        return self.inner.elapsed(start, end)

    def settle(self, last: Any) -> None:
        """The inner source's wait for its last mark."""
        self.inner.settle(last)

    @property
    def intervals(self) -> int:
        """Timed intervals so far."""
        return self.marks // 2


def _profiler(device: torch.device, memory: bool = False) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, profile_memory=memory)


def _union_seconds(spans: list[tuple[int, int]]) -> float:
    """Seconds covered by ``(start_ns, end_ns)`` spans (overlaps once)."""
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e9


def _comm_kind(name: str) -> str:
    low = name.lower()
    if "all_to_all" in low or "alltoall" in low:
        return "all_to_all"
    if "send" in low or "recv" in low:
        return "p2p"
    return "other"


def profiled_comm(prof: torch.profiler.profile, device: torch.device) -> dict[str, float]:
    """Seconds of communication in a finished profile (union of spans): ``cp`` (all-to-all and point-to-point, what
    the CommClock times), ``all_to_all``, ``p2p`` and ``other`` (all-reduces, gathers: not the clock's).

    CPU: gloo's work spans (``gloo:*``, issue to completion) and c10d's host ops (``c10d::*``). CUDA: kernels whose
    name holds ``nccl`` (NCCL runs an all-to-all as grouped send/receive: ``SendRecv`` kernels count as ``p2p``).
    """
    from torch.autograd import DeviceType

    spans: dict[str, list[tuple[int, int]]] = {"all_to_all": [], "p2p": [], "other": []}
    for event in prof.profiler.kineto_results.events():
        name = event.name()
        if device.type == "cuda":
            if event.device_type() != DeviceType.CUDA or "nccl" not in name.lower():
                continue
        elif not name.startswith(("gloo:", "c10d::")):
            continue
        spans[_comm_kind(name)].append((event.start_ns(), event.end_ns()))
    out = {kind: _union_seconds(s) for kind, s in spans.items()}
    out["cp"] = _union_seconds(spans["all_to_all"] + spans["p2p"])
    return out


def comm_bounds(
    clock: float, profiled: float, intervals: int, device: torch.device, blocking: bool, ranks_per_host: int = 1
) -> dict:
    """The clock against the profiler's time over one window: the figures, the bounds and ``ok``.

    The bounds hold where each rank has a core of its own (a CUDA device, or a CPU host with at least as many cores
    as ranks): on an oversubscribed host the scheduler parks a rank inside the clock's interval (measured: a clock
    2.6x its all-to-all's gloo span with 4 ranks on 2 busy cores), so there ``bounds_held`` is reported and ``ok``
    asks only that both sides saw the communication.

    Args:
        clock: Seconds the clock read.
        profiled: Seconds of communication the profiler's spans cover.
        intervals: Intervals the clock timed.
        device: The device the check ran on.
        blocking: Whether the communication blocks the rank (an all-to-all: the lower bound applies too).
        ranks_per_host: Ranks sharing this host's cores.
    """
    slack = COMM_SLACK["cuda" if device.type == "cuda" else "cpu"]
    upper = COMM_UPPER * profiled + intervals * slack
    lower = COMM_LOWER * profiled if blocking else 0.0
    held = lower <= clock <= upper
    enforced = device.type == "cuda" or ranks_per_host <= (os.cpu_count() or 1)
    row = {
        "clock_seconds": round(clock, 6),
        "profiler_seconds": round(profiled, 6),
        "ratio": round(clock / profiled, 3) if profiled > 0 else None,
        "intervals": intervals,
        "bounds": [round(lower, 6), round(upper, 6)],
        "bounds_held": held,
        "ok": held if enforced else (intervals > 0 and profiled > 0 and (clock > 0 or not blocking)),
    }
    if not enforced:
        row["bounds_enforced"] = f"no: {ranks_per_host} ranks share {os.cpu_count()} cores"
    return row


def comm_probe(device: torch.device, count: int, numel: int, group: Any = None) -> dict:
    """``count`` all-to-alls of ``numel`` float32 on ``group`` (collective), each timed by a fresh clock, under the
    profiler: the clock against the profiler (both bounds: all-to-alls block)."""
    clock = CommClock.for_device(device)
    source = CountingSource(clock.source)
    clock.source = source
    world = dist.get_world_size(group)
    x = torch.ones(numel // world * world, dtype=torch.float32, device=device)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # warm-up: connections, communicators
    _sync(device)
    with _profiler(device) as prof:
        for _ in range(count):
            with clock.measure():
                dist.all_to_all_single(out, x, group=group)
        _sync(device)
    seconds = sum(clock.read().values())
    row = comm_bounds(seconds, profiled_comm(prof, device)["cp"], source.intervals, device, blocking=True)
    return {"collectives": count, "bytes": x.numel() * 4} | row


# ---------------------------------------------------------------------------------------------- one-rank world
def _live_state_bytes(module: torch.nn.Module, optimizers: Sequence[Any]) -> int:
    """Bytes of the distinct storages of parameters, gradients and optimizer state now alive."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for p in module.parameters():
        add(p)
        add(p.grad)
    for optimizer in optimizers:
        for state in getattr(optimizer, "state", {}).values():
            for value in state.values():
                add(value)
    return sum(seen.values())


def _profiled_peak_rise(prof: torch.profiler.profile) -> int:
    """The largest rise of live CPU bytes over a profile, from its allocation and free events."""
    from torch.autograd import DeviceType

    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


class StepMeasures(pl.Callback):
    """``peak_memory`` over training step :attr:`MEMORY_STEP` and ``comm_profile`` over step :attr:`PROFILE_STEP`
    (batch indices; the first steps create the optimizer's state and the communicators), then the all-to-all probe
    at the end of training (while the world is up)."""

    MEMORY_STEP = 2
    PROFILE_STEP = 3

    def __init__(self, probe_numel: int, leftover: int = 0) -> None:
        self.probe_numel = probe_numel
        self.leftover = leftover
        """CUDA bytes allocated before the run (earlier checks' tensors not yet freed), taken off the peak."""
        self.memory: dict = {}
        self.comm: dict = {}
        self._prof: Any = None
        self._base = 0
        self._source: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Start the step's measurement."""
        device = trainer.strategy.root_device
        if idx == self.MEMORY_STEP:
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            else:
                self._base = _live_state_bytes(module, trainer.optimizers)
                self._prof = _profiler(device, memory=True).__enter__()
        elif idx == self.PROFILE_STEP:
            clock = trainer.strategy.runtime.comm_clock
            self._source = CountingSource(clock.source)
            clock.source = self._source
            _sync(device)
            self._prof = _profiler(device).__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:
        """End the step's measurement; the rows' figures."""
        strategy = trainer.strategy
        device = strategy.root_device
        if idx == self.MEMORY_STEP:
            _sync(device)
            if device.type == "cuda":
                measured = torch.cuda.max_memory_allocated(device) - self.leftover
                method = "torch.cuda.max_memory_allocated less what was allocated before the run"
            else:
                self._prof.__exit__(None, None, None)
                measured = self._base + _profiled_peak_rise(self._prof)
                method = "live state + torch.profiler's largest rise of CPU allocations"
            self.memory = _memory_row(strategy, batch, measured, method)
            if device.type == "cuda":
                self.memory["leftover_bytes"] = self.leftover
        elif idx == self.PROFILE_STEP:
            _sync(device)
            self._prof.__exit__(None, None, None)
            strategy.runtime.comm_clock.source = self._source.inner
            record = strategy.last_record
            rank = dist.get_rank()  # the pool's column (one stage)
            clock = float(np.asarray(record.comm)[:, rank].sum()) if record is not None else math.nan
            profiled = profiled_comm(self._prof, device)
            step = comm_bounds(clock, profiled["cp"], self._source.intervals, device, blocking=False)
            self.comm["step"] = step | {"other_seconds": round(profiled["other"], 6)}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """The probe of clock-timed all-to-alls on the world (collective)."""
        self.comm["probe"] = comm_probe(trainer.strategy.root_device, 5, self.probe_numel)


def _memory_row(strategy: Any, batch: Any, measured: int, method: str) -> dict:
    breakdown = strategy.memory_breakdown()
    tokens = max(mb.num_tokens for mb in batch.microbatches)
    state = sum(breakdown.state.values())
    activations = breakdown.per_token["total"] * tokens
    predicted = state + activations
    upper, lower = predicted + breakdown.margin, PEAK_LOW * predicted
    return {
        "method": method,
        "precision": str(strategy.precision_plugin.precision),
        "tokens": tokens,
        "capacity": strategy.planner_config.max_tokens_per_rank,
        "budget_bytes": int(breakdown.budget),
        "measured_bytes": int(measured),
        "predicted_bytes": int(predicted),
        "state_bytes": int(state),
        "activation_bytes": int(activations),
        "margin_bytes": int(breakdown.margin),
        "ratio": round(measured / predicted, 3),
        "bounds": {"upper_bytes": int(upper), "lower_bytes": int(lower), "lower_ratio": PEAK_LOW},
        "ok": lower <= measured <= upper,
    }


MEMORY_SHAPES = {
    "cuda": ({"hidden_size": 2048, "num_layers": 8, "num_heads": 16, "num_kv_heads": 4, "vocab_size": 32000}, 16384),
    "cpu": ({"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "vocab_size": 258}, 4096),
    "quick": ({"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 258}, 1024),
}
"""``peak_memory``'s model and tokens per step, by device (``quick``: the CPU test)."""


def budget_for(model: Any, device: torch.device, precision: str, tokens: int) -> int:
    """The ``memory_budget`` whose ``"auto"`` capacity is ``tokens`` (a multiple of 256) for ``model`` on one rank
    (no sharding or checkpointing, one microbatch)."""
    from lightning_hydra.strategy.capacity import pool_memory

    kw = {"device": device, "precision": precision, "sharding": "none", "checkpointing": "none", "pool": 1}
    kw |= {"ranks_per_node": 1, "num_microbatches": 1, "pipeline_stages": 1, "ulysses_blocks": 3}
    probe = pool_memory(model, budget=1e18, **kw)
    fixed = sum(probe.state.values()) + probe.communicators
    budget = math.ceil((fixed + (tokens + 0.5) * probe.per_token["total"]) / (1 - probe.margin / probe.budget))
    assert pool_memory(model, budget=budget, **kw).capacity == tokens, "the capacity rounds to another multiple"
    return budget


def world_measures(device: torch.device, kernel: str, quick: bool) -> list[dict]:
    """``peak_memory`` and ``comm_profile`` in a one-rank world (one training run; see the module docstring)."""
    from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
    from lightning_hydra.testing import quiet_trainer

    cuda = device.type == "cuda"
    shape, tokens = MEMORY_SHAPES["quick" if quick else device.type]
    precision = "bf16-true" if cuda else "32-true"
    hw = {"accelerator": "gpu", "precision": precision} if cuda else {}
    rows = []
    try:
        torch.manual_seed(0)
        model = DecoderLM(**shape)
        budget = budget_for(model, device, precision, tokens)
        rng = np.random.default_rng(0)  # documents of 16 to tokens / 4, enough for every step's global batch
        lengths = rng.integers(16, tokens // 4, size=(StepMeasures.PROFILE_STEP + 2) * 16)
        g = torch.Generator().manual_seed(0)
        data = [torch.randint(2, shape["vocab_size"] - 8, (int(n),), generator=g) for n in lengths]
        strategy = HydraStrategy(
            kernel=kernel, max_tokens_per_rank="auto", memory_budget=budget, num_microbatches=1, sharding="none"
        )
        gc.collect()  # the earlier checks' models and trainers
        if cuda:
            torch.cuda.empty_cache()
        leftover = torch.cuda.memory_allocated(device) if cuda else 0
        measures = StepMeasures((1 << 24) if cuda else (1 << 20), leftover)
        devices = [device.index or 0] if cuda else 1
        trainer = quiet_trainer(devices, strategy, callbacks=[measures], max_steps=StepMeasures.PROFILE_STEP + 1, **hw)
        # global batches a little under the capacity: the documents' zigzag padding (a token each) stays inside it
        trainer.fit(model, HydraDataModule(data, global_batch_tokens=tokens - 64, seed=0))
        rows.append({"check": "peak_memory", "shape": shape} | measures.memory)
        comm = measures.comm
        rows.append({"check": "comm_profile", **comm, "ok": comm["step"]["ok"] and comm["probe"]["ok"]})
    except Exception as error:  # one line per failed check
        reason = f"{type(error).__name__}: {error}"[:2000]
        done = {r["check"] for r in rows}
        rows += [{"check": n, "ok": False, "error": reason} for n in WORLD_MEASURES if n not in done]
    return rows


# ---------------------------------------------------------------------------------------------- several ranks
def cp_comm_profile(rank: int, world: int, device: torch.device, lengths: Sequence[int]) -> dict:
    """multi_gpu_check's ``comm_profile`` on this rank (collective): one CP forward and backward over every rank as
    Ulysses (``all_to_all``) and as a ring (``ring``), each timed by the group's clock under the profiler."""
    from lightning_hydra.cp import hydra_attn_func
    from lightning_hydra.planner import Group

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks sharing this host (torchrun sets it)
    cu = [0, *itertools.accumulate(lengths)]
    phases = {}
    for phase, (ulysses, ring) in (("all_to_all", (world, 1)), ("ring", (1, world))):
        heads, kv_heads = (2 * world, world) if ulysses > 1 else (8, 2)
        g = torch.Generator().manual_seed(7)
        q, k, v, dout = (
            torch.randn(cu[-1], h, 64, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
        )
        source = CountingSource(CommClock.for_device(device).source)
        cache = GroupCache(clock=CommClock(source))
        cache.prepare([Group(tuple(range(world)), ulysses, ring)])
        if ring > 1:  # the runtime's own ring communicator
            cache.ring_group = dist.new_group(list(range(world)))
        group = cache.get(tuple(range(world)), ulysses, ring)
        ins = [zigzag_shard(x, cu, world, rank).contiguous().requires_grad_() for x in (q, k, v)]
        grad = zigzag_shard(dout, cu, world, rank)

        def step(ins=ins, group=group, grad=grad) -> None:
            for x in ins:
                x.grad = None
            hydra_attn_func(*ins, cu, group=group).backward(grad)

        step()  # warm-up: connections and communicators
        _sync(device)
        cache.clock.discard()
        source.marks = 0
        with _profiler(device) as prof:
            step()
            _sync(device)
        clock = sum(cache.clock.read().values())
        profiled = profiled_comm(prof, device)
        row = comm_bounds(clock, profiled["cp"], source.intervals, device, blocking=ulysses > 1, ranks_per_host=local)
        if ulysses == 1:
            row["exposed"] = row.pop("ratio")
        phases[phase] = row
        if cache.ring_group is not None:
            dist.destroy_process_group(cache.ring_group)
            cache.ring_group = None
        cache.destroy()
    return phases


def comm_profile_row(rank: int, world: int, device: torch.device, lengths: Sequence[int]) -> dict:
    """``comm_profile`` over every rank: each rank's phases gathered on rank 0 (collective)."""
    mine = cp_comm_profile(rank, world, device, lengths)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    phases = {
        phase: {
            "ranks": {str(r): {k: v for k, v in x[phase].items() if k != "ok"} for r, x in enumerate(every)},
            "ok": all(x[phase]["ok"] for x in every),
        }
        for phase in mine
    }
    bounds = {
        "upper": f"clock <= {COMM_UPPER} * profiler + intervals * {COMM_SLACK[device.type]} s",
        "lower": f"all_to_all: clock >= {COMM_LOWER} * profiler",
    }
    return {"check": "comm_profile", "phases": phases, "bounds": bounds, "ok": all(p["ok"] for p in phases.values())}
