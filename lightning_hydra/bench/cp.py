"""CP engine benchmark: the overhead of splitting attention, as ratios measured in one run.

    python -m lightning_hydra.bench.cp                  # degrees 2, 4, 8, every factorization
    python -m lightning_hydra.bench.cp --degrees 4
    python -m lightning_hydra.bench.cp --short-docs     # 400 documents of 8-64 tokens (see below)

For a bin of mixed lengths (at least 16K tokens), each configuration runs forward+backward of
:func:`lightning_hydra.cp.hydra_attn_func` on ``degree`` spawned gloo ranks and records every rank's busy CPU time
(thread CPU time: time blocked in collectives is not counted; one intra-op thread per rank). The *CP overhead* is
the total busy time over ranks divided by the one-process time of the same bin on the same kernel (physical
limit 1.0). On one long sequence, the pure ring (``ulysses=1``) is also timed against torch's private ring
reference (``_templated_ring_attention`` and its backward) on the same kernel and layout. This machine has 2 cores,
so wall-clock figures of more than 2 ranks mean nothing: compare busy CPU time.

``--short-docs``: a bin of 400 documents of 8-64 tokens (about 14K tokens), forward+backward through
:class:`CPContext` (the microbatch's plan is built inside the timed region, once, as in training). It reports the
engine at degree 1 over a plain Python loop of the CPU attention op over the documents (forward and backward op
per document, no output assembly), and the total busy time of 4 ranks at Ulysses 4, Ulysses 2 x ring 2 and ring 4
over the same plain loop (``*_over_plain``), over the engine at degree 1 (``*_over_engine``), and over the plain
loop's busy time when 4 processes run it at once (``*_over_plain_4_processes``: 4 ranks on this 2-core machine
share cores and caches, which inflates each rank's busy time whatever the engine does). Busy times are the
minimum over repeats (noise on a shared machine only adds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from lightning_hydra.cp import CPContext, CPGroup, GroupCache, hydra_attn_func, zigzag_shard
from lightning_hydra.planner import Group
from lightning_hydra.testing import run_world

__all__ = ["main"]

MIXED = [8192, 3000, 2048, 1500, 1024, 600, 333, 200, 77, 13]
"""The mixed bin: 16,987 tokens, one long document and a tail of short ones."""
FACTORIZATIONS = {2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2), (4, 1)], 8: [(1, 8), (2, 4), (4, 2), (8, 1)]}
SHORT_CONFIGS = {"ulysses4": (4, 1), "ulysses2_ring2": (2, 2), "ring4": (1, 4)}
"""The 4-rank factorizations of the short-document benchmark."""


def short_docs(count: int = 400, low: int = 8, high: int = 64, seed: int = 0) -> list[int]:
    """The short-document bin: ``count`` lengths drawn uniformly from ``[low, high]``."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(low, high + 1, size=count)]


