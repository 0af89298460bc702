"""The CPU demo: the reference decoder trained with HydraStrategy on 4 CPU ranks over the embedded corpus.

    python -m lightning_hydra.demo                  # 4 ranks, 20 steps, policy hydra
    python -m lightning_hydra.demo --policy mcore --steps 10

Lightning launches the ranks (gloo). Loss is logged to ``runs/demo`` (CSV) and shown in the progress bar; at the
end rank 0 prints the loss curve and the per-rank busy-time balance of the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy

__all__ = ["main"]


class _Summary(pl.Callback):
    """Collects the loss and every rank's busy time per step; rank 0 prints a summary at the end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.balance: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        busy = torch.tensor([module.last_timing.total_busy], dtype=torch.float64)
        gathered = [torch.zeros_like(busy) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, busy)  # plain collective: no autograd needed
        values = torch.cat(gathered)
        self.balance.append(float(values.max() / values.mean()))

    def on_train_end(self, trainer, module) -> None:
        if trainer.is_global_zero and self.losses:
            print(f"loss: {self.losses[0]:.3f} -> {self.losses[-1]:.3f} over {len(self.losses)} steps")
            print(f"per-rank busy time max/mean per step (median): {statistics.median(self.balance):.3f}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="hydra", choices=["hydra", "mcore", "static"])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--capacity", type=int, default=4096, help="max tokens per rank per microbatch")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    model = DecoderLM(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, lr=2e-3, warmup_steps=5)
    budget = int(0.75 * args.devices * args.capacity * args.microbatches)
    data = HydraDataModule(
        global_batch_tokens=budget, seed=args.seed, corpus_max_bytes=args.devices * args.capacity - 64
    )
    strategy = HydraStrategy(
        policy=args.policy,
        max_tokens_per_rank=args.capacity,
        num_microbatches=args.microbatches,
        ranks_per_node=args.devices,
        kernel="cpu",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=1000,
        logger=CSVLogger("runs", name=f"demo-{args.policy}"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        limit_val_batches=4,
        val_check_interval=max(1, args.steps // 2),
        num_sanity_val_steps=0,
        callbacks=[_Summary()],
    )
    trainer.fit(model, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
