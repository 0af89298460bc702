"""Benchmark: what tensor parallelism costs and saves on a rank.

``python -m lightning_hydra.bench.tp`` prints JSON with, for the same global batch on 4 gloo ranks (a replica per
rank over a pool of 4, or TP 2 over a pool of 2, whose TP ranks split the blocks of a pool position holding twice
the tokens, without (``tp2``) and with (``tp2_sp``) sequence parallelism):

- ``bytes``: bytes one rank holds of parameters, gradients and AdamW state (local shards), and the activation bytes
  autograd saves in its step (distinct tensors, parameters excluded), measured from the tensors;
- ``busy_s``: per-rank busy (thread CPU) seconds of a training step (median over steps, mean over ranks), and TP's
  ratio to the replica's (measured in the same run; CPU threads, not a GPU's timing);
- ``llama3_70b_capacity``: ``max_tokens_per_rank="auto"`` of a Llama-3-70B shape at 256 GPUs on 80 GB per TP degree
  (zero3, selective checkpointing, bf16-mixed, AdamW), with and without sequence parallelism, from the memory model
  (not a measurement);
- ``simulated_2048``: the simulator's 2,048-GPU job (``recipes/sim-2048-256k-pp.yaml``, a Llama-3-70B shape at 256K
  over PP 4) as written, TP 8 (a pool of 64; the planner's cost model at ``tensor_parallel=8``), and with TP not
  modelled, TP 1 (a pool of 512 whose ranks hold an eighth of the tokens, the same global batch): tokens per
  second, 1F1B bubble, memory headroom (the planner's memory model, ``lightning_hydra.sim.footprint``) and the share
  of busy time spent in TP's own collectives (the truth times them: all-gathers and reduce-scatters with the job's
  sequence parallelism, all-reduces without) per policy, and TP 8's throughput over TP 1's from the one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import torch

from lightning_hydra.planner.memory import ModelMemoryShape, memory_capacity
from lightning_hydra.testing import run_world

__all__ = ["main"]

LLAMA3_70B = ModelMemoryShape.for_decoder(8192, 80, 64, 8, 28672, 128256)
"""Llama-3-70B's shape (untied embeddings)."""


