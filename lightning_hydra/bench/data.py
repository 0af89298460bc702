"""Data set-up at scale: from ``HydraDataModule.setup`` to the first planned step, for an index of 10^8 documents.

Writes a synthetic Megatron index (``.idx``: lognormal-mixture lengths up to ``--context``; the ``.bin`` file is
sparse: the few tokens read are zeros), then measures, each in a fresh process (one rank's view: every rank does
the same), the time and peak memory from ``setup`` to the first planned and packed step::

    python -m lightning_hydra.bench.data                       # 10^8 documents; today's path at 10^7
    python -m lightning_hydra.bench.data --docs 1e7 --compare 1e6

and prints one JSON object:

- ``new``: at ``--docs`` documents, the data by path (``HydraDataModule(sources=prefix)``: lengths from the
  memory-mapped index, vectorised global batches);
- ``compare``: at ``--compare`` documents, the same path (``new``) beside today's (``today``: a map-style dataset
  with a ``lengths()`` method, the lengths copied to ``int64``, and the batches formed by the loop over every
  document, :func:`~lightning_hydra.data.batching.reference_global_batches`), ``ratio`` = today's time over the
  new one's from ``setup`` to the first step, and ``data_ratio`` the same without the first plan (``data_s``:
  set-up, the epoch's batches, reading and packing the rank's share; the planner is the same in both);
- ``global_batches``: at ``--compare`` lengths in this process, the loop's time over the vectorised batches', and
  whether the two give the same batches.

Every process plans for rank 0 of a pool of ``--world-size`` ranks (Llama-3-8B cost model, ``hydra`` policy);
``first_plan_ms`` is the planner's share of the first step (the first plan of a process also compiles or loads
the planner's kernels where Numba is installed). ``rss_*`` are resident set sizes: ``base`` after the imports,
``peak`` the process's maximum (memory-mapped pages of the index that were read count in it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "measure", "write_index"]

_GIB = 2**30


def write_index(prefix: Path, docs: int, context: int, seed: int = 0, chunk: int = 10_000_000) -> int:
    """Write ``<prefix>.idx`` for ``docs`` documents (lognormal mixture up to ``context`` tokens, ``uint16``) and a
    sparse ``<prefix>.bin`` of the right size; returns the tokens."""
    from lightning_hydra.bench.batches import DISTRIBUTIONS
    from lightning_hydra.data.indexed import HEADER, VERSION, dtype_code

    rng = np.random.default_rng(seed)
    lengths = np.empty(docs, dtype=np.int32)
    for a in range(0, docs, chunk):
        b = min(docs, a + chunk)
        lengths[a:b] = DISTRIBUTIONS["lognormal"](rng, b - a, context)
    itemsize = 2
    with open(f"{prefix}.idx", "wb") as f:
        f.write(HEADER)
        f.write(np.uint64(VERSION).tobytes())
        f.write(np.uint8(dtype_code(np.uint16)).tobytes())
        f.write(np.uint64(docs).tobytes())
        f.write(np.uint64(docs + 1).tobytes())
        f.write(lengths.tobytes())
        offset = 0
        for a in range(0, docs, chunk):
            part = lengths[a : a + chunk].astype(np.int64) * itemsize
            pointers = np.empty(len(part), dtype=np.int64)
            pointers[0] = offset
            np.cumsum(part[:-1], out=pointers[1:])
            pointers[1:] += offset
            offset += int(part.sum())
            f.write(pointers.tobytes())
        for a in range(0, docs + 1, chunk):
            f.write(np.arange(a, min(docs + 1, a + chunk), dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(offset)  # sparse: no block is written
    return offset // itemsize


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(mode: str, prefix: str, args: argparse.Namespace) -> dict[str, Any]:
    """One rank's set-up to its first step (``mode`` ``"new"`` or ``"today"``), in this process."""
    import torch

    from lightning_hydra import HydraDataModule
    from lightning_hydra.bench.schedule import llama8b_cost
    from lightning_hydra.data import datamodule
    from lightning_hydra.data.batching import reference_global_batches
    from lightning_hydra.data.indexed import IndexedTokens
    from lightning_hydra.planner import BatchPlanner, PlannerConfig
    from lightning_hydra.strategy.runtime import LocalRuntime

    class PoolRuntime(LocalRuntime):
        """Rank 0 of a pool of ``world_size`` ranks (it plans; it runs nothing)."""

        def batch_planner(self) -> BatchPlanner:
            config = PlannerConfig(
                policy="hydra",
                max_tokens_per_rank=args.capacity,
                num_microbatches=args.microbatches,
                ranks_per_node=8,
            )
            return BatchPlanner(config=config, world_size=args.world_size, num_heads=32, num_kv_heads=8)

    runtime = PoolRuntime(None)
    runtime._cost = llama8b_cost()

    class Data(HydraDataModule):
        def _runtime(self) -> PoolRuntime:
            return runtime

    class Today(torch.utils.data.Dataset):
        """What a user wrote before: a map-style dataset with a ``lengths()`` method."""

        def __init__(self, prefix: str) -> None:
            self.tokens = IndexedTokens(prefix)

        def __len__(self) -> int:
            return len(self.tokens)

        def __getitem__(self, index: int) -> torch.Tensor:
            return self.tokens[index]

        def lengths(self) -> np.ndarray:
            return self.tokens.lengths()

    class Listed(list):
        def tokens_before(self, k: int) -> None:
            return None

    timed: dict[str, float] = {}
    vectorised = datamodule._epoch_batches

    def epoch_batches(source, budget, seed, epoch, shuffle):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        if mode == "today":
            out = Listed(reference_global_batches(source.lengths, budget, seed=seed, epoch=epoch, shuffle=shuffle))
        else:
            out = vectorised(source, budget, seed, epoch, shuffle)
        timed["batches_s"] = time.perf_counter() - start
        timed["steps_per_epoch"] = len(out)
        return out

    datamodule._epoch_batches = epoch_batches
    budget = int(args.fill * args.world_size * args.capacity * args.microbatches)
    settings = {"global_batch_tokens": budget, "max_seq_len": args.context, "plan_ahead": False}
    base = _rss()
    start = time.perf_counter()
    data = Data(sources=prefix, **settings) if mode == "new" else Data(Today(prefix), **settings)
    data.setup("fit")
    set_up = time.perf_counter()
    step = next(iter(datamodule._StepStream(data, "train"))).result()
    done = time.perf_counter()
    return {
        "docs": len(data._sources["train"]),
        "global_batch_tokens": budget,
        "setup_s": round(set_up - start, 3),
        "batches_s": round(timed["batches_s"], 3),
        "first_plan_ms": round(step.schedule_ms, 1),
        "first_step_s": round(done - start, 3),
        "data_s": round(done - start - step.schedule_ms / 1e3, 3),
        "steps_per_epoch": int(timed["steps_per_epoch"]),
        "rss_base_gib": round(base / _GIB, 3),
        "rss_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB, 3),
    }


