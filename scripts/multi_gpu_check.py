"""Multi-GPU check of the CP engine and the strategy, 2 to 8 ranks under torchrun, each against one process.

    torchrun --standalone --nproc-per-node=4 scripts/multi_gpu_check.py                # NCCL, one GPU a rank
    torchrun --standalone --nproc-per-node=2 scripts/multi_gpu_check.py --device cpu   # the same over gloo
    python scripts/multi_gpu_check.py --dry-run                                        # list, run none

**Not run on a GPU yet** (none was available to this project); the test suite runs it over gloo on CPU.

Checks (one JSON line each from rank 0, then a summary; the exit status is non-zero if any failed):

1. ``ring``: :func:`~lightning_hydra.cp.hydra_attn_func` over a ring of every rank (Ulysses 1) on a bin of mixed
   lengths, causal; each rank's output and input gradients against its zigzag shard of per-document float32
   attention of the whole bin computed in this process (float32 inputs on CPU, bfloat16 on CUDA, bounds to match).
2. ``all_to_all``: the same with every rank in the Ulysses all-to-all (ring 1; the heads divide by the world).
3. ``tp2_vocab_loss``: :func:`~lightning_hydra.models.vocab_parallel.vocab_parallel_cross_entropy` of a head
   split by rows over TP 2 against :func:`~lightning_hydra.models.losses.chunked_cross_entropy` of the whole head
   on the device: the loss and both gradients (the weight's gathered with ``full_tensor()``); bf16 inputs on CUDA.
4. ``pipeline``: ``DecoderLM`` trained 3 SGD steps with ``pipeline_stages=2`` (2 stages x world/2); losses and
   every parameter against one process trained on the same global batches (a child process of rank 0 without the
   launcher's environment).
5. ``zero2``: the same with ``sharding="zero2"`` (FSDP2 over the world).
6. ``tp2``: the same with ``tensor_parallel=2`` and ``sharding="zero2"`` (TP 2 x pool world/2: TP 2 x pool 1 at 2
   ranks, TP 2 x pool 2 at 4), every parameter gathered with ``full_tensor()``; on CUDA under ``bf16-mixed`` (FSDP's
   bf16 policy over float32 parameters) against a one-process ``bf16-mixed`` run.
7. ``tp2_hsdp``: the same with ``sharding="hsdp"`` (FSDP2 over the pool split into ``(replicate, shard)``, nodes of
   ``max(2, local / 2)`` ranks: TP 2 x (replicate 2 x shard 1) at 4 ranks, TP 2 x (2 x 2) at 8, one TP group at 2).

The training checks run ``bf16-true`` on CUDA (``tp2``, ``tp2_hsdp``: ``bf16-mixed``) and float32 on CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from gpu_check import BF16_BOUND, reference_attention, relative_error  # beside this script
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.cp import GroupCache, hydra_attn_func, zigzag_shard
from lightning_hydra.models.losses import chunked_cross_entropy
from lightning_hydra.models.vocab_parallel import vocab_parallel_cross_entropy
from lightning_hydra.planner import Group
from lightning_hydra.strategy.tensor import tensor_mesh
from lightning_hydra.testing import quiet_trainer

LENGTHS = [300, 7, 96, 64, 3, 180, 41, 120, 12, 77]
"""The attention checks' bin."""
DATA_LENGTHS = [230, 7, 95, 64, 3, 180, 41, 120, 12, 77, 200, 33, 150, 9, 60, 110, 25, 88, 140, 5]
"""The training checks' documents."""
CHECKS = ("ring", "all_to_all", "tp2_vocab_loss", "pipeline", "zero2", "tp2", "tp2_hsdp")
TRAINING = ("pipeline", "zero2", "tp2", "tp2_hsdp")
"""The checks that train under Lightning (on the process group the others ran on)."""
LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
"""torchrun's variables (and every ``TORCHELASTIC_*``), left out of the one-process reference's environment."""


def _model() -> DecoderLM:
    torch.manual_seed(5)
    return DecoderLM(vocab_size=258, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=2, lr=1.0, optimizer="sgd")


def _dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 250, (n,), generator=g) for n in DATA_LENGTHS]


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.params: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_end(self, trainer, module) -> None:
        if getattr(trainer.strategy, "tensor_parallel", 1) > 1:  # every parameter, gathered (collective)
            self.params = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu()
                for n, p in module.named_parameters()
            }


