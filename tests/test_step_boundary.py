"""A step's boundary costs one host read and one small control all-reduce: the plan digest check, a data error on
any rank and SIGTERM on any rank travel in one ``all_reduce`` read once, at the step's start (issue 55, item 6).

Host reads are counted on CPU ranks as a stand-in for CUDA: ``Tensor.item``, ``tolist``, ``cpu`` and the conversions
to Python numbers and truth values, called from any code but the tests' (each a device-to-host synchronisation on a
GPU), Lightning's conversion of the values a module logs to the progress bar aside; not run on a GPU."""

from __future__ import annotations

import os
import pickle
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hydra import HydraDataModule
from lightning_hydra.data.datamodule import resolve
from lightning_hydra.errors import ConfigError, RankDiedError
from lightning_hydra.schedule import control_words
from lightning_hydra.strategy.checks import DigestMismatch, agree_step
from lightning_hydra.strategy.guard import SIGTERM_EXIT, RunGuard
from lightning_hydra.strategy.recorder import CollectiveRecorder
from lightning_hydra.testing import quiet_trainer, run_world
from tests.test_collective_order import make_dataset, make_model, strategy_of

_READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__")
"""The host reads counted (each a synchronisation with a CUDA device): ``float(t)``, ``int(t)`` and ``if t:`` call the
dunder methods, not ``item``."""

_LOGGING = os.path.join("fabric", "utilities", "apply_func.py")
"""Lightning's conversion of the values a module logs to the progress bar (``convert_tensors_to_scalars``): a read per
logged value and step, the module's choice of what to log, not counted."""


