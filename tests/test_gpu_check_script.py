"""The GPU check script runs the engine's code on one device; on CPU it must agree with the references."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_hydra.cp.kernels import select_kernel

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load(monkeypatch: pytest.MonkeyPatch | None = None):
    if monkeypatch is not None:  # its main imports gpu_measure from beside it
        monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_measure(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # it imports gpu_check from beside it
    import gpu_measure

    return gpu_measure


def test_emulated_ring_matches_reference_on_cpu() -> None:
    """The script's own one-process emulation of a ring (its shards, plans, gathered keys and merges), which the GPU
    check compares the device's kernel through, on one bin of awkward lengths. The kernel over many bins, rings,
    masks and gather limits is ``tests/test_kernels.py``'s; this checks the script's wiring of it."""
    ring, causal = 3, False  # an odd ring, and no causal mask: key sets empty on some rows
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
def test_script_runs_on_cpu_and_reports_one_summary(
    dtype: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_check = _load(monkeypatch)
    status = gpu_check.main(["--device", "cpu", "--quick", "--dtype", dtype])
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    summary = lines[-1]
    assert summary["summary"] and summary["kernel"] == "cpu"
    by_name = {line["check"]: line for line in lines[:-1] if line["check"] != "ring"}
    assert by_name["train_step"]["ok"], by_name["train_step"]
    # the kernel measurements: flash-attn against aten needs CUDA; the engine against per-document SDPA runs
    assert by_name["flash_vs_aten"]["skipped"].startswith("needs CUDA") and summary["skipped"] == ["flash_vs_aten"]
    engine = by_name["engine_vs_varlen"]
    assert engine["ok"] and engine["kernel"] == "cpu" and engine["baseline"] == "sdpa_per_document", engine
    assert engine["bounds"] == {"error": 1e-4 if dtype == "float32" else 2e-2, "ratio": None}  # no time bound on CPU
    assert engine["bins"]["mixed"]["tokens"] == 194 and engine["bins"]["mixed"]["ratio"] > 0
    assert status == 0 and summary["ok"] and summary["measure_ok"], lines


def test_flash_vs_aten_compares_both_kernels_through_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison a GPU makes of the ``flash`` and ``torch`` kernels, on CPU through stand-ins of flash-attn
    2.7's and aten's ops (float64 attention inside): both within bf16's bound of float32 SDPA, equal to each other,
    and timed (no time bound off CUDA)."""
    from lightning_hydra.cp.kernels import FlashAttnKernel, TorchFlashKernel
    from tests.varlen_fakes import FakeAtenOps, aten_packets, flash_interface

    measure = _load_measure(monkeypatch)
    calls: list = []
    kernels = {
        "torch": TorchFlashKernel(*aten_packets(FakeAtenOps()), native_gqa=True),
        "flash": FlashAttnKernel(flash_interface("2.7", calls), "2.7.0"),
    }
    row = measure.flash_vs_aten(
        torch.device("cpu"), bins={"mixed": [40, 7, 1, 16]}, shape=(4, 2, 16), reps=1, warmup=0, kernels=kernels
    )
    assert row["ok"] and row["bounds"] == {"error": 2e-2, "time_ratio": None}, row
    figures = row["bins"]["mixed"]
    assert figures["errors"]["between"] == 0.0 and 0 < row["worst_error"] <= 2e-2
    assert figures["seconds"]["flash"] > 0 and figures["seconds"]["torch"] > 0
    assert [kind for kind, _ in calls] == ["forward", "backward"]  # one timed call, through flash-attn's ops
    assert measure.kernel_pair(torch.device("cpu"))[0] is None  # on CPU the script's own row is skipped


def test_comm_bounds_hold_the_clock_between_the_profilers_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """``comm_profile``'s arithmetic: overlapping spans count once, a blocking collective's clock must cover most
    of its spans, and no clock may read more than the spans plus a slack per timed interval."""
    measure = _load_measure(monkeypatch)
    ms = 1_000_000  # ns
    assert measure._union_seconds([(0, 4 * ms), (2 * ms, 6 * ms), (10 * ms, 11 * ms)]) == pytest.approx(7e-3)
    cpu = torch.device("cpu")
    assert measure.comm_bounds(0.0095, 0.0100, 1, cpu, blocking=True)["ok"]
    assert not measure.comm_bounds(0.0050, 0.0100, 1, cpu, blocking=True)["ok"]  # missed half of an all-to-all
    assert measure.comm_bounds(0.0010, 0.0100, 1, cpu, blocking=False)["ok"]  # a ring's overlapped transfers
    assert measure.comm_bounds(0.0129, 0.0100, 1, cpu, blocking=False)["ok"]  # 1.1 x 10 ms + 2 ms of slack
    assert not measure.comm_bounds(0.0131, 0.0100, 1, cpu, blocking=False)["ok"]
    # more ranks than cores: the bounds are reported, not held (a parked rank's clock runs on), but the clock and
    # the profiler must both have seen the communication
    crowded = measure.comm_bounds(0.0259, 0.0100, 1, cpu, blocking=True, ranks_per_host=10**6)
    assert crowded["ok"] and not crowded["bounds_held"] and crowded["bounds_enforced"].startswith("no: ")
    assert not measure.comm_bounds(0.0, 0.0100, 1, cpu, blocking=True, ranks_per_host=10**6)["ok"]
    assert not measure.comm_bounds(0.0100, 0.0, 1, cpu, blocking=True, ranks_per_host=10**6)["ok"]
    assert measure._comm_kind("gloo:all_to_all") == "all_to_all" and measure._comm_kind("c10d::recv_") == "p2p"
    assert measure._comm_kind("ncclDevKernel_SendRecv(...)") == "p2p"
    assert measure._comm_kind("gloo:all_reduce") == "other"


