"""Layout and sizing errors under tensor parallelism and pipeline stages name the devices, ``tensor_parallel``,
``pipeline_stages`` and the pool they leave, and suggest values that fit the given devices (pure: no process)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.errors import ConfigError
from lightning_hydra.strategy.layout import RunLayout, check_layout
from lightning_hydra.strategy.prelaunch import preflight


def _preflight(devices: int, data: HydraDataModule | None = None, **kw) -> None:
    strategy = HydraStrategy(**kw)
    strategy.parallel_devices = [torch.device("cpu")] * devices
    preflight(strategy, DecoderLM(hidden_size=32, num_heads=4, num_kv_heads=2), data)


def _one_line(devices: int, data: HydraDataModule | None = None, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        _preflight(devices, data, **kw)
    said = str(info.value)
    assert "\n" not in said
    return said


def test_stages_and_tensor_parallel_that_leave_no_pool() -> None:
    """The issue's case: TP 2 x PP 2 on 2 devices (it said "a world of 1 ranks cannot form 2 pipeline stages")."""
    said = _one_line(2, tensor_parallel=2, pipeline_stages=2, ranks_per_node=2, max_tokens_per_rank=256)
    assert said == (
        "2 devices with tensor_parallel=2 and pipeline_stages=2 leave no whole pool: devices / (pipeline_stages x "
        "tensor_parallel) = 2 / (2 x 2) is not a whole number of pool positions; use a multiple of 4 devices, or "
        "pipeline_stages in [1], or tensor_parallel in [1]"
    )
    for kw in ({"pipeline_stages": 1}, {"tensor_parallel": 1}):  # each suggestion fits
        _preflight(2, **{"tensor_parallel": 2, "pipeline_stages": 2, "ranks_per_node": 2, **kw})
    _preflight(4, tensor_parallel=2, pipeline_stages=2, ranks_per_node=2, max_tokens_per_rank=256)
    said = _one_line(3, pipeline_stages=2, ranks_per_node=4, max_tokens_per_rank=256)  # stages alone
    assert said.startswith("3 devices with pipeline_stages=2 leave no whole pool: devices / (pipeline_stages x ")
    assert said.endswith("use a multiple of 2 devices, or pipeline_stages in [1, 3]")


def test_suggested_tensor_degrees_fit_the_devices() -> None:
    """With the default ranks_per_node=8 on 4 devices, no suggested degree is 8 (nor 3 on 6 devices)."""
    said = _one_line(4, tensor_parallel=8, max_tokens_per_rank=256)
    assert said == (
        "tensor_parallel=8 does not divide the 4 devices: they must be whole TP groups; use tensor_parallel in "
        "[1, 2, 4] on 4 devices with ranks_per_node=8"
    )
    said = _one_line(6, tensor_parallel=4, max_tokens_per_rank=256)
    assert said.endswith("use tensor_parallel in [1, 2] on 6 devices with ranks_per_node=8")
    with pytest.raises(ConfigError, match=r"tensor_parallel=3 does not divide ranks_per_node=8: .*\[1, 2, 4, 8\]$"):
        HydraStrategy(tensor_parallel=3)  # the devices are not known yet: the node's divisors
    for t in (1, 2, 4):
        check_layout(4, tensor=t, ranks_per_node=8)


def test_a_pool_that_is_not_whole_nodes_names_positions_and_devices() -> None:
    said = _one_line(12, tensor_parallel=2, pipeline_stages=2, ranks_per_node=4, max_tokens_per_rank=256)
    assert said == (
        "12 devices with tensor_parallel=2 and pipeline_stages=2 leave each stage a pool of 3 positions (devices / "
        "(pipeline_stages x tensor_parallel)), and a node (ranks_per_node=4) holds 2 positions of 2 devices: a pool "
        "must be whole nodes or divide one; use 4, 8, 16 devices"
    )
    for devices in (4, 8, 16):
        check_layout(devices, tensor=2, stages=2, ranks_per_node=4)


