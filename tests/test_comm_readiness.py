"""What only multi-GPU NCCL runs exercise, checked on CPU: communication timed by an injectable clock read once per
step (CUDA events on GPU), no object collective in a training step, and no object gather of tensors on the
checkpoint and weight-return paths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.cp.groups import CommClock, CudaEventSource
from lightning_hydra.strategy.checkpoint import full_state_dict, load_sharded_checkpoint, save_sharded_checkpoint
from lightning_hydra.testing import quiet_trainer, run_world

LENGTHS = [230, 7, 95, 64, 3, 180, 41, 120, 12, 77, 200, 33, 150, 9, 60, 110, 25, 88, 140, 5]
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


class RecordingSource:
    """A clock source that counts marks and notes any interval read before the step's one settle."""

    immediate = False

    def __init__(self) -> None:
        self.marks = 0
        self.settles = 0
        self.early_reads = 0
        self.settled = False

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def elapsed(self, start: int, end: int) -> float:
        if not self.settled:
            self.early_reads += 1
        return (end - start) * 1e-3

    def settle(self, last: int) -> None:
        assert last == self.marks  # the last mark recorded: every earlier one is then complete
        self.settles += 1
        self.settled = True


def _carries_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_carries_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_carries_tensor(v) for v in obj)
    return False


def count_object_collectives(log: list[tuple[str, bool]], during: list[bool]) -> None:
    """Wrap torch.distributed's object collectives to append ``(name, carries a tensor)`` to ``log`` while
    ``during[0]``."""
    for name in OBJECT_COLLECTIVES:
        real = getattr(dist, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            if during[0]:
                log.append((_name, _carries_tensor([*args, *kwargs.values()])))
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)


def test_the_clock_reads_once_per_step_and_sums_per_tag() -> None:
    source = RecordingSource()
    clock = CommClock(source)
    for tag in (0, 0, 2):
        clock.tag(tag)
        with clock.measure():
            pass
    assert clock.pending == 3 and source.early_reads == 0 and source.settles == 0  # nothing read while issuing
    assert clock.read() == pytest.approx({0: 2e-3, 2: 1e-3})
    assert source.settles == 1 and source.early_reads == 0
    assert clock.read() == {} and source.settles == 1  # nothing measured: nothing to wait for
    clock.tag(1)
    with clock.measure():
        pass
    clock.discard()
    assert clock.read() == {}


class _FakeEvent:
    recorded: ClassVar[list] = []
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t = 0.0

    def record(self, stream=None) -> None:
        _FakeEvent.recorded.append(stream)
        self.t = float(len(_FakeEvent.recorded))

    def synchronize(self) -> None:
        _FakeEvent.synchronized += 1

    def elapsed_time(self, end: _FakeEvent) -> float:
        return 1e3 * (end.t - self.t)


