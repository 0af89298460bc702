"""Tensor parallelism composed with dynamic CP on real processes: TP 2 x pool 2 on 4 gloo ranks trains the same
parameters as one process; bad TP settings stop before launch with one line."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.cp import CPContext
from lightning_hydra.errors import ConfigError
from lightning_hydra.planner import BatchPlanner, CostModel, PlannerConfig
from lightning_hydra.planner.memory import (
    LLAMA3_8B,
    ModelMemoryShape,
    activation_bytes_per_token,
    memory_capacity,
    model_state_bytes,
)
from lightning_hydra.strategy.capacity import memory_shape
from lightning_hydra.strategy.prelaunch import preflight
from lightning_hydra.strategy.recorder import RecordCollectives, recorded_runs
from lightning_hydra.strategy.tensor import check_tensor_parallel, parallelize, tensor_mesh
from lightning_hydra.testing import quiet_trainer, run_world
from tests.test_sharding import assert_exports_as_llama, make_dataset, make_model  # their data and model (SGD, clip)

VIEW_WARNING = "returned a view tensor"
"""FSDP2's warning about a ``fully_shard``-ed module's output that is a view ("... wrong gradients")."""

CAPTURE_CHECK = "Record captures this rank's warnings"


class Record(pl.Callback):
    """Every rank writes its losses, grad norms, idle microbatches, full (gathered) parameters, and the warnings it
    issued from set-up on (captured in the rank's own process; the first is :data:`CAPTURE_CHECK`, which shows that
    capturing works there)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.idle = 0
        self.partial = 0
        self.kinds: list[str] = []
        self._catching: warnings.catch_warnings | None = None

    def setup(self, trainer, module, stage) -> None:
        self._catching = warnings.catch_warnings(record=True)
        self.caught = self._catching.__enter__()
        warnings.simplefilter("always")  # every copy, not once per place
        warnings.warn(CAPTURE_CHECK, UserWarning, stacklevel=1)

    def teardown(self, trainer, module, stage) -> None:
        if self._catching is not None:
            self._catching.__exit__(None, None, None)
            self._catching = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.idle += sum(mb.num_tokens == 0 for mb in batch.microbatches)

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        from torch.distributed.tensor import DTensor

        for p in module.parameters():  # after the gradient sums and clipping: none may be a partial sum
            self.partial += isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.tensor import DTensor

        params, types = {}, {}
        for name, p in module.named_parameters():
            self.kinds.append(type(p.data).__name__)
            types[name] = type(p.data).__name__
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()  # collective for DTensors
            params[name] = full.tolist()
        row = {"losses": self.losses, "norms": self.norms, "idle": self.idle, "params": params, "kinds": self.kinds}
        row["types"] = types
        row["partial"] = self.partial
        row["warnings"] = [str(w.message) for w in self.caught]
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(row))


def _fit(
    tmp: Path, name: str, model: DecoderLM, devices: int, steps: int, strategy=None, saves: list | None = None
) -> list[dict]:
    out = tmp / f"{name}.json"
    callbacks = [Record(out), RecordCollectives(tmp / f"{name}.ops"), *(saves or [])]
    trainer = quiet_trainer(devices, strategy, callbacks=callbacks, max_steps=steps, enable_checkpointing=bool(saves))
    trainer.fit(model, HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5))
    if devices > 1:  # every rank issued exactly its operation lists (TP's collectives too), and they pass the checker
        recorded_runs(tmp / f"{name}.ops", devices)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)]


