"""The GPU check script runs the engine's code on one device; on CPU it must agree with the references."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
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
    ref_out, ref_grads = gpu_check.reference_attention(q, k, v, dout, cu, causal)
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


def test_dry_run_lists_every_check_and_runs_none(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    gpu_check = _load()
    monkeypatch.setattr(gpu_check, "train_check", lambda *a, **k: pytest.fail("a dry run ran a check"))
    assert gpu_check.main(["--dry-run"]) == 0  # the default device (CUDA) on a machine without one
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    names = [line["check"] for line in lines[:-1]]
    assert all(line["dry_run"] for line in lines)
    assert names.count("ring") == 12 and names[0] == "train_step"
    assert names[-3:] == ["world_step", "comm_clock", "world_zero2_checkpoint"]
    assert lines[-1]["summary"] and lines[-1]["checks"] == len(names) == len(gpu_check.planned_checks(True))


def test_one_rank_world_checks_run_the_strategys_step_on_cpu() -> None:
    """The checks a GPU runs over a one-rank NCCL group, here over gloo: the real step, the clock, zero2 and a
    sharded checkpoint resumed. In a child process, as the script runs: Lightning's one-rank world leaves its
    ``MASTER_PORT`` and store behind in the process that ran it, where the next test's launcher would meet them."""
    code = (
        "import json, sys, torch; sys.path.insert(0, sys.argv[1]); import gpu_check; "
        "print(json.dumps(gpu_check.world_checks(torch.device('cpu'), 'cpu', quick=True)))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["check"] for r in rows] == ["world_step", "comm_clock", "world_zero2_checkpoint"]
    assert all(r["ok"] for r in rows), rows
    assert rows[0]["backend"] == "gloo" and rows[0]["clock"] == "HostClockSource" and rows[2]["sharded"]


MULTI = SCRIPT.parent / "multi_gpu_check.py"


def test_multi_gpu_dry_run_lists_its_checks() -> None:
    done = subprocess.run([sys.executable, str(MULTI), "--dry-run"], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert done.returncode == 0 and [line["check"] for line in lines[:-1]] == [
        "ring",
        "all_to_all",
        "tp2_vocab_loss",
        "pipeline",
        "zero2",
        "tp2",
        "tp2_hsdp",
    ]
