"""Asynchronous checkpoints (``HydraStrategy(async_checkpoint=True)``, Lightning's ``AsyncCheckpointIO``) on real
gloo processes: a save blocks only while the state is staged, saves are published one after the other, an older
checkpoint is removed only once the newer one is published, the end of ``fit`` and a SIGTERM stop wait for the
pending write, no thread is left behind, and a run resumed from a checkpoint written while the next step ran trains
what one process trains. A write error surfaces at the next save or wait."""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_hydra import HydraDataModule, HydraStrategy
from lightning_hydra.errors import RankDiedError
from lightning_hydra.strategy.checkpoint import CheckpointSaver, check_complete, load_full_checkpoint
from lightning_hydra.strategy.guard import SIGTERM_EXIT
from lightning_hydra.strategy.prelaunch import SpawnLauncher
from lightning_hydra.testing import quiet_trainer, run_world
from tests.test_sharding import _fit, _strategy, assert_params, make_dataset, make_model


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict, pl.LightningModule]:
    """3 steps on one process, without checkpoints: what every run here must train."""
    model = make_model()
    return _fit(tmp_path_factory.mktemp("ref"), "ref", model, 1, 3)[0], model


class _ThreadsLeft(SpawnLauncher):
    """Each rank, once its worker function returned, writes the non-daemon threads still running (5 s allowed for
    a finished thread to end)."""

    def _wrapping_function(self, *args, **kwargs) -> None:
        super()._wrapping_function(*args, **kwargs)
        deadline = time.monotonic() + 5
        while True:
            left = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        Path(f"{self._strategy.events}.threads{self._strategy.global_rank}").write_text(json.dumps(left))


class _Recording(HydraStrategy):
    """Rank 0 appends every checkpoint it publishes or removes to ``events`` (in the order they happen, whichever
    thread does it); every rank records the threads it leaves."""

    events = ""

    def _configure_launcher(self) -> None:
        self._launcher = _ThreadsLeft(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.global_rank != 0:
            return
        from lightning_hydra.strategy import checkpoint as module

        log, publish, remove = Path(self.events), module.publish, module.remove_checkpoint

        def published(staged, path) -> None:
            publish(staged, path)
            with log.open("a") as f:
                f.write(json.dumps(["publish", Path(path).name]) + "\n")

        def removed(path) -> None:
            with log.open("a") as f:
                f.write(json.dumps(["remove", Path(path).name]) + "\n")
            remove(path)

        module.publish, module.remove_checkpoint = published, removed


def _recording(strategy: HydraStrategy, events: Path) -> HydraStrategy:
    strategy.__class__ = _Recording
    strategy.events = str(events)
    return strategy


def _saves(folder: Path, keep: Path) -> list[ModelCheckpoint]:
    """A checkpoint every step (the newest kept) and ``last``; ``stop`` at step 2, written while step 3 runs."""
    return [
        ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1, save_top_k=1, save_last=True, filename="{step}"),
        ModelCheckpoint(dirpath=str(keep), every_n_train_steps=2, save_top_k=-1, filename="stop"),
    ]


EXPECTED = [  # each save published after the previous one; step N's removed only once step N+1's is published
    ["publish", "step=1.ckpt"],
    ["publish", "last.ckpt"],
    ["publish", "step=2.ckpt"],
    ["remove", "step=1.ckpt"],
    ["publish", "last.ckpt"],
    ["publish", "stop.ckpt"],
    ["publish", "step=3.ckpt"],
    ["remove", "step=2.ckpt"],
    ["publish", "last.ckpt"],
]


