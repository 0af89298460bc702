"""Benchmark: the pipeline bubble measured from the stages' timelines, beside its projection, per policy.

``python -m lightning_hydra.bench.pipeline`` trains the reference decoder on the embedded corpus on 4 CPU ranks as
2 pipeline stages x a pool of 2 (``HydraStrategy(pipeline_stages=2)``), once per policy (static, mcore, hydra: the
same global batches), and prints JSON with, per policy, the median over steps of

- ``bubble_pp``: measured: each rank's forward and backward busy times replayed in the 1F1B order with the
  schedule's dependencies (on this host more ranks share the cores than it has, so wall time measures time
  slicing; see :func:`lightning_hydra.metrics.loads.pipeline_replay`);
- ``bubble_pp_projected``: the projection from per-microbatch maximum times, as data-parallel runs report it;
- ``bubble_pp_min``: the floor of the step's measured times
  (:func:`~lightning_hydra.metrics.bubbles.pipeline_bubble_floor`; ``(P - 1) / (M + P - 1)`` when every microbatch
  takes equally long on every stage);
- ``projection_error``: ``|measured - projected|``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch

__all__ = ["main"]


class _Collect(pl.Callback):
    """Global rank 0 writes every step's pipeline metrics."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        from lightning_hydra.metrics.loads import step_metrics

        record = module.last_record
        if trainer.global_rank == 0 and record is not None:
            metrics = step_metrics(record, replay=True)
            self.rows.append({k: float(v) for k, v in metrics.items() if k.startswith(("bubble/", "balance/"))})

    def on_train_end(self, trainer, module) -> None:
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.rows))


def _run(policy: str, args: argparse.Namespace, out: Path) -> list[dict[str, float]]:
    from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
    from lightning_hydra.testing import quiet_trainer

    pl.seed_everything(0, verbose=False)
    model = DecoderLM(hidden_size=args.hidden, num_layers=4, num_heads=4, num_kv_heads=2, lr=2e-3)
    strategy = HydraStrategy(
        policy=policy,
        pipeline_stages=2,
        max_tokens_per_rank=args.capacity,
        num_microbatches=args.microbatches,
        ranks_per_node=2,
        kernel="cpu",
        calibrate=True,
        start_method="spawn",
        monitor=False,
    )
    pool_tokens = 2 * args.capacity * args.microbatches
    data = HydraDataModule(global_batch_tokens=int(0.75 * pool_tokens), seed=0, corpus_max_bytes=2 * args.capacity - 64)
    trainer = quiet_trainer(4, strategy, callbacks=[_Collect(out)], max_steps=args.steps)
    trainer.fit(model, data)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print JSON."""
    parser = argparse.ArgumentParser(prog="python -m lightning_hydra.bench.pipeline", description=__doc__)
    parser.add_argument("--steps", type=int, default=8, help="training steps per policy")
    parser.add_argument("--microbatches", type=int, default=6, help="microbatches per step")
    parser.add_argument("--capacity", type=int, default=1024, help="max_tokens_per_rank")
    parser.add_argument("--hidden", type=int, default=128, help="model width")
    parser.add_argument("--policies", nargs="+", default=["static", "mcore", "hydra"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies:
            rows = _run(policy, args, Path(tmp) / f"{policy}.json")[1:]  # step 0: the uncalibrated model
            measured = np.array([r["bubble/pp"] for r in rows])
            projected = np.array([r["bubble/pp_projected"] for r in rows])
            result[policy] = {
                "bubble_pp": float(np.median(measured)),
                "bubble_pp_projected": float(np.median(projected)),
                "bubble_pp_min": float(np.median([r["bubble/pp_min"] for r in rows])),
                "projection_error": float(np.median(np.abs(measured - projected))),
                "balance": float(np.median([r["balance/max_over_mean"] for r in rows])),
                "steps": len(rows),
            }
    setup = {"stages": 2, "pool": 2, **{k: v for k, v in vars(args).items() if k != "policies"}}
    print(json.dumps({"setup": setup, "policies": result}, indent=2))


if __name__ == "__main__":
    main()
