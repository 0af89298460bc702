"""Shared test fixtures."""

from __future__ import annotations

import os

import pytest

from lightning_hydra.planner import CostModel
from lightning_hydra.testing import preload_for_ranks

# every multi-rank run of the suite (HydraStrategy left at its default timeout, run_world) times its collectives out
# after 3 minutes, and the watchdog names each stuck rank's operation after 90 s: a hang fails its test with a
# message instead of stalling CI (pytest's own per-test timeout, pyproject.toml, is the last resort); set before
# the fork server starts, which keeps this environment
os.environ.setdefault("LIGHTNING_HYDRA_COLLECTIVE_TIMEOUT", "180")

# ranks start from a fork server that imported these once (a spawned rank imports them again: 10-25 s per test),
# started here, before any test could change the environment it keeps
preload_for_ranks(["torch", "torch.distributed", "lightning.pytorch"])


_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
"""What ``seed_everything`` (a recipe's ``seed_everything:`` run in-process by ``LightningCLI``) leaves in the
environment: every later Lightning rank would reseed from it (``reset_seed``) instead of taking the launching
process's random state."""


@pytest.fixture(autouse=True)
def _seed_variables_restored():
    """Restore Lightning's seed variables after every test (a test that runs a recipe in this process sets them)."""
    saved = {name: os.environ.get(name) for name in _SEED_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def cost() -> CostModel:
    """An 8B-shaped analytic cost model (communication charged)."""
    return CostModel.for_transformer(4096, 32, 32, 8, 14336, 128256)


@pytest.fixture
def isolated_process():
    """Undo what an in-process Lightning launch leaves in this process: the launcher's environment variables
    (``MASTER_PORT``, ``LOCAL_RANK``, ``WORLD_SIZE``, ... would make later launches skip starting their ranks or
    reuse a port) and a default process group created by the test."""
    import os

    import torch.distributed as dist

    environ = dict(os.environ)
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if dist.is_available() and dist.is_initialized() and not had_group:
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
