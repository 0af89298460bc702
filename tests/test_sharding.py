"""Sharded training state (FSDP2 over the pool) on real processes: zero2, zero3 and hsdp train the same parameters
as one process; checkpoints save on 4 ranks and resume on 2; selective activation checkpointing is exact and never
repeats CP communication."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.cp import CPContext
from lightning_hydra.strategy.prelaunch import SpawnLauncher
from lightning_hydra.strategy.recorder import RecordCollectives, recorded_runs
from lightning_hydra.strategy.sharding import build_mesh, state_bytes
from lightning_hydra.testing import quiet_trainer

LENGTHS = [230, 7, 95, 64, 3, 180, 41, 120, 12, 77, 200, 33, 150, 9, 60, 110, 25, 88, 140, 5]


def make_dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 250, (n,), generator=g) for n in LENGTHS]


def make_model(optimizer: str = "sgd") -> DecoderLM:
    torch.manual_seed(99)
    lr = 1.0 if optimizer == "sgd" else 3e-3
    return DecoderLM(
        vocab_size=258,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        lr=lr,
        optimizer=optimizer,
        max_grad_norm=0.2,  # active: the norm is taken over every shard, as one process takes it
    )


class LossLog(pl.Callback):
    """Every rank writes its losses and grad norms, counts its idle microbatches, measures its state bytes and, at
    the end, writes its full (gathered) parameters."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.idle = 0
        self.bytes: dict[str, int] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.idle += sum(mb.num_tokens == 0 for mb in batch.microbatches)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.norms.append(float(trainer.callback_metrics["train/grad_norm"]))
        if not self.bytes:
            self.bytes = state_bytes(module, module.optimizers().optimizer)

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.tensor import DTensor

        params = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).tolist()
            for n, p in module.named_parameters()
        }  # collective for DTensors
        row = {"losses": self.losses, "norms": self.norms, "idle": self.idle, "bytes": self.bytes, "params": params}
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(row))


def _fit(
    tmp: Path, name: str, model: DecoderLM, devices: int, steps: int, strategy=None, ckpt: str | None = None, **kw
) -> list[dict]:
    out = tmp / f"{name}.json"
    callbacks = [LossLog(out), *kw.pop("callbacks", [])]
    checkpoints = len(callbacks) > 1
    callbacks.append(RecordCollectives(tmp / f"{name}.ops"))
    trainer = quiet_trainer(
        devices, strategy, callbacks=callbacks, max_steps=steps, enable_checkpointing=checkpoints, **kw
    )
    trainer.fit(model, HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5), ckpt_path=ckpt)
    if devices > 1:  # every rank issued exactly its operation lists (saves included), and they pass the checker
        recorded_runs(tmp / f"{name}.ops", devices)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)]


class _ExitRecorder(SpawnLauncher):
    """Lightning's multiprocessing launcher, each worker writing what it holds once it has released its groups."""

    def _wrapping_function(self, *args, **kwargs) -> None:
        super()._wrapping_function(*args, **kwargs)
        strategy = self._strategy
        cache = strategy.runtime.cache
        row = {"created": cache.created, "destroyed": cache.destroyed, "held": len(cache)}
        row["initialized"] = dist.is_initialized()
        Path(f"{strategy.exit_log}.rank{strategy.global_rank}").write_text(json.dumps(row))


class _ExitRecordingStrategy(HydraStrategy):
    exit_log = ""

    def _configure_launcher(self) -> None:
        self._launcher = _ExitRecorder(self, start_method=self._start_method)


def _strategy(sharding: str, capacity: int = 80, exit_log: Path | None = None, **kw) -> HydraStrategy:
    kw.setdefault("num_microbatches", 4)
    cls = HydraStrategy if exit_log is None else _ExitRecordingStrategy
    strategy = cls(
        max_tokens_per_rank=capacity,
        ranks_per_node=2,
        start_method="forkserver",
        kernel="cpu",
        sharding=sharding,
        cost=make_model().cost_model().replace(min_chunk_tokens=16),
        monitor=False,
        **kw,
    )
    if exit_log is not None:
        strategy.exit_log = str(exit_log)
    return strategy


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, DecoderLM]:
    tmp = tmp_path_factory.mktemp("ref")
    model = make_model()
    return _fit(tmp, "ref", model, 1, 3)[0], model


