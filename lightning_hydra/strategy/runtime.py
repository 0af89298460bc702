"""The runtime a :class:`~lightning_hydra.HydraModule` and the :class:`~lightning_hydra.HydraDataModule` talk to.

One typed interface, :class:`HydraRuntime`, with two implementations: :class:`LocalRuntime` (one process, no
strategy: the whole global batch in one microbatch at degree 1) and :class:`PoolRuntime` (the dynamic-CP pool of a
:class:`~lightning_hydra.HydraStrategy`: plans, communicators, digest checks, gradient sums, measurement gathers,
calibration). Per optimizer step a module calls, in this order on every rank::

    runtime.begin_step(batch)            # digest check of the plan (collective), groups prepared (none created)
    sync = runtime.gradient_sync()       # .begin(); .arm() before the last backward; .finish() after it
    ... microbatches, each under runtime.group(mb.group) ...
    runtime.all_sum(loss)
    runtime.finish_step(batch, timing)   # one gather of every rank's measurements; calibration

The order of the world collectives is the same on every rank whatever its plan, which nccl and gloo require.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_hydra.cp import CPGroup, GroupCache
from lightning_hydra.cp.groups import aligned_blocks
from lightning_hydra.metrics.record import StepGather, StepRecord, step_row
from lightning_hydra.metrics.timing import StepTiming
from lightning_hydra.planner import CostModel, DegreeRules, Group, Plan, PlannerConfig, shard_tokens
from lightning_hydra.planner.calibration import NUM_FEATURES, CostCalibrator
from lightning_hydra.planner.memory import ModelMemoryShape
from lightning_hydra.strategy.checks import check_digests, check_fits
from lightning_hydra.strategy.clipping import clip_grad_norm
from lightning_hydra.strategy.gradients import GradientReducer
from lightning_hydra.strategy.pipeline import PipelineLayout
from lightning_hydra.strategy.sharding import ShardedGradientSync, ShardingPlan

__all__ = [
    "GradientSync",
    "HydraRuntime",
    "LocalRuntime",
    "PoolRuntime",
    "memory_shape",
    "model_cost",
    "model_heads",
]

log = logging.getLogger(__name__)


def model_heads(module: Any) -> tuple[int | None, int | None]:
    """``(num_heads, num_kv_heads)`` of a module with ``attention_heads()`` (``(None, None)`` otherwise)."""
    heads = getattr(module, "attention_heads", None)
    return heads() if callable(heads) else (None, None)


def model_cost(module: Any) -> CostModel:
    """The analytic cost model of a :class:`~lightning_hydra.HydraModule` (``TypeError`` for other modules)."""
    make = getattr(module, "cost_model", None)
    if not callable(make):
        raise TypeError(f"{type(module).__name__} has no cost_model(): subclass lightning_hydra.HydraModule")
    return make()


def memory_shape(module: Any) -> ModelMemoryShape:
    """The memory model's view of a :class:`~lightning_hydra.HydraModule`: its shape and parameter count."""
    shape = getattr(module, "model_shape", None)
    if not callable(shape):
        raise TypeError(f"{type(module).__name__} has no model_shape(): subclass lightning_hydra.HydraModule")
    s = dict(shape())
    hidden, heads = int(s["hidden_size"]), int(s["num_heads"])
    return ModelMemoryShape(
        num_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
        hidden_size=hidden,
        num_layers=int(s["num_layers"]),
        num_heads=heads,
        num_kv_heads=int(s.get("num_kv_heads") or heads),
        ffn_hidden_size=int(s.get("ffn_hidden_size") or 4 * hidden),
        vocab_size=int(s.get("vocab_size") or 32000),
    )


class GradientSync(Protocol):
    """How a step's gradients become the pool's sum: ``begin`` at the start of the step, ``arm`` before the last
    microbatch's backward, ``finish`` after the last microbatch."""

    def begin(self) -> None:
        """Start a step."""

    def arm(self) -> None:
        """The next backward is the step's last."""

    def finish(self) -> None:
        """Complete the sum (blocking)."""

    def must_run(self, index: int, last: int) -> bool:
        """Whether a rank idle in microbatch ``index`` (of ``0..last``) must still run a zero-token pass so that
        its collectives line up with the other ranks'."""


