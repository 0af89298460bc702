"""GPU check of the CP engine on one device: a full bf16 training step of ``DecoderLM`` through the engine, the
ring's block and merge code against a float32 reference, and peak memory per token.

    PYTHONPATH=. python3 scripts/gpu_check.py                  # CUDA: kernel "auto" (torch's flash attention)
    PYTHONPATH=. python3 scripts/gpu_check.py --kernel flash   # flash-attn instead
    PYTHONPATH=. python3 scripts/gpu_check.py --device cpu     # the same code on the CPU op

Needs only torch, Lightning, torchmetrics (what ``lightning_hydra.models`` imports); no flash-attn, no jsonargparse.
Three checks:

1. ``train_step``: ``DecoderLM`` in bf16 (weights and activations) runs one forward, backward and AdamW step on a
   packed bin through :class:`~lightning_hydra.cp.CPContext` (degree 1, the selected kernel). Its loss and
   gradients are compared with the same model in float32 whose attention is a per-document float32 SDPA, and
   the peak memory of the step is reported per token (CUDA only).
2. ``ring``: every rank of a ring of degree 1, 2 and 4 is emulated in one process: each walks its ring steps
   through the kernel's step plans, merges partials with the engine's log-sum-exp merge and runs the per-block
   backward with the final output and log-sum-exp (the code the ring runs, minus the transfers); short sequences
   take the kernel's gathered path when it has one. Outputs and gradients are compared with a per-document
   float32 reference, causal and not, with and without GQA.
3. ``world_step``, ``world_zero2_checkpoint``, ``comm_clock`` (``--world``, the default on CUDA): a one-rank
   process group (NCCL on CUDA, gloo on CPU: ``init_process_group(world_size=1)`` by the strategy) through
   :class:`~lightning_hydra.HydraStrategy`'s real step: CP groups of one, the device-timed communication clock
   (CUDA events on GPU) feeding the step's rows, FSDP2 ``fully_shard`` on a one-rank mesh (``zero2``), a sharded
   checkpoint saved and resumed, and one all-reduce timed by the clock.
4. Measurements for a GPU window (``scripts/gpu_measure.py``, whose docstring states each bound and why):
   ``flash_vs_aten`` (the ``flash`` and ``torch`` kernels on the same bins: outputs, gradients, time; skipped
   without CUDA or flash-attn), ``engine_vs_varlen`` (the engine at degree 1 against one varlen call on the whole
   bin: time ratio), and with the world checks ``peak_memory`` (a training step's peak against
   ``memory_breakdown()``'s prediction) and ``comm_profile`` (the CommClock against ``torch.profiler``).
5. ``summary``: one JSON object on the last line; the exit status is non-zero if any check failed.

``--dry-run`` prints the line of every check it would run (``"dry_run": true``) and the summary, running none.
**Not run on a GPU yet** (none was available to this project): on CPU the test suite runs every check (the world
checks over gloo; ``flash_vs_aten`` through stand-ins of the CUDA ops); the CUDA paths wait for a device. Multi-GPU
checks: ``scripts/multi_gpu_check.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hydra.cp.blocks import Accumulator
from lightning_hydra.cp.groups import CommClock, CPGroup
from lightning_hydra.cp.kernels import AttentionKernel, select_kernel
from lightning_hydra.cp.layout import ZigzagMeta, zigzag_shard, zigzag_source_index
from lightning_hydra.cp.plan import AttentionPlan, MicrobatchLayout

LENGTHS = [1500, 37, 4096, 2, 611, 64, 64, 64, 9, 1000]
"""The ring check's bin: mixed lengths, some shorter than ``2 * ring``, runs of equal length."""
TRAIN_LENGTHS = [2048, 700, 130, 130, 31, 5, 1]
"""The training step's bin."""
BF16_BOUND = 2e-2
"""Relative bound for bf16 results against a float32 reference."""


def reference_attention(q, k, v, dout, cu, causal):
    """Per-document float32 SDPA: output and gradients of ``q, k, v``."""
    rep = q.shape[1] // k.shape[1]
    leaves = [x.float().clone().requires_grad_() for x in (q, k, v)]
    outs = []
    for a, b in itertools.pairwise(cu):
        outs.append(
            F.scaled_dot_product_attention(
                leaves[0][a:b].transpose(0, 1),
                leaves[1][a:b].transpose(0, 1).repeat_interleave(rep, 0),
                leaves[2][a:b].transpose(0, 1).repeat_interleave(rep, 0),
                is_causal=causal,
            ).transpose(0, 1)
        )
    out = torch.cat(outs)
    out.backward(dout.float())
    return out.detach(), [x.grad for x in leaves]


