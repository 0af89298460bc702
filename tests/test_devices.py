"""The default cost model follows the device (a patched CUDA device query stands in for a GPU): a known GPU's rates
and the precision's bytes per element, calibration on by default on CUDA; on CPU nothing changes (the same plans)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_hydra import DecoderLM, HydraStrategy
from lightning_hydra.models.module import CPU_LINKS, device_rates
from lightning_hydra.planner import CostModel, schedule
from lightning_hydra.planner.devices import CPU_RATES, GPU_RATES, bytes_per_element, gpu_rates

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def test_gpus_are_known_by_their_cuda_names() -> None:
    assert gpu_rates("NVIDIA H100 80GB HBM3") is GPU_RATES["h100"]
    assert gpu_rates("NVIDIA H200") is GPU_RATES["h200"]
    assert gpu_rates("NVIDIA A100-SXM4-80GB") is GPU_RATES["a100"]
    assert gpu_rates("Some Accelerator 9000") is None
    h100 = GPU_RATES["h100"]
    assert h100.flops_per_second == pytest.approx(989e12 * 0.5)
    assert h100.flops_per_second / CPU_RATES.flops_per_second > 10_000  # what the CPU defaults got wrong on a GPU
    assert h100.intra_node_bandwidth / CPU_RATES.intra_node_bandwidth == pytest.approx(180)
    assert (bytes_per_element("bf16-mixed"), bytes_per_element("16-mixed"), bytes_per_element("32-true")) == (2, 2, 4)


def test_an_unknown_gpu_takes_an_h100s_rates_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        rates = device_rates(torch.device("cuda", 0), device_name=lambda d: "Some Accelerator 9000")
    assert rates is GPU_RATES["h100"] and "Some Accelerator 9000" in caplog.text
    assert device_rates(torch.device("cpu")) is CPU_RATES


def test_a_module_on_a_gpu_plans_with_the_gpus_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_model = DecoderLM(**SHAPE).cost_model()
    model = DecoderLM(**SHAPE)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    model._device = torch.device("cuda", 0)  # what Lightning's move to the device sets; no tensor is moved
    gpu_model = model.cost_model()
    a100 = GPU_RATES["a100"]
    assert cpu_model.linear / gpu_model.linear == pytest.approx(a100.flops_per_second / CPU_RATES.flops_per_second)

    def expected(element_bytes: int) -> CostModel:
        return CostModel.for_transformer(
            **SHAPE, ffn_hidden_size=model.ffn_hidden_size, vocab_size=258, flops_per_second=a100.flops_per_second,
            bytes_per_element=element_bytes, intra_node_bandwidth=a100.intra_node_bandwidth,
            inter_node_bandwidth=a100.inter_node_bandwidth,
        )  # fmt: skip

    assert gpu_model == expected(4)  # no trainer: no precision known
    model._trainer = SimpleNamespace(precision="bf16-mixed")
    assert model.cost_model() == expected(2) != expected(4)
    given = DecoderLM(**SHAPE, flops_per_second=1e14)
    given._device = torch.device("cuda", 0)
    assert given.cost_model().linear == pytest.approx(cpu_model.linear * CPU_RATES.flops_per_second / 1e14)


def test_on_cpu_the_default_cost_model_and_its_plans_are_unchanged() -> None:
    before = CostModel.for_transformer(
        **SHAPE, ffn_hidden_size=DecoderLM(**SHAPE).ffn_hidden_size, vocab_size=258, flops_per_second=20e9, **CPU_LINKS
    )
    now = DecoderLM(**SHAPE).cost_model()
    assert now == before
    lengths = np.random.default_rng(0).integers(10, 400, size=40)
    digests = [
        schedule(lengths, world_size=8, num_microbatches=6, max_tokens_per_rank=256, cost=c, num_heads=4).digest()
        for c in (before, now)
    ]
    assert digests[0] == digests[1]


def test_calibration_is_on_by_default_on_cuda_only() -> None:
    assert HydraStrategy().calibrate is False  # no device yet
    cpu = HydraStrategy(parallel_devices=[torch.device("cpu")])
    assert cpu.calibrate is False
    gpu = HydraStrategy(parallel_devices=[torch.device("cuda", 0)])
    assert gpu.calibrate is True
    assert HydraStrategy(calibrate=False, parallel_devices=[torch.device("cuda", 0)]).calibrate is False
    assert HydraStrategy(calibrate=True).calibrate is True