class BoundaryCounts(pl.Callback):
    """Counts, in every rank, the host reads this package's code makes and the collectives it issues, by where they
    happen: in an operation of a step's list (by its kind), or between two lists (``None``)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.recorder: CollectiveRecorder | None = None
        self.reads: list[tuple[int, str | None, str, str]] = []
        """``(lists run before, operation kind or None, read, file:line)`` per host read."""
        self._saved: dict[str, Any] = {}

    def setup(self, trainer: pl.Trainer, module: Any, stage: str) -> None:
        self.recorder = CollectiveRecorder(trainer.global_rank).install(module.runtime())
        for name in _READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, self._saved[name]))

    def _counting(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            recorder = self.recorder
            frame = sys._getframe(1)
            where = frame.f_code.co_filename
            if (
                recorder is not None
                and threading.current_thread() is threading.main_thread()  # the step's thread (planning may run in
                and f"{os.sep}tests{os.sep}" not in where  # another: its reads block no step)
                and not where.endswith(_LOGGING)
            ):
                op = recorder.current
                place = f"{Path(where).parent.name}/{Path(where).name}:{frame.f_lineno}"
                self.reads.append((len(recorder.steps), None if op is None else op.kind, name, place))
            return original(tensor, *args, **kwargs)

        return read

    def on_fit_end(self, trainer: pl.Trainer, module: Any) -> None:
        assert self.recorder is not None
        row = {
            "reads": self.reads,
            "between": self.recorder.between,
            "steps": self.recorder.steps,
            "problems": self.recorder.problems(),
        }
        Path(f"{self.out}.rank{trainer.global_rank}").write_bytes(pickle.dumps(row))

    def teardown(self, trainer: pl.Trainer, module: Any, stage: str) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        if self.recorder is not None:
            self.recorder.uninstall()


def boundary_counts(row: dict, index: int) -> dict[str, list]:
    """What a rank did at the boundary before its list ``index`` (0-based): the host reads and the collectives
    between the previous list and this one (data module, :class:`~lightning_hydra.strategy.guard.RunGuard`,
    Lightning's loop), and those of this list's check."""
    program, calls = row["steps"][index]
    check = next(i for i, op in enumerate(program) if op.kind == "check")
    return {
        "reads": [(k, r, at) for done, k, r, at in row["reads"] if done == index and k in (None, "check")],
        "collectives": [c for done, c in row["between"] if done == index] + [c for i, c in calls if i == check],
    }


@pytest.mark.timeout(120)
def test_a_step_boundary_reads_the_host_once_in_one_control_all_reduce(tmp_path: Path) -> None:
    """Two gloo ranks train three steps; at the boundaries before the second and the third, each rank makes one host
    read (the check's ``tolist``) and issues one collective (the check's ``all_reduce`` of 4 int64 on the world):
    no all-reduce of the data error flag, none of the guard's SIGTERM flag, no Lightning SIGTERM broadcast."""
    out = tmp_path / "counts"
    strategy = strategy_of(layers=1, max_tokens_per_rank=256, num_microbatches=2, ranks_per_node=2)
    trainer = quiet_trainer(2, strategy, callbacks=[BoundaryCounts(out)], max_steps=3)
    trainer.fit(make_model(1), HydraDataModule(make_dataset(3, 16), global_batch_tokens=500, seed=1))
    for rank in range(2):
        row = pickle.loads(Path(f"{out}.rank{rank}").read_bytes())
        assert not row["problems"], row["problems"][:3]  # every list issued exactly its calls
        assert len(row["steps"]) == 3
        for index in (1, 2):
            seen = boundary_counts(row, index)
            print(f"rank {rank} before step {index}: reads {seen['reads']}; collectives {seen['collectives']}")
            step = Counter((kind, r) for done, kind, r, _ in row["reads"] if done == index and kind is not None)
            print(f"rank {rank} step {index}: reads by operation {dict(step)}")
            assert [(kind, r) for kind, r, _ in seen["reads"]] == [("check", "tolist")]
            assert [(c.name, c.ranks, c.numel, c.dtype) for c in seen["collectives"]] == [
                ("all_reduce", (0, 1), control_words(), "int64")
            ]


def _agree_worker(rank: int, world: int) -> list[str]:
    """Three steps' checks on every rank: rank 2 received SIGTERM; rank 1's data failed; rank 1's plan differs."""
    said = []
    cpu = torch.device("cpu")
    said.append(f"stop={agree_step('ab' * 32, device=cpu, world_size=world, stop=rank == 2)}")
    error = ValueError("train item 7 holds token id 300") if rank == 1 else None
    try:
        agree_step(None if error else "ab" * 32, device=cpu, world_size=world, error=error)
    except ConfigError as exc:
        said.append(f"ConfigError: {exc}")
    try:
        agree_step("cd" * 32 if rank == 1 else "ab" * 32, device=cpu, world_size=world)
    except DigestMismatch as exc:
        said.append(f"DigestMismatch: {exc}")
    return said


def test_the_control_all_reduce_stops_every_rank_alike() -> None:
    """SIGTERM on one rank is every rank's; a data error on one rank is the same one-line ConfigError on every rank,
    naming the rank; plans that differ are a DigestMismatch on every rank, naming the rank: never a hang."""
    for said in run_world(3, _agree_worker, timeout=60):
        assert said[0] == "stop=True"
        assert said[1] == "ConfigError: train item 7 holds token id 300 (found by rank 1)"
        assert said[2].startswith("DigestMismatch: plan digests differ across ranks: ranks [1] disagree with rank 0")


class _SignalOnRankOne(pl.Callback):
    """Rank 1 receives SIGTERM (its guard's flag, as the guard's handler sets it) at the end of the second step;
    every rank notes the batches it starts."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        with open(f"{self.out}.rank{trainer.global_rank}", "a") as f:
            f.write(f"{batch_idx}:{resolve(batch).step}\n")

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 1 and batch_idx == 1 and trainer.global_step == 2:
            next(c for c in trainer.callbacks if isinstance(c, RunGuard)).requested.set()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("isolated_process")
def test_sigterm_on_one_rank_stops_every_rank_at_the_next_steps_check(tmp_path: Path) -> None:
    """The flag travels in the third step's check: every rank saves the state after two steps and stops before
    anything else of the third step runs (the launching rank with status 143)."""
    strategy = strategy_of(layers=1, max_tokens_per_rank=256, num_microbatches=2, ranks_per_node=2)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    signal = _SignalOnRankOne(tmp_path / "started")
    trainer = quiet_trainer(2, strategy, callbacks=[checkpoints, signal], max_steps=6, enable_checkpointing=True)
    with pytest.raises(RankDiedError, match=f"rank 0 .* exited with status {SIGTERM_EXIT} without a Python error"):
        trainer.fit(make_model(1), HydraDataModule(make_dataset(3, 24), global_batch_tokens=500, seed=1))
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 2 and state["HydraDataModule"]["step"] == 2
    started = [Path(f"{tmp_path / 'started'}.rank{rank}") for rank in range(2)]
    for path in started:  # the third step started (its check ran) and trained nothing
        assert path.read_text().split() == ["0:0", "1:1", "2:2"]
        path.unlink()
    strategy = strategy_of(layers=1, max_tokens_per_rank=256, num_microbatches=2, ranks_per_node=2)
    trainer = quiet_trainer(2, strategy, callbacks=[signal], max_steps=4)
    data = HydraDataModule(make_dataset(3, 24), global_batch_tokens=500, seed=1)
    trainer.fit(make_model(1), data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    for path in started:  # the resumed run trains the third and fourth batches
        assert path.read_text().split() == ["2:2", "3:3"]
