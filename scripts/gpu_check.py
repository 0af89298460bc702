"""GPU check of the flash-attn kernel path through the ring's own block and merge code, on one device.

Emulates every rank of a ring of degree ``r`` in one process: each emulated rank walks the ring's steps
(``RingLayout.step``), calls the kernel on the visible rows, merges partials with the ring's log-sum-exp merge,
and runs the per-block backward with the final output and LSE; dK/dV are added to the owner's block. Outputs and
gradients are compared with a per-document reference (float32 SDPA).

    python scripts/gpu_check.py                              # CUDA + flash-attn (bf16)
    python scripts/gpu_check.py --device cpu --kernel cpu    # the same code on the CPU op (float32)

Prints one JSON line per configuration and exits non-zero if any error exceeds its bound.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from lightning_hydra.cp.kernels import select_kernel
from lightning_hydra.cp.layout import ZigzagMeta, zigzag_shard, zigzag_source_index
from lightning_hydra.cp.ring import RingLayout, _merge, _select

LENGTHS = [1500, 37, 4096, 2, 611]


def _reference(q, k, v, dout, cu, causal):
    rep = q.shape[1] // k.shape[1]
    leaves = [x.float().clone().requires_grad_() for x in (q, k, v)]
    outs = []
    for a, b in itertools.pairwise(cu):
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                leaves[0][a:b].transpose(0, 1),
                leaves[1][a:b].transpose(0, 1).repeat_interleave(rep, 0),
                leaves[2][a:b].transpose(0, 1).repeat_interleave(rep, 0),
                is_causal=causal,
            ).transpose(0, 1)
        )
    out = torch.cat(outs)
    out.backward(dout.float())
    return out.detach(), [x.grad for x in leaves]


def emulate(q, k, v, dout, cu, ring, causal, kernel):
    """All ranks of a ring of ``ring`` ranks, in one process; returns unsharded out, dq, dk, dv."""
    meta = ZigzagMeta.from_cu_seqlens(cu, ring)
    scale = q.shape[-1] ** -0.5
    hkv = k.shape[1]
    shard = [[zigzag_shard(x, cu, ring, p).transpose(0, 1).contiguous() for x in (q, k, v, dout)] for p in range(ring)]
    outs, lses = [], []
    for p in range(ring):
        lay = RingLayout(meta.lengths, meta.chunks, ring, p)
        out = torch.zeros(shard[p][0].shape, dtype=torch.float32, device=q.device)
        lse = torch.full(shard[p][0].shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for s in range(ring):
            src = (p - s) % ring
            step = lay.step(src, causal)
            if step is None:
                continue
            kv = torch.cat([shard[src][1], shard[src][2]], dim=0)
            o, lo = kernel.forward(
                _select(shard[p][0], step.q_rows),
                _select(kv[:hkv], step.k_rows),
                _select(kv[hkv:], step.k_rows),
                step.cu_q,
                step.cu_k,
                step.causal,
                scale,
            )
            _merge(out, lse, step.q_rows, o, lo)
        outs.append(out)
        lses.append(lse)
    grads = [[torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in shard[p][:3]] for p in range(ring)]
    for p in range(ring):
        lay = RingLayout(meta.lengths, meta.chunks, ring, p)
        out_p = outs[p].to(q.dtype)
        for s in range(ring):
            src = (p - s) % ring
            step = lay.step(src, causal)
            if step is None:
                continue
            rows = step.q_rows
            dq, dk, dv = kernel.backward(
                _select(shard[p][3], rows),
                _select(shard[p][0], rows),
                _select(shard[src][1], step.k_rows),
                _select(shard[src][2], step.k_rows),
                _select(out_p, rows),
                _select(lses[p], rows).contiguous(),
                step.cu_q,
                step.cu_k,
                step.causal,
                scale,
            )
            for acc, part, r_ in (
                (grads[p][0], dq, rows),
                (grads[src][1], dk, step.k_rows),
                (grads[src][2], dv, step.k_rows),
            ):
                if r_ is None:
                    acc += part
                else:
                    acc.index_add_(1, r_, part)

    def unshard(per_rank):
        total = per_rank[0].new_zeros((meta.total, *per_rank[0].shape[0:1], per_rank[0].shape[2]))
        for p, x in enumerate(per_rank):
            src = zigzag_source_index(meta, p)[1].to(x.device)
            keep = src >= 0
            total[src[keep]] = x.transpose(0, 1)[keep]
        return total

    return unshard(outs), unshard([g[0] for g in grads]), unshard([g[1] for g in grads]), unshard([g[2] for g in grads])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    kernel = select_kernel(device, args.kernel)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    bound = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    cu = [0, *itertools.accumulate(LENGTHS)]
    failed = False
    for ring, causal, (heads, kv_heads) in itertools.product((1, 2, 4), (True, False), ((8, 8), (8, 2))):
        g = torch.Generator(device="cpu").manual_seed(ring)
        q, k, v, dout = (
            torch.randn(cu[-1], h, 64, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
        )
        ref_out, ref_grads = _reference(q, k, v, dout, cu, causal)
        got = emulate(q, k, v, dout, cu, ring, causal, kernel)
        errors = {
            name: float((a.float() - b).abs().max() / b.abs().max())
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref_out, *ref_grads], strict=True)
        }
        ok = max(errors.values()) <= bound
        failed |= not ok
        print(
            json.dumps(
                {
                    "kernel": kernel.name,
                    "device": str(device),
                    "dtype": str(dtype),
                    "ring": ring,
                    "causal": causal,
                    "heads": heads,
                    "kv_heads": kv_heads,
                    "errors": errors,
                    "ok": ok,
                }
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
