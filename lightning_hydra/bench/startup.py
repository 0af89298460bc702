"""Start-up: seconds from ``lightning-hydra fit`` to the first training step of the 4-rank CPU demo, and where they go.

Runs the demo (``recipes/cpu-demo.yaml``, 5 steps, ``sharding="zero2"``) as a user would, with a callback that
prints wall-clock marks on global rank 0 (the callbacks built, set-up done, training started, first batch), and
prints one JSON object::

    python -m lightning_hydra.bench.startup                        # this checkout, Numba's cache as it is
    python -m lightning_hydra.bench.startup --cold                 # an empty Numba cache (a fresh install)
    python -m lightning_hydra.bench.startup --repo /tmp/base --cold  # another checkout of the package (before/after)

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

__all__ = ["main"]

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


def main(argv: list[str] | None = None) -> int:
    """Entry point: measure and print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2], help="checkout to run")
    parser.add_argument("--cold", action="store_true", help="start with an empty Numba cache")
    parser.add_argument("--steps", type=int, default=5, help="training steps of the run")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.repo.resolve(), cold=args.cold, steps=args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
