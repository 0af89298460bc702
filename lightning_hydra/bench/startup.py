"""Start-up: seconds from ``lightning-hydra fit`` to the first training step of the 4-rank CPU demo, and where they go.

Runs the demo (``recipes/cpu-demo.yaml``, 5 steps, ``sharding="zero2"``) as a user would, with a callback that
prints wall-clock marks on global rank 0 (the callbacks built, set-up done, training started, first batch), and
prints one JSON object::

    python -m lightning_hydra.bench.startup                        # this checkout, Numba's cache as it is
    python -m lightning_hydra.bench.startup --cold                 # an empty Numba cache (a fresh install)
    python -m lightning_hydra.bench.startup --repo /tmp/base --cold  # another checkout of the package (before/after)

With ``--pretrained``, it measures instead what loading pretrained weights costs each rank: a Llama-shaped model
(``--hidden``, ``--layers``, ``--vocab``; 336 MB of float32 by default) saved with transformers' ``save_pretrained``
is trained one step on 4 gloo ranks under tensor parallelism 2 x zero3 from ``HFCausalLM.from_pretrained``, and
each rank reports how much its resident set's high-water mark rose while it materialised and filled its shards
(``strategy.startup_memory``: the process's whole resident set, the memory-mapped file pages it touched
included), its parameter shards' bytes and the bytes it read from the files::

    python -m lightning_hydra.bench.startup --pretrained

``first_step_s`` is from starting the command to the first batch; ``marks`` gives each mark in seconds from the
start: ``built`` (one per process: the launching one, then the three ranks it starts, each after its imports and
the recipe), ``setup``, ``train_start``, ``first_step``. ``--cold`` points ``NUMBA_CACHE_DIR`` at an empty
directory, so every planning process finds no compiled kernels. Wall seconds on a shared host vary from run to run:
compare runs made one after the other, and the parts (imports before ``built``, compiling between ``train_start``
and ``first_step``) rather than the totals of different hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override

__all__ = ["LoadMemory", "main", "measure_pretrained"]

_CALLBACK = """
import time

import lightning.pytorch as pl


class Marks(pl.Callback):
    def __init__(self):
        print(f"MARK built {time.time():.3f}", flush=True)

    def _mark(self, trainer, name):
        if trainer.is_global_zero:
            print(f"MARK {name} {time.time():.3f}", flush=True)

    def setup(self, trainer, module, stage):
        self._mark(trainer, "setup")

    def on_train_start(self, trainer, module):
        self._mark(trainer, "train_start")

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 0:
            self._mark(trainer, "first_step")
"""


def measure(repo: Path, *, cold: bool, steps: int = 5, timeout: float = 900.0) -> dict:
    """Run the demo from ``repo`` and return its marks (see the module documentation)."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "startup_marks.py").write_text(_CALLBACK)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(repo), os.environ.get("PYTHONPATH", "")])}
        if cold:
            env["NUMBA_CACHE_DIR"] = str(Path(tmp, "numba"))
        command = [
            sys.executable, "-m", "lightning_hydra", "fit", "--config", str(repo / "recipes" / "cpu-demo.yaml"),
            f"--trainer.max_steps={steps}", "--trainer.strategy.init_args.sharding=zero2",
            "--trainer.callbacks+=startup_marks.Marks", f"--trainer.logger.init_args.save_dir={tmp}/runs",
        ]  # fmt: skip
        start = time.time()
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        total = time.time() - start
    if done.returncode:
        raise RuntimeError(f"the demo failed ({done.returncode}):\n{done.stderr[-3000:]}")
    marks: dict[str, list[float]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("MARK "):
            _, name, at = line.split()
            marks.setdefault(name, []).append(round(float(at) - start, 2))
    return {
        "repo": str(repo),
        "cold_numba_cache": cold,
        "first_step_s": marks["first_step"][0],
        "total_s": round(total, 2),
        "marks": marks,
    }


class LoadMemory(pl.Callback):
    """Writes each rank's ``strategy.startup_memory`` and the bytes its model read (``{out}.rank{r}``)."""

    def __init__(self, out: str) -> None:
        self.out = out

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        row = {**(trainer.strategy.startup_memory or {}), "read": getattr(pl_module, "loaded_bytes", None)}
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(row))


def measure_pretrained(*, hidden: int, layers: int, vocab: int, ranks: int = 4, tensor: int = 2) -> dict:
    """Save a Llama of that shape, load it with ``HFCausalLM.from_pretrained`` on ``ranks`` gloo ranks (TP
    ``tensor`` x zero3 over the rest) for one SGD step, and return each rank's load figures (module docs)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_hydra import HydraDataModule, HydraStrategy
    from lightning_hydra.models.hf import HFCausalLM
    from lightning_hydra.testing import quiet_trainer

    heads = max(hidden // 128, tensor)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64 * -(-(8 * hidden // 3) // 64),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        source = LlamaForCausalLM(config)
        model_bytes = sum(p.numel() * p.element_size() for p in source.parameters())
        source.save_pretrained(tmp)
        del source
        module = HFCausalLM.from_pretrained(tmp, lr=1e-3, optimizer="sgd")
        strategy = HydraStrategy(
            tensor_parallel=tensor, sharding="zero3", max_tokens_per_rank=128, ranks_per_node=ranks, num_microbatches=2,
            start_method="forkserver", kernel="cpu", monitor=False,
        )  # fmt: skip
        out = str(Path(tmp, "load"))
        generator = torch.Generator().manual_seed(0)
        data = [torch.randint(0, vocab, (n,), generator=generator) for n in (40, 64, 24, 56, 32, 48, 16, 64)]
        start = time.time()
        trainer = quiet_trainer(ranks, strategy, callbacks=[LoadMemory(out)], max_steps=1)
        trainer.fit(module, HydraDataModule(data, global_batch_tokens=300, seed=0))
        seconds = time.time() - start
        rows = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(ranks)]
    mib = 2**20
    per_rank = [
        {
            "peak_rise_mib": round((row["peak"] - row["before"]) / mib, 1),
            "shards_mib": round(row["share"] / mib, 1),
            "read_mib": round(row["read"] / mib, 1),
        }
        for row in rows
    ]
    worst = max(row["peak"] - row["before"] for row in rows)
    return {
        "mode": "pretrained",
        "layout": f"TP {tensor} x zero3 over {ranks // tensor}, {ranks} gloo ranks",
        "model_mib": round(model_bytes / mib, 1),
        "per_rank": per_rank,
        "max_peak_rise_over_model": round(worst / model_bytes, 3),
        "fit_s": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: measure and print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2], help="checkout to run")
    parser.add_argument("--cold", action="store_true", help="start with an empty Numba cache")
    parser.add_argument("--steps", type=int, default=5, help="training steps of the run")
    parser.add_argument("--pretrained", action="store_true", help="measure each rank's memory loading weights")
    parser.add_argument("--hidden", type=int, default=1024, help="--pretrained: the model's hidden size")
    parser.add_argument("--layers", type=int, default=4, help="--pretrained: the model's layers")
    parser.add_argument("--vocab", type=int, default=16384, help="--pretrained: the model's vocabulary")
    args = parser.parse_args(argv)
    if args.pretrained:
        result = measure_pretrained(hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    else:
        result = measure(args.repo.resolve(), cold=args.cold, steps=args.steps)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
