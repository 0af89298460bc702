"""Bad input to the strategy and the DataModule gets a clear error, never a hang or a silent drop."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.data.datamodule import _Source
from lightning_hydra.strategy import check_digests, check_pool
from lightning_hydra.testing import run_world


@pytest.mark.parametrize(("world", "per_node"), [(6, 4), (3, 2), (3, 8)])
def test_world_size_must_match_ranks_per_node(world: int, per_node: int) -> None:
    with pytest.raises(ValueError, match="ranks_per_node"):
        check_pool(world, per_node)


@pytest.mark.parametrize(("world", "per_node"), [(8, 8), (16, 8), (4, 8), (2, 2)])
def test_valid_pools_pass(world: int, per_node: int) -> None:
    check_pool(world, per_node)


def test_heads_a_ulysses_degree_cannot_split() -> None:
    strategy = HydraStrategy(ulysses_degree=3)
    with pytest.raises(ValueError, match="cannot be split over ulysses_degree=3"):
        strategy.connect(DecoderLM(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2))


def _strategy_for(world: int, **kw) -> HydraStrategy:
    env = LightningEnvironment()
    env.set_world_size(world)
    env.set_global_rank(0)
    strategy = HydraStrategy(parallel_devices=[torch.device("cpu")] * world, cluster_environment=env, **kw)
    strategy.connect(DecoderLM(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2))
    return strategy


def test_sequence_longer_than_the_pool() -> None:
    strategy = _strategy_for(4, max_tokens_per_rank=100, ranks_per_node=4, num_microbatches=2)
    strategy.check_fits(400, "train", global_batch_tokens=800)  # fits at degree 4
    with pytest.raises(ValueError, match=r"more than the pool can hold.*truncate=True"):
        strategy.check_fits(401, "train", global_batch_tokens=800)
    with pytest.raises(ValueError, match="global_batch_tokens=801"):
        strategy.check_fits(10, "train", global_batch_tokens=801)


def test_truncation_is_explicit() -> None:
    data = [torch.arange(50), torch.arange(5)]
    assert _Source(data, "train", max_seq_len=20, truncate=True).lengths.tolist() == [20, 5]
    assert _Source(data, "train", max_seq_len=20, truncate=True).item(0).numel() == 20
    assert _Source(data, "train", max_seq_len=20, truncate=False).lengths.tolist() == [50, 5]
    with pytest.raises(ValueError, match="truncate=True needs max_seq_len"):
        HydraDataModule(data, global_batch_tokens=100, truncate=True)
    dm = HydraDataModule(data, global_batch_tokens=100, max_seq_len=20)
    with pytest.raises(ValueError, match="over max_seq_len=20; pass truncate=True"):
        dm.setup("fit")


@pytest.mark.parametrize("data", [[], [torch.zeros(0, dtype=torch.long)]])
def test_empty_dataset(data) -> None:
    dm = HydraDataModule(data, global_batch_tokens=100)
    with pytest.raises(ValueError, match="empty"):
        dm.setup("fit")


def test_datasets_of_lists_arrays_and_dicts_are_accepted() -> None:
    import numpy as np

    data = [[1, 2, 3], np.arange(4), {"input_ids": [5, 6]}, torch.tensor([7])]
    source = _Source(data, "train", None, False)
    assert source.lengths.tolist() == [3, 4, 2, 1]
    assert [source.item(i).tolist() for i in range(4)] == [[1, 2, 3], [0, 1, 2, 3], [5, 6], [7]]


def _digest_worker(rank: int, world: int) -> str:
    digest = "ab" * 32 if rank != 1 else "cd" * 32
    try:
        check_digests(digest, world, device=torch.device("cpu"))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_plan_digest_mismatch_names_the_ranks() -> None:
    for message in run_world(3, _digest_worker, timeout=120):
        assert "ranks [1] disagree with rank 0" in message
