"""Planning in a process of its own, beside the training loop rather than inside its interpreter.

:class:`~lightning_hydra.HydraDataModule` plans step ``k + 1`` while step ``k`` trains. In a thread, the planner
holds Python's global interpreter lock for most of its run, and the training loop, which launches every kernel from
Python, waits for it at each operation: a host-bound CPU training step of a small transformer took 1.87-2.06x as
long while a 2,048-rank plan ran in a thread beside it, 1.04-1.23x with the planner in a process (``python -m
lightning_hydra.bench.overlap``). In a process the planner holds no lock the loop needs.

:class:`PlanWorker` runs :func:`main` of this module in ``python -c``, its own entry point, not the training script
(a process that ``multiprocessing`` spawns re-imports the script's main module, which starts training again where
the script has no ``if __name__ == "__main__"`` guard), with the training process's module search path, and says
which copy of the package it imported before it serves. Requests and answers are length-prefixed pickles over the
child's standard input and output; the child imports numpy and the planner only (no torch, no Lightning), plans
with one BLAS/OpenMP thread, and exits on a stop request, when its input closes, or when the training process has
gone (however it ends, even where a process forked from it holds the pipe).

Nothing is lost when it fails. An error the planner raises (a batch that cannot be planned) is raised as the
planner raised it. A worker that cannot start, or dies (killed, out of memory), is reported once with a warning and
the step is planned in the calling thread instead, with the same plan: :func:`plan_step` is pure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import signal
import struct
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

from lightning_hydra.planner import compiled
from lightning_hydra.planner.calibration import plan_features
from lightning_hydra.planner.config import BatchPlanner
from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.plan import Group, Plan

__all__ = ["PlanWorker", "PlannedStep", "main", "plan_step", "read_plan"]

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
    with compiled.first_plan():  # a cold compile cache: the node's planners compile one at a time, then load it
        start = time.perf_counter()
        plan = planner.plan(lengths, seed=seed, cost=cost)
    return read_plan(plan, cost, rank, 1e3 * (time.perf_counter() - start))


def read_plan(plan: Plan, cost: CostModel, rank: int, schedule_ms: float) -> PlannedStep:
    """What ``rank`` reads of ``plan`` (:class:`PlannedStep`), its loads and features under ``cost``.

    Args:
        plan: The plan of the global batch.
        cost: The cost model it was planned with.
        rank: The rank whose share is read.
        schedule_ms: Milliseconds the plan took.
    """
    per_rank = plan_features(plan, cost).reshape(plan.num_microbatches, plan.world_size, -1)
    shapes = {(g.ranks, g.ulysses, g.ring) for mb in plan.microbatches for g in mb}
    return PlannedStep(
        digest=plan.digest(),
        groups=tuple(Group(r, u, g) for r, u, g in sorted(shapes)),
        rank_groups=plan.groups_of(rank),
        world_size=plan.world_size,
        loads=np.ascontiguousarray(plan.loads(cost)[:, rank]),
        features=np.ascontiguousarray(per_rank[:, rank]),
        schedule_ms=schedule_ms,
    )


class _Gone(Exception):
    """The worker could not be started, stopped answering, or cannot serve this process."""


_HANDSHAKE_S = 120.0
"""Seconds a new worker may take to import the planner and say which copy of it it runs."""
_LENGTH = struct.Struct("<Q")
"""Each message: its length, then its pickle (a message that does not unpickle leaves the stream in step)."""


class PlanWorker:
    """A planning process of one rank: :meth:`plan_step` there, or here where the process failed.

    Started at the first request (or :meth:`start`); one request at a time (callers from several threads take
    turns). The worker is started with this process's module search path and says, before its first answer, which
    copy of ``lightning_hydra`` it imported: another copy (a checkout in the working directory) is a failure, not a
    plan made by other code. Pickling it (a module sent to spawned processes) keeps its command only: each process
    starts its own.

    Args:
        command: The worker's command line (default: this interpreter with this process's ``sys.path``, running
            :func:`main`).
    """

    def __init__(self, command: Sequence[str] | None = None) -> None:
        self.command = list(command) if command is not None else None
        self._proc: subprocess.Popen | None = None
        self._greeted = False  # whether the running worker said which package it imported
        self._lock = threading.Lock()
        self.closed = False
        """Set by :meth:`close` and cleared by :meth:`start`: a request in between (a step asked for ahead of a
        loop that ended) is planned here rather than starting a worker nothing would stop."""
        self.failure: str | None = None
        """Why the worker was given up (``None`` while it serves): from then on every step is planned here."""
        self.served = 0
        """Requests the worker answered (the planner's errors included)."""

    def plan_step(
        self, planner: BatchPlanner, lengths: Sequence[int] | np.ndarray, *, seed: int, cost: CostModel, rank: int
    ) -> PlannedStep:
        """:func:`plan_step` in the worker (errors the planner raises are raised here, as raised there); in this
        thread once the worker has failed (a warning says why, once) or after :meth:`close`."""
        request = ("plan_step", planner, np.asarray(lengths), seed, cost, rank)
        with self._lock:
            if self.failure is None and not self.closed:
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
            self.closed = False
            if self.failure is None and self._proc is None:
                with contextlib.suppress(_Gone):  # the first request tries again and reports it
                    self._start()

    @property
    def pid(self) -> int | None:
        """The worker's process id (``None`` before it starts and after it stops)."""
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Stop the worker; until :meth:`start`, requests are planned here."""
        with self._lock:
            self.closed = True
            self._stop()

    def _ask(self, request: tuple) -> Any:
        try:
            blob = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise _Gone(f"the planning request does not pickle ({type(exc).__name__}: {exc})") from exc
        proc = self._start() if self._proc is None else self._proc
        if proc.poll() is not None:  # died between requests
            raise _Gone(f"the planning process (pid {proc.pid}) exited with code {proc.returncode}")
        try:
            if not self._greeted:
                self._greeting(proc)
            _send(proc.stdin, blob)
            status, value = pickle.loads(_receive(proc.stdout))
        except _Gone:
            raise
        except Exception as exc:
            raise _Gone(f"the planning process (pid {proc.pid}) {_said(proc, exc)}") from exc
        if status == "unreadable":
            raise _Gone(f"the planning process cannot read the request: {value}")
        self.served += 1
        if status == "error":
            raise value
        return value

    def _greeting(self, proc: subprocess.Popen) -> None:
        """Wait (at most :data:`_HANDSHAKE_S`) for a new worker to say which ``lightning_hydra`` it imported."""
        ready, _, _ = select.select([proc.stdout], [], [], _HANDSHAKE_S)
        if not ready:
            raise _Gone(f"the planning process (pid {proc.pid}) did not start within {_HANDSHAKE_S:.0f} s")
        try:
            theirs = pickle.loads(_receive(proc.stdout))
        except Exception as exc:
            raise _Gone(f"the planning process (pid {proc.pid}) {_said(proc, exc)}") from exc
        if theirs != _package_file():
            raise _Gone(f"the planning process imported lightning_hydra from {theirs}, this process from "
                        f"{_package_file()}")  # fmt: skip
        self._greeted = True

    def _start(self) -> subprocess.Popen:
        self._stop()
        env = dict(os.environ)
        env.update(dict.fromkeys(_ONE_THREAD, "1"))
        command = self.command or [sys.executable, "-c", _BOOT.format(path=sys.path)]
        self._greeted = False
        try:
            self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        except Exception as exc:
            raise _Gone(f"the planning process could not start ({exc})") from exc
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    _send(proc.stdin, pickle.dumps(("stop",)))  # a process forked from this one may hold the pipe
                proc.stdin.close()
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


_BOOT = "import sys; sys.path[:] = {path!r}; from lightning_hydra.planner.worker import main; sys.exit(main())"
"""The worker's program: this process's module search path (not the working directory ``-m`` would put first),
then :func:`main` of the module as imported there (answers pickle under their importable names)."""


def _package_file() -> str:
    """The ``__init__.py`` of the ``lightning_hydra`` this module belongs to (found from this file, so that the
    planner does not import the package that imports it)."""
    return str(Path(__file__).resolve().parents[1] / "__init__.py")


def _said(proc: subprocess.Popen, exc: BaseException) -> str:
    try:
        return f"exited with code {proc.wait(timeout=1)}"
    except subprocess.TimeoutExpired:
        return f"stopped answering ({type(exc).__name__})"


def _send(out: BinaryIO, blob: bytes) -> None:
    out.write(_LENGTH.pack(len(blob)))
    out.write(blob)
    out.flush()


def _receive(inp: BinaryIO) -> bytes:
    head = inp.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the other end closed the pipe")
    (size,) = _LENGTH.unpack(head)
    blob = inp.read(size)
    if len(blob) < size:
        raise EOFError("the other end closed the pipe mid-message")
    return blob


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
    _send(out, blob)


def _exit_with_parent() -> None:
    """Leave when the training process has gone, even where a process forked from it still holds the pipe."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main() -> int:
    """The worker: say which ``lightning_hydra`` it imported, then answer requests from standard input on standard
    output until a stop request, the end of the input or the training process's end.

    It ignores SIGINT and SIGTERM, which a terminal or a scheduler sends to the whole process group: the training
    process decides when planning stops (a preempted run saves its checkpoint first).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="hydra-plan-parent", daemon=True).start()
    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what the planner might print goes to stderr, not the answers
    try:
        _send(answers, pickle.dumps(_package_file()))
        while True:
            try:
                blob = _receive(requests)
            except EOFError:
                return 0
            try:
                kind, *args = pickle.loads(blob)
            except Exception as exc:
                _answer(answers, "unreadable", f"{type(exc).__name__}: {exc}")
                continue
            if kind == "stop":
                return 0
            try:
                status, value = "ok", _HANDLERS[kind](*args)
            except Exception as exc:  # raised again in the training process
                status, value = "error", exc
            _answer(answers, status, value)
    except BrokenPipeError:  # the training process has gone
        return 0


if __name__ == "__main__":
    sys.exit(main())