def assert_params(rank: dict, expected: DecoderLM, rtol: float, atol: float) -> None:
    """A rank's gathered parameters are ``expected``'s."""
    for name, p in expected.named_parameters():
        torch.testing.assert_close(torch.tensor(rank["params"][name]), p.detach(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("sharding", ["zero2", "zero3", "hsdp"])
def test_sharded_pool_trains_like_one_process(tmp_path: Path, reference, sharding: str) -> None:
    ref, ref_model = reference
    model = make_model()
    # the static policy at one degree over 6 microbatches leaves ranks idle in some microbatches of steps 2 and 3
    # whatever hydra's candidates would pick, so zero-token passes run (under zero3 every rank runs every microbatch)
    exit_log = tmp_path / "exit.json"
    strategy = _strategy(
        sharding, 96, exit_log, policy="static", num_microbatches=6, activation_checkpointing="selective"
    )
    saves = [] if sharding == "zero2" else [ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)]
    ranks = _fit(tmp_path, sharding, model, 4, 3, strategy, callbacks=saves)
    assert max(ref["norms"]) > 0.2  # clipping changed the update (and stayed exact)
    for rank in ranks:  # every rank: hsdp's two replicas each hold a whole model
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert rank["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert_params(rank, ref_model, rtol=1e-6, atol=1e-6)
    assert sum(r["idle"] for r in ranks) > 0  # some ranks were idle in some microbatch: zero-token passes ran
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=name)
    replica = state_bytes(ref_model)
    shards = 2 if sharding == "hsdp" else 4  # hsdp shards inside a node of 2 ranks
    for rank in ranks:
        assert rank["bytes"]["params"] <= replica["params"] / shards * 1.2
    if saves:  # the sharded checkpoint exports as a Llama (zero2's: the killed-and-resumed run's)
        assert_exports_as_llama(tmp_path / "ckpt" / "last.ckpt", tmp_path / "hf", model, ref_model)
    # a worker that returned released its CP communicators and the process groups before its interpreter finalised
    for rank in range(4):
        left = json.loads(Path(f"{exit_log}.rank{rank}").read_text())
        assert 0 < left["destroyed"] <= left["created"]  # those this rank is a member of
        assert left["held"] == 0
        assert not left["initialized"]


def test_zero2_state_and_resume_on_fewer_ranks(tmp_path: Path) -> None:
    """AdamW state is sharded (<= 0.3x a replica's per rank at 4 ranks); a checkpoint saved by 4 ranks resumes on
    2 and the next step equals the 4-rank run's."""
    full_model = make_model("adamw")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1, filename="stop")
    full = _fit(tmp_path, "full", full_model, 4, 3, _strategy("zero2", capacity=128), callbacks=[ckpt])
    assert (tmp_path / "ckpt" / "stop.ckpt").is_dir()  # a sharded checkpoint: a directory of shards
    replica_optimizer = 2 * sum(p.numel() * 4 for p in full_model.parameters())  # exp_avg and exp_avg_sq
    for rank in full:
        assert 0 < rank["bytes"]["optimizer"] <= 0.3 * replica_optimizer
        assert rank["losses"] == full[0]["losses"]  # the loss is the global batch's, the same on every rank

    resumed_model = make_model("adamw")
    path = str(tmp_path / "ckpt" / "stop.ckpt")
    resumed = _fit(tmp_path, "resumed", resumed_model, 2, 3, _strategy("zero2", capacity=128), ckpt=path)
    for rank in resumed:
        assert len(rank["losses"]) == 1  # only step 3 ran
        assert rank["losses"][0] == pytest.approx(full[0]["losses"][-1], rel=1e-5)
        assert_params(rank, full_model, rtol=1e-4, atol=1e-6)
    for (name, p), q in zip(full_model.named_parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)


