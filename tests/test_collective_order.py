"""Real processes at the sizes that hung before the step was data: 2 stages x a pool of 4 under ``hydra`` (8 gloo
ranks) and zero2 on a pool of 4 with ranks idle in microbatch 0 train exactly what one process trains; a recorder of
the ``torch.distributed`` calls shows that every rank issued exactly its operation list, and the lists of the whole
run pass the checker; a deliberately mis-ordered list fails within its timeout, and the message names the ranks,
their operations and the communicator instead of hanging."""

from __future__ import annotations

import dataclasses
import pickle
import re
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.data.datamodule import resolve
from lightning_hydra.schedule import (
    ScheduleError,
    StepLayout,
    StepOptions,
    Work,
    check_programs,
    per_position_order,
    step_programs,
)
from lightning_hydra.strategy.pool import PoolRuntime
from lightning_hydra.strategy.recorder import RecordCollectives, recorded_runs
from lightning_hydra.strategy.watchdog import Watchdog
from lightning_hydra.testing import quiet_trainer


def make_model(layers: int) -> DecoderLM:
    torch.manual_seed(5)
    return DecoderLM(
        vocab_size=258, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2, lr=1.0, optimizer="sgd"
    )


def make_dataset(seed: int, count: int) -> list[torch.Tensor]:
    lengths = np.random.default_rng(seed).integers(3, 240, size=count)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (int(n),), generator=g) for n in lengths]


class Rows(pl.Callback):
    """Every rank writes its share of every plan, the losses and the parameters it holds at the end (a pipeline
    stage its own layers; zero2 gathered)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[list[tuple[tuple[int, ...], int]]] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.rows.append([(mb.group.ranks, mb.num_tokens) for mb in resolve(batch).microbatches])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.tensor import DTensor

        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in module.named_parameters()}
        row = {"rows": self.rows, "losses": self.losses, "params": params}
        Path(f"{self.out}.rows{trainer.global_rank}").write_bytes(pickle.dumps(row))


def _fit(tmp: Path, model: DecoderLM, devices: int, data: list, strategy=None, *, seed: int) -> list[dict]:
    """Train 3 steps; every rank's rows and losses, and (several ranks) its recorded lists, checked."""
    tmp.mkdir(exist_ok=True)
    out = tmp / f"run{devices}"
    trainer = quiet_trainer(devices, strategy, callbacks=[Rows(out), RecordCollectives(out)], max_steps=3)
    trainer.fit(model, HydraDataModule(data, global_batch_tokens=700, seed=seed))
    ranks = [pickle.loads(Path(f"{out}.rows{r}").read_bytes()) for r in range(devices)]
    if devices > 1:  # every rank issued exactly its lists, and the lists of the whole run pass the checker
        for row, recorded in zip(ranks, recorded_runs(out, devices), strict=True):
            row["programs"] = recorded["programs"]
    return ranks


def _assert_params(ranks: list[dict], reference: DecoderLM, stages: int) -> None:
    """Every rank holds the reference's parameters (each of a pipeline stage's layers on every rank of its pool)."""
    for name, p in reference.named_parameters():
        holders = [row for row in ranks if name in row["params"]]
        assert len(holders) == len(ranks) // stages, name
        for row in holders:
            torch.testing.assert_close(row["params"][name], p.detach(), rtol=1e-6, atol=1e-6, msg=name)


def strategy_of(cls: type[HydraStrategy] = HydraStrategy, *, layers: int, **kw) -> HydraStrategy:
    """A CPU strategy of these tests: forkserver ranks, the CPU kernel, the tiny model's cost model, no monitor, a
    two-minute collective timeout (unless ``kw`` says otherwise)."""
    kw.setdefault("timeout", timedelta(seconds=120))
    cost = make_model(layers).cost_model().replace(min_chunk_tokens=16)
    return cls(start_method="forkserver", kernel="cpu", cost=cost, monitor=False, **kw)


def _work(ranks: list[dict], positions: list[int], step: int) -> list[list[Work]]:
    return [[Work(g, t) for g, t in ranks[r]["rows"][step]] for r in positions]


@pytest.mark.timeout(300)
def test_two_stages_by_a_pool_of_four_under_hydra_train_like_one_process(tmp_path: Path) -> None:
    # the data's first batches include one whose plan puts two pool positions of one CP group out of order under a
    # per-position 1F1B (checked below): the run that hung before
    data = make_dataset(38, 24)
    reference = make_model(4)
    ref = _fit(tmp_path / "ref", reference, 1, data, seed=2)[0]
    model = make_model(4)
    strategy = strategy_of(layers=4, pipeline_stages=2, max_tokens_per_rank=128, num_microbatches=6, ranks_per_node=4)
    ranks = _fit(tmp_path / "pp", model, 8, data, strategy, seed=2)
    for row in ranks:
        assert row["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    _assert_params(ranks, reference, stages=2)
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=name)
    layout = StepLayout(stages=2, pool=4)
    broken = 0
    for step in range(3):
        try:
            work = _work(ranks, [0, 1, 2, 3], step)
            check_programs(step_programs(layout, work, StepOptions(), order=per_position_order))
        except ScheduleError:
            broken += 1
    assert broken > 0  # these batches break the old order