def test_dry_run_lists_every_check_and_runs_none(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    gpu_check = _load()
    monkeypatch.setattr(gpu_check, "train_check", lambda *a, **k: pytest.fail("a dry run ran a check"))
    assert gpu_check.main(["--dry-run"]) == 0  # the default device (CUDA) on a machine without one
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    names = [line["check"] for line in lines[:-1]]
    assert all(line["dry_run"] for line in lines)
    assert names.count("ring") == 12 and names[0] == "train_step"
    assert names[13:15] == ["flash_vs_aten", "engine_vs_varlen"]
    assert names[-5:] == ["world_step", "comm_clock", "world_zero2_checkpoint", "peak_memory", "comm_profile"]
    assert lines[-1]["summary"] and lines[-1]["checks"] == len(names) == len(gpu_check.planned_checks(True))


def test_one_rank_world_checks_run_the_strategys_step_on_cpu() -> None:
    """The checks a GPU runs over a one-rank NCCL group, here over gloo: the real step, the clock, zero2 and a
    sharded checkpoint resumed; then the measurements: a step's peak memory at the memory model's capacity against
    its prediction, and the communication clock against the profiler. In a child process, as the script runs:
    Lightning's one-rank world leaves its ``MASTER_PORT`` and store behind in the process that ran it, where the
    next test's launcher would meet them."""
    code = (
        "import json, sys, torch; sys.path.insert(0, sys.argv[1]); import gpu_check, gpu_measure; "
        "cpu = torch.device('cpu'); rows = gpu_check.world_checks(cpu, 'cpu', quick=True); "
        "print(json.dumps(rows + gpu_measure.world_measures(cpu, 'cpu', quick=True)))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    names = ["world_step", "comm_clock", "world_zero2_checkpoint", "peak_memory", "comm_profile"]
    assert [r["check"] for r in rows] == names
    assert all(r["ok"] for r in rows), rows
    assert rows[0]["backend"] == "gloo" and rows[0]["clock"] == "HostClockSource" and rows[2]["sharded"]
    memory, comm = rows[3], rows[4]
    assert memory["capacity"] == 1024 and 0 < memory["tokens"] <= 1024  # the "auto" capacity the budget gives
    assert memory["predicted_bytes"] == memory["state_bytes"] + memory["activation_bytes"]
    assert memory["bounds"]["lower_bytes"] <= memory["measured_bytes"] <= memory["bounds"]["upper_bytes"]
    assert memory["method"].startswith("live state + torch.profiler")
    step, probe = comm["step"], comm["probe"]
    assert step["clock_seconds"] == 0.0 and step["intervals"] == 0  # a one-rank world sends nothing for CP
    assert step["other_seconds"] > 0  # ... but the step's own all-reduces showed in the profile
    assert probe["intervals"] == probe["collectives"] == 5 and probe["profiler_seconds"] > 0


MULTI = SCRIPT.parent / "multi_gpu_check.py"
ROOT = SCRIPT.parents[1]


def _load_multi(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # it imports gpu_check from beside it
    spec = importlib.util.spec_from_file_location("multi_gpu_check", MULTI)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "multi_gpu_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_multi_gpu_dry_run_lists_its_checks() -> None:
    done = subprocess.run([sys.executable, str(MULTI), "--dry-run"], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert done.returncode == 0 and [line["check"] for line in lines[:-1]] == [
        "ring",
        "all_to_all",
        "nested_gqa",
        "tp2_vocab_loss",
        "pipeline",
        "zero2",
        "tp2",
        "tp2_hsdp",
        "pipeline_hydra",
        "zero2_idle_first",
        "bf16_none",
        "comm_profile",
    ]
    assert lines[-1]["checks"] == 12


def test_multi_gpu_checks_option_runs_some_in_the_scripts_order(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    multi = _load_multi(monkeypatch)
    assert multi.main(["--dry-run", "--checks", "bf16_none, ring"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [line["check"] for line in lines[:-1]] == ["ring", "bf16_none"] and lines[-1]["checks"] == 2
    with pytest.raises(SystemExit, match=r"unknown checks \['nope'\]"):
        multi.main(["--dry-run", "--checks", "ring,nope"])


def test_multi_gpu_hazard_fields_read_the_operation_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``pipeline_hydra`` and ``zero2_idle_first`` report of the plans that ran, from lists built here."""
    from lightning_hydra.schedule import StepLayout, StepOptions, Work, step_programs

    multi = _load_multi(monkeypatch)
    alone, pair, idle = Work((0,), 5), Work((0, 1), 6), Work((1,), 0)
    # position 1 sits microbatches 0 and 2 out and shares (0, 1) with position 0 in 1 and 3: its own 1F1B over
    # [1, 3] runs F1 F3 B1 B3 where position 0's runs F1 B1 F3 B3
    work = [[alone, pair, alone, pair], [idle, pair, idle, pair]]
    programs = step_programs(StepLayout(stages=2, pool=2), work, StepOptions())
    assert multi._stage_work([programs[0], programs[1]]) == work  # what the lists say of the plan
    assert multi.old_order_hazard(work, 2)
    assert not multi.old_order_hazard([[pair] * 4] * 2, 2)
    zero2 = StepLayout(pool=2, sharding="zero2")
    first_idle = step_programs(zero2, [[alone, pair], [idle, pair]], StepOptions(units=2))
    last_idle = step_programs(zero2, [[pair, alone], [pair, idle]], StepOptions(units=2))
    assert multi.idle_first(list(first_idle.values())) and not multi.idle_first(list(last_idle.values()))


def _torchrun(ranks: int, *args: str, timeout: float = 280) -> tuple[subprocess.CompletedProcess, list[dict], float]:
    """The script under torchrun over gloo: the process, rank 0's JSON lines, and the wall seconds it took."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    start = time.monotonic()
    done = subprocess.run(
        [*command, str(MULTI), "--device", "cpu", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done, rows, time.monotonic() - start


@pytest.mark.timeout(300)
def test_multi_gpu_new_checks_pass_over_gloo_at_four_ranks() -> None:
    """Nested Ulysses x ring with GQA, 2 stages x a pool of 2 under hydra, zero2 with ranks idle in microbatch 0 and
    bf16-mixed without FSDP, each against one process, with every rank's collectives recorded and checked; and the
    CP clock against the profiler on every rank."""
    done, rows, _ = _torchrun(4, "--checks", "nested_gqa,pipeline_hydra,zero2_idle_first,bf16_none,comm_profile")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    by_name = {row["check"]: row for row in rows[:-1]}
    assert list(by_name) == ["nested_gqa", "pipeline_hydra", "zero2_idle_first", "bf16_none", "comm_profile"]
    assert all(row["ok"] for row in rows), rows
    nested = by_name["nested_gqa"]
    assert (nested["ulysses"], nested["ring"]) == (2, 2)
    assert {k: v["kv_replication"] for k, v in nested["heads"].items()} == {"8/2": 1, "12/3": 2}
    for name in ("pipeline_hydra", "zero2_idle_first", "bf16_none"):
        assert by_name[name]["recorded_ok"], by_name[name]
    assert by_name["zero2_idle_first"]["idle_first"]  # reversed plans: a rank sat microbatch 0 out
    assert by_name["pipeline_hydra"]["pool"] == 2 and "old_order_hazard_needs" in by_name["pipeline_hydra"]
    assert by_name["bf16_none"]["precision"] == "bf16-mixed"
    phases = by_name["comm_profile"]["phases"]
    for phase in ("all_to_all", "ring"):
        assert sorted(phases[phase]["ranks"]) == ["0", "1", "2", "3"] and phases[phase]["ok"], phases
        assert all(r["intervals"] > 0 and r["profiler_seconds"] > 0 for r in phases[phase]["ranks"].values())
    assert rows[-1]["summary"] and rows[-1]["ok"] and rows[-1]["checks"] == 5


@pytest.mark.timeout(300)
def test_multi_gpu_hung_check_fails_at_its_deadline_naming_check_and_operation() -> None:
    """The last rank never reaches the first step's plan digest check: the deadline (8 s) ends the run with the
    check's row and the operation every rank waits in, instead of the process group's timeout (450 s here)."""
    done, rows, seconds = _torchrun(
        2, "--checks", "zero2_idle_first", "--hang-check", "zero2_idle_first", "--check-timeout", "8"
    )
    assert done.returncode != 0, done.stdout
    row, summary = rows
    assert row["check"] == "zero2_idle_first" and not row["ok"], rows
    assert row["error"].startswith("timed out after 8 s, rank 0 in the plan digest check on world(0, 1)"), row
    assert row["operation"] == "the plan digest check on world(0, 1)"
    assert summary["summary"] and not summary["ok"] and summary["timed_out"] == "zero2_idle_first"
    assert "check 'zero2_idle_first' timed out after 8 s, rank 1 in the plan digest check" in done.stderr
    assert seconds < 120, seconds  # start-up, the deadline and the others' grace: far below any collective timeout