def precision(name: str, device: torch.device) -> str:
    """A training check's (and its reference's) Trainer precision."""
    if device.type != "cuda":
        return "32-true"
    return "bf16-mixed" if name in ("tp2", "tp2_hsdp") else "bf16-true"


def _fit(devices: int, strategy, device: torch.device, precision: str, num_nodes: int = 1) -> tuple[list[float], dict]:
    """Three steps; the losses and (on rank 0) the full parameters."""
    model, losses = _model(), _Losses()
    hw = {"accelerator": "gpu"} if device.type == "cuda" else {}
    trainer = quiet_trainer(
        devices, strategy, callbacks=[losses], max_steps=3, num_nodes=num_nodes, precision=precision, **hw
    )
    trainer.fit(model, HydraDataModule(_dataset(), global_batch_tokens=700, seed=2))
    if losses.params:
        state = losses.params
    elif isinstance(strategy, HydraStrategy) and strategy.is_sharded:
        state = strategy.full_state_dict()
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return losses.losses, state


def reference(out: str, device: torch.device, precision: str) -> None:
    """One process (no launcher environment): the losses and parameters the distributed runs must reproduce."""
    strategy = HydraStrategy(kernel="auto" if device.type == "cuda" else "cpu", max_tokens_per_rank=4096)
    losses, state = _fit(1, strategy, device, precision)
    torch.save({"losses": losses, "state": state}, out)


def _dtype_bound(device: torch.device) -> tuple[torch.dtype, float]:
    """The inputs' dtype of the checks against float32 in this process, and their bound."""
    return (torch.bfloat16, BF16_BOUND) if device.type == "cuda" else (torch.float32, 1e-5)


