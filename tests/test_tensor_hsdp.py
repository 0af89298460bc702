"""``sharding="hsdp"`` composed with tensor parallelism on real processes: TP 2 x (replicate 2 x shard 2) on 8 gloo
ranks trains the parameters of one process, and its distributed checkpoint resumes at TP 1 zero2; a bad layout stops
before launch with one line. The 8-rank runs take about a minute each on 2 cores (``timeout`` marks)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.errors import ConfigError
from lightning_hydra.strategy.prelaunch import preflight
from lightning_hydra.testing import quiet_trainer
from tests.test_sharding import make_dataset, make_model
from tests.test_tensor import CAPTURE_CHECK, VIEW_WARNING, Record, _fit, _strategy, assert_held_params


class Placements(pl.Callback):
    """Rank 0 writes each parameter's mesh dims and placements after set-up (the FSDP x TP layout)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, module) -> None:
        from torch.distributed.tensor import DTensor

        if trainer.global_rank == 0:
            row = {
                name: [list(p.device_mesh.mesh_dim_names or ()), [str(x) for x in p.placements]]
                for name, p in module.named_parameters()
                if isinstance(p, DTensor)
            }
            self.out.write_text(json.dumps(row))


class OptimizerState(pl.Callback):
    """Every rank writes the full (gathered) optimizer state by parameter name at the end of training."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = trainer.optimizers[0]
        state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
        row = {name: {k: torch.as_tensor(v).tolist() for k, v in s.items()} for name, s in state.items()}
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(row))


def _hsdp(**kw) -> HydraStrategy:
    # 8 ranks, ranks_per_node 4: two nodes of two TP-2 groups; the pool of 4 positions is (replicate 2, shard 2)
    return _strategy(tensor_parallel=2, sharding="hsdp", ranks_per_node=kw.pop("ranks_per_node", 4), **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stages", "ranks_per_node"), [(1, 4), (2, 2), (2, 4)])
def test_hsdp_tp2_trains_like_one_process(tmp_path: Path, stages: int, ranks_per_node: int) -> None:
    """TP 2 x (replicate 2 x shard 2) on 8 ranks; TP 2 x PP 2 x (replicate 2 x shard 1): nodes of one TP group, a
    stage's pool of 2 positions on two nodes; and TP 2 x PP 2 x (replicate 1 x shard 2): a stage's pool in one node
    (a shard group above 1 under PP needs 16 ranks for a replicate dim above 1 too)."""
    reference = make_model()
    ref = _fit(tmp_path, "ref", reference, 1, 3)[0]
    placements = tmp_path / "placements.json"
    out = tmp_path / "hsdp.json"
    strategy = _hsdp(
        policy="static",
        num_microbatches=6,
        pipeline_stages=stages,
        ranks_per_node=ranks_per_node,
        capacity=160 * stages,
    )
    trainer = quiet_trainer(8, strategy, callbacks=[Record(out), Placements(placements)], max_steps=3)
    trainer.fit(make_model(), HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5))
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(8)]
    assert max(ref["norms"]) > 0.2  # clipping changed the update (and stayed exact)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert rank["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        # sequence parallelism (on by default) under hsdp: no block returned a view to FSDP2, on any rank
        assert rank["warnings"][0] == CAPTURE_CHECK
        assert not [w for w in rank["warnings"] if VIEW_WARNING in w], rank["warnings"]
    # positions sat out microbatches: zero-token passes in the last (on every stage, the activations they send
    # included)
    assert sum(r["idle"] for r in ranks) > 0
    layout = json.loads(placements.read_text())
    # a TP-split projection: replicated across nodes, FSDP-sharded inside a node, TP-sharded by rows
    mesh, where = layout["layers.0.attn.q_proj.weight"]
    assert mesh == ["replicate", "shard", "tp"], mesh
    assert where[0] == "R" and where[2] == "S(0)", where  # FSDP strides its dim-0 shard over the TP shard
    if stages == 1:
        assert layout["lm_head.weight"][0] == ["replicate", "shard", "tp"]  # the vocabulary-parallel head
    assert_held_params(ranks, reference, 8 // stages)


@pytest.mark.timeout(300)
def test_hsdp_tp2_checkpoint_resumes_at_tp1_zero2(tmp_path: Path) -> None:
    """Saved at TP 2 x (replicate 2 x shard 2) after step 2 (AdamW), resumed at TP 1 x pool 2 zero2: step 3, the
    parameters and the AdamW state equal the uninterrupted run's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def model() -> DecoderLM:
        torch.manual_seed(99)
        return DecoderLM(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, lr=3e-3, max_grad_norm=0.2)

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1, filename="stop")
    out, opt = tmp_path / "full.json", tmp_path / "full_opt.json"
    callbacks = [Record(out), OptimizerState(opt), ckpt]
    trainer = quiet_trainer(
        8, _hsdp(num_microbatches=2, capacity=256), callbacks=callbacks, max_steps=3, enable_checkpointing=True
    )
    trainer.fit(model(), HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5))
    fulls = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(8)]
    full_opts = [json.loads(Path(f"{opt}.rank{r}").read_text()) for r in range(8)]
    full, full_opt = fulls[0], full_opts[0]
    for rank, rank_opt in zip(fulls, full_opts, strict=True):  # one model and state on every rank (gathered)
        assert rank["losses"] == full["losses"] and rank["params"] == full["params"] and rank_opt == full_opt
    path = tmp_path / "ckpt" / "stop.ckpt"
    assert path.is_dir()  # a torch.distributed.checkpoint directory
    out, opt = tmp_path / "resumed.json", tmp_path / "resumed_opt.json"
    strategy = _strategy(tensor_parallel=1, sharding="zero2", num_microbatches=2, capacity=256)
    trainer = quiet_trainer(2, strategy, callbacks=[Record(out), OptimizerState(opt)], max_steps=3)
    trainer.fit(model(), HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5), ckpt_path=str(path))
    for r in range(2):  # every rank of the resumed run
        again = json.loads(Path(f"{out}.rank{r}").read_text())
        again_opt = json.loads(Path(f"{opt}.rank{r}").read_text())
        assert len(again["losses"]) == 1  # only step 3 ran
        assert again["losses"][0] == pytest.approx(full["losses"][-1], rel=1e-5)
        for name, values in full["params"].items():
            torch.testing.assert_close(torch.tensor(again["params"][name]), torch.tensor(values), rtol=1e-5, atol=1e-7)
        assert set(again_opt) == set(full_opt) and len(full_opt) == len(full["params"])
        for name, state in full_opt.items():
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, state.keys()
            for key, values in state.items():
                torch.testing.assert_close(
                    torch.tensor(again_opt[name][key]), torch.tensor(values), rtol=1e-5, atol=1e-9, msg=f"{name} {key}"
                )


def test_hsdp_tp_layout_checks_stop_before_launch() -> None:
    """hsdp x TP is accepted at construction; a pool that is not whole nodes stops before launch with one line."""
    model = DecoderLM(hidden_size=32, num_heads=4, num_kv_heads=2)
    strategy = HydraStrategy(tensor_parallel=2, sharding="hsdp", ranks_per_node=8, max_tokens_per_rank=256)
    strategy.parallel_devices = [torch.device("cpu")] * 16  # 2 nodes of 8: a pool of 8 positions, (2, 4)
    preflight(strategy, model, None)
    strategy.parallel_devices = [torch.device("cpu")] * 12  # 6 positions, 4 per node: not whole nodes
    message = (
        r"^12 devices with tensor_parallel=2 leave a pool of 6 positions \(devices / \(pipeline_stages x "
        r"tensor_parallel\)\), and a node \(ranks_per_node=8\) holds 4 positions of 2 devices: a pool must be whole "
        r"nodes or divide one; use 4, 8, 16 devices$"
    )
    with pytest.raises(ConfigError, match=message) as info:
        preflight(strategy, model, None)
    assert "\n" not in str(info.value)