def emulate(q, k, v, dout, cu, ring, causal, kernel: AttentionKernel):
    """All ranks of a ring of ``ring`` ranks in one process; returns the unsharded out, dq, dk, dv (float32)."""
    meta = ZigzagMeta.from_cu_seqlens(cu, ring)
    scale = q.shape[-1] ** -0.5
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    shard = [[zigzag_shard(x, cu, ring, p).contiguous() for x in (q, k, v, dout)] for p in range(ring)]
    plans = [
        AttentionPlan.build(
            MicrobatchLayout(cu, 1, ring, p), kernel, q.device, causal=causal, heads=heads, kv_heads=kv_heads
        )
        for p in range(ring)
    ]
    t = meta.shard_len
    kpos = [None] * ring
    for p, plan in enumerate(plans):
        if plan.gathered is not None:  # the keys of the short sequences, collected from every block
            kpos[p] = torch.empty((2, plan.gather_index.numel(), kv_heads, dim), dtype=k.dtype, device=q.device)
            for src in range(ring):
                kv = torch.stack([shard[src][1], shard[src][2]])
                kpos[p].index_copy_(1, plan.gather_index[src], kv[:, plan.split :])
    outs, lses = [], []
    for p, plan in enumerate(plans):
        acc = Accumulator(t, heads, dim, torch.float32, q.device, init=not plan.first_covers)
        for s, step in enumerate(plan.steps):
            src = (p - s) % ring
            if step is not None:
                kernel.forward(shard[p][0], shard[src][1], shard[src][2], step, scale, acc, first=s == 0)
        if plan.gathered is not None:
            kernel.gathered_forward(shard[p][0], kpos[p][0], kpos[p][1], plan.gathered, scale, acc)
        lse = acc.lse.clone()
        lse.masked_fill_(lse == float("-inf"), float("inf"))  # as the ring does before its backward
        lse[acc.sink] = float("inf")
        outs.append(acc.out3().clone())
        lses.append(lse)
    dq = [torch.zeros(t * heads + 1, dim, device=q.device) for _ in range(ring)]
    dk = [torch.zeros(t * kv_heads + 1, dim, device=q.device) for _ in range(ring)]
    dv = [torch.zeros(t * kv_heads + 1, dim, device=q.device) for _ in range(ring)]
    for p, plan in enumerate(plans):
        out_p = outs[p].to(q.dtype)
        if plan.gathered is not None:
            dq_g = torch.zeros_like(dq[p])
            dkv = kernel.gathered_backward(
                shard[p][3], shard[p][0], kpos[p][0], kpos[p][1], out_p, lses[p], plan.gathered, scale, dq_g
            )
            dq[p] += dq_g
            for src in range(ring):  # each block's share goes back to its owner
                part = dkv.index_select(1, plan.gather_index[src]).reshape(2, -1, dim)
                dk[src][plan.split * kv_heads : t * kv_heads] += part[0]
                dv[src][plan.split * kv_heads : t * kv_heads] += part[1]
        for s, step in enumerate(plan.steps):
            src = (p - s) % ring
            if step is None:
                continue
            apply = kernel.backward(
                shard[p][3], shard[p][0], shard[src][1], shard[src][2], out_p, lses[p], step, scale, dq[p], True
            )
            apply(dk[src], dv[src], True)

    def unshard(per_rank, h):
        total = torch.zeros((meta.total, h, dim), device=q.device)
        for p, x in enumerate(per_rank):
            src = zigzag_source_index(meta, p)[1].to(x.device)
            keep = src >= 0
            total[src[keep]] = x[: t * h].view(t, h, dim)[keep]
        return total

    return (
        unshard([o.reshape(-1, dim) for o in outs], heads),
        unshard(dq, heads),
        unshard(dk, kv_heads),
        unshard(dv, kv_heads),
    )


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float32."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def ring_checks(
    device: torch.device, kernel: AttentionKernel, dtype: torch.dtype, lengths: list[int] | None = None
) -> list[dict]:
    """The emulated ring against the float32 reference, for rings of 1, 2 and 4 ranks."""
    bound = BF16_BOUND if dtype in (torch.bfloat16, torch.float16) else 1e-5
    cu = [0, *itertools.accumulate(lengths or LENGTHS)]
    rows = []
    for ring, causal, (heads, kv_heads) in itertools.product((1, 2, 4), (True, False), ((8, 8), (8, 2))):
        g = torch.Generator(device="cpu").manual_seed(ring)
        q, k, v, dout = (
            torch.randn(cu[-1], h, 64, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
        )
        ref_out, ref_grads = reference_attention(q, k, v, dout, cu, causal)
        got = emulate(q, k, v, dout, cu, ring, causal, kernel)
        errors = {
            name: relative_error(a, b)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref_out, *ref_grads], strict=True)
        }
        rows.append(
            {"ring": ring, "causal": causal, "heads": heads, "kv_heads": kv_heads, "errors": errors}
            | {"ok": max(errors.values()) <= bound}
        )
    return rows


