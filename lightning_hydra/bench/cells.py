"""The cells the truth-timed benchmarks walk: pools x contexts x length distributions x truths, as command-line
arguments and as one loop (:mod:`~lightning_hydra.bench.headroom`, :mod:`~lightning_hydra.bench.reach`)."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Sequence

from lightning_hydra.bench.batches import DISTRIBUTIONS
from lightning_hydra.bench.schedule import CONTEXTS
from lightning_hydra.sim.family import DEAR_TRUTHS, TRUTHS

__all__ = ["add_cell_arguments", "cells_of"]


def add_cell_arguments(
    parser: argparse.ArgumentParser, *, contexts: Sequence[str] = tuple(CONTEXTS), truths: Sequence[str]
) -> None:
    """Add ``--world-sizes`` (default 64), ``--contexts``, ``--distributions`` (default all) and ``--truths`` to
    ``parser``.

    Args:
        parser: The benchmark's parser.
        contexts: The contexts walked by default.
        truths: The truths walked by default (any of the family's and the dear family's may be named).
    """
    parser.add_argument("--world-sizes", type=int, nargs="*", default=[64])
    parser.add_argument("--contexts", nargs="*", default=list(contexts), choices=list(CONTEXTS))
    parser.add_argument("--distributions", nargs="*", default=list(DISTRIBUTIONS), choices=list(DISTRIBUTIONS))
    parser.add_argument("--truths", nargs="*", default=list(truths), choices=[*TRUTHS, *DEAR_TRUTHS])


def cells_of(args: argparse.Namespace) -> Iterator[tuple[int, str, str, str]]:
    """Every ``(world size, context, distribution, truth)`` of parsed arguments (:func:`add_cell_arguments`), in that
    nesting order."""
    yield from itertools.product(args.world_sizes, args.contexts, args.distributions, args.truths)
