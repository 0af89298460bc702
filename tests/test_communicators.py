"""What runs on which communicator, recorded from a real run: ring transfers, pipeline transfers and gradient sums
each on a communicator of their own, the step-boundary collectives on the default group."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from lightning_hydra import HydraDataModule
from lightning_hydra.strategy.recorder import RecordCollectives, recorded_runs
from lightning_hydra.testing import quiet_trainer
from tests.test_collective_order import make_dataset, make_model, strategy_of


@pytest.mark.timeout(240)
def test_ring_pipeline_and_gradient_traffic_each_run_on_their_own_communicator(tmp_path: Path) -> None:
    strategy = strategy_of(
        layers=2,
        policy="static",  # one degree over 2 pool positions: every busy microbatch is a ring of 2
        pipeline_stages=2,
        max_tokens_per_rank=128,
        num_microbatches=4,
        ranks_per_node=1,  # no Ulysses: the CP groups are rings
    )
    out = tmp_path / "ops"
    trainer = quiet_trainer(4, strategy, callbacks=[RecordCollectives(out)], max_steps=2)
    trainer.fit(make_model(2), HydraDataModule(make_dataset(0, 20), global_batch_tokens=700, seed=5))
    recorded_runs(out, 4)  # every rank issued exactly its lists
    for rank in range(4):
        row = pickle.loads(Path(f"{out}.rank{rank}").read_bytes())
        groups, usage = row["groups"], row["usage"]
        assert set(groups) == {"world", "gradient sum", "ring", "pipeline"}
        assert len(set(groups.values())) == 4  # four communicators, not one carrying three kinds of traffic
        assert usage[("forward", "p2p")] == usage[("backward", "p2p")] == {groups["ring"]}
        assert usage[("exchange", "p2p")] == {groups["pipeline"]}
        assert {name for (kind, name) in usage if kind == "grad_sum"} == {"all_reduce", "all_gather"}
        assert usage[("grad_sum", "all_reduce")] == {groups["gradient sum"]}
        for kind in ("check", "loss_sum", "measure"):  # the step-boundary collectives: the default group
            assert {g for (k, _), names in usage.items() if k == kind for g in names} == {groups["world"]}