class ReferenceAttention:
    """Stands in for a model's CP context: per-document float32 SDPA (GQA by repeating KV heads)."""

    def __init__(self, cu: list[int]) -> None:
        self.cu = cu

    def attention(self, q, k, v, *, causal=True, scale=None):
        rep = q.shape[1] // k.shape[1]
        outs = [
            F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                k[a:b].transpose(0, 1).repeat_interleave(rep, 0),
                v[a:b].transpose(0, 1).repeat_interleave(rep, 0),
                is_causal=causal,
                scale=scale,
            ).transpose(0, 1)
            for a, b in itertools.pairwise(self.cu)
        ]
        return torch.cat(outs)


def _microbatch(lengths: list[int], vocab: int, seed: int):
    from lightning_hydra.data.packing import IGNORE_INDEX, RankMicrobatch
    from lightning_hydra.planner import Group

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, vocab, (n,), generator=g) for n in lengths]
    cu = [0, *itertools.accumulate(lengths)]
    tokens = torch.cat(docs)
    labels = torch.cat([torch.cat([d[1:], d.new_full((1,), IGNORE_INDEX)]) for d in docs])
    meta = ZigzagMeta.from_cu_seqlens(cu, 1)
    positions, source = zigzag_source_index(meta, 0)
    real = source >= 0
    ids = torch.zeros(meta.shard_len, dtype=torch.long)
    lab = torch.full((meta.shard_len,), IGNORE_INDEX, dtype=torch.long)
    ids[real] = tokens[source[real]]
    lab[real] = labels[source[real]]
    seq_ids = tuple(range(len(lengths)))
    mb = RankMicrobatch(ids, lab, positions, tuple(cu), Group((0,), 1, 1, seq_ids), seq_ids)
    # the reference sees the unpadded bin in bin order, positions restarting at every document
    ref_positions = torch.arange(cu[-1]) - torch.repeat_interleave(torch.tensor(cu[:-1]), torch.tensor(lengths))
    return mb, tokens, labels, ref_positions


