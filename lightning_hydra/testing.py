"""Helpers for tests and benchmarks: run a function on N real processes (gloo on CPU), collect each rank's result,
and fail on a hang instead of hanging.

Ranks start from a fork server where the platform has one: a spawned rank imports torch and Lightning again (10-25 s
for 4 ranks on 2 cores), a rank forked from the server starts with what :func:`preload_for_ranks` imported there once
(0.2 s; this package's modules take 0.1 s more). The rank is still a fresh process given its arguments by
pickling, as under ``spawn``, and it takes the caller's environment variables of the moment, not the server's."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_hydra._environ import LaunchEnvironment
from lightning_hydra.strategy.watchdog import collective_timeout

__all__ = ["RANK_START_METHOD", "preload_for_ranks", "quiet_trainer", "run_world"]

RANK_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
"""How :func:`run_world` starts its ranks: a fork server where the platform has one, else ``spawn``."""


def preload_for_ranks(modules: list[str]) -> None:
    """Start the fork server that ranks start from, with ``modules`` imported once there, so that each rank starts
    with them imported.

    Call it once, early (a test configuration at import): the server is started now, with this process's
    environment of the moment, and lives as long as this process; a later call, or a server already started, changes
    nothing. A no-op where ranks are spawned. The modules must be safe to fork after import and touch no
    accelerator (torch, numpy and Lightning are). Only third-party modules: Python starts the server without the
    caller's module search path, so this package's modules (of which a checkout and an installed copy may both be
    on a path) are imported by each rank, after it has taken the caller's path.

    Args:
        modules: Module names, e.g. ``["torch", "lightning.pytorch"]``.

    Raises:
        ValueError: A module of this package.
    """
    ours = [m for m in modules if m.split(".")[0] == __name__.split(".")[0]]
    if ours:
        raise ValueError(f"preload third-party modules only: each rank imports {ours} from the caller's path")
    if RANK_START_METHOD == "forkserver":
        from multiprocessing import forkserver

        multiprocessing.set_forkserver_preload(list(modules))
        forkserver.ensure_running()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    environ: None,
    world: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple,
    threads: int,
) -> None:
    del environ  # a LaunchEnvironment: the caller's variables, set before ``fn`` and ``args`` were unpickled
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    timeout = collective_timeout(None)  # LIGHTNING_HYDRA_COLLECTIVE_TIMEOUT, where set: a hang raises, naming where
    dist.init_process_group("gloo", rank=rank, world_size=world, **({"timeout": timeout} if timeout else {}))
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # report to the parent instead of hanging the others
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    if result[0] == "ok":
        dist.barrier()
    dist.destroy_process_group()


def run_world(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 300.0,
    threads: int = 1,
    start_method: str = RANK_START_METHOD,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks in processes of their own; return the per-rank results.

    ``fn`` must be importable by name (a module-level function). Each rank uses ``threads`` intra-op threads and
    starts by ``start_method`` (see the module's docstring).

    Raises:
        AssertionError: A rank raised (its traceback is included) or the run exceeded ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(LaunchEnvironment(dict(os.environ)), world, _free_port(), out_dir, fn, args, threads),
            nprocs=world,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ctx.join(timeout=1.0):
                    break
            except mp.ProcessRaisedException as exc:
                raise AssertionError(str(exc)) from None
            except mp.ProcessExitedException as exc:
                errors = _read(out_dir, world)
                raise AssertionError(f"a rank died: {exc}; reports: {errors}") from None
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                reports = [res for res in _read(out_dir, world) if res is not None and res[0] != "ok"]
                raise AssertionError(f"distributed run of {world} ranks timed out after {timeout} s; {reports}")
        results = _read(out_dir, world)
    failures = [f"rank {r}: {res[1]}" for r, res in enumerate(results) if res is None or res[0] != "ok"]
    assert not failures, "\n".join(failures)
    return [res[1] for res in results]


def _read(out_dir: str, world: int) -> list[Any]:
    out = []
    for r in range(world):
        path = Path(out_dir, f"{r}.pkl")
        out.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    return out


def quiet_trainer(devices: int, strategy: Any = None, *, callbacks: list | None = None, **kw: Any) -> Any:
    """A CPU ``Trainer`` for tests and benchmarks: no logger, checkpoints, progress bar, summary or validation
    unless asked (``**kw`` overrides any of them)."""
    import lightning.pytorch as pl

    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        "strategy": strategy or "auto",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "callbacks": callbacks or [],
    }
    settings.update(kw)
    return pl.Trainer(**settings)