def test_sizing_under_tensor_parallelism_counts_positions_of_the_devices() -> None:
    """4 devices at TP 2: the pool is 2 positions (the issue saw "2 ranks x 2048 tokens" with 4 devices)."""
    data = HydraDataModule([torch.arange(100), torch.arange(5000)], global_batch_tokens=9000)
    said = _one_line(4, data, tensor_parallel=2, ranks_per_node=4, max_tokens_per_rank=2048)
    assert said.startswith(
        "4 devices with tensor_parallel=2 (DP 2 x TP 2): the batch is planned on a pool of 2 positions (devices / "
        "tensor_parallel), each a TP group of 2 ranks holding the same tokens: global_batch_tokens=9000 exceeds "
        "what 1 microbatch of 2 positions x 2048 tokens hold (4096); the train data holds a sequence of 5000 "
        "tokens, more than the pool can hold (2 positions x 2048 tokens). Values that fit: max_tokens_per_rank=4500"
    )
    assert said.endswith(
        "; or add devices (or lower tensor_parallel), or set HydraDataModule(max_seq_len=..., truncate=True)"
    )
    fit = int(re.search(r"Values that fit: max_tokens_per_rank=(\d+)", said).group(1))
    _preflight(4, data, tensor_parallel=2, ranks_per_node=4, max_tokens_per_rank=fit)
    said = _one_line(8, data, tensor_parallel=2, pipeline_stages=2, ranks_per_node=4, max_tokens_per_rank=2048)
    assert said.startswith(
        "8 devices with tensor_parallel=2 and pipeline_stages=2 (DP 2 x TP 2 x PP 2): each of the 2 stages plans the "
        "batch on its own pool of 2 positions (devices / (pipeline_stages x tensor_parallel)), each a TP group of 2 "
    )
    assert "or add devices (or lower pipeline_stages or tensor_parallel)" in said


def test_sizing_at_set_up_names_tensor_parallelism() -> None:
    """The same message where the data's lengths are known only at set-up (``HydraStrategy.check_fits``)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    env = LightningEnvironment()
    env.set_world_size(4)
    env.set_global_rank(0)
    strategy = HydraStrategy(
        parallel_devices=[torch.device("cpu")] * 4, cluster_environment=env, tensor_parallel=2, ranks_per_node=4,
        max_tokens_per_rank=1024,
    )  # fmt: skip
    strategy.connect(DecoderLM(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2))
    with pytest.raises(ConfigError, match=r"^4 devices with tensor_parallel=2 \(DP 2 x TP 2\): .* of 2 positions x"):
        strategy.check_fits(10, "train", global_batch_tokens=5000)


def test_sequence_parallel_without_tensor_parallelism_is_said(caplog) -> None:
    with caplog.at_level(logging.INFO):
        strategy = HydraStrategy(sequence_parallel=True)
    assert strategy.sequence_parallel is False
    said = [r.getMessage() for r in caplog.records if "sequence_parallel" in r.getMessage()]
    assert said == [
        "HydraStrategy: sequence_parallel=True is ignored at tensor_parallel=1 (it splits tokens over a TP group; "
        "set tensor_parallel > 1 to use it)"
    ]


def test_the_layout_reads_as_megatron_writes_it() -> None:
    assert RunLayout(256, 8, 1, 8).describe("GPUs") == "256 GPUs = DP 32 x TP 8 (32 nodes x 8 GPUs)"
    assert RunLayout(2048, 8, 4, 8).describe("GPUs") == "2,048 GPUs = DP 64 x TP 8 x PP 4 (256 nodes x 8 GPUs)"
    assert RunLayout(4, 2).describe() == "4 devices = DP 2 x TP 2"
    layout = RunLayout(16, 2, 2, 8)
    assert list(layout.position_ranks(1, stage=1)) == [10, 11]  # (stage x pool + position) x T
    assert RunLayout.from_json(layout.to_json()) == layout


def test_the_start_up_line_says_over_what_fsdp_shards() -> None:
    """ "zero2 over 4 ranks" under TP 2 meant 2 pool positions; hsdp's line says its replicate x shard layout."""
    from types import SimpleNamespace

    from lightning_hydra.strategy.layout import sharding_layout

    def said(shape: tuple[int, ...], layout: RunLayout) -> str:
        return sharding_layout("zero2", SimpleNamespace(shape=shape), layout)  # the mesh FSDP2 was given

    assert said((2,), RunLayout(4, 2, 1, 4)) == (
        "over the 2 positions of the pool (each of a TP group's 2 ranks shards its own TP slices)"
    )
    assert said((2, 2), RunLayout(8, 2, 1, 4)) == (
        "over the 4 positions of the pool as replicate 2 x shard 2 (a node's 2 positions shard the state, 2 nodes "
        "replicate it; each of a TP group's 2 ranks shards its own TP slices)"
    )
    assert said((2,), RunLayout(4, 1, 2, 4)) == "over the 2 ranks of each stage's pool"