def _in_child(mode: str, prefix: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", "lightning_hydra.bench.data", "--child", mode, "--prefix", str(prefix)]
    for name in ("world_size", "capacity", "microbatches", "context", "fill"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"the {mode} measurement failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _batches_ratio(n: int, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_hydra.bench.batches import DISTRIBUTIONS
    from lightning_hydra.data.batching import EpochBatches, reference_global_batches

    lengths = DISTRIBUTIONS["lognormal"](np.random.default_rng(1), n, args.context).astype(np.int32)
    budget = int(args.fill * args.world_size * args.capacity * args.microbatches)
    start = time.perf_counter()
    new = EpochBatches(lengths, budget, seed=0, epoch=0)
    new_s = time.perf_counter() - start
    start = time.perf_counter()
    old = reference_global_batches(lengths, budget, seed=0, epoch=0)
    old_s = time.perf_counter() - start
    same = len(old) == len(new) and all(np.array_equal(a, b) for a, b in zip(old, new, strict=True))
    return {"lengths": n, "loop_s": round(old_s, 3), "vectorised_s": round(new_s, 3),
            "ratio": round(old_s / new_s, 2), "same_batches": same}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Print the measurements as one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=float, default=1e8, help="documents of the large index")
    parser.add_argument("--compare", type=float, default=1e7, help="documents where today's path is measured too")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=16384, help="tokens per rank per microbatch")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--context", type=int, default=32768, help="longest document (max_seq_len)")
    parser.add_argument("--fill", type=float, default=0.75, help="global batch tokens as a share of the pool's")
    parser.add_argument("--dir", type=Path, default=None, help="where the synthetic index is written (default: temp)")
    parser.add_argument("--child", choices=("new", "today"), help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.prefix, args)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result: dict[str, Any] = {"world_size": args.world_size, "context": args.context, "cores": os.cpu_count()}
        small = Path(tmp, "compare")
        write_index(small, int(args.compare), args.context)
        today = _in_child("today", small, args)
        new_small = _in_child("new", small, args)
        result["compare"] = {
            "new": new_small,
            "today": today,
            "ratio": round(today["first_step_s"] / new_small["first_step_s"], 2),
            "data_ratio": round(today["data_s"] / new_small["data_s"], 2),
        }
        for suffix in (".bin", ".idx"):
            Path(f"{small}{suffix}").unlink()
        result["global_batches"] = _batches_ratio(int(args.compare), args)
        large = Path(tmp, "large")
        start = time.perf_counter()
        result["tokens"] = write_index(large, int(args.docs), args.context)
        result["write_index_s"] = round(time.perf_counter() - start, 1)
        result["new"] = _in_child("new", large, args)
    result["load_average"] = [round(x, 1) for x in os.getloadavg()]  # other processes sharing the cores
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
