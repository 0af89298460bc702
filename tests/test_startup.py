"""Start-up: with a cold Numba cache, a node's planners compile one at a time (the first writes the cache, the others
load it) instead of all at once; with the cache warm nothing waits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_hydra.planner import compiled

_OTHER = textwrap.dedent(
    """
    import os
    from lightning_hydra.planner import compiled
    compiled._cached = lambda: {cached}
    compiled.enabled()  # imports Numba
    print("ready", flush=True)
    with compiled.first_plan():
        print("after" if os.path.exists({released!r}) else "during", flush=True)
    """
)


def _blocked_on_locks() -> set[int] | None:
    """The processes waiting for a file lock, from the kernel's lock table (``None`` where there is none to read)."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    # "1: -> FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF": pid 4242 waits behind the lock of the line above
    return {int(f[5]) for f in map(str.split, lines) if len(f) > 5 and f[1] == "->" and f[5].isdigit()}


def _other_plans(cached: bool, released: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, bool | None]:
    """Another process's first plan while this one holds its own first plan with a cold cache (the compile): whether
    it planned ``"during"`` this one's or ``"after"`` it, and whether the kernel showed it waiting for a file lock
    (``None``: no lock table to read, or none that named it); this process creates ``released`` as it leaves its
    first plan. No bound on time decides either: a busy machine only makes the processes slower."""
    monkeypatch.setattr(compiled, "_cached", lambda: False)
    monkeypatch.setattr(compiled, "_LOADED", [False])  # this process has not planned yet
    blocked: bool | None = False
    with compiled.first_plan():
        code = _OTHER.format(cached=cached, released=str(released))
        other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout is not None and other.stdout.readline().strip() == "ready"  # its imports are done
            if cached:  # it plans while this process holds the lock, or never: its exit ends the wait
                try:
                    other.wait(timeout=240)
                except subprocess.TimeoutExpired:
                    pytest.fail("with a warm cache the other process waited for this one's first plan")
            else:  # until the kernel shows it waiting for the lock, or it planned (the lock did not hold it)
                unseen_after = time.monotonic() + 60  # a table whose process ids are not this namespace's
                while other.poll() is None:
                    waiting = _blocked_on_locks()
                    if waiting is not None and other.pid in waiting:
                        blocked = True
                        break
                    if waiting is None or time.monotonic() > unseen_after:  # the order alone decides then
                        blocked = None
                        time.sleep(3.0 if waiting is None else 0.0)  # for it to reach the lock on an idle machine
                        break
                    time.sleep(0.05)
        except BaseException:
            other.kill()
            other.wait()
            raise
        released.touch()
    out = other.stdout.read()  # the same buffered reader as the first line
    assert other.wait(timeout=240) == 0
    return out.strip(), blocked


def test_a_cold_cache_is_compiled_by_one_process_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numba")
    if not compiled.enabled():
        pytest.skip(f"compiled kernels are turned off ({compiled.ENV}=0)")
    # a cold cache: it waited on the lock this process held for its first plan (the compile), and planned after
    planned, blocked = _other_plans(False, tmp_path / "cold", monkeypatch)
    assert planned == "after" and blocked is not False, (planned, blocked)
    # a warm cache: no lock, it planned while this process still held its first plan
    assert _other_plans(True, tmp_path / "warm", monkeypatch) == ("during", False)


def test_after_its_first_plan_a_process_checks_no_cache_and_takes_no_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans run every step: only a process's first looks at the cache (and may wait on the lock)."""
    monkeypatch.setattr(compiled, "_LOADED", [False])
    monkeypatch.setattr(compiled, "enabled", lambda: True)
    monkeypatch.setattr(compiled, "_cached", lambda: True)
    with compiled.first_plan():
        pass
    looked = []
    monkeypatch.setattr(compiled, "_cached", lambda: looked.append(1) or False)  # cold: would lock
    for _ in range(3):
        with compiled.first_plan():
            pass
    assert looked == []