def _worst(errors: dict[str, float], device: torch.device) -> float:
    """The largest error over every rank (collective)."""
    worst = torch.tensor([max(errors.values())], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def attention_check(name: str, rank: int, world: int, device: torch.device) -> dict:
    """The engine over every rank (``ring`` or ``all_to_all``) against degree 1 in this process."""
    dtype, bound = _dtype_bound(device)
    ulysses, ring = (1, world) if name == "ring" else (world, 1)
    heads, kv_heads = (8, 2) if ulysses == 1 else (2 * world, world)  # the all-to-all splits both by the world
    cu = [0, *itertools.accumulate(LENGTHS)]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(cu[-1], h, 32, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
    )
    cache = GroupCache()
    record = Group(tuple(range(world)), ulysses, ring)
    cache.prepare([record])
    group = cache.get(record.ranks, ulysses, ring)
    ins = [zigzag_shard(x, cu, world, rank).contiguous().requires_grad_() for x in (q, k, v)]
    out = hydra_attn_func(*ins, cu, group=group)
    out.backward(zigzag_shard(dout, cu, world, rank))
    ref, grads = reference_attention(q, k, v, dout, cu, True)  # the whole bin in float32 in this process
    refs = [ref, *grads]
    real = zigzag_shard(torch.ones((cu[-1], 1, 1), device=device), cu, world, rank)  # 0 on padding rows
    errors = {
        n: relative_error(a * real, zigzag_shard(b, cu, world, rank))
        for n, a, b in zip(("out", "dq", "dk", "dv"), [out.detach(), *(x.grad for x in ins)], refs, strict=True)
    }
    cache.destroy()
    worst = _worst(errors, device)
    return {"check": name, "ulysses": ulysses, "ring": ring, "errors": errors, "worst": worst} | {"ok": worst <= bound}


def vocab_check(world: int, device: torch.device) -> dict:
    """``tp2_vocab_loss``: the vocabulary-parallel loss of a head split by rows over TP 2 (every TP group of the
    world at once) against the chunked loss of the whole head, loss and gradients, on the device."""
    dtype, bound = _dtype_bound(device)
    g = torch.Generator().manual_seed(3)
    hidden, weight = (torch.randn(n, 64, generator=g).to(device, dtype) for n in (300, 258))
    labels = torch.randint(0, 258, (300,), generator=g).to(device)
    labels[::7] = -100  # ignored tokens
    mesh = tensor_mesh(device.type, stages=1, pool=world // 2, tensor=2)["tp"]
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    whole = chunked_cross_entropy(h1, w1, labels, chunk_tokens=64)
    whole.backward()
    h2 = hidden.clone().requires_grad_()
    w2 = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    split = vocab_parallel_cross_entropy(h2, w2, labels, chunk_tokens=64)
    split.backward()
    errors = {
        "loss": float((split.detach().float() - whole.detach().float()).abs() / whole.detach().float().abs()),
        "dhidden": relative_error(h2.grad, h1.grad),
        "dweight": relative_error(w2.grad.full_tensor(), w1.grad),  # collective over the TP group
    }
    rows = w2.grad.to_local().shape[0]  # half the vocabulary's rows on each rank
    worst = _worst(errors, device)
    return {"check": "tp2_vocab_loss", "errors": errors, "worst": worst, "shard_rows": rows} | {
        "ok": worst <= bound and rows == 129
    }


def training_check(name: str, world: int, device: torch.device, expected: dict | None) -> dict:
    """A pipeline (2 stages), zero2, TP 2 x zero2 or TP 2 x hsdp run on every rank against the one-process reference
    (compared on rank 0, which holds it and the full parameters)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    kw = {
        "pipeline": {"pipeline_stages": 2, "ranks_per_node": world // 2},
        "zero2": {"sharding": "zero2"},
        "tp2": {"tensor_parallel": 2, "sharding": "zero2", "ranks_per_node": local},
        "tp2_hsdp": {"tensor_parallel": 2, "sharding": "hsdp", "ranks_per_node": max(2, local // 2)},
    }[name]
    kernel = "auto" if device.type == "cuda" else "cpu"
    strategy = HydraStrategy(kernel=kernel, max_tokens_per_rank=4096, num_microbatches=4, **kw)
    losses, state = _fit(local, strategy, device, precision(name, device), num_nodes=world // local)
    if expected is None:
        return {"check": name, "ok": True}
    ref = expected[precision(name, device)]
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True))
    param_error = max(relative_error(state[k], v) for k, v in ref["state"].items())
    bound = 5e-2 if device.type == "cuda" else 1e-5  # bf16 on CUDA: other reduction orders than one process
    return {"check": name, "loss_error": loss_error, "param_error": param_error} | {
        "ok": loss_error <= bound and param_error <= bound
    }


def main(argv: list[str] | None = None) -> int:
    """Run every check on this rank; rank 0 prints the lines; exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (NCCL, one GPU per rank) or cpu (gloo)")
    parser.add_argument("--dry-run", action="store_true", help="list the checks, run none")
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)  # the one-process child
    parser.add_argument("--precision", default="32-true", help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args(argv)
    if args.dry_run:
        for name in CHECKS:
            print(json.dumps({"check": name, "dry_run": True}))
        print(json.dumps({"summary": True, "dry_run": True, "checks": len(CHECKS), "ok": True}))
        return 0
    kind = torch.device(args.device).type
    if args.reference:
        reference(args.reference, torch.device(kind, 0) if kind == "cuda" else torch.device("cpu"), args.precision)
        return 0
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if not 2 <= world <= 8 or world % 2:
        print(json.dumps({"ok": False, "error": f"run under torchrun with 2, 4, 6 or 8 ranks (got {world})"}))
        return 1
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    precisions = sorted({precision(name, device) for name in TRAINING})
    with tempfile.TemporaryDirectory() as tmp:
        paths = {p: str(Path(tmp, f"reference-{p}.pt")) for p in precisions}
        if rank == 0:  # the one-process references (one a precision), without the launcher's environment
            env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC")}
            for p, path in paths.items():
                command = [sys.executable, __file__, "--device", kind, "--reference", path, "--precision", p]
                subprocess.run(command, env=env, check=True)
        rows = []
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", device_id=device if kind == "cuda" else None)
        dist.barrier()
        expected = {p: torch.load(path, weights_only=False) for p, path in paths.items()} if rank == 0 else None
        for name in ("ring", "all_to_all"):
            rows.append(attention_check(name, rank, world, device))
        rows.append(vocab_check(world, device))
        # Lightning runs on this process group: destroying it would restart the groups' names at "0", and the new
        # groups would read the destroyed ones' peer addresses from the launcher's store (gloo: connection refused)
        for name in TRAINING:
            rows.append(training_check(name, world, device, expected))
        dist.destroy_process_group()
    if rank == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
        summary = {"summary": True, "world": world, "device": kind, "ok": all(r["ok"] for r in rows)}
        print(json.dumps(summary), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