class _ReversedPlans(PoolRuntime):
    """hydra's plans with their microbatches in reverse order (the same groups): hydra fills microbatch 0 first and
    never leaves a rank of a pool of 4 idle in it (none of 862 random batches did), reversed its last microbatches
    come first."""

    def plan_batch(self, lengths, *, seed, cost=None):
        plan = super().plan_batch(lengths, seed=seed, cost=cost)
        return dataclasses.replace(plan, microbatches=plan.microbatches[::-1])


class _ReversedStrategy(HydraStrategy):
    def _setup_runtime(self) -> None:
        super()._setup_runtime()
        assert type(self.runtime) is PoolRuntime
        self.runtime.__class__ = _ReversedPlans


@pytest.mark.timeout(300)
def test_zero2_with_ranks_idle_in_the_first_microbatch_trains_like_one_process(tmp_path: Path) -> None:
    data = make_dataset(0, 20)
    reference = make_model(2)
    ref = _fit(tmp_path / "ref", reference, 1, data, seed=5)[0]
    model = make_model(2)
    strategy = strategy_of(
        _ReversedStrategy, layers=2, max_tokens_per_rank=96, num_microbatches=4, ranks_per_node=2, sharding="zero2"
    )
    ranks = _fit(tmp_path / "z2", model, 4, data, strategy, seed=5)
    for row in ranks:
        assert row["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    _assert_params(ranks, reference, stages=1)
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=name)
    # a rank sat microbatch 0 out and ran a later one in a group of several: it gathered at the step's start
    patterns = 0
    for step in range(3):
        work = _work(ranks, [0, 1, 2, 3], step)
        for row in work:
            patterns += row[0].tokens == 0 and any(w.tokens and len(w.group) > 1 for w in row[1:])
        for row in ranks:  # every rank, the idle ones too, gathers its two layers first
            assert [op.kind for op in row["programs"][step][:3]] == ["check", "gather", "gather"]
    assert patterns > 0


class _Misordered(PoolRuntime):
    """Rank 1's first step runs its first forward in a CP group before the plan's digest check: its peers wait in
    the check on the world's communicator while it waits in the forward on its group's."""

    steps = 0

    def program(self, batch, module, *, train, clip=False):
        ops = super().program(batch, module, train=train, clip=clip)
        if self.world_rank == 1 and train and not self.steps:
            first = next(
                i for i, op in enumerate(ops) if op.kind == "forward" and any(c.kind == "cp" for c in op.comms)
            )
            ops.insert(0, ops.pop(first))
        self.steps += 1
        return ops


class _MisorderedStrategy(HydraStrategy):
    reports = ""  # every rank appends its watchdog's reports to this file (its standard error is the terminal's)

    def _setup_runtime(self) -> None:
        super()._setup_runtime()
        self.runtime.__class__ = _Misordered
        watchdog = self.runtime.watchdog
        self.runtime.watchdog = Watchdog(watchdog.rank, watchdog.limit, report=self._report)

    def _report(self, message: str) -> None:
        with open(self.reports, "a") as f:
            f.write(message + "\n")


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("isolated_process")  # a failed launch leaves no port or variable to the tests after it
def test_a_misordered_collective_fails_in_seconds_naming_ranks_and_communicator(tmp_path: Path) -> None:
    strategy = strategy_of(
        _MisorderedStrategy,
        layers=2,
        policy="static",  # groups of two in every microbatch: (0, 1) and (2, 3)
        max_tokens_per_rank=128,
        num_microbatches=2,
        ranks_per_node=2,
        timeout=timedelta(seconds=10),  # the watchdog reports at half of it
    )
    strategy.reports = str(tmp_path / "watchdog.txt")
    trainer = quiet_trainer(4, strategy, max_steps=2)
    with pytest.raises(ProcessRaisedException) as failed:  # whichever rank's error Lightning's launcher raises
        trainer.fit(make_model(2), HydraDataModule(make_dataset(0, 20), global_batch_tokens=700, seed=5))
    message = str(failed.value)
    assert re.search(r"rank \d failed in (the plan digest check on world\(0, 1, 2, 3\)|forward of )", message), message
    # the first rank whose collective timed out ends; a peer still waiting may see its connection close first (no
    # collective synchronises the ranks before the step's check any more: which rank waits longest varies)
    assert any(s in message for s in ("Timed out", "timed out", "Connection closed by peer")), message[-2000:]
    err = Path(strategy.reports).read_text()
    # every rank said where it waits: rank 1 in its forward on its CP group, the others in the check
    assert re.search(
        r"watchdog: rank 1 has waited \d+ s in forward of microbatch \d \(stage 0, \d+ tokens\) on cp\(0, 1\)", err
    ), err[-3000:]
    for rank in (0, 2, 3):
        assert re.search(
            rf"watchdog: rank {rank} has waited \d+ s in the plan digest check on world\(0, 1, 2, 3\)", err
        ), err[-3000:]
