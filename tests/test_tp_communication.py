"""What tensor parallelism communicates beyond its blocks' own collectives, on real gloo processes.

- The gradient sum of TP without FSDP (:class:`~lightning_hydra.strategy.tensor_pool.TensorGradientSync`): buckets of
  local shards, the complete ones launched while the last backward runs, the partial (sequence-parallel) ones after
  the TP group's sum; exact, every gradient a view of its bucket, no flat copy.
- Selective activation checkpointing's recompute: the TP collectives per block in forward and backward, with and
  without it, for the reference decoder (``"block"``, ``"block_tp"``) and a Hugging Face Llama (units).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hydra import DecoderLM
from lightning_hydra.cp import CPContext
from lightning_hydra.strategy.tensor import parallelize, tensor_mesh
from lightning_hydra.testing import run_world

HF_LLAMA = {"model_type": "llama", "vocab_size": 258, "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip


class _Functional(TorchDispatchMode):
    """Counts the functional collectives (DTensor's, TP's) by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        namespace, _, rest = str(func).partition(".")
        name = rest.partition(".")[0]
        if namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _decoder(layers: int = 2, selective: str = "block", **kw) -> DecoderLM:
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64, **kw}
    return DecoderLM(num_layers=layers, selective_checkpointing=selective, **shape)


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    with model.local_cp.use(CPContext.local_group(), [0, len(ids)]):
        return model(ids, torch.arange(len(ids)), labels=ids)


# ---------------------------------------------------------------------------------------------------- gradient sum
def _tokens(position: int, step: int, m: int) -> torch.Tensor:
    return torch.randint(0, 250, (12 + 2 * m + 4 * position,), generator=torch.Generator().manual_seed(step * 10 + m))


def _runs(position: int, step: int) -> range:
    """The microbatches a pool position runs: position 1 sits out the first step's last and all of the second."""
    return range(3) if position == 0 else range(2 if step == 0 else 0)