def test_on_cuda_the_clock_records_events_on_the_collectives_stream(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    device = torch.device("cuda", 3)
    clock = CommClock.for_device(device)
    assert isinstance(clock.source, CudaEventSource)
    for tag in (0, 1, 1):
        clock.tag(tag)
        with clock.measure():
            pass
    assert _FakeEvent.recorded == ["stream of cuda:3"] * 6 and _FakeEvent.synchronized == 0
    assert clock.read() == pytest.approx({0: 1.0, 1: 2.0})
    assert _FakeEvent.synchronized == 1  # one wait, for the last event, once per step
    assert not isinstance(CommClock.for_device(torch.device("cpu")).source, CudaEventSource)


class Probe(pl.Callback):
    """Injects a recording clock source, counts object collectives inside training steps, and checks that each
    step's per-rank rows and calibration rows carry the clock's figures."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.source = RecordingSource()
        self.calls: list[tuple[str, bool]] = []
        self.during = [False]
        self.steps: list[dict] = []
        self.calibrated: list = []

    def setup(self, trainer, module, stage) -> None:
        count_object_collectives(self.calls, self.during)

    def on_train_start(self, trainer, module) -> None:
        runtime = trainer.strategy.runtime
        runtime.comm_clock.source = self.source
        self.oversubscribed = bool(runtime.oversubscribed)
        add = runtime.calibrator.add

        def recorded(features, times, *, includes_comm, comm=None):
            self.calibrated.append(None if comm is None else [float(c) for c in comm])
            return add(features, times, includes_comm=includes_comm, comm=comm)

        runtime.calibrator.add = recorded

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.during[0] = True  # from the first step on, checkpoint saves included
        self.source.settled = False
        self.marks_before = self.source.marks
        self.settles_before = self.source.settles

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        record = module.last_record
        rank = trainer.global_rank
        self.steps.append(
            {
                "intervals": (self.source.marks - self.marks_before) // 2,
                "settles": self.source.settles - self.settles_before,
                "comm": [float(c) for c in record.comm[:, rank]],
                "degree": [int(d) for d in record.degree[:, rank]],
                "table": [float(c) for c in record.comm.ravel()],
            }
        )

    def on_train_end(self, trainer, module) -> None:
        self.during[0] = False
        out = {
            "steps": self.steps,
            "calls": self.calls,
            "early": self.source.early_reads,
            "calibrated": self.calibrated,
            "oversubscribed": self.oversubscribed,
        }
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(out))


def test_a_step_takes_the_clocks_figures_and_runs_no_object_collective(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = DecoderLM(vocab_size=258, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, optimizer="sgd")
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 250, (n,), generator=g) for n in LENGTHS]
    strategy = HydraStrategy(
        max_tokens_per_rank=128,
        num_microbatches=2,
        ranks_per_node=2,
        start_method="forkserver",
        kernel="cpu",
        calibrate=True,
    )
    probe = Probe(tmp_path / "probe")
    saves = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    trainer = quiet_trainer(2, strategy, callbacks=[probe, saves], max_steps=3, enable_checkpointing=True)
    trainer.fit(model, HydraDataModule(data, global_batch_tokens=500, seed=1))
    for rank in range(2):
        out = json.loads(Path(f"{tmp_path}/probe.rank{rank}").read_text())
        assert out["early"] == 0  # no interval was read before the step's end
        assert out["calls"] == []  # no object collective inside a training step (the checkpoint save included)
        for step, rows in zip(out["steps"], out["calibrated"], strict=True):
            assert step["settles"] == 1  # one wait per step
            assert sum(step["comm"]) == pytest.approx(step["intervals"] * 1e-3)  # the rows carry the clock's time
            assert all((c > 0) == (d > 1) for c, d in zip(step["comm"], step["degree"], strict=True))
            if not out["oversubscribed"]:
                assert rows == pytest.approx(step["table"])  # the calibration fits the same figures
        assert any(d > 1 for step in out["steps"] for d in step["degree"])  # CP collectives ran


class _Stage(nn.Module):
    def __init__(self, stage: int) -> None:
        super().__init__()
        torch.manual_seed(stage)
        setattr(self, f"layer{stage}", nn.Linear(3, 2 + stage))


def _save_and_gather(rank: int, world: int, tmp: str) -> dict:
    log: list[tuple[str, bool]] = []
    count_object_collectives(log, [True])
    model = _Stage(rank)  # one stage per rank: every rank holds different tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, optimizer)],
        "global_step": 7,
    }
    save_sharded_checkpoint(state, tmp, global_rank=rank)
    on_save = list(log)
    dist.barrier()  # rank 0 writes the metadata file last (Lightning waits the same way before a resume)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    meta = load_sharded_checkpoint(tmp, model, [optimizer])
    restored = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    full = full_state_dict(
        model, sharded=False, staged=True, device=torch.device("cpu"), stage_roots=tuple(range(world))
    )
    return {
        "log": log,
        "on_save": on_save,
        "restored": restored,
        "step": meta["global_step"],
        "full": {k: v.tolist() for k, v in full.items()},
        "mine": {k: v.tolist() for k, v in saved.items()},
    }


def test_checkpoints_and_full_weights_gather_no_tensor_as_an_object(tmp_path: Path) -> None:
    results = run_world(3, _save_and_gather, str(tmp_path / "ckpt"))
    for r in results:
        assert r["restored"] and r["step"] == 7
        assert not any(tensor for _, tensor in r["log"])  # no object collective carried a tensor
    assert not any(name == "all_gather_object" for r in results for name, _ in r["on_save"])  # DCP's plans only
    expected = {k: v for r in results for k, v in r["mine"].items()}
    assert results[0]["full"] == expected  # rank 0 holds every stage's weights
    assert results[1]["full"] == {} and results[2]["full"] == {}  # the others hold nothing more than their own
