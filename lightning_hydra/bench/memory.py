"""Benchmark: what sharding and activation checkpointing cost and save.

``python -m lightning_hydra.bench.memory`` prints JSON with

- ``state_bytes``: bytes one rank holds of parameters, gradients and AdamW state under each sharding mode at 4
  gloo ranks, measured from the tensors after a step of a small :class:`~lightning_hydra.DecoderLM`, and their
  ratio to a replica's;
- ``step_time``: per-rank busy (thread CPU) time of a training step under each mode and with selective activation
  checkpointing, as ratios to the replica without checkpointing (measured in the same run);
- ``llama3_8b_capacity``: ``max_tokens_per_rank="auto"`` for Llama-3-8B at 64 ranks (8 per node, AdamW,
  ``bf16-mixed``, 8 microbatches) on 80 GB and 141 GB GPUs, per mode and checkpointing, from the memory model
  (:mod:`lightning_hydra.planner.memory`; not a measurement).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_hydra.planner.memory import LLAMA3_8B, memory_capacity
from lightning_hydra.testing import run_world

__all__ = ["main"]

MODES = ("none", "zero2", "zero3", "hsdp")


def _worker(rank: int, world: int, steps: int, tokens: int, hidden: int) -> dict:
    from lightning_hydra import DecoderLM
    from lightning_hydra.cp import CPContext
    from lightning_hydra.strategy.gradients import GradientReducer
    from lightning_hydra.strategy.sharding import build_mesh, shard_model, state_bytes, sync_module_states

    out: dict = {}
    for mode in MODES:
        for checkpointing in ("none", "selective") if mode in ("none", "zero2") else ("none",):
            torch.manual_seed(0)
            model = DecoderLM(hidden_size=hidden, num_layers=4, num_heads=8, num_kv_heads=4)
            sync_module_states(model, torch.device("cpu"))
            model.set_activation_checkpointing(checkpointing)
            if mode != "none":
                shard_model(model, mode, build_mesh(mode, world, 2, "cpu"))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            reducer = GradientReducer(list(model.parameters())) if mode == "none" else None
            g = torch.Generator().manual_seed(rank)
            busy = []
            measured: dict = {}
            for _ in range(steps):
                ids = torch.randint(0, 256, (tokens,), generator=g)
                start = time.thread_time()
                if reducer is not None:
                    reducer.begin()
                    reducer.arm()
                with model.local_cp.use(CPContext.local_group(), [0, tokens // 2, tokens]):
                    loss = model(ids, torch.arange(tokens) % (tokens // 2), labels=ids)
                loss.backward()
                if reducer is not None:
                    reducer.finish()
                optimizer.step()
                busy.append(time.thread_time() - start)
                if not measured:
                    measured = state_bytes(model, optimizer)
                optimizer.zero_grad(set_to_none=reducer is None)
            if reducer is not None:
                reducer.remove()
            out[f"{mode}/{checkpointing}"] = {"bytes": measured, "busy_s": sorted(busy)[len(busy) // 2]}
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print JSON."""
    parser = argparse.ArgumentParser(prog="python -m lightning_hydra.bench.memory", description=__doc__)
    parser.add_argument("--steps", type=int, default=3, help="training steps per configuration (median busy time)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    parser.add_argument("--hidden", type=int, default=256, help="model width of the measured DecoderLM")
    args = parser.parse_args(argv)
    ranks = run_world(4, _worker, args.steps, args.tokens, args.hidden, timeout=1800)
    replica = ranks[0]["none/none"]["bytes"]
    state = {}
    for key in ranks[0]:
        mode, checkpointing = key.split("/")
        if checkpointing != "none":
            continue
        worst = {k: max(r[key]["bytes"][k] for r in ranks) for k in replica}
        state[mode] = {**worst, **{f"{k}_vs_replica": worst[k] / replica[k] for k in replica if replica[k]}}
    base = [r["none/none"]["busy_s"] for r in ranks]
    step_time = {key: sum(r[key]["busy_s"] for r in ranks) / sum(base) for key in ranks[0] if key != "none/none"}
    capacity = {}
    for budget in ("80GB", "141GB"):
        for mode in MODES:
            for checkpointing in ("none", "selective"):
                breakdown = memory_capacity(
                    LLAMA3_8B,
                    budget=float(budget[:-2]) * 1e9,
                    sharding=mode,
                    precision="bf16-mixed",
                    checkpointing=checkpointing,
                    world_size=64,
                    ranks_per_node=8,
                    num_microbatches=8,
                )
                capacity[f"{budget}/{mode}/{checkpointing}"] = breakdown.capacity
    result = {
        "setup": {"ranks": 4, "ranks_per_node": 2, "tokens_per_rank": args.tokens, "hidden": args.hidden},
        "state_bytes": state,
        "step_time_vs_replica": step_time,
        "llama3_8b_capacity": capacity,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
