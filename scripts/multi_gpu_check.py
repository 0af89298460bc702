"""Multi-GPU check of the CP engine and the strategy, 2 to 8 ranks under torchrun, each against one process.

    torchrun --standalone --nproc-per-node=4 scripts/multi_gpu_check.py                # NCCL, one GPU a rank
    torchrun --standalone --nproc-per-node=2 scripts/multi_gpu_check.py --device cpu   # the same over gloo
    torchrun --standalone --nproc-per-node=8 scripts/multi_gpu_check.py --checks pipeline_hydra,zero2_idle_first
    python scripts/multi_gpu_check.py --dry-run                                        # list, run none

**Not run on a GPU yet** (none was available to this project), the checks 3 and 9-12 and the deadlines included.
Over gloo on CPU the test suite runs checks 3 and 9-12 at 4 ranks and a hung check's deadline at 2
(``tests/test_gpu_check_script.py``); every check passed by hand at 4 and 8 ranks, and at 2 but for the recorded
calls of ``tp2`` and ``tp2_hsdp`` (TP 2 x a pool of 1: the runtime sums the loss on a one-rank group its list leaves
out). One of six 8-rank runs with ``pipeline_hydra`` hung in it (ranks 0-2 in backward of microbatch 0 on
``cp(0, 1, 2, 3)``, rank 3 already in forward of microbatch 2 on ``cp(2, 3)``); its deadline ended the run.

Checks (one JSON line each from rank 0 as it ends, with its ``seconds``, then a summary with the references'
``reference_seconds``; the exit status is non-zero if any failed; ``--checks`` runs some of them, in this order):

1. ``ring``: :func:`~lightning_hydra.cp.hydra_attn_func` over a ring of every rank (Ulysses 1) on a bin of mixed
   lengths, causal; each rank's output and input gradients against its zigzag shard of per-document float32
   attention of the whole bin computed in this process (float32 inputs on CPU, bfloat16 on CUDA, bounds to match).
2. ``all_to_all``: the same with every rank in the Ulysses all-to-all (ring 1; the heads divide by the world).
3. ``nested_gqa``: the same with Ulysses 2 nested in a ring of world / 2 at once, grouped-query attention with 8
   query heads over 2 KV heads (the all-to-all splits them) and 12 over 3 (Ulysses 2 does not divide 3: each KV
   head is replicated to 6, :func:`~lightning_hydra.cp.attention.kv_replication`). Needs 4 ranks or more: at 2 its
   row is ``ok`` with ``skipped`` saying why.
4. ``tp2_vocab_loss``: :func:`~lightning_hydra.models.vocab_parallel.vocab_parallel_cross_entropy` of a head
   split by rows over TP 2 against :func:`~lightning_hydra.models.losses.chunked_cross_entropy` of the whole head
   on the device: the loss and both gradients (the weight's gathered with ``full_tensor()``); bf16 inputs on CUDA.
5. ``pipeline``: ``DecoderLM`` trained 3 SGD steps with ``pipeline_stages=2`` (2 stages x world/2); losses and
   every parameter against one process trained on the same global batches (a child process of rank 0 without the
   launcher's environment).
6. ``zero2``: the same with ``sharding="zero2"`` (FSDP2 over the world).
7. ``tp2``: the same with ``tensor_parallel=2`` and ``sharding="zero2"`` (TP 2 x pool world/2: TP 2 x pool 1 at 2
   ranks, TP 2 x pool 2 at 4), every parameter gathered with ``full_tensor()``; on CUDA under ``bf16-mixed`` (FSDP's
   bf16 policy over float32 parameters) against a one-process ``bf16-mixed`` run.
8. ``tp2_hsdp``: the same with ``sharding="hsdp"`` (FSDP2 over the pool split into ``(replicate, shard)``, nodes of
   ``max(2, local / 2)`` ranks: TP 2 x (replicate 2 x shard 1) at 4 ranks, TP 2 x (2 x 2) at 8, one TP group at 2).
9. ``pipeline_hydra``: 2 stages x a pool of world/2 under ``policy="hydra"`` on data whose plans leave pool
   positions idle in different microbatches (a smaller ``DecoderLM``, hidden 32 and 4 heads, on 24 documents of
   3-239 tokens; 128 tokens a rank, 256 at 2 ranks; 6 microbatches): the run that hung when each position ran its
   own 1F1B order over the microbatches it ran. The row's ``old_order_hazard`` says whether the lists that old order
   makes of the plans that ran fail the schedule checker (two members of a communicator out of order); it needs a
   pool of 4 or more (8 ranks: ``true`` over gloo), below it (``old_order_hazard_needs``) the check is an
   exactness check of hydra's plans through a pipeline.
10. ``zero2_idle_first``: zero2 over the world with hydra's plans' microbatches reversed (the same groups; 2 layers,
    20 documents, 96 tokens a rank, 128 at 2 ranks), so that ranks sit microbatch 0 out and run a later one in a
    group of several: the run that hung when FSDP gathered at a rank's first forward. ``idle_first`` says whether
    the plans that ran had such a rank (over gloo: at 4 and 8 ranks, not at 2).
11. ``bf16_none``: ``bf16-mixed`` without FSDP and without TP (``sharding="none"``, a pool of the world; the model
    and data of 9 at 128 tokens a rank, so CP groups of several ranks) against a one-process ``bf16-mixed`` run,
    within bf16's precision: the run whose float32 q and k beside a bf16 v crashed the attention kernels.
12. ``comm_profile``: the CP engine's :class:`~lightning_hydra.cp.groups.CommClock` against ``torch.profiler`` on
    every rank, over one forward and backward of the bin of 1 (on CUDA each length 8 times) through every rank as
    Ulysses (all-to-alls: ``0.8 * profiler <= clock <= 1.1 * profiler + slack``) and as a ring (the upper bound;
    ``exposed``: the share of the ring's transfer time the clock saw as waits); ``scripts/gpu_measure.py`` says why
    (check 4 there). Passed by hand over gloo at 2, 4 and 8 ranks.

The training checks (5-11) run ``bf16-true`` on CUDA (``tp2``, ``tp2_hsdp``, ``bf16_none``: ``bf16-mixed``) and
float32 on CPU (``bf16_none``: ``bf16-mixed`` under CPU autocast), bound 1e-5 in float32 and 5e-2 in bf16. Each
records every rank's ``torch.distributed`` calls (:class:`~lightning_hydra.strategy.recorder.RecordCollectives`)
and checks them with :func:`~lightning_hydra.strategy.recorder.recorded_runs`: every rank issued exactly its
operation lists and the lists pass the schedule checker (``recorded_ok``; a failure fails the row).

**Deadlines.** Each check runs under a deadline (``--check-timeout`` seconds: 120 on CUDA, 600 on CPU). A check
past it ends the run: every rank says which check and, when a training step runs, which operation of it (from the
strategy's :class:`~lightning_hydra.strategy.watchdog.Watchdog`): rank 0 as the check's row (``"ok": false`` with
``"error": "timed out after N s ..."``) and the summary, the other ranks on standard error; then every process exits
with status 1 (``os._exit``), so that torchrun ends the job instead of waiting for the collective timeout. The
process group's collectives time out after 1.5 times the longer of a check's deadline and the references' (at
least 300 s, the time the other ranks wait for rank 0's one-process references), and every strategy's watchdog
(collective timeout 1.5 deadlines) reports a step's operation still running after 0.75 deadline on every rank's
standard error. A check that raises becomes its row (``"ok": false``, the error of every rank that raised), and the
run goes on with the next check once every rank has reported it (a synchronisation inside the check's deadline:
where the process group no longer works, that deadline ends the run, or the synchronisation raises and the run stops
after the row, the checks left listed in the summary's ``not_run``). ``--hang-check NAME`` (hidden, for the
tests) keeps the world's last rank from check ``NAME``'s first collective (a training check: its first step's plan
digest check), so that its deadline ends the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from gpu_check import BF16_BOUND, reference_attention, relative_error  # beside this script
from gpu_measure import comm_profile_row
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.cp import GroupCache, hydra_attn_func, zigzag_shard
from lightning_hydra.cp.attention import kv_replication
from lightning_hydra.models.losses import chunked_cross_entropy
from lightning_hydra.models.vocab_parallel import vocab_parallel_cross_entropy
from lightning_hydra.planner import Group
from lightning_hydra.schedule import (
    Op,
    ScheduleError,
    StepLayout,
    StepOptions,
    Work,
    check_programs,
    per_position_order,
    step_programs,
)
from lightning_hydra.strategy.recorder import RecordCollectives, recorded_runs
from lightning_hydra.strategy.tensor import tensor_mesh
from lightning_hydra.strategy.watchdog import Watchdog
from lightning_hydra.testing import quiet_trainer

LENGTHS = [300, 7, 96, 64, 3, 180, 41, 120, 12, 77]
"""The attention checks' bin."""
DATA_LENGTHS = [230, 7, 95, 64, 3, 180, 41, 120, 12, 77, 200, 33, 150, 9, 60, 110, 25, 88, 140, 5]
"""The training checks' documents (``pipeline``, ``zero2``, ``tp2``, ``tp2_hsdp``)."""
CHECKS = (
    "ring", "all_to_all", "nested_gqa", "tp2_vocab_loss", "pipeline", "zero2", "tp2", "tp2_hsdp", "pipeline_hydra",
    "zero2_idle_first", "bf16_none", "comm_profile",
)  # fmt: skip
TRAINING = ("pipeline", "zero2", "tp2", "tp2_hsdp", "pipeline_hydra", "zero2_idle_first", "bf16_none")
"""The checks that train under Lightning (on the process group the others ran on)."""
NESTED_HEADS = ((8, 2), (12, 3))
"""``nested_gqa``'s (query heads, KV heads): Ulysses 2 splits the 2 KV heads, and replicates the 3 to 6."""
CHECK_TIMEOUT = {"cuda": 120.0, "cpu": 600.0}
"""A check's default deadline in seconds, by device."""
SETUP_TIMEOUT = 300.0
"""Seconds (at least) rank 0's one-process references may take while the other ranks wait for the process group."""
GRACE = 2.0
"""Seconds a rank other than 0 waits after its deadline report before it exits (rank 0 prints the rows first)."""
LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
"""torchrun's variables (and every ``TORCHELASTIC_*``), left out of the one-process reference's environment."""