def train_check(
    device: torch.device, kernel: str, dtype: torch.dtype, lengths: list[int] | None = None, hidden: int = 256
) -> dict:
    """One full training step of DecoderLM in ``dtype`` through the engine, against a float32 reference."""
    from lightning_hydra.models.decoder import DecoderLM

    torch.manual_seed(0)
    shape = {"vocab_size": 258, "hidden_size": hidden, "num_layers": 2, "num_heads": 8, "num_kv_heads": 2}
    model = DecoderLM(**shape)
    model.local_cp.kernel = kernel
    mb, tokens, labels, ref_positions = _microbatch(lengths or TRAIN_LENGTHS, 258, seed=1)
    reference = DecoderLM(**shape)
    reference.load_state_dict(model.state_dict())
    model.to(device=device, dtype=dtype)
    reference.to(device=device, dtype=torch.float32)
    for layer in reference.layers:
        object.__setattr__(layer.attn, "hydra_cp", ReferenceAttention(list(mb.cu_seqlens)))
    mb.input_ids, mb.labels, mb.position_ids = (x.to(device) for x in (mb.input_ids, mb.labels, mb.position_ids))
    trained = int((mb.labels != -100).sum())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with model.local_cp.use(CPGroup((0,), 1, 1), mb.cu_seqlens):
        loss = model.microbatch_loss(mb) / trained
    loss.backward()
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters()}
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    ref_logits = reference(tokens.to(device), ref_positions.to(device))
    ref_loss = F.cross_entropy(ref_logits.float(), labels.to(device), ignore_index=-100, reduction="sum") / trained
    ref_loss.backward()
    grad_errors = [relative_error(grads[name], p.grad) for name, p in reference.named_parameters()]
    loss_error = abs(float(loss.detach()) - float(ref_loss.detach())) / abs(float(ref_loss.detach()))
    finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    bound = BF16_BOUND if dtype in (torch.bfloat16, torch.float16) else 1e-4
    # bf16 gradients: relative max error over each tensor; bounded loosely (bf16 has 8 mantissa bits)
    grad_bound = 0.1 if dtype in (torch.bfloat16, torch.float16) else 1e-3
    return {
        "kernel": model.local_cp.kernel_for(device).name,
        "dtype": str(dtype),
        "tokens": mb.num_tokens,
        "loss": float(loss.detach()),
        "reference_loss": float(ref_loss.detach()),
        "loss_error": loss_error,
        "max_grad_error": max(grad_errors),
        "step_seconds": round(seconds, 4),
        "peak_bytes_per_token": None if peak is None else round(peak / mb.num_tokens, 1),
        "ok": finite and loss_error <= bound and max(grad_errors) <= grad_bound,
    }


WORLD_LENGTHS = [200, 7, 33, 90, 12, 140, 40, 61]
"""The world checks' dataset (token counts of its documents)."""


class ClockProbe(pl.Callback):
    """At the end of training: one all-reduce on the world timed by a fresh device clock, the clock kind of the
    strategy's runtime and whether the last step's rows hold finite communication times."""

    def __init__(self) -> None:
        self.result: dict = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Record the facts (every rank: the all-reduce is a collective)."""
        strategy = trainer.strategy
        clock = CommClock.for_device(strategy.root_device)
        probe = torch.ones(1024, dtype=torch.float32, device=strategy.root_device)
        with clock.measure():
            dist.all_reduce(probe)
        seconds = list(clock.read().values())
        record = strategy.last_record
        self.result = {
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "clock": type(strategy.runtime.comm_clock.source).__name__,
            "all_reduce_seconds": seconds[0] if seconds else None,
            "step_comm_finite": bool(record is not None and (record.comm >= 0).all()),
            "sum_ok": float(probe[0]) == dist.get_world_size(),
        }


def world_checks(device: torch.device, kernel: str, quick: bool) -> list[dict]:
    """A one-rank process group through the strategy's real step: replicas, then zero2 with a sharded checkpoint
    saved and resumed (see the module docstring)."""
    import tempfile
    from pathlib import Path

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
    from lightning_hydra.strategy.checkpoint import is_sharded_checkpoint
    from lightning_hydra.testing import quiet_trainer

    cuda = device.type == "cuda"
    hw = {"accelerator": "gpu", "precision": "bf16-true"} if cuda else {}
    devices = [device.index or 0] if cuda else 1
    shape = {"vocab_size": 258, "hidden_size": 32 if quick else 256, "num_layers": 2, "num_heads": 8}
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 250, (n,), generator=g) for n in WORLD_LENGTHS]
    rows = []

    def fit(sharding: str, steps: int, callbacks: list, ckpt: str | None = None):
        torch.manual_seed(0)
        model = DecoderLM(num_kv_heads=2, **shape)
        strategy = HydraStrategy(sharding=sharding, kernel=kernel, max_tokens_per_rank=256, num_microbatches=2)
        saving = any(isinstance(c, ModelCheckpoint) for c in callbacks)
        trainer = quiet_trainer(
            devices, strategy, callbacks=callbacks, max_steps=steps, enable_checkpointing=saving, **hw
        )
        trainer.fit(model, HydraDataModule(data, global_batch_tokens=300, seed=0), ckpt_path=ckpt)
        return trainer

    probe = ClockProbe()
    try:
        trainer = fit("none", 2, [probe])
        facts = probe.result
        want = "CudaEventSource" if cuda else "HostClockSource"
        ok = facts["world_size"] == 1 and facts["clock"] == want and facts["step_comm_finite"] and facts["sum_ok"]
        rows.append(
            {"check": "world_step", "steps": trainer.global_step} | facts | {"ok": ok and trainer.global_step == 2}
        )
        seconds = facts["all_reduce_seconds"]
        rows.append({"check": "comm_clock", "seconds": seconds, "ok": seconds is not None and seconds >= 0})
    except Exception as error:  # one line per failed check, then the others
        rows.append({"check": "world_step", "ok": False, "error": repr(error)})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            saves = ModelCheckpoint(dirpath=tmp, every_n_train_steps=2, save_top_k=-1, filename="s")
            fit("zero2", 2, [saves])
            path = str(Path(tmp, "s.ckpt"))
            sharded = is_sharded_checkpoint(path)
            resumed = fit("zero2", 3, [], ckpt=path)
        ok = sharded and resumed.global_step == 3
        rows.append({"check": "world_zero2_checkpoint", "sharded": sharded, "resumed_at": 2, "ok": ok})
    except Exception as error:
        rows.append({"check": "world_zero2_checkpoint", "ok": False, "error": repr(error)})
    return rows


ENGINE_CHECKS = ("flash_vs_aten", "engine_vs_varlen")
"""The kernel measurements (``gpu_measure.engine_checks``), after the ring checks."""
WORLD_MEASURES = ("peak_memory", "comm_profile")
"""The one-rank world's measurements (``gpu_measure.world_measures``), after the world checks."""


