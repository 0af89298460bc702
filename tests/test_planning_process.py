"""Planning in a process of its own (``HydraDataModule(planning_process=True)``, the default): the plans the
planning thread makes, the planner's errors as it raised them, and a worker that cannot serve replaced by the thread
without a step lost or planned differently."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import sys
import time

import numpy as np
import pytest
import torch

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.bench.batches import make_batch
from lightning_hydra.bench.schedule import llama8b_cost
from lightning_hydra.planner import BatchPlanner, PlanError, PlannerConfig
from lightning_hydra.planner.worker import PlannedStep, PlanWorker, plan_step
from lightning_hydra.testing import quiet_trainer

pytestmark = pytest.mark.usefixtures("isolated_process")  # in-process launches leave no trace

WORLD = 16
PLANNER = BatchPlanner(
    config=PlannerConfig(max_tokens_per_rank=4096, num_microbatches=4, ranks_per_node=8),
    world_size=WORLD,
    num_heads=8,
    num_kv_heads=2,
)
LENGTHS = make_batch("lognormal", world_size=WORLD, capacity=4096, num_microbatches=4, fill=0.75, context=32768, seed=1)
COST = llama8b_cost()


def _assert_same(a: PlannedStep, b: PlannedStep) -> None:
    assert a.digest == b.digest
    assert a.groups == b.groups
    assert a.rank_groups == b.rank_groups
    assert a.world_size == b.world_size
    np.testing.assert_array_equal(a.loads, b.loads)
    np.testing.assert_array_equal(a.features, b.features)


def test_the_planning_process_plans_what_the_thread_plans() -> None:
    worker = PlanWorker()
    try:
        for rank in (0, 7, WORLD - 1):
            there = worker.plan_step(PLANNER, LENGTHS, seed=3, cost=COST, rank=rank)
            _assert_same(there, plan_step(PLANNER, LENGTHS, seed=3, cost=COST, rank=rank))
            assert any(g.seq_ids for g in there.rank_groups)
        assert worker.pid not in (None, os.getpid())
        # a scheduler's SIGTERM to the process group leaves the worker serving: the training process stops it
        os.kill(worker.pid, signal.SIGTERM)
        _assert_same(
            worker.plan_step(PLANNER, LENGTHS, seed=4, cost=COST, rank=3),
            plan_step(PLANNER, LENGTHS, seed=4, cost=COST, rank=3),
        )
        assert worker.failure is None and worker.served == 4
    finally:
        worker.close()
    assert worker.pid is None


def test_the_planners_error_is_raised_as_the_planner_raised_it() -> None:
    lengths = np.asarray([100, 300_000])  # more than 16 ranks of 4,096 tokens hold
    with pytest.raises(PlanError) as here:
        plan_step(PLANNER, lengths, seed=0, cost=COST, rank=0)
    worker = PlanWorker()
    try:
        with pytest.raises(PlanError, match=re.escape(str(here.value))):
            worker.plan_step(PLANNER, lengths, seed=0, cost=COST, rank=0)
        assert worker.failure is None  # the worker still serves
        _assert_same(
            worker.plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=1),
            plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=1),
        )
    finally:
        worker.close()


_ANOTHER_COPY = (
    "import pickle, struct, sys; blob = pickle.dumps('/elsewhere/lightning_hydra/__init__.py'); "
    "sys.stdout.buffer.write(struct.pack('<Q', len(blob)) + blob); sys.stdout.flush(); sys.stdin.read()"
)
SAID = {
    "killed in a request": "exited with code -9",
    "killed between requests": "exited with code -9",
    "cannot start": "could not start",
    "not a worker": "exited with code 0",
    "another copy of the package": "imported lightning_hydra from /elsewhere/lightning_hydra/__init__.py",
}


@pytest.mark.parametrize("failure", list(SAID))
def test_a_worker_that_cannot_serve_is_replaced_by_the_thread(failure, caplog) -> None:
    command = {
        "cannot start": ["/nonexistent/python"],
        "not a worker": [sys.executable, "-c", "pass"],
        "another copy of the package": [sys.executable, "-c", _ANOTHER_COPY],
    }.get(failure)
    worker = PlanWorker(command)
    expected = plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=2)
    try:
        if failure.startswith("killed"):
            _assert_same(worker.plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=2), expected)
            os.kill(worker.pid, signal.SIGKILL)
            if failure == "killed between requests":
                worker._proc.wait()
        with caplog.at_level(logging.WARNING, logger="lightning_hydra.planner.worker"):
            for _ in range(2):
                _assert_same(worker.plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=2), expected)
    finally:
        worker.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # said once; the second step is planned here without a word
    assert SAID[failure] in warnings[0] and "planning in the training process" in warnings[0]
    assert worker.failure is not None and worker.pid is None


def test_the_worker_imports_the_package_this_process_runs(tmp_path, monkeypatch) -> None:
    shadow = tmp_path / "lightning_hydra"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise SystemExit(3)\n")  # an old checkout in the working directory
    monkeypatch.chdir(tmp_path)
    worker = PlanWorker()
    try:
        _assert_same(
            worker.plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=0),
            plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=0),
        )
        assert worker.failure is None and worker.served == 1
    finally:
        worker.close()


def test_a_request_the_worker_cannot_read_is_planned_here(tmp_path, monkeypatch, caplog) -> None:
    worker = PlanWorker()
    try:
        worker.start()
        (tmp_path / "late_cost.py").write_text(
            "from lightning_hydra.planner import CostModel\n\nclass LateCost(CostModel):\n    pass\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))  # after the worker took this process's search path
        from late_cost import LateCost

        cost = LateCost(**{f.name: getattr(COST, f.name) for f in dataclasses.fields(COST)})
        with caplog.at_level(logging.WARNING, logger="lightning_hydra.planner.worker"):
            _assert_same(
                worker.plan_step(PLANNER, LENGTHS, seed=0, cost=cost, rank=0),
                plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=0),
            )
    finally:
        worker.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot read the request: ModuleNotFoundError" in warnings[0], warnings


def test_a_closed_worker_plans_here_until_started_again() -> None:
    worker = PlanWorker()
    worker.close()  # a step asked for ahead of a loop that ended
    expected = plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=0)
    _assert_same(worker.plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=0), expected)
    assert worker.pid is None and worker.served == 0 and worker.failure is None
    worker.start()
    try:
        _assert_same(worker.plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=0), expected)
        assert worker.served == 1
    finally:
        worker.close()


def test_a_process_forked_from_the_rank_does_not_keep_the_worker() -> None:
    worker = PlanWorker()
    worker.plan_step(PLANNER, LENGTHS, seed=0, cost=COST, rank=0)
    child = os.fork()  # a fork-started data loader or pool: it holds the worker's pipe
    if child == 0:
        time.sleep(60)
        os._exit(0)
    try:
        proc = worker._proc
        assert proc is not None
        worker.close()
        # stopped by its stop request (its own exit, status 0), not killed after close's wait (-SIGKILL): the
        # forked child holds the pipe open, so no end of input could have stopped it
        assert proc.returncode == 0, proc.returncode
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def _fit(planning_process: bool) -> tuple[dict, HydraDataModule]:
    torch.manual_seed(0)
    model = DecoderLM(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, lr=0.05, optimizer="sgd")
    data = HydraDataModule(global_batch_tokens=1500, corpus_max_bytes=3000, planning_process=planning_process)
    strategy = HydraStrategy(ranks_per_node=1, max_tokens_per_rank=4096, num_microbatches=2)
    quiet_trainer(1, strategy, max_steps=3).fit(model, data)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, data


def test_a_fit_that_fails_stops_its_planning_process() -> None:
    import lightning.pytorch as pl

    class Fail(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("boom")

    model = DecoderLM(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    data = HydraDataModule(global_batch_tokens=1500, corpus_max_bytes=3000)
    strategy = HydraStrategy(ranks_per_node=1, max_tokens_per_rank=4096)
    with pytest.raises(RuntimeError, match="boom"):
        quiet_trainer(1, strategy, max_steps=5, callbacks=[Fail()]).fit(model, data)
    assert data._worker.served >= 2 and data._worker.pid is None


def test_a_run_plans_in_the_planning_process_and_trains_what_the_thread_trains() -> None:
    in_process, data = _fit(True)
    assert data._worker.served >= 3 and data._worker.failure is None  # every step (and one asked for ahead)
    assert data._worker.pid is None  # stopped at teardown
    in_thread, data = _fit(False)
    assert data._worker.served == 0
    assert in_process.keys() == in_thread.keys()
    for name, value in in_process.items():
        assert torch.equal(value, in_thread[name]), name


def test_a_runtime_that_plans_its_own_way_is_still_asked() -> None:
    from lightning_hydra.data.source import DatasetSource
    from lightning_hydra.strategy import LocalRuntime

    class Recording(LocalRuntime):
        asked = 0

        def plan_batch(self, lengths, *, seed, cost=None):
            Recording.asked += 1
            return super().plan_batch(lengths, seed=seed, cost=cost)

    runtime = Recording(DecoderLM(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1))
    data = HydraDataModule([torch.arange(30), torch.arange(7)], global_batch_tokens=64)
    data._runtime = lambda: runtime
    source = DatasetSource(data.train_dataset, "train", None, False)
    step = data.make_step(source, 0, 0, np.arange(2))
    assert Recording.asked == 1 and data._worker.served == 0
    assert [len(mb.input_ids) for mb in step.microbatches] == [38]  # both documents, zigzag-padded, on one rank