def _lengths(seed: int, count: int) -> tuple[int, ...]:
    return tuple(int(n) for n in np.random.default_rng(seed).integers(3, 240, size=count))


@dataclass(frozen=True)
class Setup:
    """A training check's model and data (its one-process reference trains the same)."""

    hidden: int
    """``DecoderLM``'s hidden size (4 layers or ``layers``, 2 KV heads, vocabulary 258, SGD at lr 1)."""
    heads: int
    """Query heads."""
    layers: int
    """Blocks."""
    lengths: tuple[int, ...]
    """Document lengths."""
    data_seed: int
    """Seed of the documents' tokens."""
    batch_seed: int
    """Seed of the global batches."""


SETUPS = {
    "base": Setup(64, 8, 4, tuple(DATA_LENGTHS), 11, 2),
    "small": Setup(32, 4, 4, _lengths(38, 24), 38, 2),  # hydra's plans leave positions idle in different microbatches
    "tiny": Setup(32, 4, 2, _lengths(0, 20), 0, 5),  # reversed, hydra's plans leave ranks idle in microbatch 0
}
"""The training checks' setups (``small`` and ``tiny``: the data of ``tests/test_collective_order.py``)."""
SETUP_OF = {"pipeline_hydra": "small", "zero2_idle_first": "tiny", "bf16_none": "small"}
"""A training check's setup (default ``base``)."""