def _cu(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _tensors(lengths: list[int], heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    return tuple(torch.randn(total, h, dim, generator=g) for h in (heads, kv_heads, kv_heads, heads))


def _busy(fn, repeat: int, reduce=statistics.median) -> tuple[float, float]:
    """Thread CPU time and wall time of ``fn`` over ``repeat`` runs (after one warm-up), reduced by ``reduce``."""
    fn()
    cpu, wall = [], []
    for _ in range(repeat):
        dist.barrier() if dist.is_initialized() else None
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return reduce(cpu), reduce(wall)


def one_process(lengths: list[int], heads: int, kv_heads: int, dim: int, repeat: int) -> float:
    """Busy CPU seconds of forward+backward of the whole bin in this process (degree 1, same kernel)."""
    torch.set_num_threads(1)
    q, k, v, dout = _tensors(lengths, heads, kv_heads, dim)
    cu = _cu(lengths)
    group = CPGroup((0,), 1, 1)
    shards = [zigzag_shard(x, cu, 1, 0) for x in (q, k, v)]
    g = zigzag_shard(dout, cu, 1, 0)

    def run() -> None:
        ins = [s.clone().requires_grad_() for s in shards]
        hydra_attn_func(*ins, cu, group=group).backward(g)

    return _busy(run, repeat)[0]


def _hydra_worker(rank: int, world: int, lengths, u, r, heads, kv_heads, dim, repeat) -> dict:
    cache = GroupCache()
    rec = Group(tuple(range(world)), u, r)
    cache.prepare([rec])
    group = cache.get(rec.ranks, u, r)
    q, k, v, dout = _tensors(lengths, heads, kv_heads, dim)
    cu = _cu(lengths)
    shards = [zigzag_shard(x, cu, world, rank) for x in (q, k, v)]
    g = zigzag_shard(dout, cu, world, rank)

    def run() -> None:
        ins = [s.clone().requires_grad_() for s in shards]
        hydra_attn_func(*ins, cu, group=group).backward(g)

    cpu, wall = _busy(run, repeat)
    return {"cpu": cpu, "wall": wall}


def _torch_ring_worker(rank: int, world: int, length: int, heads: int, dim: int, repeat: int) -> dict:
    from torch.distributed.tensor.experimental._context_parallel._attention import (  # private: benchmark only
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    q, k, v, dout = _tensors([length], heads, heads, dim)
    cu = [0, length]
    # torch's load-balanced layout is the same head-tail (zigzag) split; it takes [B, H, S, D]
    q, k, v, dout = (
        zigzag_shard(x, cu, world, rank).transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, dout)
    )
    group = dist.group.WORLD

    def run() -> None:
        out, lse, *_ = _templated_ring_attention(group, 2, fwd, q, k, v, is_causal=True)
        _templated_ring_attention_backward(
            group, 2, bwd, dout, "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0
        )

    cpu, wall = _busy(run, repeat)
    return {"cpu": cpu, "wall": wall}


def _context_run(lengths, group: CPGroup, rank: int, world: int, heads: int, kv_heads: int, dim: int):
    """A closure running forward+backward of this rank's shard through a fresh microbatch context."""
    q, k, v, dout = _tensors(lengths, heads, kv_heads, dim)
    cu = _cu(lengths)
    leaves = [zigzag_shard(x, cu, world, rank).requires_grad_() for x in (q, k, v)]
    g = zigzag_shard(dout, cu, world, rank)
    context = CPContext("cpu")

    def run() -> None:
        for x in leaves:
            x.grad = None
        with context.use(group, cu):
            out = context.attention(*leaves, causal=True)
        out.backward(g)

    return run


def _plain_loop(lengths, heads: int, kv_heads: int, dim: int):
    """The baseline: the CPU op's forward and backward per document on views of the packed tensors."""
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    q, k, v, dout = _tensors(lengths, heads, kv_heads, dim)
    cu = _cu(lengths)
    docs = [tuple(x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v, dout)) for a, b in itertools.pairwise(cu)]

    def run() -> None:
        for qd, kd, vd, gd in docs:
            o, lse = fwd(qd, kd, vd, 0.0, True)
            bwd(gd, qd, kd, vd, o, lse, 0.0, True)

    return run


def _short_worker(rank: int, world: int, lengths, u: int, r: int, heads, kv_heads, dim, repeat) -> float:
    cache = GroupCache()
    rec = Group(tuple(range(world)), u, r)
    cache.prepare([rec])
    run = _context_run(lengths, cache.get(rec.ranks, u, r), rank, world, heads, kv_heads, dim)
    return _busy(run, repeat, min)[0]


def _plain_worker(rank: int, world: int, lengths, heads, kv_heads, dim, repeat) -> float:
    return _busy(_plain_loop(lengths, heads, kv_heads, dim), repeat, min)[0]


def short_docs_report(heads: int = 8, kv_heads: int = 2, dim: int = 64, repeat: int = 5) -> dict:
    """Busy-time ratios of the short-document bin (see the module docstring), measured in one run."""
    torch.set_num_threads(1)
    lengths = short_docs()
    plain = _plain_loop(lengths, heads, kv_heads, dim)
    engine = _context_run(lengths, CPGroup((0,), 1, 1), 0, 1, heads, kv_heads, dim)
    plain(), engine()
    plain_s, engine_s = [], []
    for _ in range(repeat):  # interleaved, so that load on the machine hits both alike
        plain_s.append(_busy(plain, 1)[0])
        engine_s.append(_busy(engine, 1)[0])
    base, eng = min(plain_s), min(engine_s)
    row = {
        "bin_tokens": sum(lengths),
        "documents": len(lengths),
        "plain_loop_busy_s": round(base, 4),
        "engine_d1_busy_s": round(eng, 4),
        "engine_d1_over_plain": round(eng / base, 3),
    }
    # the same plain loop in 4 processes at once: a 4-rank run shares this machine's cores and caches the same way
    loaded = statistics.median(run_world(4, _plain_worker, lengths, heads, kv_heads, dim, repeat, timeout=900))
    row["plain_loop_busy_4_processes_s"] = round(loaded, 4)
    for name, (u, r) in SHORT_CONFIGS.items():
        busy = run_world(u * r, _short_worker, lengths, u, r, heads, kv_heads, dim, repeat, timeout=900)
        row[f"{name}_total_busy_s"] = round(sum(busy), 4)
        row[f"{name}_over_plain"] = round(sum(busy) / base, 3)
        row[f"{name}_over_engine"] = round(sum(busy) / eng, 3)
        row[f"{name}_over_plain_4_processes"] = round(sum(busy) / loaded, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints one JSON object per configuration and a summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--degrees", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--single", type=int, default=16384, help="length of the one-sequence comparison")
    parser.add_argument("--short-docs", action="store_true", help="the 400-short-document bin only")
    args = parser.parse_args(argv)
    if args.short_docs:
        print(json.dumps(short_docs_report(args.heads, args.kv_heads, args.dim, max(args.repeat, 5))), flush=True)
        return 0
    base = one_process(MIXED, args.heads, args.kv_heads, args.dim, args.repeat)
    single_base = one_process([args.single], args.heads, args.heads, args.dim, args.repeat)
    rows = []
    for d in args.degrees:
        for u, r in FACTORIZATIONS[d]:
            res = run_world(
                d, _hydra_worker, MIXED, u, r, args.heads, args.kv_heads, args.dim, args.repeat, timeout=900
            )
            busy = [x["cpu"] for x in res]
            row = {
                "bin_tokens": sum(MIXED),
                "degree": d,
                "ulysses": u,
                "ring": r,
                "cp_overhead": round(sum(busy) / base, 3),
                "busy_max_over_mean": round(max(busy) / statistics.mean(busy), 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        ours = run_world(
            d, _hydra_worker, [args.single], 1, d, args.heads, args.heads, args.dim, args.repeat, timeout=900
        )
        ref = run_world(d, _torch_ring_worker, args.single, args.heads, args.dim, args.repeat, timeout=900)
        row = {
            "single_sequence": args.single,
            "degree": d,
            "hydra_ring_overhead": round(sum(x["cpu"] for x in ours) / single_base, 3),
            "torch_ring_overhead": round(sum(x["cpu"] for x in ref) / single_base, 3),
            "hydra_over_torch_busy": round(sum(x["cpu"] for x in ours) / sum(x["cpu"] for x in ref), 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"one_process_busy_s": round(base, 4), "rows": len(rows)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
