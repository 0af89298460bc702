"""Shared test fixtures."""

from __future__ import annotations

import pytest

from lightning_hydra.planner import CostModel


@pytest.fixture
def cost() -> CostModel:
    """An 8B-shaped analytic cost model (communication charged)."""
    return CostModel.for_transformer(4096, 32, 32, 8, 14336, 128256)