class _KillMidSave(HydraStrategy):
    """Rank 1 dies (SIGKILL, as SLURM's after KillWait) in the middle of the second save: its shards written, the
    checkpoint's metadata not yet."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        self._saves = getattr(self, "_saves", 0) + 1
        if self._saves == 2 and self.global_rank == 1:
            from torch.distributed.checkpoint import FileSystemWriter

            write = FileSystemWriter.write_data

            def write_then_die(writer, plan, planner):
                write(writer, plan, planner).wait()
                os.kill(os.getpid(), signal.SIGKILL)

            FileSystemWriter.write_data = write_then_die
        super().save_checkpoint(checkpoint, filepath, storage_options)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), model.local_cp.use(CPContext.local_group(), [0, ids.numel()]):
        return model(ids, torch.arange(ids.numel()))


def assert_exports_as_llama(checkpoint: Path, out: Path, *models) -> None:
    """``lightning-hydra export`` of ``checkpoint`` (float32) loads in transformers as a LlamaForCausalLM whose logits
    on held-out tokens are each of ``models``' (<= 1e-5)."""
    from transformers import AutoModelForCausalLM

    from lightning_hydra.cli import main

    assert main(["export", str(checkpoint), str(out), "--dtype", "fp32", "--max-shard-size", "60KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded as transformers shards
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.float32
    ids = torch.randint(0, 258, (56,), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    for model in models:
        torch.testing.assert_close(theirs, _logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_save_loses_nothing_and_the_run_resumes_exactly(tmp_path: Path, reference) -> None:
    """A save publishes a checkpoint's name only once every rank's shards and the metadata are written: rank 1
    killed in the middle of the second save (4 zero2 ranks, a ``last.ckpt`` every step) leaves ``last.ckpt`` naming
    step 1's complete checkpoint; ``ckpt_path="last"`` resumes from it and trains what one process trains; the next
    save removes the torn attempt; the checkpoint exports as a Llama that transformers loads to the same logits."""
    from lightning_hydra.errors import ConfigError, RankDiedError
    from lightning_hydra.strategy.checkpoint import check_complete

    ref, ref_model = reference
    folder = tmp_path / "ckpt"

    def saves() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1, save_last=True, save_top_k=0)

    killed = _strategy("zero2", 128)
    killed.__class__ = _KillMidSave
    trainer = quiet_trainer(4, killed, callbacks=[saves()], max_steps=3, enable_checkpointing=True)
    with pytest.raises(RankDiedError, match=r"rank 1 .*SIGKILL"):
        trainer.fit(make_model(), HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5))
    last = folder / "last.ckpt"
    check_complete(last)  # whole: the previous save's
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 1
    torn = [p for p in folder.glob(".last.ckpt.*") if p.resolve() != last.resolve()]
    assert torn and not (torn[0] / ".metadata").exists()  # the interrupted save's shards, never named

    model = make_model()
    resumed = _fit(tmp_path, "resumed", model, 4, 3, _strategy("zero2", 128), ckpt="last", callbacks=[saves()])
    for rank in resumed:
        assert rank["losses"] == pytest.approx(ref["losses"][1:], rel=1e-5)  # steps 2 and 3
        assert_params(rank, ref_model, rtol=1e-6, atol=1e-6)
    assert [p.name for p in folder.iterdir() if not p.is_symlink()] == [last.resolve().name]  # torn attempt gone
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 3
    assert_exports_as_llama(last, tmp_path / "hf", model, ref_model)
    copy = tmp_path / "copy.ckpt"  # a copy cut short: refused in one line before any rank starts
    shutil.copytree(last, copy)
    (copy / "__1_0.distcp").unlink()
    with pytest.raises(ConfigError, match=r"copy.ckpt is torn \(.*\): shard __1_0.distcp is missing$"):
        quiet_trainer(4, _strategy("zero2", 128)).fit(make_model(), ckpt_path=str(copy))


class _Counting(CPContext):
    def __init__(self) -> None:
        super().__init__("cpu")
        self.calls = 0

    def attention(self, q, k, v, *, causal=True, scale=None):
        self.calls += 1
        return super().attention(q, k, v, causal=causal, scale=scale)


def _grads(model, ids, pos, labels, context) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with context.use(CPContext.local_group(), [0, 20, ids.numel()]):
        model(ids, pos, labels=labels).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_selective_checkpointing_is_exact_and_never_repeats_attention() -> None:
    model = make_model()
    context = _Counting()
    for layer in model.layers:
        layer.attn.hydra_cp = context
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (48,), generator=g)
    pos = torch.cat([torch.arange(20), torch.arange(28)])
    labels = torch.randint(0, 250, (48,), generator=g)
    plain = _grads(model, ids, pos, labels, context)
    assert context.calls == 2
    assert model.set_activation_checkpointing("selective") == 2
    checkpointed = _grads(model, ids, pos, labels, context)
    assert context.calls == 4  # one attention per layer again: backward recomputed norms and MLPs only
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=0, msg=name)
    model.set_activation_checkpointing("none")
    assert not any(layer.checkpointed for layer in model.layers)


def test_bad_sharding_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown sharding 'zero4'"):
        HydraStrategy(sharding="zero4")
    with pytest.raises(ValueError, match="activation_checkpointing must be one of"):
        HydraStrategy(activation_checkpointing="full")
    with pytest.raises(ValueError, match="cannot read 'lots'"):
        HydraStrategy(max_tokens_per_rank="auto", memory_budget="lots")
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        HydraStrategy(max_tokens_per_rank="big")
    with pytest.raises(ValueError, match="hsdp needs whole nodes"):
        build_mesh("hsdp", 6, 4, "cpu")
