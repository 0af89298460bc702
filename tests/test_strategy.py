"""HydraStrategy + HydraDataModule on real processes (Lightning's multiprocessing launcher, gloo): exact training."""

from __future__ import annotations

import copy
import json
import multiprocessing.forkserver
import os
import uuid
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.cp.layout import ZigzagMeta, zigzag_source_index
from lightning_hydra.testing import quiet_trainer

LENGTHS = [230, 7, 95, 64, 3, 180, 41, 120, 12, 77, 200, 33, 150, 9, 60, 110, 25, 88, 140, 5]


class CountingDataset(torch.utils.data.Dataset):
    """A map-style dataset that counts how often each item is read (per process)."""

    def __init__(self, items: list[torch.Tensor]) -> None:
        self.items = items
        self.reads: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads[index] += 1
        return self.items[index]


def make_dataset(seed: int = 0) -> CountingDataset:
    g = torch.Generator().manual_seed(seed)
    return CountingDataset([torch.randint(0, 250, (n,), generator=g) for n in LENGTHS])


def make_model(optimizer: str = "adamw") -> DecoderLM:
    torch.manual_seed(1234)
    lr = 3e-3 if optimizer == "adamw" else 1.0
    return DecoderLM(
        vocab_size=258,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        lr=lr,
        max_grad_norm=None,
        optimizer=optimizer,
    )


MARK = "LIGHTNING_HYDRA_TEST_MARK"
"""An environment variable set before a launch, which every rank must see."""


