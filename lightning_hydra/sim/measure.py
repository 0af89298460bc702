"""Measure this machine's kernel timings and fit the simulator's hardware constants (``python -m
lightning_hydra.sim.measure``).

Runs the measurements on ``--ranks`` processes at once (one thread each), so that the figures carry the same core
sharing as a multi-rank CPU run of the demo. Measured, per process, with thread CPU time (what the training
monitor calls busy time):

- the CPU attention op, forward plus backward, for one layer's heads at lengths 64 .. 8192;
- the reference decoder (``DecoderLM``) forward plus backward on one sequence of each length, and on bins of
  several sequences of the same total length.

Fits (least squares): attention ``t = k * L * (L + half)`` gives ``attn_efficiency * peak`` and
``attn_half_len``; the decoder's remainder (decoder minus the layers' attention) is linear in tokens, giving the
GEMM FLOP rate (``peak_flops`` with ``gemm_efficiency = 1``) and the fixed per-layer overhead; the bins give the
per-sequence overhead. Prints JSON with the raw timings and a ``hardware`` section for a scenario recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch

from lightning_hydra.testing import run_world

__all__ = ["fit_hardware", "main", "measure_rank"]

LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _cpu_time(fn: Any, repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return float(np.median(samples))


def measure_rank(rank: int, world: int, shape: dict[str, int], repeat: int) -> dict[str, Any]:
    """Timings of one process (run on every rank at once)."""
    from lightning_hydra.cp.context import CPContext
    from lightning_hydra.data.packing import RankMicrobatch
    from lightning_hydra.models.decoder import DecoderLM

    torch.manual_seed(rank)
    heads, hidden = shape["num_heads"], shape["hidden_size"]
    dim = hidden // heads
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    attn: dict[int, float] = {}
    for n in LENGTHS:
        q = torch.randn(1, heads, n, dim, requires_grad=True)
        k = torch.randn(1, heads, n, dim, requires_grad=True)  # KV heads repeated to the query heads, as the model
        v = torch.randn(1, heads, n, dim, requires_grad=True)

        def run(q=q, k=k, v=v) -> None:
            out = op(q, k, v, 0.0, True)[0]
            out.sum().backward()

        attn[n] = _cpu_time(run, repeat)
    model = DecoderLM(**shape)
    group = CPContext.local_group()

    def step(lengths: list[int]) -> None:
        total = sum(lengths)
        ids = torch.randint(0, 250, (total,))
        pos = torch.cat([torch.arange(n) for n in lengths])
        cu = tuple(int(x) for x in np.cumsum([0, *lengths]))
        mb = RankMicrobatch(ids, ids.clone(), pos, cu, (0,), 1, 1, ())
        with model.local_cp.use(group, cu):
            model.microbatch_loss(mb).backward()

    decoder = {n: _cpu_time(lambda n=n: step([n]), repeat) for n in LENGTHS}
    bins = {k: _cpu_time(lambda k=k: step([2048 // k] * k), repeat) for k in (1, 4, 16)}  # 2048, 512, 128
    return {"attention": attn, "decoder": decoder, "bins": bins}


def fit_hardware(timings: dict[str, Any], shape: dict[str, int]) -> dict[str, float]:
    """Hardware constants (see the module docstring) from the median timings over processes."""
    layers, hidden = shape["num_layers"], shape["hidden_size"]
    lens = np.array(LENGTHS, dtype=np.float64)
    attn = np.array([timings["attention"][n] for n in LENGTHS])
    # relative least squares (every length counts alike): t = k * L^2 + k * half * L
    w = 1.0 / attn
    (k2, k1), *_ = np.linalg.lstsq(np.stack([lens**2, lens], axis=1) * w[:, None], attn * w, rcond=None)
    attn_rate = 6.0 * hidden / k2  # FLOP/s of long attention (6 * hidden * L^2 FLOPs per layer)
    attn_half = max(k1 / k2, 0.0)
    decoder = np.array([timings["decoder"][n] for n in LENGTHS])
    rest = decoder - layers * attn
    w = 1.0 / rest
    (slope, intercept), *_ = np.linalg.lstsq(
        np.stack([lens, np.ones_like(lens)], axis=1) * w[:, None], rest * w, rcond=None
    )
    from lightning_hydra.models.decoder import DecoderLM
    from lightning_hydra.sim.hardware import ModelShape

    model = ModelShape(**DecoderLM(**shape).model_shape(), bytes_per_element=4)
    gemm_rate = 6.0 * model.params / slope
    peak = max(gemm_rate, attn_rate)
    bins, measured_attn = timings["bins"], timings["attention"]
    # the same 2048 tokens in k sequences: attention shrinks (measured), the per-sequence overhead grows by k - 1
    per_seq = [
        (bins[k] - bins[1] - layers * (k * measured_attn[2048 // k] - measured_attn[2048])) / ((k - 1) * layers)
        for k in (4, 16)
    ]
    return {
        "peak_flops": float(peak),
        "gemm_efficiency": float(gemm_rate / peak),
        "gemm_half_tokens": 0.0,
        "attn_efficiency": float(attn_rate / peak),
        "attn_half_len": float(attn_half),
        "layer_overhead": float(max(intercept, 0.0) / layers),
        "seq_overhead": float(max(np.median(per_seq), 0.0)),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="processes measuring at once (the demo's ranks)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    args = parser.parse_args(argv)
    shape = {
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
    }
    results = run_world(args.ranks, measure_rank, shape, args.repeat, timeout=1800)
    median = {
        part: {key: float(np.median([r[part][key] for r in results])) for key in results[0][part]}
        for part in results[0]
    }
    fitted = fit_hardware(median, shape)
    json.dump({"ranks": args.ranks, "shape": shape, "timings": median, "hardware": fitted}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
