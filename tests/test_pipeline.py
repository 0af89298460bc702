"""Pipeline parallelism under dynamic CP on real processes: stages x pools train exactly what one process trains,
the layers are dealt by FLOPs, the measured bubble comes from the stages' timelines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.metrics.loads import pipeline_replay, projected_pipeline_bubble, step_metrics
from lightning_hydra.metrics.record import StepRecord, rank_row
from lightning_hydra.models.stages import stage_layers
from lightning_hydra.planner.calibration import NUM_FEATURES
from lightning_hydra.schedule import exchanges, stage_order
from lightning_hydra.strategy.pipeline import PipelineLayout
from lightning_hydra.strategy.recorder import RecordCollectives, recorded_runs
from lightning_hydra.testing import quiet_trainer

LENGTHS = [230, 7, 95, 64, 3, 180, 41, 120, 12, 77, 200, 33, 150, 9, 60, 110, 25, 88, 140, 5]


def make_dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 250, (n,), generator=g) for n in LENGTHS]


def make_model() -> DecoderLM:
    torch.manual_seed(5)
    return DecoderLM(
        vocab_size=258,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        lr=1.0,
        optimizer="sgd",
        max_grad_norm=0.2,  # active: the clip sees the norm over both stages' layers, as one process does
    )


class Log(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict] = []
        self.trace: list[list[tuple[str, int, list[int]]]] = []

    def setup(self, trainer, module, stage) -> None:
        post = torch.distributed.batch_isend_irecv

        def recorded(ops):  # every batched P2P call this rank makes, as posted: (op, peer, shape)
            self.trace.append([(op.op.__name__, op.peer, list(op.tensor.shape)) for op in ops])
            return post(ops)

        torch.distributed.batch_isend_irecv = recorded

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        record = module.last_record
        self.rows.append(
            {
                "loss": float(outputs["loss"] if isinstance(outputs, dict) else outputs),
                "microbatches": len(batch.microbatches),
                "idle": sum(mb.num_tokens == 0 for mb in batch.microbatches),
                "shapes": sorted({mb.num_tokens for mb in batch.microbatches}),
                "stages": int(record.stages),
                "grad_norm": float(trainer.callback_metrics["train/grad_norm"]),
                "bubble": {k: v for k, v in step_metrics(record, replay=True).items() if k.startswith("bubble/pp")},
            }
        )

    def on_train_end(self, trainer, module) -> None:
        rows = [{**r, "bubble": {k: float(v) for k, v in r["bubble"].items()}} for r in self.rows]
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(rows))
        Path(f"{self.out}.trace{trainer.global_rank}").write_text(json.dumps(self.trace))


def link_trace(trace: list, peer: int) -> list[list[tuple[str, list[int]]]]:
    """The batched P2P calls of one rank's trace that involve ``peer``, as ``(direction, shape)`` sorted lists with
    the direction seen from the rank that sends (``isend`` on one end is ``irecv`` on the other)."""
    out = []
    for batch in trace:
        ops = sorted((name, shape) for name, p, shape in batch if p == peer)
        if ops:
            out.append(ops)
    return out


def _fit(tmp: Path, name: str, model: DecoderLM, devices: int, strategy=None) -> list[list[dict]]:
    out = tmp / name
    trainer = quiet_trainer(devices, strategy, callbacks=[Log(out), RecordCollectives(f"{out}.ops")], max_steps=3)
    trainer.fit(model, HydraDataModule(make_dataset(), global_batch_tokens=700, seed=2))
    if devices > 1:  # every rank issued exactly its operation lists, and they pass the checker
        recorded_runs(f"{out}.ops", devices)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = make_model()
    rows = _fit(tmp_path_factory.mktemp("ref"), "ref", model, 1)[0]
    return [r["loss"] for r in rows], model


@pytest.mark.parametrize(("stages", "capacity"), [(2, 128), (4, 256)])
def test_pipeline_trains_like_one_process(tmp_path: Path, reference, stages: int, capacity: int) -> None:
    ref_losses, ref_model = reference
    model = make_model()
    strategy = HydraStrategy(
        pipeline_stages=stages,
        max_tokens_per_rank=capacity,
        num_microbatches=6,
        ranks_per_node=4 // stages,
        start_method="forkserver",
        kernel="cpu",
        cost=make_model().cost_model().replace(min_chunk_tokens=16),
    )
    ranks = _fit(tmp_path, f"pp{stages}", model, 4, strategy)
    for rows in ranks:
        assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    first = ranks[0][0]
    assert max(r["grad_norm"] for r in ranks[0]) > 0.2  # clipping changed the update (and stayed exact)
    assert first["microbatches"] > stages  # more microbatches than stages: the steady 1F1B phase ran
    assert len(first["shapes"]) > 2  # microbatches of different shapes
    if stages == 2:
        assert sum(r["idle"] for rows in ranks for r in rows) > 0  # idle pool positions were skipped
    assert first["stages"] == stages
    bubble = first["bubble"]
    assert set(bubble) >= {"bubble/pp", "bubble/pp_projected", "bubble/pp_min"}
    assert 0 < bubble["bubble/pp_min"] <= bubble["bubble/pp"] < 1
    for rows in ranks:  # every measured step at or above its floor
        assert all(r["bubble"]["bubble/pp"] >= r["bubble"]["bubble/pp_min"] - 1e-12 for r in rows)
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=name)
    # every link's P2P operations, recorded as posted: the same batches in the same order on both ends
    traces = [json.loads(Path(f"{tmp_path}/pp{stages}.trace{r}").read_text()) for r in range(4)]
    pool = 4 // stages
    flip = {"isend": "irecv", "irecv": "isend"}
    for upper in range(4 - pool):
        lower = upper + pool
        down = link_trace(traces[upper], lower)
        up = [sorted((flip[name], shape) for name, shape in ops) for ops in link_trace(traces[lower], upper)]
        assert down == up and len(down) >= 3 * first["microbatches"] // 2
        assert any(len(ops) == 2 for ops in down)  # the steady phase pairs a send with a receive


def test_layers_are_dealt_by_flops() -> None:
    assert stage_layers(8, 2, block_flops=1.0) == [range(0, 4), range(4, 8)]
    # a heavy head leaves the last stage fewer blocks
    assert stage_layers(8, 2, block_flops=1.0, head_flops=2.0) == [range(0, 5), range(5, 8)]
    assert [len(r) for r in stage_layers(5, 5, block_flops=1.0)] == [1] * 5
    with pytest.raises(ValueError, match="3 transformer blocks cannot fill 4 pipeline stages"):
        stage_layers(3, 4, block_flops=1.0)
    with pytest.raises(ValueError, match="cannot form 3 pipeline stages"):
        PipelineLayout.of_world(4, 3)
    layout = PipelineLayout.of_world(8, 2)
    assert layout.stage_ranks(1) == (4, 5, 6, 7) and layout.position(6) == 2 and layout.global_rank(1, 2) == 6


def _record(forward: np.ndarray, backward: np.ndarray, stages: int) -> StepRecord:
    m, n = forward.shape
    pool = n // stages
    rows = []
    for r in range(n):
        rows.append(
            rank_row(
                list(forward[:, r] + backward[:, r]),
                [0.0] * m,
                [0.0] * m,
                [(r, 1)] * m,  # every rank its own group
                np.zeros((m, NUM_FEATURES)),
                1.0,
                0.0,
                forward=list(forward[:, r]),
                backward=list(backward[:, r]),
                stage=r // pool,
            )
        )
    return StepRecord.from_table(np.stack(rows), step=0, num_microbatches=m, trained_tokens=1, includes_comm=False)


def test_replayed_bubble_of_equal_microbatches_is_the_closed_form() -> None:
    stages, m = 4, 6
    forward = np.full((m, stages), 1.0)
    backward = np.full((m, stages), 2.0)
    record = _record(forward, backward, stages)
    makespan = pipeline_replay(record)
    assert makespan == pytest.approx((m + stages - 1) * 3.0)  # 1F1B with equal operations
    busy = (forward + backward).sum()
    assert 1 - busy / (stages * makespan) == pytest.approx((stages - 1) / (m + stages - 1))
    assert projected_pipeline_bubble(record) == pytest.approx((stages - 1) / (m + stages - 1))


def test_a_slow_microbatch_stretches_the_replayed_pipeline() -> None:
    stages, m = 2, 4
    forward = np.full((m, stages), 1.0)
    backward = np.full((m, stages), 2.0)
    base = pipeline_replay(_record(forward, backward, stages))
    forward[1, :] = 3.0
    backward[1, :] = 6.0
    assert pipeline_replay(_record(forward, backward, stages)) > base + 5.0


KILL_SCRIPT = """
import os
import lightning.pytorch as pl
import torch
from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy


