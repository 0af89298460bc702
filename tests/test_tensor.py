"""Tensor parallelism composed with dynamic CP on real processes: TP 2 x pool 2 on 4 gloo ranks trains the same
parameters as one process; bad TP settings stop before launch with one line."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.errors import ConfigError
from lightning_hydra.strategy.prelaunch import preflight
from lightning_hydra.strategy.tensor import check_tensor_parallel
from lightning_hydra.testing import quiet_trainer

LENGTHS = [230, 7, 95, 64, 3, 180, 41, 120, 12, 77, 200, 33, 150, 9, 60, 110, 25, 88, 140, 5]


def make_dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 250, (n,), generator=g) for n in LENGTHS]


def make_model() -> DecoderLM:
    torch.manual_seed(99)
    return DecoderLM(
        vocab_size=258,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        lr=1.0,
        optimizer="sgd",
        max_grad_norm=0.2,  # active: the norm sums the TP shards' squares once, the replicated parameters once
    )


class Record(pl.Callback):
    """Every rank writes its losses, grad norms, idle microbatches and full (gathered) parameters."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.idle = 0
        self.kinds: list[str] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.idle += sum(mb.num_tokens == 0 for mb in batch.microbatches)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.tensor import DTensor

        params = {}
        for name, p in module.named_parameters():
            self.kinds.append(type(p.data).__name__)
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()  # collective for DTensors
            params[name] = full.tolist()
        row = {"losses": self.losses, "norms": self.norms, "idle": self.idle, "params": params, "kinds": self.kinds}
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(row))


def _fit(tmp: Path, name: str, model: DecoderLM, devices: int, steps: int, strategy=None) -> list[dict]:
    out = tmp / f"{name}.json"
    trainer = quiet_trainer(devices, strategy, callbacks=[Record(out)], max_steps=steps)
    trainer.fit(model, HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5))
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)]


def _strategy(**kw) -> HydraStrategy:
    return HydraStrategy(
        max_tokens_per_rank=kw.pop("capacity", 160),
        ranks_per_node=kw.pop("ranks_per_node", 4),
        start_method="forkserver",
        kernel="cpu",
        cost=make_model().cost_model().replace(min_chunk_tokens=16),
        monitor=False,
        **kw,
    )


def test_tp2_pool2_trains_like_one_process(tmp_path: Path) -> None:
    reference = make_model()
    ref = _fit(tmp_path, "ref", reference, 1, 3)[0]
    model = make_model()
    # the static policy at one degree over 6 microbatches leaves pool positions idle in some microbatches (their
    # whole TP group sits out together: TP's collectives stay aligned)
    strategy = _strategy(tensor_parallel=2, policy="static", num_microbatches=6)
    ranks = _fit(tmp_path, "tp", model, 4, 3, strategy)
    assert ranks[0]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert max(ranks[0]["norms"]) > 0.2  # clipping changed the update (and stayed exact)
    assert ranks[0]["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert sum(r["idle"] for r in ranks) > 0  # some ranks were idle in some microbatch
    assert "DTensor" in ranks[0]["kinds"]  # the projections really are TP shards
    for name, p in reference.named_parameters():
        expected = p.detach()
        for rank in ranks:
            got = torch.tensor(rank["params"][name], dtype=expected.dtype)
            rel = (got - expected).norm() / expected.norm()
            assert rel <= 1e-6, f"{name}: relative difference {float(rel):.2e}"


@pytest.mark.parametrize(
    ("tensor", "kw", "message"),
    [
        (3, {"world": 6, "ranks_per_node": 4}, r"tensor_parallel=3 does not divide ranks_per_node=4.*\[1, 2, 4\]"),
        (4, {"world": 6, "ranks_per_node": 8}, r"does not divide the world of 6 ranks; use one of \[1, 2, 3, 6\]"),
        (4, {"world": 8, "ranks_per_node": 8, "heads": 6}, r"does not divide the model's 6 attention heads"),
        (4, {"world": 8, "ranks_per_node": 8, "heads": 8, "kv_heads": 2}, r"does not divide the model's 2 KV heads"),
        (2, {"world": 8, "ranks_per_node": 8, "heads": 4, "max_ulysses": 4}, r"2 x ulysses_degree=4 exceeds.*<= 2"),
    ],
)
def test_bad_tensor_parallel_is_one_line(tensor: int, kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        check_tensor_parallel(tensor, **kw)
    assert "\n" not in str(info.value)


def test_bad_tensor_parallel_stops_before_launch() -> None:
    strategy = HydraStrategy(tensor_parallel=2, ranks_per_node=4, max_tokens_per_rank=256)
    strategy.parallel_devices = [torch.device("cpu")] * 6  # 6 ranks on one node of 4: TP 2 divides it
    model = DecoderLM(hidden_size=48, num_heads=6, num_kv_heads=3)
    with pytest.raises(ConfigError, match="does not divide the model's 3 KV heads"):
        preflight(strategy, model, None)
    with pytest.raises(ConfigError, match="does not divide ranks_per_node=4"):
        HydraStrategy(tensor_parallel=3, ranks_per_node=4)
    with pytest.raises(ValueError, match="tensor_parallel > 1 runs with sharding='none'"):
        HydraStrategy(tensor_parallel=2, sharding="zero2")