def _bucketed_sum(rank: int, world: int) -> dict:
    """TP 2 x pool 2, sequence-parallel, buckets of 4 KB: two steps of three microbatches (position 1 runs two, then
    none), against the whole model's summed gradients."""
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile

    from lightning_hydra.strategy.tensor_pool import TensorGradientSync

    whole, split = _decoder(), _decoder()
    mesh = tensor_mesh("cpu", stages=1, pool=2, tensor=2)
    parallelize(split, mesh["tp"], sequence_parallel=True)
    grad_group = mesh["pool"].get_group()
    sync = TensorGradientSync(list(split.parameters()), grad_group, partial_sums=True, bucket_bytes=4096)
    position = rank // 2
    phase = ["outside"]
    calls: list[tuple[str, str, int, str]] = []
    names = ("all_reduce", "all_gather_single", "all_gather_into_tensor")
    wrapped = {name: getattr(dist, name) for name in names if getattr(dist, name, None) is not None}

    def record(name, original):
        def call(tensor_or_out, *args, **kwargs):
            if kwargs.get("group") is grad_group:
                t = args[0] if name != "all_reduce" else tensor_or_out  # an all-gather's input follows its output
                calls.append((phase[0], "all_reduce" if name == "all_reduce" else "all_gather", t.numel(), t.dtype))
            return original(tensor_or_out, *args, **kwargs)

        return call

    out: dict = {"steps": []}
    for name, original in wrapped.items():
        setattr(dist, name, record(name, original))
    try:
        for step in range(2):
            expected = sync.collectives()  # what the step's list states (built before the step)
            calls.clear()
            whole.zero_grad(set_to_none=True)
            for p in range(2):
                for m in _runs(p, step):
                    _loss(whole, _tokens(p, step, m)).backward()
            sync.begin()
            tp_calls = []
            runs = _runs(position, step)
            for m in runs:
                loss = _loss(split, _tokens(position, step, m))
                last = m == runs[-1]  # the runner arms the rank's own last backward
                if last:
                    sync.arm()
                phase[0] = "backward" if last else "accumulate"
                with _Functional() as seen:
                    loss.backward()
                tp_calls.append(sum(seen.calls.values()))
            phase[0] = "partial"
            sync.sum_partials()
            buffers = [  # the buffers this step's gradients live in (a rebuild makes new ones)
                (b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.numel() * b.buffer.element_size())
                for b in sync.buckets
            ]
            phase[0] = "finish"
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                sync.finish()
            phase[0] = "outside"
            events = sorted(
                (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
            )
            live = peak = 0
            for _, nbytes in events:
                live += nbytes
                peak = max(peak, live)
            worst, views = 0.0, 0
            for q, p in zip(whole.parameters(), split.parameters(), strict=True):
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                views += any(a <= local.data_ptr() < z for a, z in buffers)
                got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # collective: every rank
                worst = max(worst, float((got - q.grad).norm() / q.grad.norm().clamp_min(1e-30)))
            partial = sum(
                isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
                for p in split.parameters()
            )
            late = sum(b.late for b in sync.buckets)
            out["steps"].append(
                {
                    "worst": worst,
                    "views": views,
                    "params": len(list(split.parameters())),
                    "expected": [(c[1], c[2], c[3]) for c in expected],
                    "issued": [
                        (c[1], c[2], str(c[3]).removeprefix("torch.")) for c in calls if c[0] in ("backward", "finish")
                    ],
                    "phases": [c[0] for c in calls],
                    "early": sync.launched_in_backward,
                    "buckets": len(sync.buckets),
                    "late": late,
                    "late_first": min((i for i, b in enumerate(sync.buckets) if b.late), default=-1),
                    "partial": partial,
                    "finish_bytes": peak,
                    "grad_bytes": sum(z - a for a, z in buffers),
                    "tp_calls": tp_calls,
                }
            )
            split.zero_grad(set_to_none=True)  # as Lightning's optimizer step leaves them
    finally:
        for name, original in wrapped.items():
            setattr(dist, name, original)
        sync.remove()
    return out


def _four_rank_checks(rank: int, world: int) -> dict:
    """What runs on 4 ranks (one world for both tests): the bucketed sum at TP 2 x pool 2, and ``"block_tp"``'s
    exactness at TP 4 on uneven and empty token shards."""
    return {**_bucketed_sum(rank, world), "block_tp_error": _block_tp_exact(rank, world, (10, 6))}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_world(4, _four_rank_checks, timeout=150)


@pytest.mark.timeout(180)
def test_tp_gradient_sum_in_buckets_overlaps_the_backward_and_copies_nothing(four_ranks: list[dict]) -> None:
    """TP 2 x pool 2 with sequence parallelism on 4 gloo ranks: the pool sum of local shards is exact; complete
    buckets launch during the last backward (not on a position idle in it), in one order, and exactly the calls
    ``collectives()`` states reach the gradient communicator; the norms' partial gradients sit in late buckets
    launched after the TP sum; every gradient is a view of its bucket and ``finish`` allocates (almost) nothing."""
    for rank, result in enumerate(four_ranks):
        for step, s in enumerate(result["steps"]):
            where = f"rank {rank} step {step}"
            assert s["worst"] <= 1e-5, where
            assert s["views"] == s["params"], where  # no gradient of its own: each is its bucket's slice
            assert s["issued"] == s["expected"], where  # the step list's grad_sum calls, in order
            assert s["partial"] == 0, where
            assert s["buckets"] >= 4 and s["late"] == 1 and s["late_first"] == s["buckets"] - 1, where
            launched = s["phases"].count("backward")
            assert launched == s["early"], where
            if rank < 2 or step == 0:  # a backward ran: every complete bucket launched in it, the late one after
                assert s["early"] == s["buckets"] - s["late"], where
            else:  # no backward: finish launched them all (zeros)
                assert s["early"] == 0, where
            assert s["phases"][-1] == "finish", where
            # the first step's order gather is a few hundred bytes: nothing like a copy of the gradients
            assert s["finish_bytes"] < s["grad_bytes"] / 50, (where, s["finish_bytes"], s["grad_bytes"])
            assert len(set(s["tp_calls"])) <= 1, where  # placements learnt: accumulating communicates nothing more
        assert [s["expected"][-1][0] for s in result["steps"]] == ["all_gather", "all_reduce"]  # first step: the order


# --------------------------------------------------------------------------------- selective checkpointing and TP
def _model(kind: str, layers: int):
    if kind == "hf":
        from lightning_hydra.models.hf import HFCausalLM

        torch.manual_seed(0)
        return HFCausalLM(config={**HF_LLAMA, "num_hidden_layers": layers})
    return _decoder(layers, "block_tp" if kind == "block_tp" else "block")


def _per_block_counts(rank: int, world: int) -> dict:
    """TP collectives of one forward and one backward per block (two blocks' count minus one block's), for every
    model, with and without sequence parallelism and selective checkpointing."""
    mesh = tensor_mesh("cpu", stages=1, pool=1, tensor=world)["tp"]
    ids = torch.arange(16) % 200
    out = {}
    for kind in ("block", "block_tp", "hf"):
        for sp in (True, False):
            for mode in ("none", "selective") if kind == "block" else ("selective",):
                counts = []
                for layers in (1, 2):
                    model = _model(kind, layers)
                    parallelize(model, mesh, sequence_parallel=sp)
                    model.set_activation_checkpointing(mode)
                    with _Functional() as forward:
                        loss = _loss(model, ids)
                    with _Functional() as backward:
                        loss.backward()
                    counts.append((forward.calls, backward.calls))
                per_block = [dict(counts[1][i] - counts[0][i]) for i in range(2)]
                out[kind, sp, mode] = per_block
    return out


def _block_tp_exact(rank: int, world: int, lengths: tuple[int, ...]) -> float:
    """``"block_tp"`` under TP ``world`` with sequence parallelism against the whole model on sequences of each of
    ``lengths`` (uneven or empty token shards): the gradients' worst relative difference."""
    from torch.distributed.tensor import DTensor

    from lightning_hydra.strategy.tensor_pool import sum_partial_gradients

    whole, split = _decoder(selective="block_tp", num_kv_heads=4), _decoder(selective="block_tp", num_kv_heads=4)
    for model in (whole, split):
        model.set_activation_checkpointing("selective")
    parallelize(split, tensor_mesh("cpu", stages=1, pool=1, tensor=world)["tp"], sequence_parallel=True)
    worst = 0.0
    for tokens in lengths:
        ids = torch.randint(0, 250, (tokens,), generator=torch.Generator().manual_seed(tokens))
        for model in (whole, split):
            model.zero_grad(set_to_none=True)
            _loss(model, ids).backward()
        sum_partial_gradients(list(split.parameters()))
        for p, q in zip(whole.parameters(), split.parameters(), strict=True):
            got = q.grad.full_tensor() if isinstance(q.grad, DTensor) and q.grad.placements[0].is_shard() else q.grad
            got = got.to_local() if isinstance(got, DTensor) else got
            worst = max(worst, float((got - p.grad).norm() / p.grad.norm().clamp_min(1e-30)))
    return worst


def _kept_bytes(rank: int, world: int) -> dict:
    """Bytes per token of the distinct tensors a selective forward keeps on this TP rank (autograd's saved tensors
    and the selective policy's kept outputs; parameters excluded), for ``"block"`` and ``"block_tp"``."""
    from torch.distributed.tensor import DTensor

    from lightning_hydra.models import checkpointing

    def local(x: torch.Tensor) -> torch.Tensor:
        return x.to_local() if isinstance(x, DTensor) else x

    out: dict = {}
    tokens = 512
    for selective, sequence_parallel in itertools.product(("block", "block_tp"), (True, False)):
        model = _decoder(3, selective, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=384)
        parallelize(
            model, tensor_mesh("cpu", stages=1, pool=1, tensor=world)["tp"], sequence_parallel=sequence_parallel
        )
        model.set_activation_checkpointing("selective")
        params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def keep(x: torch.Tensor, seen=seen) -> torch.Tensor:
            storage = local(x).untyped_storage()
            if x.numel():
                seen[storage.data_ptr()] = storage.nbytes()
            return x

        class Kept(TorchDispatchMode):  # what the selective policy keeps (below autograd's saved-tensor hooks)
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
                result = func(*args, **(kwargs or {}))
                if checkpointing.keep_gathers_policy(None, func) == checkpointing.CheckpointPolicy.MUST_SAVE:
                    keep(result)
                return result

        original = checkpointing.keep_gathers

        def recording(original=original) -> tuple:
            forward, recompute = original()

            @contextlib.contextmanager
            def both():
                with forward, Kept():
                    yield

            return both(), recompute

        checkpointing.keep_gathers = recording
        try:
            ids = torch.randint(0, 250, (tokens,))
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
                _loss(model, ids)
        finally:
            checkpointing.keep_gathers = original
        out[selective, sequence_parallel] = sum(v for k, v in seen.items() if k not in params) / tokens
    return out


@pytest.mark.timeout(180)
def test_selective_checkpointing_tp_collectives_per_block(four_ranks: list[dict]) -> None:
    """Per block at TP 2: forward two all-gathers and two reduce-scatters with sequence parallelism (two
    all-reduces without), backward their transposes (two all-gathers, two reduce-scatters; five all-reduces without
    SP). Selective checkpointing by units (Hugging Face) and the decoder's ``"block_tp"`` add none in backward; the
    decoder's ``"block"`` repeats the norms' all-gathers and o's reduce-scatter (o's all-reduce without SP); the
    recompute never reaches down's. ``"block_tp"`` stays exact on uneven and empty token shards."""
    results = run_world(2, _per_block_counts, timeout=150)
    assert results[0] == results[1]
    counts = results[0]
    sp_forward = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    for (kind, sp, mode), (forward, backward) in counts.items():
        assert forward == (sp_forward if sp else {"all_reduce": 2}), (kind, sp, mode)
        repeated = Counter(backward)
        repeated.subtract(sp_forward if sp else {"all_reduce": 5})  # the backward without checkpointing
        if mode == "none":
            assert not +repeated and not -repeated, (kind, sp, backward)
        elif kind == "block":  # what its recompute repeats
            assert +repeated == ({"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1} if sp else {"all_reduce": 1})
        else:
            assert not +repeated and not -repeated, (kind, sp, mode, backward)
    assert max(r["block_tp_error"] for r in four_ranks) <= 1e-5  # 3/3/3/1 and 2/2/2/0 tokens per TP rank


@pytest.mark.timeout(180)
def test_memory_model_counts_what_block_tp_keeps() -> None:
    """The memory model's selective bytes per token on a TP-2 rank within 2% of what the forward keeps (autograd's
    saved tensors and the policy's kept all-gathers), for ``"block"`` and ``"block_tp"``, with and without sequence
    parallelism."""
    from lightning_hydra.planner.memory import activation_bytes_per_token
    from lightning_hydra.strategy.capacity import memory_shape

    measured = run_world(2, _kept_bytes, timeout=150)
    assert measured[0] == measured[1]
    for (selective, sequence_parallel), saved in measured[0].items():
        model = _decoder(3, selective, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=384)
        shape = memory_shape(model)
        assert shape.selective == selective
        kw = {"checkpointing": "selective", "precision": "32-true", "tensor_parallel": 2}
        model_bytes = activation_bytes_per_token(shape, **kw, sequence_parallel=sequence_parallel)
        assert model_bytes["blocks"] + model_bytes["once"] == pytest.approx(saved, rel=0.02), (
            selective,
            sequence_parallel,
        )
    for sequence_parallel in (True, False):
        assert measured[0]["block_tp", sequence_parallel] > measured[0]["block", sequence_parallel]
