"""Models built on the meta device (issue 54, item 0): no rank builds the whole model. A ``DecoderLM(init_device=
"meta")`` laid out by HydraStrategy (TP 2 x zero3, 2 pipeline stages), then allocated and initialised shard by
shard, trains exactly the parameters of a one-process model built normally with the same seed; each rank's peak
memory while materialising stays near its share of the model."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_hydra import DecoderLM, HydraDataModule
from lightning_hydra.models.init import is_meta
from lightning_hydra.testing import quiet_trainer
from tests.test_sharding import make_dataset
from tests.test_tensor import _fit, _strategy, assert_held_params


def _model(init_device: str | None = None) -> DecoderLM:
    """``tests.test_sharding.make_model``'s decoder (SGD, active clipping), built on ``init_device``."""
    torch.manual_seed(99)
    return DecoderLM(
        vocab_size=258, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, lr=1.0, optimizer="sgd",
        max_grad_norm=0.2, init_device=init_device,
    )  # fmt: skip


def test_meta_build_materialises_to_the_same_weights() -> None:
    """Built on the meta device it holds no memory; materialised whole it has the normal construction's weights
    (every parameter from its own generator), and a second construction draws another seed."""
    normal, meta = _model(), _model("meta")
    assert is_meta(meta) and not is_meta(normal)
    assert all(p.is_meta for p in meta.parameters())
    meta.materialize("cpu")
    assert not is_meta(meta)
    for (name, a), (_, b) in zip(normal.named_parameters(), meta.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert normal.init_seed != DecoderLM(vocab_size=258, hidden_size=32, num_layers=2, num_heads=4).init_seed


def test_meta_build_trains_in_one_process_without_hydra_strategy(tmp_path: Path) -> None:
    """Under Lightning's own single-device strategy, ``configure_model`` materialises the meta-built model whole:
    the same losses and parameters as the normal build."""
    reference, meta = _model(), _model("meta")
    ref = _fit(tmp_path, "ref", reference, 1, 2)[0]
    got = _fit(tmp_path, "meta", meta, 1, 2)[0]
    assert got["losses"] == ref["losses"]
    for name, p in reference.named_parameters():
        assert torch.equal(dict(meta.named_parameters())[name], p), name


@pytest.mark.parametrize(("sharding", "tensor", "stages"), [("zero3", 2, 1), ("zero3", 1, 2)])
def test_meta_build_trains_like_one_process(tmp_path: Path, sharding: str, tensor: int, stages: int) -> None:
    """TP 2 x zero3 over a pool of 2, and 2 stages x zero3 over a pool of 2, on 4 gloo ranks: the meta-built
    model's losses, gradient norms and parameters after 2 SGD steps are the normally built one-process model's."""
    reference = _model()
    ref = _fit(tmp_path, "ref", reference, 1, 2)[0]
    strategy = _strategy(
        tensor_parallel=tensor, sharding=sharding, pipeline_stages=stages, num_microbatches=4, capacity=160 * stages
    )
    ranks = _fit(tmp_path, "meta", _model("meta"), 4, 2, strategy)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert rank["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert_held_params(ranks, reference, 4 // stages)


class _StartupMemory(pl.Callback):
    """Every rank writes ``strategy.startup_memory``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer, module) -> None:
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(trainer.strategy.startup_memory))


def test_materialising_keeps_each_rank_near_its_share(tmp_path: Path) -> None:
    """A ~100 MB decoder (8 layers of 512) under zero3 on 4 gloo ranks: each rank's resident set rises by its
    quarter of the parameters plus about one full parameter (drawn whole, then cut), far below the whole model."""
    torch.manual_seed(1)
    model = DecoderLM(
        vocab_size=1024, hidden_size=512, num_layers=8, num_heads=8, lr=1.0, optimizer="sgd", init_device="meta"
    )
    full = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    assert full > 90 * 2**20
    out = tmp_path / "memory.json"
    strategy = _strategy(sharding="zero3", capacity=64)
    trainer = quiet_trainer(4, strategy, callbacks=[_StartupMemory(out)], max_steps=1)
    trainer.fit(model, HydraDataModule([t[:60] for t in make_dataset()], global_batch_tokens=200, seed=5))
    assert not is_meta(model)  # the main process took the trained weights (it never allocated the model itself)
    for rank in range(4):
        memory = json.loads(Path(f"{out}.rank{rank}").read_text())
        assert memory["share"] == pytest.approx(full / 4, rel=0.02)
        rise = memory["peak"] - memory["before"]
        assert rise <= memory["share"] + largest + 16 * 2**20, (rise, memory, full)
        assert rise < 0.5 * full, (rise, full)