def _model(setup: Setup) -> DecoderLM:
    torch.manual_seed(5)
    return DecoderLM(
        vocab_size=258,
        hidden_size=setup.hidden,
        num_layers=setup.layers,
        num_heads=setup.heads,
        num_kv_heads=2,
        lr=1.0,
        optimizer="sgd",
    )


def _dataset(setup: Setup) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(setup.data_seed)
    return [torch.randint(0, 250, (n,), generator=g) for n in setup.lengths]


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.params: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_end(self, trainer, module) -> None:
        if getattr(trainer.strategy, "tensor_parallel", 1) > 1:  # every parameter, gathered (collective)
            self.params = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu()
                for n, p in module.named_parameters()
            }


def precision(name: str, device: torch.device) -> str:
    """A training check's (and its reference's) Trainer precision."""
    if name == "bf16_none":
        return "bf16-mixed"
    if device.type != "cuda":
        return "32-true"
    return "bf16-mixed" if name in ("tp2", "tp2_hsdp") else "bf16-true"


def reference_key(name: str, device: torch.device) -> str:
    """The one-process reference a training check compares with: ``setup@precision``."""
    return f"{SETUP_OF.get(name, 'base')}@{precision(name, device)}"


# ---------------------------------------------------------------------------------------------- strategies
class _OpWatchdog(Watchdog):
    """The strategy's watchdog, which also keeps the operation of the step running now (a deadline names it)."""

    def __init__(self, rank: int, limit: float) -> None:
        super().__init__(rank, limit)
        self.running: str | None = None
        """The operation running now (``None``: none)."""

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Mark ``what`` as running for the block (and report it past the limit)."""
        self.running = what
        try:
            with super().watch(what):
                yield
        finally:
            self.running = None


def _check_runtime(base: type, *, reverse: bool, hang: bool) -> type:
    """A subclass of the pool runtime ``base`` (the strategy's runtime becomes one: a plain subclass keeps its
    layout) that plans with hydra's microbatches in reverse order (``reverse``: the same groups; hydra fills
    microbatch 0 first and rarely leaves a rank idle in it, reversed its last microbatches come first), or whose
    world's last rank never reaches its first step's plan digest check (``hang``: a collective of every rank, so the
    others wait in it)."""

    class CheckRuntime(base):  # type: ignore[misc, valid-type]
        check_runtime = True

        def plan_batch(self, lengths: np.ndarray, *, seed: int, cost: Any = None) -> Any:
            plan = super().plan_batch(lengths, seed=seed, cost=cost)
            return dataclasses.replace(plan, microbatches=plan.microbatches[::-1]) if reverse else plan

        def begin_step(self, batch: Any) -> None:
            if hang and dist.get_rank() == dist.get_world_size() - 1:
                threading.Event().wait()  # never set
            super().begin_step(batch)

    CheckRuntime.__name__ = CheckRuntime.__qualname__ = f"Check{base.__name__}"
    return CheckRuntime


class CheckStrategy(HydraStrategy):
    """A :class:`~lightning_hydra.HydraStrategy` whose runtime's watchdog keeps the running operation for the
    check's deadline (:class:`CheckDeadline`), with hydra's plans reversed (``reverse``) or the last rank stuck
    before its first step's collectives (``hang``)."""

    def __init__(
        self, *, deadline: CheckDeadline | None = None, reverse: bool = False, hang: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.deadline = deadline
        self.reverse = reverse
        self.hang = hang

    def _setup_runtime(self) -> None:
        super()._setup_runtime()
        runtime = self.runtime
        assert runtime is not None
        if (self.reverse or self.hang) and not getattr(runtime, "check_runtime", False):
            runtime.__class__ = _check_runtime(type(runtime), reverse=self.reverse, hang=self.hang)
        watchdog = runtime.watchdog
        if watchdog is not None and not isinstance(watchdog, _OpWatchdog):
            runtime.watchdog = _OpWatchdog(watchdog.rank, watchdog.limit)
        if self.deadline is not None:
            self.deadline.watchdog = runtime.watchdog


# ---------------------------------------------------------------------------------------------- deadlines
class CheckDeadline:
    """Ends the run when a check outlives its deadline (see the module docstring, *Deadlines*).

    Args:
        seconds: A check's deadline.
        rank: This process's global rank (0 prints the rows).
        summary: The summary's fields besides ``ok`` (rank 0).
    """

    def __init__(self, seconds: float, rank: int, summary: dict) -> None:
        self.seconds = seconds
        self.rank = rank
        self.summary = summary
        self.watchdog: _OpWatchdog | None = None
        """The running strategy's watchdog (set by :class:`CheckStrategy`), for the operation a step runs."""

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[None]:
        """Run the block as check ``name`` under the deadline."""
        done = threading.Event()
        thread = threading.Thread(target=self._expire, args=(name, done), name="check-deadline", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            self.watchdog = None

    def _expire(self, name: str, done: threading.Event) -> None:
        if done.wait(self.seconds):
            return
        running = self.watchdog.running if self.watchdog is not None else None
        where = f"in {running}" if running else "outside a training step's operations"
        error = f"timed out after {self.seconds:g} s, rank {self.rank} {where}"
        if self.rank == 0:
            row = {"check": name, "ok": False, "error": f"{error} (the other ranks: standard error)"}
            print(json.dumps(row | {"operation": running}), flush=True)
            print(json.dumps(self.summary | {"ok": False, "timed_out": name}), flush=True)
        else:
            print(f"multi_gpu_check: check {name!r} {error}", file=sys.stderr, flush=True)
            time.sleep(GRACE)  # rank 0 prints first: torchrun ends every rank once one has exited
        sys.stderr.flush()
        os._exit(1)


# ---------------------------------------------------------------------------------------------- attention
def _dtype_bound(device: torch.device) -> tuple[torch.dtype, float]:
    """The inputs' dtype of the checks against float32 in this process, and their bound."""
    return (torch.bfloat16, BF16_BOUND) if device.type == "cuda" else (torch.float32, 1e-5)


def _worst(errors: Sequence[float], device: torch.device) -> float:
    """The largest error over every rank (collective)."""
    worst = torch.tensor([max(errors)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _attention_errors(
    group: Any, rank: int, world: int, device: torch.device, heads: int, kv_heads: int
) -> dict[str, float]:
    """This rank's relative errors of the engine over ``group`` (every rank) against the whole bin in float32."""
    dtype, _ = _dtype_bound(device)
    cu = [0, *itertools.accumulate(LENGTHS)]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(cu[-1], h, 32, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
    )
    ins = [zigzag_shard(x, cu, world, rank).contiguous().requires_grad_() for x in (q, k, v)]
    out = hydra_attn_func(*ins, cu, group=group)
    out.backward(zigzag_shard(dout, cu, world, rank))
    ref, grads = reference_attention(q, k, v, dout, cu, True)  # the whole bin in float32 in this process
    real = zigzag_shard(torch.ones((cu[-1], 1, 1), device=device), cu, world, rank)  # 0 on padding rows
    return {
        n: relative_error(a * real, zigzag_shard(b, cu, world, rank))
        for n, a, b in zip(
            ("out", "dq", "dk", "dv"), [out.detach(), *(x.grad for x in ins)], [ref, *grads], strict=True
        )
    }


def _world_group(world: int, ulysses: int, ring: int) -> tuple[GroupCache, Any]:
    cache = GroupCache()
    record = Group(tuple(range(world)), ulysses, ring)
    cache.prepare([record])  # collective
    return cache, cache.get(record.ranks, ulysses, ring)


def attention_check(name: str, rank: int, world: int, device: torch.device) -> dict:
    """The engine over every rank (``ring`` or ``all_to_all``) against degree 1 in this process."""
    _, bound = _dtype_bound(device)
    ulysses, ring = (1, world) if name == "ring" else (world, 1)
    heads, kv_heads = (8, 2) if ulysses == 1 else (2 * world, world)  # the all-to-all splits both by the world
    cache, group = _world_group(world, ulysses, ring)
    errors = _attention_errors(group, rank, world, device, heads, kv_heads)
    cache.destroy()
    worst = _worst(list(errors.values()), device)
    return {"check": name, "ulysses": ulysses, "ring": ring, "errors": errors, "worst": worst} | {"ok": worst <= bound}


def nested_check(rank: int, world: int, device: torch.device) -> dict:
    """``nested_gqa``: Ulysses 2 x ring world/2 over every rank, GQA with split and with replicated KV heads."""
    if world < 4:
        return {
            "check": "nested_gqa",
            "ok": True,
            "skipped": f"needs 4 ranks or more (Ulysses 2 x ring 2), got {world}",
        }
    _, bound = _dtype_bound(device)
    ulysses, ring = 2, world // 2
    cache, group = _world_group(world, ulysses, ring)
    cases = {}
    for heads, kv_heads in NESTED_HEADS:
        errors = _attention_errors(group, rank, world, device, heads, kv_heads)
        cases[f"{heads}/{kv_heads}"] = {"kv_replication": kv_replication(heads, kv_heads, ulysses), "errors": errors}
    cache.destroy()
    worst = _worst([e for case in cases.values() for e in case["errors"].values()], device)
    return {"check": "nested_gqa", "ulysses": ulysses, "ring": ring, "heads": cases, "worst": worst} | {
        "ok": worst <= bound
    }


def vocab_check(world: int, device: torch.device) -> dict:
    """``tp2_vocab_loss``: the vocabulary-parallel loss of a head split by rows over TP 2 (every TP group of the
    world at once) against the chunked loss of the whole head, loss and gradients, on the device."""
    dtype, bound = _dtype_bound(device)
    g = torch.Generator().manual_seed(3)
    hidden, weight = (torch.randn(n, 64, generator=g).to(device, dtype) for n in (300, 258))
    labels = torch.randint(0, 258, (300,), generator=g).to(device)
    labels[::7] = -100  # ignored tokens
    mesh = tensor_mesh(device.type, stages=1, pool=world // 2, tensor=2)["tp"]
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    whole = chunked_cross_entropy(h1, w1, labels, chunk_tokens=64)
    whole.backward()
    h2 = hidden.clone().requires_grad_()
    w2 = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    split = vocab_parallel_cross_entropy(h2, w2, labels, chunk_tokens=64)
    split.backward()
    errors = {
        "loss": float((split.detach().float() - whole.detach().float()).abs() / whole.detach().float().abs()),
        "dhidden": relative_error(h2.grad, h1.grad),
        "dweight": relative_error(w2.grad.full_tensor(), w1.grad),  # collective over the TP group
    }
    rows = w2.grad.to_local().shape[0]  # half the vocabulary's rows on each rank
    worst = _worst(list(errors.values()), device)
    return {"check": "tp2_vocab_loss", "errors": errors, "worst": worst, "shard_rows": rows} | {
        "ok": worst <= bound and rows == 129
    }


# ---------------------------------------------------------------------------------------------- training
@dataclass
class Run:
    """Where and how this rank runs the checks."""

    rank: int
    world: int
    local: int
    """Ranks on this node."""
    device: torch.device
    tmp: str
    """This rank's scratch directory."""
    timeout: timedelta
    """Every strategy's collective timeout (its watchdog reports at half of it)."""
    deadline: CheckDeadline
    hang: str | None = None
    """The check whose last rank hangs (``--hang-check``)."""


def _fit(
    devices: int,
    strategy: Any,
    device: torch.device,
    precision: str,
    setup: Setup,
    num_nodes: int = 1,
    callbacks: Sequence[pl.Callback] = (),
) -> tuple[list[float], dict]:
    """Three steps; the losses and (on rank 0) the full parameters."""
    model, losses = _model(setup), _Losses()
    hw = {"accelerator": "gpu"} if device.type == "cuda" else {}
    trainer = quiet_trainer(
        devices, strategy, callbacks=[losses, *callbacks], max_steps=3, num_nodes=num_nodes, precision=precision, **hw
    )
    trainer.fit(model, HydraDataModule(_dataset(setup), global_batch_tokens=700, seed=setup.batch_seed))
    if losses.params:
        state = losses.params
    elif isinstance(strategy, HydraStrategy) and strategy.is_sharded:
        state = strategy.full_state_dict()
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return losses.losses, state


def reference(out: str, keys: Sequence[str], device: torch.device, timeout: timedelta) -> None:
    """One process (no launcher environment): for every ``setup@precision`` key, the losses and parameters the
    distributed runs must reproduce, saved to ``{out}/reference-{key}.pt``."""
    for key in keys:
        name, prec = key.split("@")
        kernel = "auto" if device.type == "cuda" else "cpu"
        strategy = HydraStrategy(kernel=kernel, max_tokens_per_rank=4096, timeout=timeout)
        losses, state = _fit(1, strategy, device, prec, SETUPS[name])
        torch.save({"losses": losses, "state": state}, Path(out, f"reference-{key}.pt"))


def _strategy(name: str, run: Run) -> CheckStrategy:
    """The strategy of training check ``name`` on ``run``'s world."""
    world, local = run.world, run.local
    kw: dict[str, Any] = {
        "pipeline": {"pipeline_stages": 2, "ranks_per_node": world // 2},
        "zero2": {"sharding": "zero2", "ranks_per_node": local},
        "tp2": {"tensor_parallel": 2, "sharding": "zero2", "ranks_per_node": local},
        "tp2_hsdp": {"tensor_parallel": 2, "sharding": "hsdp", "ranks_per_node": max(2, local // 2)},
        "pipeline_hydra": {
            "pipeline_stages": 2,
            "policy": "hydra",
            "ranks_per_node": world // 2,
            "max_tokens_per_rank": 128 if world >= 4 else 256,  # a pool of 1 at 2 ranks: the longest document
            "num_microbatches": 6,
        },
        "zero2_idle_first": {
            "sharding": "zero2",
            "policy": "hydra",
            "ranks_per_node": 2,
            "max_tokens_per_rank": 96 if world >= 4 else 128,
            "reverse": True,
        },
        "bf16_none": {"sharding": "none", "ranks_per_node": local, "max_tokens_per_rank": 128},
    }[name]
    kw = {"max_tokens_per_rank": 4096, "num_microbatches": 4} | kw
    if name in ("pipeline_hydra", "zero2_idle_first"):  # the small models' chunks: plans of many small groups
        kw["cost"] = _model(SETUPS[SETUP_OF[name]]).cost_model().replace(min_chunk_tokens=16)
    kernel = "auto" if run.device.type == "cuda" else "cpu"
    return CheckStrategy(kernel=kernel, timeout=run.timeout, deadline=run.deadline, hang=name == run.hang, **kw)


def _recorded(out: Path, run: Run) -> tuple[bool, str | None, list[dict] | None]:
    """Gather every rank's recorded calls on rank 0 and check them with ``recorded_runs`` (collective):
    ``(recorded_ok, error, every rank's record)`` on rank 0."""
    mine = Path(f"{out}.rank{run.rank}")
    row = pickle.loads(mine.read_bytes()) if mine.exists() else None
    rows: list[Any] = [None] * run.world if run.rank == 0 else []
    dist.gather_object(row, rows if run.rank == 0 else None, dst=0)
    if run.rank != 0:
        return True, None, None
    missing = [r for r, x in enumerate(rows) if x is None]
    if missing:
        return False, f"ranks {missing} recorded nothing", None
    gathered = Path(run.tmp, f"{out.name}-all")
    for r, x in enumerate(rows):
        Path(f"{gathered}.rank{r}").write_bytes(pickle.dumps(x))
    try:
        return True, None, recorded_runs(gathered, run.world)
    except Exception as exc:  # AssertionError (a call off its list), ScheduleError (lists out of order)
        return False, f"{type(exc).__name__}: {exc}"[:2000], None


def _stage_work(programs: Sequence[Sequence[Op]]) -> list[list[Work]]:
    """``work[position][m]`` of one step from the lists of the first stage's ranks (rank ``p`` is position ``p``)."""
    forwards = [{op.microbatch: op for op in program if op.kind == "forward"} for program in programs]
    count = 1 + max((m for f in forwards for m in f), default=-1)
    work = []
    for p, mine in enumerate(forwards):
        row = []
        for m in range(count):
            op = mine.get(m)
            if op is None or op.zero_token:
                row.append(Work((p,), 0))
            else:
                cp = next((c.ranks for c in op.comms if c.kind == "cp"), (p,))
                row.append(Work(cp, op.tokens))
        work.append(row)
    return work


def old_order_hazard(work: Sequence[Sequence[Work]], stages: int) -> bool:
    """Whether the lists the order before the step was data makes of one step's plan (``work[position][m]``) fail
    the schedule checker: two members of a communicator out of order, the hang (``tests/test_collective_order.py``
    asks the same)."""
    programs = step_programs(StepLayout(stages=stages, pool=len(work)), work, StepOptions(), order=per_position_order)
    try:
        check_programs(programs)
    except ScheduleError:
        return True
    return False


def idle_first(programs: Sequence[Sequence[Op]]) -> bool:
    """Whether a rank sat microbatch 0 out and ran a later microbatch in a CP group of several (one step's lists)."""
    for program in programs:
        forwards = {op.microbatch: op for op in program if op.kind == "forward"}
        first = forwards.get(0)
        later = any(m > 0 and not op.zero_token and any(c.kind == "cp" for c in op.comms) for m, op in forwards.items())
        if (first is None or first.zero_token) and later:
            return True
    return False


def training_check(name: str, run: Run, expected: dict | None) -> dict:
    """A training check on every rank against its one-process reference (compared on rank 0, which holds it and
    the full parameters), with every rank's collectives recorded and checked."""
    world = run.world
    strategy = _strategy(name, run)
    prec = precision(name, run.device)
    out = Path(run.tmp, f"record-{name}")
    setup = SETUPS[SETUP_OF.get(name, "base")]
    losses, state = _fit(
        run.local, strategy, run.device, prec, setup, num_nodes=world // run.local, callbacks=[RecordCollectives(out)]
    )
    recorded_ok, recorded_error, records = _recorded(out, run)
    if run.rank != 0:
        return {"check": name, "ok": True}
    assert expected is not None
    ref = expected[reference_key(name, run.device)]
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True))
    param_error = max(relative_error(state[k], v) for k, v in ref["state"].items())
    bound = 1e-5 if prec == "32-true" else 5e-2  # bf16: other reduction orders than one process
    row: dict[str, Any] = {"check": name, "precision": prec, "loss_error": loss_error, "param_error": param_error}
    row["recorded_ok"] = recorded_ok
    if recorded_error:
        row["recorded_error"] = recorded_error
    steps = None if records is None else list(zip(*(r["programs"] for r in records), strict=True))
    if name == "pipeline_hydra":  # the first stage's ranks are the pool's positions
        pool = world // 2
        row["pool"] = pool
        hazard = None if steps is None else any(old_order_hazard(_stage_work(s[:pool]), 2) for s in steps)
        row["old_order_hazard"] = hazard
        if pool < 4:
            row["old_order_hazard_needs"] = "a pool of 4 or more (8 ranks)"
    if name == "zero2_idle_first":
        row["idle_first"] = None if steps is None else any(idle_first(s) for s in steps)
    return row | {"ok": loss_error <= bound and param_error <= bound and recorded_ok}


# ---------------------------------------------------------------------------------------------- the run
def run_check(name: str, run: Run, expected: dict | None) -> dict:
    """Check ``name`` on this rank (its row; rank 0's is the one printed)."""
    if name == run.hang and name not in TRAINING and run.rank == run.world - 1:
        threading.Event().wait()  # --hang-check: the last rank never reaches the check's first collective
    if name in ("ring", "all_to_all"):
        return attention_check(name, run.rank, run.world, run.device)
    if name == "nested_gqa":
        return nested_check(run.rank, run.world, run.device)
    if name == "tp2_vocab_loss":
        return vocab_check(run.world, run.device)
    if name == "comm_profile":
        scale = 8 if run.device.type == "cuda" else 1
        return comm_profile_row(run.rank, run.world, run.device, [n * scale for n in LENGTHS])
    return training_check(name, run, expected)


def _agree(row: dict, run: Run) -> dict:
    """Rank 0's row with the errors of every rank that raised (collective: every rank has finished the check)."""
    mine = {"ok": bool(row.get("ok")), "error": row.get("error")}
    every: list[Any] = [None] * run.world
    dist.all_gather_object(every, mine)
    failed = {r: x["error"] for r, x in enumerate(every) if x["error"] and r != run.rank}
    if failed:
        row = row | {"ok": False, "errors_of_ranks": {str(r): e for r, e in failed.items()}}
    return row | {"ok": row.get("ok", False) and all(x["ok"] for x in every)}


def run_checks(names: Sequence[str], run: Run, expected: dict | None, summary: dict) -> bool:
    """Every check in ``names`` under its deadline; rank 0 prints each row as it ends, then the summary."""
    rows = []
    for index, name in enumerate(names):
        start = time.perf_counter()
        usable = True
        with run.deadline.check(name):
            try:
                row = run_check(name, run, expected)
            except Exception as exc:
                print(f"multi_gpu_check: rank {run.rank}: check {name!r} raised", file=sys.stderr, flush=True)
                traceback.print_exc()
                row = {"check": name, "ok": False, "error": f"rank {run.rank}: {type(exc).__name__}: {exc}"[:2000]}
            try:
                row = _agree(row, run)
            except Exception as exc:  # the process group no longer works: no later check can run
                row = row | {"ok": False, "process_group": f"{type(exc).__name__}: {exc}"[:2000]}
                usable = False
        rows.append(row | {"seconds": round(time.perf_counter() - start, 1)})
        if run.rank == 0:
            print(json.dumps(rows[-1]), flush=True)
        if not usable:
            summary = summary | {"not_run": list(names[index + 1 :])}
            break
    ok = all(r["ok"] for r in rows) and len(rows) == len(names)
    if run.rank == 0:
        print(json.dumps(summary | {"ok": ok}), flush=True)
    return ok


def _names(option: str | None) -> list[str]:
    """The checks ``--checks`` selects, in :data:`CHECKS` order."""
    if not option:
        return list(CHECKS)
    asked = {n.strip() for n in option.split(",") if n.strip()}
    unknown = sorted(asked - set(CHECKS))
    if unknown:
        raise SystemExit(f"multi_gpu_check: unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    return [n for n in CHECKS if n in asked]


def main(argv: list[str] | None = None) -> int:
    """Run the checks on this rank; rank 0 prints the lines; exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (NCCL, one GPU per rank) or cpu (gloo)")
    parser.add_argument("--dry-run", action="store_true", help="list the checks, run none")
    parser.add_argument("--checks", default=None, help="comma-separated checks to run (default: every check)")
    parser.add_argument(
        "--check-timeout",
        type=float,
        default=None,
        help="a check's deadline in seconds (default 120 on CUDA, 600 on CPU)",
    )
    parser.add_argument("--hang-check", default=None, help=argparse.SUPPRESS)  # a test's: the last rank hangs in it
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)  # the one-process child's directory
    parser.add_argument("--keys", default="", help=argparse.SUPPRESS)  # the child's references
    args = parser.parse_args(argv)
    names = _names(args.checks)
    if args.hang_check is not None and args.hang_check not in names:
        raise SystemExit(f"multi_gpu_check: --hang-check {args.hang_check} is not among the checks run")
    if args.dry_run:
        for name in names:
            print(json.dumps({"check": name, "dry_run": True}))
        print(json.dumps({"summary": True, "dry_run": True, "checks": len(names), "ok": True}))
        return 0
    kind = torch.device(args.device).type
    seconds = args.check_timeout or CHECK_TIMEOUT.get(kind, CHECK_TIMEOUT["cpu"])
    setup_seconds = max(seconds, SETUP_TIMEOUT)
    strategy_timeout = timedelta(seconds=1.5 * seconds)  # its watchdog reports at 0.75 of a deadline
    if args.reference:
        device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
        reference(args.reference, [k for k in args.keys.split(",") if k], device, strategy_timeout)
        return 0
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if not 2 <= world <= 8 or world % 2:
        print(json.dumps({"ok": False, "error": f"run under torchrun with 2, 4, 6 or 8 ranks (got {world})"}))
        return 1
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    summary = {"summary": True, "world": world, "device": kind, "checks": len(names)}
    keys = sorted({reference_key(name, device) for name in names if name in TRAINING and name != args.hang_check})
    with tempfile.TemporaryDirectory() as tmp:
        if rank == 0 and keys:  # the one-process references, without the launcher's environment
            env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC")}
            command = [sys.executable, __file__, "--device", kind, "--reference", tmp, "--keys", ",".join(keys)]
            command += ["--check-timeout", str(seconds)]
            start = time.perf_counter()
            try:
                subprocess.run(command, env=env, check=True, timeout=setup_seconds)
            except subprocess.SubprocessError as exc:  # the other ranks wait for the process group: torchrun ends them
                print(json.dumps({"check": "reference", "ok": False, "error": str(exc)}), flush=True)
                print(json.dumps(summary | {"ok": False}), flush=True)
                return 1
            summary["reference_seconds"] = round(time.perf_counter() - start, 1)
        collective = timedelta(seconds=1.5 * max(seconds, setup_seconds))
        backend = "nccl" if kind == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=collective, device_id=device if kind == "cuda" else None)
        dist.barrier()
        expected = (
            {k: torch.load(Path(tmp, f"reference-{k}.pt"), weights_only=False) for k in keys} if rank == 0 else None
        )
        run = Run(
            rank=rank,
            world=world,
            local=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
            device=device,
            tmp=tmp,
            timeout=strategy_timeout,
            deadline=CheckDeadline(seconds, rank, summary),
            hang=args.hang_check,
        )
        # Lightning runs on this process group: destroying it would restart the groups' names at "0", and the new
        # groups would read the destroyed ones' peer addresses from the launcher's store (gloo: connection refused)
        ok = run_checks(names, run, expected, summary)
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