class Killer(pl.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 1 and trainer.global_rank == 2:
            os._exit(3)  # a rank dies in the middle of the run


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 250, (n,), generator=g) for n in [50, 30, 70, 20, 60, 40, 10, 90] * 3]
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=258, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    strategy = HydraStrategy(
        pipeline_stages=2, max_tokens_per_rank=128, num_microbatches=4, ranks_per_node=2, kernel="cpu", monitor=False
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Killer()],
    )
    trainer.fit(model, HydraDataModule(data, global_batch_tokens=400))
"""


def test_a_rank_killed_mid_run_ends_every_rank_with_an_error(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    # the run ended (no rank hung waiting for the dead one: the timeout above would raise) with an error: each
    # surviving rank either raised from its broken link or was ended by the launcher once the dead rank was seen
    # (and named: lightning_hydra.strategy.exits), whichever came first
    assert done.returncode != 0
    ended = re.search(r"stopped: rank 2 \(pid \d+\) exited with status 3 without a Python error", done.stderr)
    raised = all(f"[rank{rank}]: RuntimeError" in done.stderr for rank in (0, 1, 3))
    assert ended or raised, done.stderr[-3000:]


def _link(posts: list, side: int) -> list[frozenset[tuple[str, int]]]:
    """The exchanges of one stage with its neighbour on ``side``, in posting order, as sets of ``(flow,
    microbatch)``: the same list on both ends of a link means they post the same batches in the same order."""
    out = []
    for batch in (x for pair in posts for x in pair):
        mine = frozenset((t.flow, t.microbatch) for s, t in batch if s == side)
        if mine:
            out.append(mine)
    return out


@pytest.mark.parametrize("train", [True, False])
def test_both_ends_of_every_link_post_the_same_exchanges_in_the_same_order(train: bool) -> None:
    rng = np.random.default_rng(4)
    paired = 0
    for stages in range(2, 9):
        for count in range(1, 13):
            for trial in range(6):
                runs = [m for m in range(count) if trial == 0 or rng.random() < 0.7]  # idle positions skipped
                posts = [exchanges(s, stages, runs, count, train=train) for s in range(stages)]
                for s in range(stages - 1):
                    down = _link(posts[s], 1)
                    assert down == _link(posts[s + 1], -1), (stages, count, runs, s)
                    moved = sorted(t for x in down for t in x)
                    expected = [("down", m) for m in runs] + [("up", m) for m in runs] * train
                    assert moved == sorted(expected)  # every tensor crosses the link once
                    paired += sum(len(x) == 2 for x in down)
                for s, schedule in enumerate(posts):  # a receive is posted before the operation that reads it
                    posted: set[tuple[str, int]] = set()
                    order = stage_order(s, stages, runs, count, train=train)
                    for (kind, m), (before, after) in zip(order, schedule, strict=True):
                        received = {(t.kind, t.microbatch) for side, t in before if (t.flow == "down") == (side < 0)}
                        posted |= received
                        need = (
                            ("act", m)
                            if kind == "F" and s > 0
                            else ("grad", m)
                            if kind == "B" and s < stages - 1
                            else None
                        )
                        assert need is None or need in posted
                        posted |= {(t.kind, t.microbatch) for side, t in after if (t.flow == "down") == (side < 0)}
    assert paired > 0 if train else paired == 0