def _worker(rank: int, world: int, tensor: int, sequence_parallel: bool, steps: int, tokens: int, hidden: int) -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_hydra import DecoderLM
    from lightning_hydra.cp import CPContext
    from lightning_hydra.strategy.gradients import GradientReducer
    from lightning_hydra.strategy.sharding import state_bytes, sync_module_states
    from lightning_hydra.strategy.tensor import parallelize, tensor_mesh
    from lightning_hydra.strategy.tensor_pool import TensorGradientSync

    torch.manual_seed(0)
    model = DecoderLM(hidden_size=hidden, num_layers=4, num_heads=8, num_kv_heads=4)
    sync_module_states(model, torch.device("cpu"))
    pool = world // tensor
    if tensor > 1:
        mesh = tensor_mesh("cpu", stages=1, pool=pool, tensor=tensor)
        parallelize(model, mesh["tp"], sequence_parallel=sequence_parallel)
        sync = TensorGradientSync(list(model.parameters()), mesh["pool"].get_group())
    else:
        sync = GradientReducer(list(model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    held = tokens * tensor  # the same global batch: a pool position of a TP group holds T ranks' tokens
    g = torch.Generator().manual_seed(rank // tensor)  # the TP ranks of a position see the same tokens
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        local = x.to_local() if isinstance(x, DTensor) else x
        if x.numel():
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return x

    busy, measured, activations = [], {}, 0
    for _ in range(steps):
        ids = torch.randint(0, 256, (held,), generator=g)
        seen.clear()
        start = time.thread_time()
        sync.begin()
        sync.arm()
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x),
            model.local_cp.use(CPContext.local_group(), [0, held // 2, held]),
        ):
            loss = model(ids, torch.arange(held) % (held // 2), labels=ids)
        loss.backward()
        sync.finish()
        optimizer.step()
        busy.append(time.thread_time() - start)
        if not measured:
            measured = state_bytes(model, optimizer)
            params = {
                (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()
            }
            activations = sum(v for k, v in seen.items() if k not in params)
        optimizer.zero_grad(set_to_none=tensor > 1)
    if isinstance(sync, GradientReducer):
        sync.remove()
    return {"bytes": {**measured, "activations": activations}, "busy_s": sorted(busy)[len(busy) // 2]}


def simulated_2048(steps: int | None = None) -> dict[str, Any]:
    """The simulator's 2,048-GPU job at TP 8 (as its recipe says) and at TP 1, on the same GPUs and global tokens.

    Args:
        steps: Global batches per run (default: the recipe's).

    Returns:
        ``{"tp8": {policy: figures}, "tp1": {...}, "tp8_over_tp1": {policy: throughput ratio}}``.
    """
    from lightning_hydra.cli import recipe_path
    from lightning_hydra.sim.scenario import load_scenario
    from lightning_hydra.sim.simulate import simulate

    base = load_scenario(recipe_path("sim-2048-256k-pp"), steps=steps)
    keys = ("tokens_per_s", "tokens_per_s_uncalibrated", "bubble_pp", "memory_headroom", "cost_model_error")
    keys += ("tp_comm_share",)  # median over steps of TP collectives' seconds over all busy seconds
    out: dict[str, Any] = {}
    for tp in (base.job.tp, 1):
        tokens = base.job.max_tokens_per_rank * tp // base.job.tp  # the pool's tokens per microbatch unchanged
        job = dataclasses.replace(base.job, tp=tp, max_tokens_per_rank=tokens)
        result = simulate(dataclasses.replace(base, job=job, policies=["mcore", "hydra"]))
        out[f"tp{tp}"] = {"pool": result["pool"], **{p: {k: s[k] for k in keys} for p, s in result["policies"].items()}}
    high, low = out[f"tp{base.job.tp}"], out["tp1"]
    out[f"tp{base.job.tp}_over_tp1"] = {p: high[p]["tokens_per_s"] / low[p]["tokens_per_s"] for p in ("mcore", "hydra")}
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print JSON."""
    parser = argparse.ArgumentParser(prog="python -m lightning_hydra.bench.tp", description=__doc__)
    parser.add_argument("--steps", type=int, default=3, help="training steps per configuration (median busy time)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank of the replica pool per step")
    parser.add_argument("--hidden", type=int, default=256, help="model width of the measured DecoderLM")
    parser.add_argument("--sim-steps", type=int, default=None, help="global batches of the simulated job (recipe's)")
    args = parser.parse_args(argv)
    configs = {"tp1": (1, False), "tp2": (2, False), "tp2_sp": (2, True)}
    runs = {
        name: run_world(4, _worker, t, sp, args.steps, args.tokens, args.hidden, timeout=1800)
        for name, (t, sp) in configs.items()
    }
    summary = {}
    for name, ranks in runs.items():
        keys = ranks[0]["bytes"]
        summary[name] = {
            "bytes": {k: max(r["bytes"][k] for r in ranks) for k in keys},
            "busy_s": sum(r["busy_s"] for r in ranks) / len(ranks),
        }

    def ratios(name: str) -> dict[str, float]:
        base, run = summary["tp1"], summary[name]
        return {
            **{f"{k}_bytes": run["bytes"][k] / v for k, v in base["bytes"].items() if v},
            "busy": run["busy_s"] / base["busy_s"],
        }

    capacity = {
        label: {
            t: memory_capacity(
                LLAMA3_70B, budget=80e9, sharding="zero3", precision="bf16-mixed", checkpointing="selective",
                world_size=256 // t, ranks_per_node=8 // t, num_microbatches=4, tensor_parallel=t,
                sequence_parallel=sp and t > 1,
            ).capacity
            for t in (1, 2, 4, 8)
        }
        for label, sp in (("sequence_parallel", True), ("no_sequence_parallel", False))
    }  # fmt: skip
    result = {
        "setup": {"ranks": 4, "global_tokens": 4 * args.tokens, "hidden": args.hidden, "layers": 4, "heads": 8},
        "replica": summary["tp1"],
        "tp2": summary["tp2"],
        "tp2_sp": summary["tp2_sp"],
        "tp2_vs_replica": ratios("tp2"),
        "tp2_sp_vs_replica": ratios("tp2_sp"),
        "llama3_70b_capacity": capacity,
        "simulated_2048": simulated_2048(args.sim_steps),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
