"""Planning beside training: how much a plan made ahead slows the training loop, in a thread and in a process.

``HydraDataModule`` plans step ``k + 1`` while step ``k`` trains. This benchmark times a host-bound training step
(forward and backward of a small transformer on one CPU thread: many short kernels launched from Python, as a GPU
step's host side is) alone, then while the planner plans a long-context batch over and over in a thread of this
process (``planning_process=False``) and in a :class:`~lightning_hydra.planner.worker.PlanWorker` (the default),
and prints one JSON object::

    python -m lightning_hydra.bench.overlap                      # 2,048 ranks, 256K lognormal, 8 microbatches
    python -m lightning_hydra.bench.overlap --world-size 512 --context 32K

``thread_over_alone`` and ``process_over_alone`` are the step's slowdowns (fastest of ``--repeat`` blocks of
``--steps`` steps each, one run); ``plans_per_second`` says how fast planning went beside the loop. The process
needs a core of its own: on a host with fewer free cores than planning and training processes, both slow down
for lack of cores, not for the lock.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from lightning_hydra.bench.batches import make_batch
from lightning_hydra.bench.schedule import CONTEXTS, llama8b_cost
from lightning_hydra.planner import BatchPlanner, PlannerConfig
from lightning_hydra.planner.worker import PlanWorker, plan_step

__all__ = ["main"]


def _training_step(layers: int, tokens: int, width: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    block = [torch.nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True) for _ in range(layers)]
    return torch.nn.Sequential(*block), torch.randn(1, tokens, width)


def _time_steps(model: torch.nn.Module, x: torch.Tensor, steps: int, repeat: int) -> float:
    """Fastest of ``repeat`` blocks of ``steps`` forward+backward passes, seconds per step."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(steps):
            model(x).sum().backward()
        best = min(best, (time.perf_counter() - start) / steps)
    return best


class _Planning:
    """Plans the batch over and over in a thread (through ``worker``, or in the thread where ``None``)."""

    def __init__(self, planner: BatchPlanner, lengths, cost, worker: PlanWorker | None) -> None:
        self.count = 0
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.is_set():
                if worker is None:
                    plan_step(planner, lengths, seed=0, cost=cost, rank=0)
                else:
                    worker.plan_step(planner, lengths, seed=0, cost=cost, rank=0)
                self.count += 1

        self._thread = threading.Thread(target=loop, name="hydra-plan", daemon=True)

    def __enter__(self) -> _Planning:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.rate = self.count / (time.perf_counter() - self.started)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2048)
    parser.add_argument("--context", choices=sorted(CONTEXTS), default="256K")
    parser.add_argument("--distribution", default="lognormal")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    longest, capacity = CONTEXTS[args.context]
    lengths = make_batch(
        args.distribution,
        world_size=args.world_size,
        capacity=capacity,
        num_microbatches=args.microbatches,
        fill=0.75,
        context=longest,
        seed=0,
    )
    config = PlannerConfig(max_tokens_per_rank=capacity, num_microbatches=args.microbatches, max_seq_len=longest)
    planner = BatchPlanner(config=config, world_size=args.world_size, num_heads=32, num_kv_heads=8)
    cost = llama8b_cost()
    model, x = _training_step(args.layers, args.tokens, args.width)
    _time_steps(model, x, 2, 1)  # warm-up
    worker = PlanWorker()
    worker.plan_step(planner, lengths, seed=0, cost=cost, rank=0)  # started and warm
    alone = _time_steps(model, x, args.steps, args.repeat)
    with _Planning(planner, lengths, cost, None) as in_thread:
        thread = _time_steps(model, x, args.steps, args.repeat)
    with _Planning(planner, lengths, cost, worker) as in_process:
        process = _time_steps(model, x, args.steps, args.repeat)
    worker.close()
    record = {
        "world_size": args.world_size,
        "context": args.context,
        "distribution": args.distribution,
        "sequences": int(lengths.size),
        "step_ms": {k: round(1e3 * t, 2) for k, t in (("alone", alone), ("thread", thread), ("process", process))},
        "thread_over_alone": round(thread / alone, 3),
        "process_over_alone": round(process / alone, 3),
        "plans_per_second": {"thread": round(in_thread.rate, 2), "process": round(in_process.rate, 2)},
        "planning_process_fell_back": worker.failure,
    }
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
