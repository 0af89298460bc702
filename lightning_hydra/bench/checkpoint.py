"""Benchmark: how long a checkpoint save blocks the training step, synchronous against asynchronous, and whether a
run resumed from an asynchronously written checkpoint is exact.

::

    python -m lightning_hydra.bench.checkpoint                       # 4 CPU ranks, zero2, ~280 MB of parameters
    python -m lightning_hydra.bench.checkpoint --hidden 256 --layers 2 --steps 3   # a quick smoke run

Three runs of the same training on 4 gloo ranks (:class:`~lightning_hydra.DecoderLM` of ``--hidden`` width and
``--layers`` blocks, float32, plain SGD, ``sharding="zero2"``, ``--steps`` steps of ``--tokens`` tokens, a checkpoint
every step, every one kept):

1. synchronous saves: the uninterrupted run;
2. asynchronous saves (``HydraStrategy(async_checkpoint=True)``);
3. resumed from run 2's checkpoint of step ``steps - 1``, written while the last step ran, to the last step.

Prints one JSON object: ``blocked_s`` (per save, the longest any rank's save call blocked it:
:attr:`~lightning_hydra.strategy.checkpoint.CheckpointSaver.blocked_seconds`) and its median for each run, their
ratio ``sync_over_async`` (how many times longer a synchronous save blocks the step), ``step_s`` (rank 0's wall
seconds from one batch's start to the next, the save included), ``fit_s`` (the whole ``fit``, the end's wait for
the last write included), ``checkpoint_bytes``, and ``resumed_max_rel_diff`` and ``async_max_rel_diff``: over the
parameters, ``max |x - uninterrupted| / max |uninterrupted|`` of the resumed run's and the asynchronous run's final
parameters (0.0: exact). A CPU run stages with plain host copies; on CUDA the stager copies into pinned host memory
that it keeps between saves (not measured here). Wall seconds on a shared host vary: compare the runs of one
invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["main", "measure"]

RANKS = 4


class _Timings(pl.Callback):
    """Every rank writes its save calls' blocked seconds at the end of training; rank 0 its step wall seconds."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.starts.append(time.perf_counter())  # the last step's save included
        steps = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]
        row = {"blocked_s": list(trainer.strategy.checkpoints.blocked_seconds), "step_s": steps}
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(row))


def _dataset(steps: int, tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    lengths = [tokens // 4] * (4 * steps)  # four sequences a step
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def _model(hidden: int, layers: int) -> Any:
    from lightning_hydra import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(
        hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4, optimizer="sgd", lr=1e-2, max_grad_norm=None
    )


def _run(
    tmp: Path, name: str, args: argparse.Namespace, *, asynchronous: bool, ckpt: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """One ``fit``; returns the (launching process's, full) model and the ranks' timings."""
    from lightning_hydra import HydraDataModule, HydraStrategy
    from lightning_hydra.testing import RANK_START_METHOD, quiet_trainer

    model = _model(args.hidden, args.layers)
    strategy = HydraStrategy(
        max_tokens_per_rank=args.tokens,
        ranks_per_node=2,
        start_method=RANK_START_METHOD,
        kernel="cpu",
        sharding="zero2",
        num_microbatches=1,
        cost=model.cost_model().replace(min_chunk_tokens=16),
        monitor=False,
        async_checkpoint=asynchronous,
    )
    out = str(tmp / f"{name}.json")
    saves = ModelCheckpoint(dirpath=str(tmp / name), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(
        RANKS, strategy, callbacks=[_Timings(out), saves], max_steps=args.steps, enable_checkpointing=True
    )
    data = HydraDataModule(_dataset(args.steps, args.tokens), global_batch_tokens=args.tokens, seed=1)
    start = time.perf_counter()
    trainer.fit(model, data, ckpt_path=ckpt)
    fit_s = time.perf_counter() - start
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(RANKS)]
    blocked = [max(col) for col in zip(*(r["blocked_s"] for r in ranks), strict=True)]
    return model, {
        "blocked_s": [round(b, 4) for b in blocked],
        "blocked_median_s": round(statistics.median(blocked), 4) if blocked else None,
        "step_s": [round(s, 3) for s in ranks[0]["step_s"]],
        "fit_s": round(fit_s, 2),
    }


def _max_rel_diff(model: Any, reference: Any) -> float:
    """The largest, over the parameters, ``max |model's - reference's| / max |reference's|``."""
    worst = 0.0
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        scale = p.detach().abs().max().item() or 1.0
        worst = max(worst, (q.detach() - p.detach()).abs().max().item() / scale)
    return worst


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the three trainings (see the module documentation) and return the figures."""
    from lightning_hydra.testing import preload_for_ranks

    preload_for_ranks(["torch", "torch.distributed", "lightning.pytorch"])
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        tmp = Path(folder)
        uninterrupted, sync = _run(tmp, "sync", args, asynchronous=False)
        asynchronous, background = _run(tmp, "async", args, asynchronous=True)
        resume_from = tmp / "async" / f"step={args.steps - 1}.ckpt"
        resumed, _ = _run(tmp, "resumed", args, asynchronous=True, ckpt=str(resume_from))
        size = _bytes(resume_from.resolve())
    params = sum(p.numel() for p in uninterrupted.parameters())
    return {
        "setup": {
            "ranks": RANKS,
            "sharding": "zero2",
            "hidden": args.hidden,
            "layers": args.layers,
            "parameters": params,
            "parameter_bytes": params * 4,
            "steps": args.steps,
            "tokens_per_step": args.tokens,
            "torch": torch.__version__,
        },
        "checkpoint_bytes": size,
        "sync": sync,
        "async": background,
        "sync_over_async": round(sync["blocked_median_s"] / background["blocked_median_s"], 2),
        "async_max_rel_diff": _max_rel_diff(asynchronous, uninterrupted),
        "resumed_max_rel_diff": _max_rel_diff(resumed, uninterrupted),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: measure and print one JSON object."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hydra.bench.checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hidden", type=int, default=1024, help="model width")
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks")
    parser.add_argument("--steps", type=int, default=4, help="training steps (a save after each)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per step")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp folder)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the resumed run starts from step steps - 1)")
    print(json.dumps(measure(args), indent=2), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
