"""``python -m lightning_hydra.demo``: the CPU demo, the same as ``lightning-hydra demo``.

Trains the reference decoder on 4 CPU ranks with ``recipes/cpu-demo.yaml``; extra arguments go to LightningCLI
(for example ``--trainer.max_steps=5`` or ``--trainer.strategy.init_args.policy=mcore``).
"""

from __future__ import annotations

import sys

from lightning_hydra.cli import main as cli_main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the CPU demo recipe."""
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