class _NoSync:
    """Gradient sync of one process: nothing to do."""

    def begin(self) -> None:
        """Nothing."""

    def arm(self) -> None:
        """Nothing."""

    def finish(self) -> None:
        """Nothing."""

    def must_run(self, index: int, last: int) -> bool:
        """Never."""
        return False


class HydraRuntime(ABC):
    """What a module and the data module need from the process(es) they run in (see the module docstring)."""

    def __init__(
        self,
        *,
        planner_config: PlannerConfig,
        device: torch.device,
        global_rank: int,
        world_size: int,
        calibrate: bool = False,
        calibrator: CostCalibrator | None = None,
    ) -> None:
        """Args:
        planner_config: How global batches are planned.
        device: The device this rank computes on (tensors of collectives live there).
        global_rank: This rank in the pool.
        world_size: Ranks in the pool.
        calibrate: Refit the cost model after every step from the gathered measurements.
        calibrator: Settings and state of the refit.
        """
        self.planner_config = planner_config
        self.device = device
        self.global_rank = global_rank
        self.world_size = world_size
        self.calibrate = calibrate
        self.calibrator = calibrator if calibrator is not None else CostCalibrator()
        self.module: nn.Module | None = None
        self._cost: CostModel | None = planner_config.cost
        self.cost_version = 0
        """Cost-model updates so far (0: the given or analytic model). A plan records the version it used."""
        self.last_record: StepRecord | None = None
        """Every rank's measurements of the last training step (the same on every rank)."""
        self.measure_seconds = 0.0
        """Wall seconds the last :meth:`finish_step` took (gathering and calibration: the cost of measuring)."""
        self.stage = 0
        """This rank's pipeline stage (0 without a pipeline)."""
        self.stages = 1
        """Pipeline stages of the run."""
        self.offset = 0
        """Global rank of this stage's pool position 0."""

    # ------------------------------------------------------------------ the model and its cost
    def bind(self, module: nn.Module) -> None:
        """Plan for ``module`` (its heads constrain Ulysses degrees; its shape gives the default cost model)."""
        self.module = module

    @property
    def heads(self) -> tuple[int | None, int | None]:
        """``(num_heads, num_kv_heads)`` of the bound module."""
        return model_heads(self.module)

    @property
    def cost_model(self) -> CostModel:
        """The cost model plans use now (given, analytic from the module's shape, or calibrated)."""
        if self._cost is None:
            self._cost = model_cost(self.module)
        return self._cost

    @cost_model.setter
    def cost_model(self, cost: CostModel) -> None:
        self._cost = cost
        self.cost_version += 1

    def degree_rules(self) -> DegreeRules:
        """The degrees the pool allows for the bound module."""
        cfg = self.planner_config
        return DegreeRules(
            world_size=self.world_size,
            ranks_per_node=min(cfg.ranks_per_node, self.world_size),
            num_heads=self.heads[0],
            max_ulysses=cfg.max_ulysses,
            max_ring=cfg.max_ring,
        )

    # ------------------------------------------------------------------ planning (pure, any thread)
    @abstractmethod
    def plan_batch(self, lengths: np.ndarray, *, seed: int, cost: CostModel | None = None) -> Plan:
        """Plan one global batch with ``cost`` (default: the current model). Pure: callable from a planning
        thread; the same inputs give the same plan on every rank."""

    @abstractmethod
    def check_fits(self, longest: int, split: str, global_batch_tokens: int) -> None:
        """Raise ``ValueError`` when the data cannot be planned onto the pool."""

    # ------------------------------------------------------------------ per step (main thread, every rank)
    @abstractmethod
    def begin_step(self, batch: Any) -> None:
        """Check that every rank holds the same plan and that its groups' communicators exist."""

    @abstractmethod
    def group(self, record: Group) -> CPGroup:
        """The communicator handle of a group of the current plan."""

    @abstractmethod
    def gradient_sync(self, module: nn.Module) -> GradientSync:
        """The gradient sum of this step for ``module``'s parameters."""

    def must_run(self, index: int, last: int, *, train: bool) -> bool:
        """Whether a rank idle in microbatch ``index`` must run a zero-token pass (sharded state: its collectives
        must line up); ``False`` for replicas."""
        return False

    def end_forward_only(self) -> None:
        """After a forward-only step (validation): release what it left gathered (nothing for replicas)."""
        return None

    @abstractmethod
    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a tensor over the pool."""

    def stage_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the pipeline's stages of a scalar every rank of a stage holds alike (one stage: the value)."""
        return value

    def clip_grad_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip this rank's gradients by the global gradient's norm (every shard, every stage); returns the norm."""
        return clip_grad_norm(parameters, max_norm, stage_sum=self.stage_sum)

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (set-up time only: pickles)."""

    @abstractmethod
    def _gather_rows(self, row: np.ndarray) -> np.ndarray:
        """The ``[N, K]`` table of every rank's measurement row."""

    def _share_cost(self, cost: CostModel) -> CostModel:
        """The refitted model every rank adopts (distributed: rank 0's)."""
        return cost

    @property
    def timer_includes_comm(self) -> bool:
        """Whether measured busy time includes communication (CUDA events) rather than excluding it (CPU time)."""
        return self.device.type == "cuda"

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this host than CPU cores (CPU runs only): wall clocks then measure time slicing."""
        return False

    def finish_step(self, batch: Any, timing: StepTiming, step: int) -> StepRecord:
        """Gather every rank's measurements of a training step and, with ``calibrate``, refit the cost model from
        them (the same model on every rank).

        Args:
            batch: The step's :class:`~lightning_hydra.data.packing.StepBatch`.
            timing: This rank's busy and communication seconds per microbatch and the step's wall seconds.
            step: The global step.

        Returns:
            The gathered :class:`StepRecord` (also kept as :attr:`last_record`).
        """
        start = time.perf_counter()
        includes = self.timer_includes_comm
        row = step_row(
            batch,
            timing,
            includes_comm=includes,
            offset=self.offset,
            stage=self.stage,
        )
        table = self._gather_rows(row)
        record = StepRecord.from_table(
            table,
            step=step,
            num_microbatches=len(timing.busy),
            trained_tokens=batch.trained_tokens,
            includes_comm=includes,
        )
        if self.calibrate:
            features = record.features.reshape(-1, NUM_FEATURES)
            # CPU thread time excludes communication, measured apart (CommClock's wall time in CP collectives):
            # both are fitted. On CUDA the clock sees only the host's launch time, so communication stays inside
            # the event-timed busy time.
            comm = None if record.includes_comm else record.comm.ravel()
            self.calibrator.add(features, record.busy.ravel(), includes_comm=record.includes_comm, comm=comm)
            refit = self.calibrator.refit(self.cost_model)
            if refit is not self.cost_model:
                self.cost_model = self._share_cost(refit)
        self.last_record = record
        self.measure_seconds = time.perf_counter() - start
        return record


class LocalRuntime(HydraRuntime):
    """One process, no strategy: the whole global batch in one microbatch on this rank at degree 1."""

    def __init__(self, module: nn.Module | None, device: torch.device | None = None) -> None:
        """Args:
        module: The model (its heads and analytic cost model; ``None``: checks only, no planning).
        device: The device it runs on (default: the module's).
        """
        if device is None:
            first = next(iter(module.parameters()), None) if module is not None else None
            device = first.device if first is not None else torch.device("cpu")
        config = PlannerConfig(policy="hydra", num_microbatches=1, ranks_per_node=1)
        super().__init__(planner_config=config, device=device, global_rank=0, world_size=1)
        self.bind(module)

    def plan_batch(self, lengths: np.ndarray, *, seed: int, cost: CostModel | None = None) -> Plan:
        """One microbatch holding every sequence on rank 0."""
        capacity = sum(shard_tokens(int(n), 1) for n in lengths)
        config = dataclasses.replace(self.planner_config, max_tokens_per_rank=max(capacity, 1))
        heads, kv_heads = self.heads
        return config.schedule(
            lengths, world_size=1, cost=cost or self.cost_model, num_heads=heads, num_kv_heads=kv_heads, seed=seed
        )

    def check_fits(self, longest: int, split: str, global_batch_tokens: int) -> None:
        """Anything fits one process (memory permitting)."""

    def begin_step(self, batch: Any) -> None:
        """Nothing to agree on with one process."""

    def group(self, record: Group) -> CPGroup:
        """The local degree-1 group."""
        return CPGroup((0,), 1, 1)

    def gradient_sync(self, module: nn.Module) -> GradientSync:
        """Nothing to sum with one process."""
        return _NoSync()

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The value itself."""
        return value.detach()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``[obj]``."""
        return [obj]

    def _gather_rows(self, row: np.ndarray) -> np.ndarray:
        return row[None, :]


class PoolRuntime(HydraRuntime):
    """The dynamic-CP pool of a :class:`~lightning_hydra.HydraStrategy`: the whole world, or with pipeline stages
    one stage's ranks (:class:`~lightning_hydra.strategy.pipeline.PipelineLayout`).

    ``global_rank`` and ``world_size`` are this rank's pool position and the pool's size (what plans are made
    for); ``world_rank`` is the rank in the default process group. Owns the communicators
    (:class:`~lightning_hydra.cp.GroupCache`, created once at :meth:`setup` for every aligned Ulysses block of every
    stage's pool, warmed up, destroyed by :meth:`close`), the gradient reducer (over the stage's pool), and the
    per-step measurement gather (over the world).
    """

    def __init__(
        self,
        *,
        backend: str | None = None,
        local_world_size: int = 1,
        layout: PipelineLayout | None = None,
        world_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Args:
        backend: Backend of the CP groups (default: the world's).
        local_world_size: Ranks on this host (for :attr:`oversubscribed`).
        layout: Pipeline stages x pool (default: one stage of ``world_size`` ranks).
        world_rank: This rank in the default process group (default: ``global_rank``).
        **kwargs: See :class:`HydraRuntime`.
        """
        super().__init__(**kwargs)
        self.layout = layout if layout is not None else PipelineLayout(stages=1, pool=self.world_size)
        if self.layout.pool != self.world_size:
            raise ValueError(f"the pool has {self.world_size} ranks but the layout's stages have {self.layout.pool}")
        self.world_rank = self.global_rank if world_rank is None else world_rank
        self.stage = self.layout.stage(self.world_rank)
        self.stages = self.layout.stages
        self.offset = self.stage * self.layout.pool
        """Global rank of this stage's pool position 0."""
        self.stage_group: dist.ProcessGroup | None = None
        """The stage's pool as a process group (``None``: the world, with one stage)."""
        self.cache = GroupCache(backend=backend)
        self.local_world_size = local_world_size
        self._reducer: GradientReducer | None = None
        self._reducer_params: list[int] = []
        self._gather: StepGather | None = None
        self.sharding: ShardingPlan | None = None
        """The sharded model (``None``: replicas), set by the strategy at set-up."""
        self._sharded_sync: ShardedGradientSync | None = None
        self.closed = False

    # ------------------------------------------------------------------ lifecycle
    def setup(self) -> int:
        """Create (collectively, in one global order) and warm up the communicators of every aligned Ulysses block
        every stage's pool can use, and each stage's pool group; a second call creates none. Returns how many CP
        communicators were created."""
        local = aligned_blocks(self.world_size, self.degree_rules().ulysses_options())
        offsets = [s * self.layout.pool for s in range(self.layout.stages)]
        made = self.cache.create(tuple(o + r for r in block) for o in offsets for block in local)
        if made:
            self.cache.warm_up(self.world_rank, self.device)
        if self.layout.stages > 1 and self.stage_group is None:
            for s in range(self.layout.stages):  # every rank creates every stage's group, in order
                pg = dist.new_group(list(self.layout.stage_ranks(s)))
                if s == self.stage:
                    self.stage_group = pg
        return made

    def to_global(self, record: Group) -> Group:
        """A plan's group (pool positions) as global ranks of this stage."""
        if not self.offset:
            return record
        return Group(tuple(self.offset + r for r in record.ranks), record.ulysses, record.ring, record.seq_ids)

    def close(self) -> int:
        """Destroy the communicators and hooks (collective on NCCL); returns how many groups were destroyed."""
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
        self.closed = True
        return self.cache.destroy()

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this host than CPU cores (CPU runs only): wall clocks then measure time slicing."""
        if self.device.type == "cuda":
            return False
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return self.local_world_size > cores

    # ------------------------------------------------------------------ planning
    def plan_batch(self, lengths: np.ndarray, *, seed: int, cost: CostModel | None = None) -> Plan:
        """Plan one global batch onto the pool (pure and deterministic: every rank gets the same plan)."""
        heads, kv_heads = self.heads
        return self.planner_config.schedule(
            lengths,
            world_size=self.world_size,
            cost=cost or self.cost_model,
            num_heads=heads,
            num_kv_heads=kv_heads,
            seed=seed,
        )

    def check_fits(self, longest: int, split: str, global_batch_tokens: int) -> None:
        """See :func:`lightning_hydra.strategy.checks.check_fits`."""
        check_fits(
            self.planner_config,
            self.world_size,
            self.heads[0],
            longest=longest,
            split=split,
            global_batch_tokens=global_batch_tokens,
        )

    # ------------------------------------------------------------------ per step
    def begin_step(self, batch: Any) -> None:
        """Check the plan digest on every rank, then make sure its groups' communicators exist (collectively; in
        steady state none is created)."""
        world = getattr(batch, "world_size", self.world_size)
        if world != self.world_size:
            raise RuntimeError(f"the batch was planned for {world} ranks, but the pool has {self.world_size}")
        check_digests(batch.digest, self.layout.world_size, device=self.device)  # every stage: the same plan
        offsets = [s * self.layout.pool for s in range(self.layout.stages)]
        made = self.cache.prepare(
            Group(tuple(o + r for r in g.ranks), g.ulysses, g.ring) for o in offsets for g in batch.groups
        )
        if made:
            log.warning("HydraStrategy created %d communicators inside a step (a plan used an unaligned block)", made)
            self.cache.warm_up(self.world_rank, self.device)

    def group(self, record: Group) -> CPGroup:
        """The communicator handle of a group of the current plan (pool positions of this stage)."""
        return self.cache.get(self.to_global(record))

    def gradient_sync(self, module: nn.Module) -> GradientSync:
        """FSDP's reduce-scatter for a sharded model; otherwise the bucketed gradient sum of ``module``'s parameters
        (built once; rebuilt if the parameters change)."""
        if self.sharding is not None:
            if self._sharded_sync is None or self._sharded_sync.plan is not self.sharding:
                self._sharded_sync = ShardedGradientSync(self.sharding)
            return self._sharded_sync
        params = [p for p in module.parameters() if p.requires_grad]
        ids = [id(p) for p in params]
        if self._reducer is None or ids != self._reducer_params:
            if self._reducer is not None:
                self._reducer.remove()
            self._reducer = GradientReducer(params, group=self.stage_group)
            self._reducer_params = ids
        return self._reducer

    def must_run(self, index: int, last: int, *, train: bool) -> bool:
        """Sharded state: training follows the mode (the last microbatch, or every one under zero3); a forward-only
        step runs every microbatch (every forward may gather parameters)."""
        if self.sharding is None:
            return False
        if not train:
            return True
        return self.gradient_sync(self.module).must_run(index, last)  # type: ignore[arg-type]

    def end_forward_only(self) -> None:
        """Reshard a sharded model after validation (zero2 keeps parameters gathered after a forward)."""
        if self.sharding is not None:
            ShardedGradientSync(self.sharding).reshard()

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a tensor over the pool."""
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def stage_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the stages of a scalar each stage's ranks hold alike: the world gathers one value per rank and
        adds pool position 0 of every stage, in stage order (the same sum on every rank)."""
        if self.stages == 1:
            return value
        out = torch.empty(self.layout.world_size, dtype=value.dtype, device=value.device)
        dist.all_gather_into_tensor(out, value.reshape(1))
        return out[:: self.layout.pool].sum()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (the whole world, every stage), in rank order."""
        out: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(out, obj)
        return out

    def _gather_rows(self, row: np.ndarray) -> np.ndarray:
        if self._gather is None or self._gather.row_size != row.size:
            self._gather = StepGather(self.layout.world_size, row.size).to(self.device)
        self._gather.reset()
        self._gather.update(row)
        return self._gather.compute().cpu().numpy()

    def _share_cost(self, cost: CostModel) -> CostModel:
        """Rank 0's refit, broadcast: identical on every rank by construction (BLAS may round differently on
        different hosts)."""
        names = [f.name for f in dataclasses.fields(cost)]
        values = torch.tensor([float(getattr(cost, n)) for n in names], dtype=torch.float64, device=self.device)
        dist.broadcast(values, src=0)
        return CostModel.from_dict(dict(zip(names, values.tolist(), strict=True)))