def held_params(
    ranks: list[dict], reference: torch.nn.Module, holders: int
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, a rank's gathered copy, the reference's)`` for every parameter of ``reference`` and every rank that
    holds it, asserting that ``holders`` ranks do (a pipeline stage holds its own layers)."""
    for name, p in reference.named_parameters():
        expected = p.detach()
        held = [rank for rank in ranks if name in rank["params"]]
        assert len(held) == holders, name
        for rank in held:
            yield name, torch.tensor(rank["params"][name], dtype=expected.dtype), expected


def assert_held_params(ranks: list[dict], reference: torch.nn.Module, holders: int, rel: float = 1e-6) -> None:
    """Every rank's gathered parameters are ``reference``'s within ``rel`` (relative norm), each parameter held by
    ``holders`` ranks (:func:`held_params`)."""
    for name, got, expected in held_params(ranks, reference, holders):
        diff = (got - expected).norm() / expected.norm()
        assert diff <= rel, f"{name}: relative difference {float(diff):.2e}"


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, DecoderLM]:
    model = make_model()
    return _fit(tmp_path_factory.mktemp("ref"), "ref", model, 1, 3)[0], model


@pytest.mark.parametrize(
    ("sharding", "stages", "sequence_parallel"),
    [
        ("none", 1, False),
        ("none", 1, True),
        ("zero2", 1, True),
        ("zero3", 1, False),
        ("zero3", 1, True),
        ("none", 2, True),
    ],
)
def test_tp2_trains_like_one_process(
    tmp_path: Path, reference, sharding: str, stages: int, sequence_parallel: bool
) -> None:
    """TP 2 x pool 2 (replicas, zero2, zero3) and TP 2 x PP 2 (pool 1) on 4 gloo ranks, with and without sequence
    parallelism (the residual stream and norms split by tokens; zigzag shards are even, so TP 2 splits them
    evenly: uneven splits are :func:`test_sequence_parallel_splits_uneven_token_counts_exactly`'s)."""
    ref, reference_model = reference
    model = make_model()
    # the static policy at one degree over 6 microbatches leaves pool positions idle in some microbatches: their
    # whole TP group sits out together (replicas), or runs a zero-token pass together (zero2's last microbatch), so
    # TP's collectives stay aligned
    strategy = _strategy(
        tensor_parallel=2,
        policy="static",
        num_microbatches=6,
        sharding=sharding,
        pipeline_stages=stages,
        capacity=160 * stages,  # a pool of 1 (two stages) must hold the longest sequence alone
        sequence_parallel=sequence_parallel,
    )
    saves = [ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)] if stages > 1 else []
    ranks = _fit(tmp_path, "tp", model, 4, 3, strategy, saves=saves)
    if saves:  # TP 2 x PP 2's checkpoint exports as a Llama whose logits are the trained module's
        assert_exports_as_llama(tmp_path / "ckpt" / "last.ckpt", tmp_path / "hf", model, reference_model)
    assert max(ref["norms"]) > 0.2  # clipping changed the update (and stayed exact)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert rank["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert "DTensor" in rank["kinds"]  # the projections really are TP shards
        # no block returned a view to FSDP2 (sequence parallelism's gather after the last block did, once per
        # microbatch, under zero2/zero3): the capture works in the rank, and saw no such warning
        assert rank["warnings"][0] == CAPTURE_CHECK
        assert not [w for w in rank["warnings"] if VIEW_WARNING in w], rank["warnings"]
    if stages == 1:
        assert sum(r["idle"] for r in ranks) > 0  # some ranks were idle in some microbatch
    # the SP norms' partial gradients were summed over the TP group before clipping (the optimizer's DTensor step
    # would sum them anyway, but the clipping norm would be wrong)
    assert sum(r["partial"] for r in ranks) == 0
    initial = dict(make_model().named_parameters())
    for name, got, expected in held_params(ranks, reference_model, 4 // stages):
        update = (expected - initial[name].detach()).norm()  # a norm weight's update is small beside its ones
        rel = (got - expected).norm() / expected.norm()
        assert rel <= 1e-6, f"{name}: relative difference {float(rel):.2e}"
        assert (got - expected).norm() <= 1e-3 * update, f"{name}: the update differs"


@pytest.mark.parametrize(
    ("tensor", "kw", "message"),
    [
        (3, {"world": 6, "ranks_per_node": 4}, r"tensor_parallel=3 does not divide ranks_per_node=4.*\[1, 2\] on 6"),
        (4, {"world": 6, "ranks_per_node": 8}, r"does not divide the 6 devices .*; use one of \[1, 2\] with ranks_p"),
        (3, {"world": None, "ranks_per_node": 8}, r"does not divide ranks_per_node=8: .*; use one of \[1, 2, 4, 8\]$"),
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
    strategy.parallel_devices = [torch.device("cpu")] * 8  # 2 nodes of 4 ranks: TP 2 divides them
    model = DecoderLM(hidden_size=48, num_heads=6, num_kv_heads=3)
    with pytest.raises(ConfigError, match="does not divide the model's 3 KV heads"):
        preflight(strategy, model, None)
    with pytest.raises(ConfigError, match="does not divide ranks_per_node=4"):
        HydraStrategy(tensor_parallel=3, ranks_per_node=4)


def _sequence_parallel_gradients(rank: int, world: int, tokens: int, mode: str) -> tuple[float, float, int, list[bool]]:
    """One forward and backward of a TP ``world`` sequence-parallel decoder against the whole model on ``tokens``
    tokens (``torch.chunk``'s split over the group: uneven, or empty on the last ranks): the loss's relative
    difference, the gradients' worst one (norm gradients completed by ``sum_partial_gradients``), how many
    gradients were partial, and whether each block's output was a view (what FSDP2 warns of)."""
    from torch.distributed.tensor import DTensor

    from lightning_hydra.strategy.tensor_pool import sum_partial_gradients

    def make() -> DecoderLM:
        torch.manual_seed(0)
        model = DecoderLM(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=128)
        model.set_activation_checkpointing(mode)
        return model

    whole, split = make(), make()
    parallelize(split, tensor_mesh("cpu", stages=1, pool=1, tensor=world)["tp"], sequence_parallel=True)
    views: list[bool] = []
    for block in split.transformer_blocks():  # after parallelize's hooks: what a block returns (and FSDP2 sees)
        block.register_forward_hook(lambda module, args, out: views.append(out._base is not None))
    ids = torch.randint(0, 250, (tokens,), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (whole, split):
        with model.local_cp.use(CPContext.local_group(), [0, tokens]):
            loss = model(ids, torch.arange(tokens), labels=ids)
        loss.backward()
        losses.append(float(loss))
    partial = sum_partial_gradients(list(split.parameters()))
    worst = 0.0
    for p, q in zip(whole.parameters(), split.parameters(), strict=True):
        got = q.grad
        if isinstance(got, DTensor):  # a shard gathered; a replicated (or partial) gradient as this rank holds it
            got = got.full_tensor() if got.placements[0].is_shard() else got.to_local()
        worst = max(worst, float((got - p.grad).norm() / p.grad.norm().clamp_min(1e-30)))
    return abs(losses[1] - losses[0]) / max(abs(losses[0]), 1e-30), worst, partial, views


@pytest.mark.parametrize(("tokens", "mode"), [(10, "none"), (6, "selective"), (0, "none")])
def test_sequence_parallel_splits_uneven_token_counts_exactly(tokens: int, mode: str) -> None:
    """TP 4: 10 tokens split 3/3/3/1, 6 tokens 2/2/2/0 (a rank's shard empty), 0 tokens (an idle pass) give the
    whole model's loss and gradients; the 4 norm weights' gradients are partial sums until summed over the group.
    No block returns a view: the last one's gathered tokens are a tensor of their own, also where the split was
    uneven (DTensor trims the gathered padding by a view)."""
    for loss, grads, partial, views in run_world(4, _sequence_parallel_gradients, tokens, mode):
        assert loss <= 1e-6
        assert grads <= 1e-5
        assert partial == 4  # two norms in each of two blocks
        assert views == [False, False], views


def _memory_model(kind: str) -> torch.nn.Module:
    """The reference decoder, or a Hugging Face Llama of the same shape (selective checkpointing by units)."""
    torch.manual_seed(0)
    if kind == "hf":
        from lightning_hydra.models.hf import HFCausalLM

        return HFCausalLM(config={**HF_CONFIG, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3})
    return DecoderLM(hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=384)


def _saved_on_tp_rank(
    rank: int, world: int, dtype: torch.dtype, sequence_parallel: bool, kind: str = "decoder"
) -> dict[str, float]:
    """Bytes per token of the distinct tensors autograd saves in one forward on this TP rank (local shards;
    parameters excluded), for both checkpointing modes."""
    from torch.distributed.tensor import DTensor

    def local(x: torch.Tensor) -> torch.Tensor:
        return x.to_local() if isinstance(x, DTensor) else x

    model = _memory_model(kind).to(dtype)
    parallelize(model, tensor_mesh("cpu", stages=1, pool=1, tensor=world)["tp"], sequence_parallel=sequence_parallel)
    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    tokens, out = 512, {}
    for mode in ("none", "selective"):
        model.set_activation_checkpointing(mode)
        seen: dict[int, int] = {}

        def pack(x: torch.Tensor, seen=seen) -> torch.Tensor:
            storage = local(x).untyped_storage()
            if x.numel():
                seen[storage.data_ptr()] = storage.nbytes()
            return x

        ids = torch.randint(0, 250, (tokens,))
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x),
            model.local_cp.use(CPContext.local_group(), [0, tokens]),
        ):
            model(ids, torch.arange(tokens), labels=ids)
        out[mode] = sum(v for k, v in seen.items() if k not in params) / tokens
    return out


@pytest.mark.parametrize(
    ("kind", "dtype", "sequence_parallel"),
    [
        ("decoder", torch.float32, False),
        ("decoder", torch.float32, True),
        ("decoder", torch.bfloat16, False),
        ("decoder", torch.bfloat16, True),
        ("hf", torch.float32, False),
        ("hf", torch.float32, True),
    ],
)
def test_tp_activation_model_matches_what_autograd_saves(
    kind: str, dtype: torch.dtype, sequence_parallel: bool
) -> None:
    """The memory model's activation bytes per token on a TP-2 rank within 2% of autograd's, for the reference
    decoder (selective checkpointing by blocks) and a Hugging Face Llama (by units: it keeps the norms' outputs)."""
    measured = run_world(2, _saved_on_tp_rank, dtype, sequence_parallel, kind)
    assert measured[0] == measured[1]
    shape = memory_shape(_memory_model(kind))
    assert shape.selective == ("units" if kind == "hf" else "block")
    precision = "32-true" if dtype == torch.float32 else "bf16-true"
    for mode, saved in measured[0].items():
        kw = {"checkpointing": mode, "precision": precision, "tensor_parallel": 2}
        tp = activation_bytes_per_token(shape, **kw, sequence_parallel=sequence_parallel)
        assert tp["blocks"] + tp["once"] == pytest.approx(saved, rel=0.02), mode
        whole = activation_bytes_per_token(shape, checkpointing=mode, precision=precision)
        assert tp["blocks"] < whole["blocks"]
        if sequence_parallel:  # the norms' and the residual stream's share divides by T
            assert tp["blocks"] < activation_bytes_per_token(shape, **kw, sequence_parallel=False)["blocks"]
            assert tp == activation_bytes_per_token(shape, **kw)  # the default under TP


def test_memory_and_cost_models_know_tensor_parallelism() -> None:
    kw = {"sharding": "zero2", "precision": "bf16-mixed", "world_size": 8, "ranks_per_node": 1, "num_microbatches": 8}
    assert model_state_bytes(LLAMA3_8B, tensor_parallel=1, **kw) == model_state_bytes(LLAMA3_8B, **kw)
    tp8 = model_state_bytes(LLAMA3_8B, tensor_parallel=8, **kw)
    whole = LLAMA3_8B.vocab_size * LLAMA3_8B.hidden_size  # the embedding stays whole on every TP rank
    # the blocks' projections and the untied head (split by vocabulary rows) hold 1/8 per TP rank
    expected = LLAMA3_8B.num_params - (LLAMA3_8B.num_layers * LLAMA3_8B.projection_params + whole) * 7 / 8
    assert tp8["optimizer"] == pytest.approx(8 * expected / 8)  # AdamW's 8 bytes per parameter over 8 pool ranks
    assert expected > whole
    tied = ModelMemoryShape.for_decoder(4096, 32, 32, 8, 14336, 128256, tied_embeddings=True)
    odd = ModelMemoryShape.for_decoder(4096, 32, 32, 8, 14336, 128257)  # 8 does not divide it: the head stays whole
    odd8 = model_state_bytes(odd, tensor_parallel=8, **kw)
    assert odd8["optimizer"] == pytest.approx(odd.num_params - odd.num_layers * odd.projection_params * 7 / 8)
    tied8 = model_state_bytes(tied, tensor_parallel=8, **kw)  # a tied head stays whole with the embedding
    assert tied8["optimizer"] == pytest.approx(tied.num_params - tied.num_layers * tied.projection_params * 7 / 8)
    caps = {
        t: memory_capacity(LLAMA3_8B, budget=80e9, checkpointing="selective", tensor_parallel=t, **kw).capacity
        for t in (1, 8)
    }
    assert caps[8] > 4 * caps[1]

    shape = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 14336}
    assert CostModel.for_transformer(**shape, tensor_parallel=1) == CostModel.for_transformer(**shape)
    one, eight = CostModel.for_transformer(**shape), CostModel.for_transformer(**shape, tensor_parallel=8)
    assert eight.attn == pytest.approx(one.attn / 8)
    assert eight.a2a_bytes_per_token == pytest.approx(one.a2a_bytes_per_token / 8)
    free = CostModel.for_transformer(**shape, tensor_parallel=8, intra_node_bandwidth=float("inf"))
    assert one.linear / 8 < free.linear < eight.linear  # the head stays whole; TP's all-reduces cost time
    # a TP-8 rank is faster: the same batch plans to a shorter predicted step
    lengths = torch.randint(100, 20000, (64,), generator=torch.Generator().manual_seed(0)).numpy()
    steps = []
    for t, cost in ((1, one), (8, eight)):  # 16 pool positions: 16 GPUs, or 16 TP groups of 8
        config = PlannerConfig(policy="hydra", max_tokens_per_rank=16384, num_microbatches=4, ranks_per_node=8 // t)
        plan = BatchPlanner(config=config, world_size=16, num_heads=32 // t).plan(lengths, seed=0, cost=cost)
        steps.append(float(plan.loads(cost).max(axis=1).sum()))
    assert steps[1] < steps[0]


def test_auto_capacity_counts_tensor_parallelism() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    capacities = {}
    for tensor, sequence_parallel in ((1, None), (2, False), (2, None)):
        env = LightningEnvironment()
        env.set_world_size(4)
        env.set_global_rank(0)
        strategy = HydraStrategy(
            parallel_devices=[torch.device("cpu")] * 4,
            cluster_environment=env,
            max_tokens_per_rank="auto",
            memory_budget="64MB",
            ranks_per_node=4,
            tensor_parallel=tensor,
            sequence_parallel=sequence_parallel,
        )
        strategy.connect(DecoderLM(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2))
        strategy._resolve_capacity(ulysses_blocks=1)
        capacities[tensor, sequence_parallel] = strategy.planner_config.max_tokens_per_rank
        assert strategy.planner_config.ranks_per_node == 4 // tensor  # pool positions per node
        assert strategy.sequence_parallel == (tensor > 1 and sequence_parallel is None)  # None: on under TP
    # half the projections and most activations per rank; with SP (the default) the norms' share halves too
    assert capacities[2, None] > capacities[2, False] > capacities[1, None] > 0


LLAMA3_70B_ARGS = ["--hidden-size", "8192", "--num-layers", "80", "--num-heads", "64", "--num-kv-heads", "8",
                   "--ffn-size", "28672"]  # fmt: skip


def test_plan_command_sizes_a_70b_shape_at_tensor_parallel_8(capsys) -> None:
    from lightning_hydra.cli import main

    base = ["plan", "--world-size", "32", "--context", "262144", "--memory", "80GB", *LLAMA3_70B_ARGS, "--json"]
    assert main([*base, "--tensor-parallel", "8"]) == 0
    tp8 = json.loads(capsys.readouterr().out)
    assert main(base) == 0
    whole = json.loads(capsys.readouterr().out)
    # Llama-3-70B on 80 GB: 16K+ tokens per rank at TP 8 with zero3 and selective checkpointing; without TP none
    assert tp8["memory"]["capacity"] == tp8["memory"]["capacities"]["zero3"]["selective"] >= 16384
    assert whole["memory"]["capacities"]["zero3"]["selective"] < tp8["memory"]["capacity"] / 4
    # sequence parallelism is on by default under TP: the norms' and the block inputs' activations are 1/8
    assert main([*base, "--tensor-parallel", "8", "--no-sequence-parallel"]) == 0
    no_sp = json.loads(capsys.readouterr().out)
    assert tp8["memory"]["capacity"] > 2 * no_sp["memory"]["capacity"] >= 2 * 16384
    assert main([*base, "--tensor-parallel", "8", "--sequence-parallel"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["capacity"] == tp8["memory"]["capacity"]
    assert main(["plan", "--tensor-parallel", "3"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage, then the error on one line
    assert "error: --tensor-parallel: tensor_parallel=3 does not divide ranks_per_node=8" in last
    assert main(["plan", "--tensor-parallel", "8", "--num-kv-heads", "4"]) == 2
    assert "does not divide the model's 4 KV heads; use one of [1, 2, 4]" in capsys.readouterr().err


def test_bench_simulates_the_2048_gpu_job_with_and_without_tensor_parallelism() -> None:
    from lightning_hydra.bench.tp import simulated_2048

    out = simulated_2048(steps=1)
    assert (out["tp8"]["pool"], out["tp1"]["pool"]) == (64, 512)  # 2,048 GPUs over PP 4 at TP 8, and at TP 1
    # a 70B stage (17.6B parameters at 6 bytes each) does not fit an 80 GB device without TP; at TP 8 it does
    assert out["tp1"]["hydra"]["memory_headroom"] < 0 < out["tp8"]["hydra"]["memory_headroom"]
    for policy, ratio in out["tp8_over_tp1"].items():
        assert ratio == pytest.approx(out["tp8"][policy]["tokens_per_s"] / out["tp1"][policy]["tokens_per_s"])


@pytest.mark.parametrize(("saved", "resumed", "sharding"), [(2, 1, "zero2"), (1, 2, "zero2"), (2, 1, "none")])
def test_checkpoint_reshards_between_tensor_parallel_degrees(
    tmp_path: Path, saved: int, resumed: int, sharding: str
) -> None:
    """A distributed checkpoint (zero2, AdamW) saved at TP ``saved`` x pool 2 resumes at TP ``resumed`` x pool 2
    (with ``sharding``; ``"none"``: a replica pool, which reads the directory whole): the resumed step 3 equals the
    uninterrupted run's (parameters and the AdamW moments they were stepped with)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def model() -> DecoderLM:
        torch.manual_seed(99)
        return DecoderLM(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, lr=3e-3, max_grad_norm=0.2)

    def strategy(tensor: int, sharding: str = "zero2") -> HydraStrategy:
        return _strategy(tensor_parallel=tensor, sharding=sharding, num_microbatches=2, capacity=256)

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1, filename="stop")
    out = tmp_path / "full.json"
    ops = tmp_path / "full.ops"  # the save's collectives are recorded and checked with the steps'
    callbacks = [Record(out), ckpt, RecordCollectives(ops)]
    trainer = quiet_trainer(2 * saved, strategy(saved), callbacks=callbacks, max_steps=3, enable_checkpointing=True)
    trainer.fit(model(), HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5))
    assert any(p[0].kind == "save" for p in recorded_runs(ops, 2 * saved)[0]["programs"])
    full = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2 * saved)]
    path = tmp_path / "ckpt" / "stop.ckpt"
    assert path.is_dir()  # a torch.distributed.checkpoint directory
    out = tmp_path / "resumed.json"
    trainer = quiet_trainer(2 * resumed, strategy(resumed, sharding), callbacks=[Record(out)], max_steps=3)
    trainer.fit(model(), HydraDataModule(make_dataset(), global_batch_tokens=700, seed=5), ckpt_path=str(path))
    again = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2 * resumed)]
    for rank in full:  # the uninterrupted run: one model on every rank (gathered), one loss
        assert rank["losses"] == full[0]["losses"]
        assert rank["params"] == full[0]["params"]
    for rank in again:
        assert len(rank["losses"]) == 1  # only step 3 ran
        assert rank["losses"][0] == pytest.approx(full[0]["losses"][-1], rel=1e-5)
        for name, values in full[0]["params"].items():
            torch.testing.assert_close(torch.tensor(rank["params"][name]), torch.tensor(values), rtol=1e-5, atol=1e-7)


HF_CONFIG = {"model_type": "llama", "vocab_size": 258, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 512}  # fmt: skip


GEMMA2_SOFTCAP = {"model_type": "gemma2", "head_dim": 8, "final_logit_softcapping": 0.2, "attn_logit_softcapping": None,
                  "layer_types": ["full_attention"] * 2, "tie_word_embeddings": False}  # fmt: skip
"""Gemma 2 with full attention (what the CP engine computes) and its final logits soft-capped hard (logits reach
about 0.4 at initialisation: a cap of 0.2 bends them)."""


@pytest.mark.parametrize(
    ("variant", "config", "stages", "sequence_parallel", "checkpointing"),
    [
        ("untied", {}, 1, True, "none"),
        ("untied-no-sp", {}, 1, False, "none"),
        ("tied", {"tie_word_embeddings": True}, 1, True, "none"),
        ("pp2", {}, 2, True, "selective"),
        ("granite", {"model_type": "granite", "logits_scaling": 4.0, "residual_multiplier": 0.5}, 1, True, "none"),
        ("gemma2", GEMMA2_SOFTCAP, 1, None, "none"),  # sandwich norms: the default is TP without SP
    ],
)
def test_hf_tp2_trains_like_one_process(
    tmp_path: Path, variant: str, config: dict, stages: int, sequence_parallel: bool | None, checkpointing: str
) -> None:
    """A Hugging Face model splits by the Llama-family plan (self_attn.q/k/v/o_proj, mlp.gate/up/down_proj; with
    sequence parallelism input_layernorm and post_attention_layernorm on ``[1, t / T, h]`` token shards) and its
    untied head by vocabulary rows (``output_head()``; the chunked loss runs vocabulary-parallel, Granite's
    ``1 / logits_scaling`` on the hidden states, Gemma 2's soft-capping on each shard); a tied head stays whole.
    TP 2 x pool 2 (TP 2 x PP 2 with selective checkpointing for ``pp2``: each stage splits and gathers its own
    layers' tokens)."""
    from lightning_hydra.models.hf import HFCausalLM

    def model() -> HFCausalLM:
        torch.manual_seed(7)
        return HFCausalLM(config={**HF_CONFIG, **config}, lr=1.0, max_grad_norm=0.2, optimizer="sgd")

    reference = model()
    assert reference.output_head() is reference.model.lm_head
    ids = torch.randint(0, 258, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), reference.local_cp.use(CPContext.local_group(), [0, 40]):
        logits = reference(ids, torch.arange(40))  # the family's own logits (scaled, soft-capped)
        chunked = reference(ids, torch.arange(40), labels=ids)  # the chunked loss's own scaling and capping
    expected = torch.nn.functional.cross_entropy(logits.float(), ids, reduction="sum")
    assert float(chunked) == pytest.approx(float(expected), rel=1e-5)
    ref = _fit(tmp_path, "ref", reference, 1, 3)[0]
    strategy = _strategy(
        tensor_parallel=2,
        num_microbatches=4,
        sequence_parallel=sequence_parallel,
        pipeline_stages=stages,
        activation_checkpointing=checkpointing,
        capacity=160 * stages,  # a pool of 1 (two stages) must hold the longest sequence alone
    )
    ranks = _fit(tmp_path, "tp", model(), 4, 3, strategy)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert rank["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert sum(r["partial"] for r in ranks) == 0  # SP norms' gradients summed over the TP group before clipping
    last = ranks[-1]  # holds the head under PP too
    head = "model.lm_head.weight" if variant != "tied" else "model.model.embed_tokens.weight"
    assert last["types"][head] == ("Tensor" if variant == "tied" else "DTensor"), last["types"][head]
    assert last["types"]["model.model.layers.1.self_attn.q_proj.weight"] == "DTensor"
    initial = dict(model().named_parameters())
    for name, got, expected in held_params(ranks, reference, 4 // stages):
        update = (expected - initial[name].detach()).norm()
        diff = (got - expected).norm()
        rel = diff / expected.norm()
        # Gemma's norm weights start at zero (it scales by 1 + w): after 3 steps their norm is ~1e-3, and TP's
        # sums in another order leave ~1e-9 absolute (1.06e-6 relative on pre_feedforward_layernorm, measured)
        assert rel <= 1e-6 or diff <= 1e-8, f"{name}: relative difference {float(rel):.2e}, {float(diff):.1e}"
        assert diff <= 1e-3 * update, f"{name}: the update differs"


def test_sequence_parallel_refuses_sandwich_norms_before_launch() -> None:
    """Gemma-2's layers norm the attention's and the MLP's outputs too (pre/post_feedforward_layernorm): asked for,
    sequence parallelism stops with one line before launch; by default it is off for them (the TP plan applies)."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from lightning_hydra.strategy.tensor import block_plan, check_sequence_parallel

    config = Gemma2Config(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    message = r"Gemma2DecoderLayer differs in post_feedforward_layernorm, pre_feedforward_layernorm: pass sequence_"
    with pytest.raises(ConfigError, match=message) as info:
        check_sequence_parallel(layer)
    assert "\n" not in str(info.value)
    assert len(block_plan(layer)) == 7  # q/k/v/o, gate/up/down: TP without SP

    class Gemma(DecoderLM):  # a HydraModule whose blocks are Gemma-2 layers
        def transformer_blocks(self) -> list[torch.nn.Module]:
            return [layer]

    strategy = HydraStrategy(tensor_parallel=2, ranks_per_node=4, max_tokens_per_rank=256, sequence_parallel=True)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    with pytest.raises(ConfigError, match=message):
        preflight(strategy, Gemma(hidden_size=32, num_heads=4, num_kv_heads=2), None)
    for asked in (None, False):  # the default turns it off for these blocks; False asks for that
        strategy = HydraStrategy(tensor_parallel=2, ranks_per_node=4, max_tokens_per_rank=256, sequence_parallel=asked)
        strategy.parallel_devices = [torch.device("cpu")] * 4
        assert strategy.sequence_parallel is (asked is None)
        preflight(strategy, Gemma(hidden_size=32, num_heads=4, num_kv_heads=2), None)
        assert strategy.sequence_parallel is False
    strategy = HydraStrategy(tensor_parallel=2, ranks_per_node=4, max_tokens_per_rank=256)
    assert strategy.resolve_sequence_parallel(DecoderLM(hidden_size=32, num_heads=4, num_kv_heads=2)) is True


def _vocab_parallel_against_whole(rank: int, world: int, softcap: float | None = None) -> list:
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_hydra.models import vocab_parallel
    from lightning_hydra.models.losses import chunked_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(258, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 258, (37,), generator=g)
    labels[::5] = -100  # ignored tokens
    mesh = tensor_mesh("cpu", stages=1, pool=1, tensor=world)["tp"]
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    whole = chunked_cross_entropy(h1, w1, labels, chunk_tokens=8, softcap=softcap)
    whole.backward()
    h2 = hidden.clone().requires_grad_(True)
    w2 = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_(True)
    calls = []
    reduce = vocab_parallel._all_reduce
    vocab_parallel._all_reduce = lambda t, op, group: calls.append(t.numel()) or reduce(t, op, group)
    try:
        split = chunked_cross_entropy(h2, w2, labels, chunk_tokens=8, softcap=softcap)  # dispatches on the DTensor
        forward = list(calls)
        split.backward()
    finally:
        vocab_parallel._all_reduce = reduce
    h3, w3 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)  # autograd on full logits
    logits = (h3 @ w3.t()).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    autograd = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    autograd.backward()
    return [
        float(abs(split - whole) / whole),
        float((h2.grad - h1.grad).norm() / h1.grad.norm()),
        float((w2.grad.full_tensor() - w1.grad).norm() / w1.grad.norm()),
        float(abs(whole - autograd) / autograd),
        float((h1.grad - h3.grad).norm() / h3.grad.norm()),
        float((w1.grad - w3.grad).norm() / w3.grad.norm()),
        float(w2.grad.to_local().shape[0]),
        forward,
    ]


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_vocab_parallel_loss_equals_the_whole_heads(softcap: float | None) -> None:
    """The vocabulary-parallel loss equals the whole head's chunked loss and autograd on full logits, soft-capped
    (Gemma 2's final_logit_softcapping, element-wise on each shard) or not."""
    for differences in run_world(2, _vocab_parallel_against_whole, softcap):
        assert max(differences[:6]) < 1e-6  # float32 logits every way (log-sum-exp summed in another order)
        assert differences[6] == 129  # each rank holds half the vocabulary's rows and their gradient
        # two all-reduces per chunk of 8 tokens (5 chunks): the maximum of [row maximum, target logit], then the sum
        assert differences[7] == [16, 8, 16, 8, 16, 8, 16, 8, 10, 5]


def test_tensor_parallel_refuses_norms_across_all_heads_before_launch() -> None:
    """OLMo-2 normalises q and k across all heads (``q_norm`` as wide as q_proj's output): TP, which splits the
    heads, stops with one line before launch; Qwen3's per-head ``q_norm`` and Llama's layers split."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Olmo2Config, Qwen3Config

    from lightning_hydra.strategy.tensor import check_tensor_block

    shape = {"vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    olmo = AutoModelForCausalLM.from_config(Olmo2Config(**shape)).model.layers[0]
    message = r"tensor_parallel=2 cannot split Olmo2DecoderLayer: self_attn.q_norm.weight \(32 values\) spans the whole"
    with pytest.raises(ConfigError, match=message) as info:
        check_tensor_block(olmo, 2)
    assert "\n" not in str(info.value)
    for config in (Qwen3Config(**shape, head_dim=8), LlamaConfig(**shape)):
        check_tensor_block(AutoModelForCausalLM.from_config(config).model.layers[0], 2)

    class Olmo(DecoderLM):  # a HydraModule whose blocks are OLMo-2 layers
        def transformer_blocks(self) -> list[torch.nn.Module]:
            return [olmo]

    strategy = HydraStrategy(tensor_parallel=2, ranks_per_node=4, max_tokens_per_rank=256)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    with pytest.raises(ConfigError, match=message):
        preflight(strategy, Olmo(hidden_size=32, num_heads=4, num_kv_heads=2), None)
