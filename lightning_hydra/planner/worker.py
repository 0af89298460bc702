"""Planning in a process of its own, beside the training loop rather than inside its interpreter.

:class:`~lightning_hydra.HydraDataModule` plans step ``k + 1`` while step ``k`` trains. In a thread, the planner
holds Python's global interpreter lock for most of its run, and the training loop, which launches every kernel from
Python, waits for it at each operation: a host-bound CPU training step of a small transformer took 1.87-2.06x as
long while a 2,048-rank plan ran in a thread beside it, 1.04-1.23x with the planner in a process (``python -m
lightning_hydra.bench.overlap``). In a process the planner holds no lock the loop needs.

:class:`PlanWorker` runs ``python -m lightning_hydra.planner.worker``, its own entry point, not the training script
(a process that ``multiprocessing`` spawns re-imports the script's main module, which starts training again where
the script has no ``if __name__ == "__main__"`` guard). Requests and answers are pickles over the child's standard
input and output; the child imports numpy and the planner only (no torch, no Lightning), plans with one BLAS/OpenMP
thread, and exits when its input closes (when the training process ends, however it ends).

Nothing is lost when it fails. An error the planner raises (a batch that cannot be planned) is raised as the
planner raised it. A worker that cannot start, or dies (killed, out of memory), is reported once with a warning and
the step is planned in the calling thread instead, with the same plan: :func:`plan_step` is pure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lightning_hydra.planner.calibration import plan_features
from lightning_hydra.planner.config import BatchPlanner
from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.plan import Group

__all__ = ["PlanWorker", "PlannedStep", "main", "plan_step"]

log = logging.getLogger(__name__)

_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""Thread-count variables set to 1 in the worker: the planner's arrays are small, and a BLAS thread pool per rank
would compete with the training processes for the host's cores."""


@dataclass(frozen=True)
class PlannedStep:
    """What one rank reads of a global batch's plan, computed where the plan was made (the whole plan of a large
    pool takes longer to send than this: the rank's groups, and the shapes of all groups)."""

    digest: str
    """:meth:`Plan.digest` (compared across ranks before the step)."""
    groups: tuple[Group, ...]
    """Every distinct group shape of the plan ``(ranks, ulysses, ring)`` without sequences, sorted."""
    rank_groups: tuple[Group, ...]
    """The rank's group in every microbatch (:meth:`Plan.groups_of`): what it packs its share from."""
    world_size: int
    """Ranks the plan was made for."""
    loads: np.ndarray
    """This rank's predicted time in every microbatch ``[M]``."""
    features: np.ndarray
    """This rank's calibration features in every microbatch ``[M, NUM_FEATURES]``."""
    schedule_ms: float
    """Milliseconds the planner took (wall clock, where it ran)."""


def plan_step(
    planner: BatchPlanner, lengths: Sequence[int] | np.ndarray, *, seed: int, cost: CostModel, rank: int
) -> PlannedStep:
    """Plan a global batch and read ``rank``'s loads and features (pure: any thread or process gives the same).

    Args:
        planner: The pool's planner settings (:meth:`HydraRuntime.batch_planner`).
        lengths: Every sequence's length.
        seed: The planner's tie-breaking seed.
        cost: The cost model to plan with.
        rank: The rank whose loads and features are read.
    """
    start = time.perf_counter()
    plan = planner.plan(lengths, seed=seed, cost=cost)
    elapsed = 1e3 * (time.perf_counter() - start)
    per_rank = plan_features(plan, cost).reshape(plan.num_microbatches, plan.world_size, -1)
    shapes = {(g.ranks, g.ulysses, g.ring) for mb in plan.microbatches for g in mb}
    return PlannedStep(
        digest=plan.digest(),
        groups=tuple(Group(r, u, g) for r, u, g in sorted(shapes)),
        rank_groups=plan.groups_of(rank),
        world_size=plan.world_size,
        loads=np.ascontiguousarray(plan.loads(cost)[:, rank]),
        features=np.ascontiguousarray(per_rank[:, rank]),
        schedule_ms=elapsed,
    )


class _Gone(Exception):
    """The worker could not be started or stopped answering."""


