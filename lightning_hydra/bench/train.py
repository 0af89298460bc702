"""Training benchmark: per-rank busy time per step under each policy, on the embedded corpus, same data and seed.

    python -m lightning_hydra.bench.train                       # 4 ranks, static / mcore / hydra
    python -m lightning_hydra.bench.train --steps 8 --world 4

Every rank measures its busy CPU time per optimizer step (forward + backward of its microbatches; time blocked in
collectives is not counted), so the figures hold on a 2-core machine where more than 2 ranks share cores. Per
policy it prints the median over steps (after the first) of ``max_r busy / mean_r busy``, the predicted figure of
the planner's cost model, and the mean busy seconds per rank and step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy

__all__ = ["BusyRecorder", "main", "run_policy"]


class BusyRecorder(pl.Callback):
    """Writes, per rank and step, the busy time of every microbatch and the planner's predicted loads."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.rows.append(
            {
                "step": batch.step,
                "busy": module.last_timing.busy,
                "wall": module.last_timing.wall,
                "predicted": list(batch.predicted_loads),
                "schedule_ms": batch.schedule_ms,
                "degrees": sorted({len(mb.ranks) for mb in batch.microbatches if mb.num_tokens}),
                "loss": float(outputs["loss"] if isinstance(outputs, dict) else outputs),
            }
        )

    def on_train_end(self, trainer, module) -> None:
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def run_policy(policy: str, *, world: int, steps: int, out: Path, capacity: int, microbatches: int, seed: int) -> dict:
    """Train the demo model for ``steps`` steps under ``policy``; return per-step per-rank figures."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = DecoderLM(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, lr=1e-3)
    dm = HydraDataModule(
        global_batch_tokens=int(0.75 * world * capacity * microbatches),
        seed=seed,
        corpus_max_bytes=world * capacity - 64,
    )
    strategy = HydraStrategy(
        policy=policy,
        max_tokens_per_rank=capacity,
        num_microbatches=microbatches,
        ranks_per_node=world,
        start_method="spawn",
        kernel="cpu",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[BusyRecorder(str(out))],
    )
    trainer.fit(model, dm)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    rows = []
    for s in range(len(ranks[0])):
        busy = [sum(ranks[r][s]["busy"]) for r in range(world)]
        pred = [sum(ranks[r][s]["predicted"]) for r in range(world)]
        rows.append(
            {
                "busy": busy,
                "max_over_mean": max(busy) / statistics.mean(busy),
                "predicted_max_over_mean": max(pred) / statistics.mean(pred),
                "degrees": ranks[0][s]["degrees"],
                "schedule_ms": ranks[0][s]["schedule_ms"],
                "loss": ranks[0][s]["loss"],
            }
        )
    measured = rows[1:] if len(rows) > 1 else rows
    return {
        "policy": policy,
        "steps": len(rows),
        "median_busy_max_over_mean": round(statistics.median(r["max_over_mean"] for r in measured), 3),
        "median_predicted_max_over_mean": round(statistics.median(r["predicted_max_over_mean"] for r in measured), 3),
        "mean_busy_s_per_rank_step": round(statistics.mean(statistics.mean(r["busy"]) for r in measured), 3),
        "degrees_used": sorted({d for r in rows for d in r["degrees"]}),
        "per_step": rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints one JSON object per policy and a summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="*", default=["static", "mcore", "hydra"])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies:
            res = run_policy(
                policy,
                world=args.world,
                steps=args.steps,
                out=Path(tmp, policy),
                capacity=args.capacity,
                microbatches=args.microbatches,
                seed=args.seed,
            )
            results[policy] = res
            print(json.dumps({k: v for k, v in res.items() if k != "per_step"}), flush=True)
    summary = {p: r["median_busy_max_over_mean"] for p, r in results.items()}
    if "hydra" in results and "mcore" in results:
        h, m = results["hydra"]["median_busy_max_over_mean"], results["mcore"]["median_busy_max_over_mean"]
        summary["hydra_gap_closed_vs_mcore"] = round(1 - (h - 1) / (m - 1), 3) if m > 1 else None
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
