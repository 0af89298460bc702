"""CP engine benchmark: the overhead of splitting attention, as ratios measured in one run.

    python -m lightning_hydra.bench.cp                  # degrees 2, 4, 8, every factorization
    python -m lightning_hydra.bench.cp --degrees 4

For a bin of mixed lengths (at least 16K tokens), each configuration runs forward+backward of
:func:`lightning_hydra.cp.hydra_attn_func` on ``degree`` spawned gloo ranks and records every rank's busy CPU time
(thread CPU time: time blocked in collectives is not counted; one intra-op thread per rank). The *CP overhead* is
the total busy time over ranks divided by the one-process time of the same bin on the same kernel (physical
limit 1.0). On one long sequence, the pure ring (``ulysses=1``) is also timed against torch's private ring
reference (``_templated_ring_attention`` and its backward) on the same kernel and layout. This machine has 2 cores,
so wall-clock figures of more than 2 ranks mean nothing: compare busy CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lightning_hydra.cp import CPGroup, GroupCache, hydra_attn_func, zigzag_shard
from lightning_hydra.planner import Group
from lightning_hydra.testing import run_world

__all__ = ["main"]

MIXED = [8192, 3000, 2048, 1500, 1024, 600, 333, 200, 77, 13]
"""The mixed bin: 16,987 tokens, one long document and a tail of short ones."""
FACTORIZATIONS = {2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2), (4, 1)], 8: [(1, 8), (2, 4), (4, 2), (8, 1)]}


def _cu(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _tensors(lengths: list[int], heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    return tuple(torch.randn(total, h, dim, generator=g) for h in (heads, kv_heads, kv_heads, heads))


def _busy(fn, repeat: int) -> tuple[float, float]:
    """Median thread CPU time and wall time of ``fn`` over ``repeat`` runs (after one warm-up)."""
    fn()
    cpu, wall = [], []
    for _ in range(repeat):
        dist.barrier() if dist.is_initialized() else None
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


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


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints one JSON object per configuration and a summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--degrees", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--single", type=int, default=16384, help="length of the one-sequence comparison")
    args = parser.parse_args(argv)
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