def planned_checks(world: bool) -> list[dict]:
    """Every check a run would make, in order (what ``--dry-run`` prints)."""
    rows = [{"check": "train_step"}]
    for ring, causal, (heads, kv_heads) in itertools.product((1, 2, 4), (True, False), ((8, 8), (8, 2))):
        rows.append({"check": "ring", "ring": ring, "causal": causal, "heads": heads, "kv_heads": kv_heads})
    rows += [{"check": name} for name in ENGINE_CHECKS]
    if world:
        rows += [{"check": "world_step"}, {"check": "comm_clock"}, {"check": "world_zero2_checkpoint"}]
        rows += [{"check": name} for name in WORLD_MEASURES]
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the checks; print one JSON line per check and a summary; exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    parser.add_argument("--quick", action="store_true", help="small bins and model (the CPU test)")
    parser.add_argument("--world", action=argparse.BooleanOptionalAction, default=None, help="the one-rank checks")
    parser.add_argument("--dry-run", action="store_true", help="list every check, run none")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    world = device.type == "cuda" if args.world is None else args.world
    if args.dry_run:
        planned = planned_checks(world)
        for row in planned:
            print(json.dumps(row | {"dry_run": True, "device": str(device)}), flush=True)
        print(json.dumps({"summary": True, "dry_run": True, "checks": len(planned), "ok": True}), flush=True)
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "CUDA is not available; run with --device cpu"}))
        return 1
    kernel = select_kernel(device, args.kernel)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    quick = {"lengths": [40, 7, 1, 16]} if args.quick else {}
    train = train_check(device, args.kernel, dtype, hidden=64 if args.quick else 256, **quick)
    print(json.dumps({"check": "train_step"} | train), flush=True)
    rings = ring_checks(device, kernel, dtype, **quick)
    for row in rings:
        print(json.dumps({"check": "ring"} | row), flush=True)
    import gpu_measure  # beside this script; it imports this one

    measures = gpu_measure.engine_checks(device, args.kernel, dtype, args.quick)
    for row in measures:
        print(json.dumps(row), flush=True)
    worlds = world_checks(device, args.kernel, args.quick) if world else []
    for row in worlds:
        print(json.dumps(row), flush=True)
    world_measures = gpu_measure.world_measures(device, args.kernel, args.quick) if world else []
    for row in world_measures:
        print(json.dumps(row), flush=True)
    measures += world_measures
    summary = {
        "summary": True,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "kernel": kernel.name,
        "dtype": str(dtype),
        "train_step_ok": train["ok"],
        "peak_bytes_per_token": train["peak_bytes_per_token"],
        "ring_ok": all(r["ok"] for r in rings),
        "worst_ring_error": max(max(r["errors"].values()) for r in rings),
        "world_ok": all(r["ok"] for r in worlds) if world else None,
        "measure_ok": all(r["ok"] for r in measures),
        "skipped": [r["check"] for r in measures if "skipped" in r],
        "ok": train["ok"] and all(r["ok"] for r in rings + worlds + measures),
    }
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
