"""Start-up: with a cold Numba cache, a node's planners compile one at a time (the first writes the cache, the others
load it) instead of all at once; with the cache warm nothing waits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from lightning_hydra.planner import compiled

_WAITER = textwrap.dedent(
    """
    import time
    from lightning_hydra.planner import compiled
    compiled._cached = lambda: {cached}
    compiled.enabled()  # imports Numba
    print("ready", flush=True)
    start = time.monotonic()
    with compiled.first_plan():
        print(f"{{time.monotonic() - start:.3f}}", flush=True)
    """
)


def _waited(cached: bool, hold: float, monkeypatch: pytest.MonkeyPatch) -> float:
    """Seconds another process waits to plan while this one holds its first plan for ``hold`` seconds."""
    monkeypatch.setattr(compiled, "_cached", lambda: False)
    monkeypatch.setattr(compiled, "_LOADED", [False])  # this process has not planned yet
    with compiled.first_plan():
        other = subprocess.Popen(
            [sys.executable, "-c", _WAITER.format(cached=cached)], stdout=subprocess.PIPE, text=True
        )
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"  # its imports are done
        time.sleep(hold)
    out = other.stdout.read()  # the same buffered reader as the first line
    assert other.wait(timeout=120) == 0
    return float(out.strip())


def test_a_cold_cache_is_compiled_by_one_process_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numba")
    if not compiled.enabled():
        pytest.skip(f"compiled kernels are turned off ({compiled.ENV}=0)")
    assert _waited(False, 3.0, monkeypatch) > 1.0  # it waited for this process's first plan (the compile)
    assert _waited(True, 3.0, monkeypatch) < 1.0  # a warm cache: no lock, planned at once


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
