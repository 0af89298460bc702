"""The GPU check script runs the engine's code on one device; on CPU it must agree with the references."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch

from lightning_hydra.cp.kernels import select_kernel

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("ring", "causal"), [(2, True), (3, False), (4, True)])
def test_emulated_ring_matches_reference_on_cpu(ring: int, causal: bool) -> None:
    gpu_check = _load()
    lengths = [57, 3, 130, 8, 8, 8, 1]
    cu = [0, *itertools.accumulate(lengths)]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(cu[-1], h, 16, generator=g) for h in (4, 2, 2, 4))
    ref_out, ref_grads = gpu_check._reference(q, k, v, dout, cu, causal)
    got = gpu_check.emulate(q, k, v, dout, cu, ring, causal, select_kernel(torch.device("cpu"), "cpu"))
    for a, b in zip(got, [ref_out, *ref_grads], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_script_runs_on_cpu_and_reports_one_summary(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check = _load()
    status = gpu_check.main(["--device", "cpu", "--quick", "--dtype", dtype])
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    summary = lines[-1]
    assert summary["summary"] and summary["kernel"] == "cpu"
    train = next(line for line in lines if line.get("check") == "train_step")
    assert train["ok"], train
    assert status == 0 and summary["ok"], lines