class Recorder(pl.Callback):
    """Each rank writes, per step: the loss, the groups it ran, and the (document, position) of every real token;
    at the end its reads, marks and full (gathered) parameters."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.rows: list[dict] = []
        self.seed = -1
        self.unpickled_mark: str | None = None

    def __setstate__(self, state: dict) -> None:  # in a rank: what the environment says as its arguments arrive
        self.__dict__.update(state, unpickled_mark=os.environ.get(MARK))

    def on_train_start(self, trainer, module) -> None:
        self.seed = torch.initial_seed()  # the launching process's (nothing seeds the ranks)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        tokens, groups = [], []
        for mb in batch.microbatches:
            if not mb.num_tokens:
                continue
            groups.append([len(mb.ranks), mb.ulysses, mb.ring])
            meta = ZigzagMeta.from_cu_seqlens(mb.cu_seqlens, len(mb.ranks))
            source = zigzag_source_index(meta, mb.ranks.index(trainer.global_rank))[1]
            for s in source[source >= 0].tolist():
                doc = max(i for i, start in enumerate(mb.cu_seqlens[:-1]) if start <= s)
                tokens.append([mb.seq_ids[doc], s - mb.cu_seqlens[doc]])
        held = sorted({i for mb in batch.microbatches for i in mb.seq_ids})
        self.rows.append(
            {
                "step": batch.step,
                "epoch": batch.epoch,
                "digest": batch.digest,
                "groups": groups,
                "tokens": tokens,
                "held": held,
                "cost_version": batch.cost_version,
            }
        )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.rows[-1]["loss"] = float(outputs["loss"] if isinstance(outputs, dict) else outputs)

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.tensor import DTensor

        reads = dict(trainer.datamodule.train_dataset.reads)
        marks = {"mark": os.environ.get(MARK), "unpickled_mark": self.unpickled_mark}
        self.rows.append({"reads": {str(k): v for k, v in reads.items()}, **marks, "seed": self.seed})
        self.rows[-1]["params"] = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).tolist()  # collective for DTensors
            for n, p in module.named_parameters()
        }
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def _trainer(devices: int, tmp: Path, strategy=None, **kw) -> pl.Trainer:
    return quiet_trainer(devices, strategy, callbacks=[Recorder(str(tmp))], **kw)


def _reference(tmp: Path, model: DecoderLM, steps: int | None = None, epochs: int = 1) -> tuple[list[dict], DecoderLM]:
    ref_dir = tmp / "ref"
    ref_dir.mkdir()
    dm = HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5)
    trainer = _trainer(1, ref_dir, max_steps=steps or -1, max_epochs=epochs)
    trainer.fit(model, dm)
    return json.loads((ref_dir / "rank0.json").read_text())[:-1], model


def _hydra_run(
    tmp: Path,
    model: DecoderLM,
    policy: str,
    steps: int | None = None,
    epochs: int = 1,
    start_method: str = "forkserver",
    **strategy_kw,
) -> list[list[dict]]:
    run_dir = tmp / policy
    run_dir.mkdir()
    # tiny documents: a small kernel tile in the cost model lets the plans use degrees up to 4 (what we test)
    cost = model.cost_model().replace(min_chunk_tokens=16)
    strategy = HydraStrategy(
        policy=policy,
        max_tokens_per_rank=80,
        num_microbatches=3,
        ranks_per_node=2,
        start_method=start_method,
        kernel="cpu",
        cost=cost,
        **strategy_kw,
    )
    dm = HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5)
    trainer = _trainer(4, run_dir, strategy=strategy, max_steps=steps or -1, max_epochs=epochs)
    trainer.fit(model, dm)
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(4)]


def _reads(rank_rows: list[dict]) -> tuple[list[dict], Counter]:
    return rank_rows[:-1], Counter({int(k): v for k, v in rank_rows[-1]["reads"].items()})


def _assert_same_training(ref_rows, ref_model, runs, model) -> None:
    params = [rank[-1]["params"] for rank in runs]
    runs = [_reads(rank)[0] for rank in runs]
    for r in range(4):  # every rank: its losses and the parameters it ends with
        assert len(ref_rows) == len(runs[r]) >= 3
        for a, b in zip(ref_rows, runs[r], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (r, a["step"])
        for name, p in ref_model.named_parameters():
            got = torch.tensor(params[r][name])
            torch.testing.assert_close(got, p.detach(), rtol=1e-5, atol=1e-5, msg=f"rank {r}: {name}")
    assert len({row["digest"] for rank in runs for row in rank if row["step"] == 0}) == 1
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=name)


def test_four_ranks_train_exactly_like_one_process(tmp_path: Path, monkeypatch) -> None:
    base = make_model()
    ref_rows, ref_model = _reference(tmp_path, copy.deepcopy(base))
    model = copy.deepcopy(base)
    multiprocessing.forkserver.ensure_running()  # started before the variable is set: the launcher must pass it
    monkeypatch.setenv(MARK, uuid.uuid4().hex)
    torch.manual_seed(4321)
    runs = _hydra_run(tmp_path, model, "hydra")
    # each rank has its own copy of the model (ranks sharing one would each apply every step), and the environment
    # and random state of the launching process at launch, not the fork server's
    _assert_same_training(ref_rows, ref_model, runs, model)
    assert [(rank[-1]["mark"], rank[-1]["unpickled_mark"]) for rank in runs] == [(os.environ[MARK],) * 2] * 4
    assert [rank[-1]["seed"] for rank in runs] == [4321] * 4
    # the plans split sequences over groups of 2 and 4 ranks, with Ulysses > 1 and ring > 1 (the engine's tests
    # cover every factorization; here the point is that the strategy runs them exactly)
    used = {tuple(g) for rank in runs for row in rank[:-1] for g in row["groups"]}
    degrees = {d for d, _, _ in used}
    assert {2, 4} <= degrees, used
    assert any(u > 1 for _, u, _ in used) and any(r > 1 for _, _, r in used), used
    # every non-pad token of the epoch was fed to the model exactly once, across all ranks
    fed = sorted(tuple(t) for rank in runs for row in rank[:-1] for t in row["tokens"])
    expected = sorted((d, p) for d, n in enumerate(LENGTHS) for p in range(n))
    assert fed == expected
    # each rank read its share of the lengths scan once, then only the sequences of its own groups
    for r, rank in enumerate(runs):
        rows, reads = _reads(rank)
        want = Counter(range(r, len(LENGTHS), 4))
        for row in rows:
            want.update(row["held"])
        assert reads == want, r
        assert all(row["cost_version"] == 0 for row in rows)  # no calibration: the analytic model throughout


# the other tests start their ranks from a fork server (each rank starts with Lightning imported); one run spawns
@pytest.mark.parametrize(("policy", "start_method"), [("mcore", "spawn"), ("static", "forkserver")])
def test_baseline_policies_also_train_exactly(tmp_path: Path, policy: str, start_method: str) -> None:
    base = make_model("sgd")
    ref_rows, ref_model = _reference(tmp_path, copy.deepcopy(base), steps=3)
    model = copy.deepcopy(base)
    runs = _hydra_run(tmp_path, model, policy, steps=3, start_method=start_method)
    _assert_same_training(ref_rows, ref_model, runs, model)


def _resume_run(
    tmp: Path, name: str, max_steps: int, ckpt: str | None = None, save_at: int | None = None
) -> list[dict]:
    run_dir = tmp / name
    run_dir.mkdir()
    model = make_model("sgd")
    dm = HydraDataModule(make_dataset(), global_batch_tokens=400, seed=9)
    strategy = HydraStrategy(
        max_tokens_per_rank=128, num_microbatches=2, ranks_per_node=2, start_method="forkserver", kernel="cpu"
    )
    trainer = _trainer(2, run_dir, strategy=strategy, max_steps=max_steps, max_epochs=3)
    if save_at:
        trainer.callbacks.append(
            ModelCheckpoint(dirpath=str(tmp / "ckpt"), every_n_train_steps=save_at, save_top_k=-1, filename="stop")
        )
    trainer.fit(model, dm, ckpt_path=ckpt)
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_resume_continues_with_the_same_batches(tmp_path: Path) -> None:
    fulls = _resume_run(tmp_path, "full", max_steps=8)
    ckpt = str(tmp_path / "ckpt" / "stop.ckpt")
    firsts = _resume_run(tmp_path, "first", max_steps=3, save_at=3)
    rests = _resume_run(tmp_path, "rest", max_steps=8, ckpt=ckpt)
    for full, first, rest in zip(fulls, firsts, rests, strict=True):  # every rank
        full, first, rest = full[:-1], first[:-1], rest[:-1]
        assert [r["digest"] for r in first + rest] == [r["digest"] for r in full]
        assert [(r["epoch"], r["step"]) for r in first + rest] == [(r["epoch"], r["step"]) for r in full]
        for a, b in zip(first + rest, full, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert len({r["epoch"] for r in full}) > 1  # the run crosses an epoch boundary
    _assert_replica_exports(Path(ckpt), tmp_path)


def _assert_replica_exports(ckpt: Path, tmp: Path) -> None:
    """A replica pool's single-file checkpoint exports (bf16 by default, one ``model.safetensors``) as a Llama whose
    logits are the checkpointed module's; a target that exists and is not empty is refused in one line unless
    ``--overwrite``."""
    from transformers import AutoModelForCausalLM

    from lightning_hydra.cli import main
    from lightning_hydra.cp import CPContext

    saved = make_model("sgd")
    saved.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"])
    out = tmp / "hf"
    out.mkdir()
    (out / "note.txt").write_text("not empty")
    assert main(["export", str(ckpt), str(out)]) == 1  # one line, nothing written
    assert (out / "note.txt").exists() and not (out / "config.json").exists()
    assert main(["export", str(ckpt), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 258, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), saved.local_cp.use(CPContext.local_group(), [0, 40]):
        mine = saved(ids, torch.arange(40))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(theirs, mine, rtol=0.05, atol=0.02)  # the weights rounded to bf16


def test_cost_model_before_setup_has_the_node_size_the_pool_will_give_it() -> None:
    """Read before ``fit``, the strategy's cost model already knows the node size its plans will use (the given
    model's own where it has one), so that it predicts rings inside a node on the intra-node link."""
    from lightning_hydra.planner import CostModel

    bare = CostModel.for_transformer(128, 4, 4, 2, 256, 258)
    assert bare.ranks_per_node == 0
    own = bare.replace(ranks_per_node=4)
    # (the strategy's ranks per node, the given model, what plans will use): 2 of the 4 ranks; a node of 8 holds the
    # whole pool of 4; a model with its own node size keeps it
    for ranks_per_node, cost, expected in ((2, bare, bare.replace(ranks_per_node=2)), (8, bare, own), (2, own, own)):
        strategy = HydraStrategy(ranks_per_node=ranks_per_node, cost=cost, start_method="forkserver", kernel="cpu")
        pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, enable_progress_bar=False)
        assert strategy.cost_model == expected