def _check_async_run(tmp: Path, folder: Path, ranks: int) -> None:
    """What an asynchronous 3-step run with :func:`_saves` left: every save in order, the newest checkpoint and
    ``last`` complete when ``fit`` returned, nothing else in the folder, no thread running."""
    assert [json.loads(line) for line in (tmp / "events").read_text().splitlines()] == EXPECTED
    check_complete(folder / "last.ckpt")  # fit returned: the pending write is published
    last = folder / "last.ckpt"
    meta = last / "meta.pt" if last.is_dir() else last
    assert torch.load(meta, weights_only=False)["global_step"] == 3
    names = sorted(p.name for p in folder.iterdir())
    links = [os.readlink(folder / n) for n in ("last.ckpt", "step=3.ckpt") if (folder / n).is_symlink()]
    assert names == sorted(["last.ckpt", "step=3.ckpt", *links])  # no hidden sibling left behind
    for rank in range(ranks):
        assert json.loads(Path(f"{tmp / 'events'}.threads{rank}").read_text()) == []


@pytest.mark.timeout(300)
def test_async_sharded_saves_publish_in_order_and_resume_exactly(tmp_path: Path, one_process) -> None:
    """zero3 on 2 ranks, ``async_checkpoint=True``, a save every step: training is unchanged, saves publish in
    order, older ones go after newer ones are published, and ``stop`` (step 2, written while step 3 updated the
    parameters in place) resumes to step 3 exactly as one process trains it."""
    ref, ref_model = one_process
    folder, keep = tmp_path / "ckpt", tmp_path / "keep"
    strategy = _recording(_strategy("zero3", 128, async_checkpoint=True), tmp_path / "events")
    ranks = _fit(tmp_path, "async", make_model(), 2, 3, strategy, callbacks=_saves(folder, keep))
    for rank in ranks:
        assert_params(rank, ref_model, rtol=1e-6, atol=1e-6)
    _check_async_run(tmp_path, folder, 2)
    assert (folder / "last.ckpt").is_symlink() and (folder / "last.ckpt").is_dir()  # a sharded checkpoint

    model = make_model()
    resumed = _fit(tmp_path, "resumed", model, 2, 3, _strategy("zero3", 128), ckpt=str(keep / "stop.ckpt"))
    for rank in resumed:
        assert rank["losses"] == pytest.approx(ref["losses"][2:], rel=1e-5)  # only step 3 ran
        assert_params(rank, ref_model, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(300)
def test_async_replica_saves_through_lightnings_plugin_resume_exactly(tmp_path: Path, one_process) -> None:
    """A replica pool (2 ranks) with Lightning's ``AsyncCheckpointIO`` plugin: the strategy's own asynchronous
    saves (rank 0 stages its state dict, a thread writes the file), the same order of publications and removals,
    and ``stop`` resumes exactly."""
    ref, ref_model = one_process
    folder, keep = tmp_path / "ckpt", tmp_path / "keep"
    strategy = _recording(_strategy("none", 128), tmp_path / "events")
    saves = _saves(folder, keep)
    ranks = _fit(tmp_path, "async", make_model(), 2, 3, strategy, callbacks=saves, plugins=[AsyncCheckpointIO()])
    for rank in ranks:
        assert_params(rank, ref_model, rtol=1e-6, atol=1e-6)
    _check_async_run(tmp_path, folder, 2)
    assert (folder / "last.ckpt").is_file() and not (folder / "last.ckpt").is_symlink()  # a replica's one file

    model = make_model()
    resumed = _fit(tmp_path, "resumed", model, 2, 3, _strategy("none", 128), ckpt=str(keep / "stop.ckpt"))
    for rank in resumed:
        assert rank["losses"] == pytest.approx(ref["losses"][2:], rel=1e-5)
        assert_params(rank, ref_model, rtol=1e-6, atol=1e-6)


class _SigtermAt(pl.Callback):
    """Rank ``rank`` receives SIGTERM as step ``step`` starts (every rank hears of it in that step's control
    all-reduce, before any of the step runs)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.timeout(300)
def test_sigterm_waits_for_the_async_save_and_the_checkpoint_resumes(tmp_path: Path, one_process) -> None:
    """SIGTERM to rank 1 as step 2 starts, in a zero2 run with asynchronous saves: every rank stops at step 2's
    control all-reduce, before any of it runs, with ``last.ckpt`` (after step 1) written and published before the
    processes exit (rank 0's status 143); it resumes steps 2 and 3 exactly as one process trains them."""
    ref, ref_model = one_process
    folder = tmp_path / "ckpt"
    strategy = _strategy("zero2", 128, async_checkpoint=True)
    callbacks = [_SigtermAt(2, 1), ModelCheckpoint(dirpath=str(folder), save_top_k=0)]
    trainer = quiet_trainer(2, strategy, callbacks=callbacks, max_steps=3, enable_checkpointing=True)
    with pytest.raises(RankDiedError, match=rf"rank 0 .*{SIGTERM_EXIT}|rank 0 .*SIGTERM"):
        trainer.fit(make_model(), HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5))
    last = folder / "last.ckpt"
    check_complete(last)  # written and published before the ranks exited
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 1
    assert sorted(p.name for p in folder.iterdir()) == sorted(["last.ckpt", os.readlink(last)])

    model = make_model()
    resumed = _fit(tmp_path, "resumed", model, 2, 3, _strategy("zero2", 128), ckpt=str(last))
    for rank in resumed:
        assert rank["losses"] == pytest.approx(ref["losses"][1:], rel=1e-5)
        assert_params(rank, ref_model, rtol=1e-6, atol=1e-6)


def test_an_async_write_error_surfaces_at_the_next_wait_and_no_thread_is_left(tmp_path: Path) -> None:
    """One process, no process group: a write that fails in the background raises at :meth:`wait` (the next save
    waits first, so it would raise there), not swallowed; the saver pickles to its setting alone; ``close``
    leaves no thread."""
    saver = CheckpointSaver(asynchronous=True)
    saver.setup(torch.device("cpu"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    state = {"state_dict": {"w": torch.ones(3)}, "global_step": 1}
    saver.save_full(state, blocker / "last.ckpt", token="t1", rank=0)  # its folder is a file: the write fails
    with pytest.raises(OSError):
        saver.wait()
    saver.save_full(state, tmp_path / "last.ckpt", token="t2", rank=0)
    state["state_dict"]["w"].add_(1)  # the optimizer's in-place update after the save returned: not in the file
    saver.wait()
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert len(saver.blocked_seconds) == 2
    copy = pickle.loads(pickle.dumps(saver))
    assert copy.asynchronous and copy.group is None and copy.blocked_seconds == []
    saver.save_full(state, blocker / "again.ckpt", token="t3", rank=0)
    with pytest.raises(OSError):
        saver.close()  # the end of a run raises the error too, and still releases the thread
    assert not [t for t in threading.enumerate() if t.name.startswith("hydra-checkpoint")]


def _saver_on_ranks(rank: int, world: int, folder: str) -> dict:
    """A rank's :class:`CheckpointSaver` used directly: two sharded saves (the parameter updated in place between
    them), a failing one, ``close`` and ``setup`` again."""
    folder_path = Path(folder)
    saver = CheckpointSaver(asynchronous=True)
    created = [saver.setup(torch.device("cpu")), saver.setup(torch.device("cpu"))]
    weights = torch.arange(8.0)

    def checkpoint(step: int) -> dict:
        return {"state_dict": {"w": weights}, "optimizer_states": [], "global_step": step}

    saver.save_sharded(checkpoint(1), folder_path / "a.ckpt", token="t1", rank=rank)
    weights.add_(100)  # the next step's in-place update, while the first write may still run
    saver.save_sharded(checkpoint(2), folder_path / "b.ckpt", token="t2", rank=rank)  # waits for a's first
    first_published = (folder_path / "a.ckpt").is_dir()
    saver.close()
    again = saver.setup(torch.device("cpu"))  # another fit in this process: a new stager, the same communicator
    blocker = folder_path / "a-file"
    if rank == 0:
        blocker.write_text("")
    dist.barrier()
    error = None
    try:
        saver.save_sharded(checkpoint(3), blocker / "c.ckpt", token="t3", rank=rank)
        saver.wait()
    except BaseException as exc:  # the failed write's error (torch's CheckpointException is a BaseException)
        error = type(exc).__name__
    from lightning_hydra.strategy import checkpoint as module

    def refuse(staged: Path, path: Path) -> None:
        raise OSError(f"no space left to publish {path.name}")

    publish = module.publish
    if rank == 0:  # rank 0's own part fails (its shards written): every rank hears of it
        module.publish = refuse
    published_error = None
    saver.save_sharded(checkpoint(4), folder_path / "d.ckpt", token="t4", rank=rank)
    try:
        saver.close()  # the end of the run
    except BaseException as exc:
        published_error = f"{type(exc).__name__}: {exc}"
    module.publish = publish
    dist.destroy_process_group()  # a new world in the same process: a new communicator, and the saves work
    dist.init_process_group("gloo", init_method=f"file://{folder_path / 'store'}", rank=rank, world_size=world)
    renewed = saver.setup(torch.device("cpu"))
    saver.save_sharded(checkpoint(5), folder_path / "e.ckpt", token="t5", rank=rank)
    saver.wait()
    replica_error = None  # a replica pool's file: rank 0 writes it, every rank's wait ends once it is published
    saver.save_full({"state_dict": {"w": weights}, "global_step": 6}, blocker / "f.ckpt", token="t6", rank=rank)
    try:
        saver.wait()
    except BaseException as exc:
        replica_error = type(exc).__name__
    saver.save_full({"state_dict": {"w": weights}, "global_step": 7}, folder_path / "g.ckpt", token="t7", rank=rank)
    saver.wait()
    replica_published = (folder_path / "g.ckpt").is_file()
    saver.close()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("hydra-checkpoint")]
    return {
        "created": created,
        "first": first_published,
        "again": again,
        "error": error,
        "publish_error": published_error,
        "renewed": renewed,
        "replica_error": replica_error,
        "replica_published": replica_published,
        "threads": threads,
    }


def test_saver_on_ranks_stages_before_returning_waits_in_turn_and_raises_write_errors_everywhere(
    tmp_path: Path,
) -> None:
    """2 gloo ranks: ``setup`` creates the checkpoint communicator once (collectively) and a stager again after
    ``close``; a save returns with the state staged (the in-place update after it is not in the checkpoint); the
    second save waits for the first to be published (on every rank, not only rank 0 that publishes); a write that
    fails raises on every rank, and so does rank 0's failure to publish; under a new default process group
    ``setup`` creates a new communicator and saves work; a replica pool's file (rank 0's) is published when every
    rank's wait returns, and rank 0's failure to write it is raised on every rank; no thread is left."""
    ranks = run_world(2, _saver_on_ranks, str(tmp_path), timeout=240)
    for rank in ranks:
        assert rank["created"] == [True, False] and rank["again"] is False
        assert rank["first"] and rank["error"] is not None and rank["threads"] == []
    assert ranks[0]["publish_error"] == "OSError: no space left to publish d.ckpt"
    assert ranks[1]["publish_error"].startswith("RuntimeError: rank 0 failed to publish the checkpoint")
    assert not (tmp_path / "d.ckpt").exists()
    assert all(rank["renewed"] and rank["replica_published"] for rank in ranks)
    assert ranks[0]["replica_error"] in ("FileExistsError", "NotADirectoryError")
    assert ranks[1]["replica_error"] == "RuntimeError"
    assert load_full_checkpoint(tmp_path / "e.ckpt")["global_step"] == 5
    first, second = load_full_checkpoint(tmp_path / "a.ckpt"), load_full_checkpoint(tmp_path / "b.ckpt")
    assert first["state_dict"]["w"].tolist() == torch.arange(8.0).tolist() and first["global_step"] == 1
    assert second["state_dict"]["w"].tolist() == (torch.arange(8.0) + 100).tolist() and second["global_step"] == 2