class PlanWorker:
    """A planning process of one rank: :meth:`plan_step` there, or here where the process failed.

    Started at the first request; one request at a time (callers from several threads take turns). Pickling it
    (a module sent to spawned processes) keeps its command only: each process starts its own.

    Args:
        command: The worker's command line (default: this interpreter, ``-m lightning_hydra.planner.worker``).
    """

    def __init__(self, command: Sequence[str] | None = None) -> None:
        self.command = list(command) if command is not None else [sys.executable, "-m", __name__]
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.failure: str | None = None
        """Why the worker was given up (``None`` while it serves): from then on every step is planned here."""
        self.served = 0
        """Requests the worker answered (the planner's errors included)."""

    def plan_step(
        self, planner: BatchPlanner, lengths: Sequence[int] | np.ndarray, *, seed: int, cost: CostModel, rank: int
    ) -> PlannedStep:
        """:func:`plan_step` in the worker (errors the planner raises are raised here, as raised there); in this
        thread once the worker has failed (a warning says why, once)."""
        request = ("plan_step", planner, np.asarray(lengths), seed, cost, rank)
        with self._lock:
            if self.failure is None:
                try:
                    return self._ask(request)
                except _Gone as exc:
                    self.failure = str(exc)
                    self._stop()
                    log.warning("%s; planning in the training process from now on (the same plans)", exc)
        return plan_step(planner, lengths, seed=seed, cost=cost, rank=rank)

    def start(self) -> None:
        """Start the worker now, without waiting for it (its imports then overlap the caller's set-up); a failure to
        start is reported at the first request."""
        with self._lock:
            if self.failure is None and self._proc is None:
                with contextlib.suppress(_Gone):  # the first request tries again and reports it
                    self._start()

    @property
    def pid(self) -> int | None:
        """The worker's process id (``None`` before it starts and after it stops)."""
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Stop the worker (a later request starts a new one)."""
        with self._lock:
            self._stop()

    def _ask(self, request: tuple) -> Any:
        proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
        try:
            pickle.dump(request, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            proc.stdin.flush()
            status, value = pickle.load(proc.stdout)
        except Exception as exc:  # a pipe that broke or an answer that does not read: the worker is of no more use
            try:
                code = proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                code = None
            said = f"exited with code {code}" if code is not None else f"stopped answering ({type(exc).__name__})"
            raise _Gone(f"the planning process (pid {proc.pid}) {said}") from exc
        self.served += 1
        if status == "error":
            raise value
        return value

    def _start(self) -> subprocess.Popen:
        self._stop()
        import lightning_hydra

        env = dict(os.environ)
        env.update(dict.fromkeys(_ONE_THREAD, "1"))
        root = str(Path(lightning_hydra.__file__).resolve().parent.parent)  # the package this process runs
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        except OSError as exc:
            raise _Gone(f"the planning process could not start ({exc})") from exc
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # the worker exits at the end of its input
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            proc.stdout.close()

    def __getstate__(self) -> dict:
        return {"command": self.command}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["command"])

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit: the worker also exits at the end of its input
            self._stop()


_HANDLERS = {"plan_step": lambda planner, lengths, seed, cost, rank: plan_step(
    planner, lengths, seed=seed, cost=cost, rank=rank
)}  # fmt: skip
"""What the worker answers, by request name."""


def _answer(out: BinaryIO, status: str, value: Any) -> None:
    try:
        blob = pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an answer that does not pickle (an exotic exception) goes as text
        text = "".join(traceback.format_exception(value)) if isinstance(value, BaseException) else repr(value)
        blob = pickle.dumps(("error", RuntimeError(f"the planning process failed:\n{text}")))
    out.write(blob)
    out.flush()


def main() -> int:
    """The worker: answer pickled requests from standard input on standard output until the input ends.

    It ignores SIGINT and SIGTERM, which a terminal or a scheduler sends to the whole process group: the training
    process decides when planning stops (a preempted run saves its checkpoint first), and the worker ends with its
    input when that process ends, however it ends.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what the planner might print goes to stderr, not the answers
    while True:
        try:
            kind, *args = pickle.load(requests)
        except EOFError:
            return 0
        try:
            status, value = "ok", _HANDLERS[kind](*args)
        except Exception as exc:  # raised again in the training process
            status, value = "error", exc
        try:
            _answer(answers, status, value)
        except BrokenPipeError:  # the training process has gone
            return 0


if __name__ == "__main__":
    # run the module's own copy (not ``__main__``'s), so that answers pickle under their importable names
    from lightning_hydra.planner.worker import main as _main

    sys.exit(_main())
