"""Say where a rank waits when an operation of its step takes too long, before the collective timeout ends the run.

A hang in a collective is silent: every rank blocks, NCCL's watchdog aborts the processes after the process group's
timeout (30 minutes by default) with a message that names a sequence number, and gloo raises a transport error that
names a socket. :class:`Watchdog` runs a daemon thread beside the training loop; the step runner marks every
operation it enters (:meth:`Watchdog.watch`), and an operation still running after :attr:`Watchdog.limit` seconds is
reported once, on every stuck rank, with the rank, the operation and its communicators::

    HydraStrategy watchdog: rank 2 has waited 60 s in forward of microbatch 4 (stage 0, 26 tokens) on cp(2, 3)

so that the ranks' lines together show who waits for whom. The limit is half the collective timeout
(:func:`watchdog_limit`): the report comes while the run can still be inspected. ``LIGHTNING_HYDRA_COLLECTIVE_TIMEOUT``
(seconds) sets the collective timeout of runs that leave ``HydraStrategy(timeout=...)`` at its default (the test
suite sets it, so that a regression fails in minutes instead of stalling CI).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

__all__ = ["TIMEOUT_ENV", "Watchdog", "collective_timeout", "watchdog_limit"]

log = logging.getLogger(__name__)

TIMEOUT_ENV = "LIGHTNING_HYDRA_COLLECTIVE_TIMEOUT"
"""Environment variable: seconds of the collective timeout where the run does not set one."""


def collective_timeout(default: timedelta | None) -> timedelta | None:
    """The collective timeout: :data:`TIMEOUT_ENV`'s seconds where it is set, otherwise ``default``.

    Raises:
        ValueError: The variable is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def watchdog_limit(timeout: timedelta | None) -> float | None:
    """Seconds an operation may run before the watchdog reports it: half the collective timeout (``None``: none)."""
    return None if timeout is None else max(timeout.total_seconds() / 2, 1.0)


class Watchdog:
    """Reports, once, an operation that has run longer than ``limit`` seconds (see the module docstring).

    Args:
        rank: The rank it watches (named in reports).
        limit: Seconds before a report.
        report: Where a report goes (default: a warning on the module logger and a line on standard error, which
            every launcher keeps, whatever the logging configuration of the rank).
        poll: Seconds between checks.
    """

    def __init__(self, rank: int, limit: float, report: Callable[[str], None] | None = None, poll: float = 0.5) -> None:
        if not limit > 0:
            raise ValueError(f"a watchdog limit must be positive, got {limit}")
        self.rank = rank
        self.limit = limit
        self.report = report or _report
        self.poll = poll
        self.reports: list[str] = []
        """What was reported so far."""
        self._current: tuple[str, float] | None = None
        self._reported: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Mark ``what`` (``"forward of microbatch 4 ... on cp(2, 3)"``) as running for the block."""
        self._ensure_running()
        entry = (what, time.monotonic())
        with self._lock:
            self._current = entry
        try:
            yield
        finally:
            with self._lock:
                if self._current is entry:
                    self._current = None

    def _ensure_running(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="hydra-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.check()

    def check(self, now: float | None = None) -> str | None:
        """Report the current operation if it has run past the limit and was not reported yet; returns the report."""
        now = time.monotonic() if now is None else now
        with self._lock:
            current = self._current
            if current is None or current is self._reported or now - current[1] < self.limit:
                return None
            self._reported = current
        message = f"HydraStrategy watchdog: rank {self.rank} has waited {now - current[1]:.0f} s in {current[0]}"
        self.reports.append(message)
        self.report(message)
        return message

    def stop(self) -> None:
        """Stop the thread (a later :meth:`watch` starts it again)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.poll + 1)
        self._thread = None


def _report(message: str) -> None:
    log.warning(message)
    print(message, file=sys.stderr, flush=True)
