"""The runtime of a :class:`~lightning_hydra.HydraStrategy`'s pool (see :mod:`lightning_hydra.strategy.runtime` for
the interface and the order of calls every rank makes)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_hydra.cp import CPGroup, GroupCache
from lightning_hydra.cp.groups import aligned_blocks
from lightning_hydra.data.datamodule import FailedStep
from lightning_hydra.metrics.record import StepGather
from lightning_hydra.planner import BatchPlanner, CostModel, Group
from lightning_hydra.schedule import StepLayout
from lightning_hydra.strategy.checks import agree_step, all_gather_single, check_fits
from lightning_hydra.strategy.gradients import GradientReducer
from lightning_hydra.strategy.pipeline import PipelineLayout
from lightning_hydra.strategy.runtime import GradientSync, HydraRuntime
from lightning_hydra.strategy.sharding import ShardedGradientSync, ShardingPlan

__all__ = ["PoolRuntime"]

log = logging.getLogger(__name__)


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
        replicas: bool = True,
        **kwargs: Any,
    ) -> None:
        """Args:
        backend: Backend of the CP groups (default: the world's).
        local_world_size: Ranks on this host (for :attr:`oversubscribed`).
        layout: Pipeline stages x pool (default: one stage of ``world_size`` ranks).
        world_rank: This rank in the default process group (default: ``global_rank``).
        replicas: The ranks hold replicas whose gradients this runtime sums (``False``: sharded state, which FSDP
            reduces over its own mesh: no gradient communicator is created).
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
        """The stage's pool as a process group of its own (after :meth:`setup`): the gradient sum's communicator,
        never the world's, which pipeline and ring transfers use (an asynchronous bucket sum launched in a rank's
        last backward must not hold up a transfer queued behind it on the same communicator)."""
        self._owned_groups: list[dist.ProcessGroup] = []
        """The step's own communicators (gradient sums, ring and pipeline transfers), destroyed by :meth:`close`."""
        self.pipe_group: dist.ProcessGroup | None = None
        """The pipeline transfers' communicator (with stages; after :meth:`setup`): never the default group's, so
        that no ring transfer queues behind a send waiting for the next stage."""
        self.replicas = replicas
        self.cache = GroupCache(backend=backend, clock=self.comm_clock)
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
        every stage's pool can use, and the step's own (:attr:`step_communicators`: each stage's pool for a replica
        pool's gradient sum, the ring transfers', the pipeline transfers'); a second call creates none. Returns how
        many CP communicators were created."""
        local = aligned_blocks(self.world_size, self.degree_rules().ulysses_options())
        made = self.cache.create(copy for block in local for copy in self.copies(block))
        if made:
            self.cache.warm_up(self.world_rank, self.device)
        if not self._owned_groups:  # the step's own communicators, once: every rank creates each, in one order
            world = list(range(self.layout.world_size))
            if self.stage_group is None and self.replicas and self.world_size > 1:  # a pool of one sums nothing
                for s in range(self.layout.stages):
                    pg = dist.new_group(list(self.layout.stage_ranks(s)))
                    self._owned_groups.append(pg)
                    if s == self.stage:
                        self.stage_group = pg
            if self.world_size > 1:
                self.cache.ring_group = dist.new_group(world)
                self._owned_groups.append(self.cache.ring_group)
            if self.layout.stages > 1:
                self.pipe_group = dist.new_group(world)
                self._owned_groups.append(self.pipe_group)
            for pg in self._owned_groups:  # NCCL makes a communicator on first use: not inside the first step
                if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.all_reduce(torch.ones(1, dtype=torch.float32, device=self.device), group=pg)
        return made

    @property
    def step_communicators(self) -> dict[str, int]:
        """The communicators of the step's own traffic this rank holds, by what they carry (the gradient sum, ring
        transfers, pipeline transfers; the CP groups' are :attr:`cache`'s)."""
        held = {"gradient sum": self.stage_group in self._owned_groups, "ring": self.cache.ring_group is not None}
        held["pipeline"] = self.pipe_group is not None
        return {name: int(bool(on)) for name, on in held.items()}

    def copies(self, positions: tuple[int, ...]) -> list[tuple[int, ...]]:
        """A plan's group of pool positions as global ranks in every stage (every stage plans the same batch), in one
        global order: the communicators every rank creates for it."""
        return [tuple(s * self.layout.pool + p for p in positions) for s in range(self.layout.stages)]

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
        owned = 0
        if dist.is_initialized():
            for pg in self._owned_groups:
                if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(pg)
                    owned += 1
        if self.stage_group in self._owned_groups:
            self.stage_group = None
        self._owned_groups.clear()
        self.cache.ring_group = self.pipe_group = None
        return self.cache.destroy() + owned

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this host than CPU cores (CPU runs only): wall clocks then measure time slicing."""
        if self.device.type == "cuda":
            return False
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return self.local_world_size > cores

    # ------------------------------------------------------------------ planning
    def batch_planner(self) -> BatchPlanner:
        """The pool's planner settings, its size and the bound module's heads."""
        heads, kv_heads = self.heads
        return BatchPlanner(
            config=self.planner_config, world_size=self.world_size, num_heads=heads, num_kv_heads=kv_heads
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
        """The step's control all-reduce over the world, every stage and TP rank (:func:`~lightning_hydra.strategy.
        checks.agree_step`: the plan digest, a data error on any rank, SIGTERM on any rank; one read to the host),
        then make sure the plan's groups' communicators exist (collectively; in steady state none is created).

        Args:
            batch: The step's :class:`~lightning_hydra.data.packing.StepBatch`, or the
                :class:`~lightning_hydra.data.datamodule.FailedStep` of a rank whose planning or reading failed
                (every rank then raises its error here).
        """
        failed = batch if isinstance(batch, FailedStep) else None
        world = getattr(batch, "world_size", self.world_size)
        if failed is None and world != self.world_size:
            raise RuntimeError(f"the batch was planned for {world} ranks, but the pool has {self.world_size}")
        stopping = self.stop_requested is not None and self.stop_requested.is_set()
        if agree_step(
            None if failed is not None else batch.digest,
            device=self.device,
            world_size=self.layout.world_size,
            error=None if failed is None else failed.error,
            stop=stopping,
        ):
            self.stop_agreed = True
        assert failed is None, "agree_step raises on every rank when a rank's step failed"
        made = self.cache.prepare(Group(copy, g.ulysses, g.ring) for g in batch.groups for copy in self.copies(g.ranks))
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
            alone = self.world_size == 1
            if self.stage_group is None and not alone:
                raise RuntimeError("PoolRuntime.setup has not run (or was made for sharded state): no gradient group")
            self._reducer = GradientReducer(params, group=self.stage_group, alone=alone)
            self._reducer_params = ids
        return self._reducer

    def step_layout(self) -> StepLayout:
        """Stages x pool and the sharding (hsdp's nodes: ``ranks_per_node`` positions)."""
        mode = self.sharding.mode if self.sharding is not None else "none"
        node = min(self.planner_config.ranks_per_node, self.layout.pool)
        return StepLayout(stages=self.layout.stages, pool=self.layout.pool, sharding=mode, node=node)

    def gather_units(self) -> int:
        """The sharded modules (every block, then the root): a step gathers them in this order."""
        return len(self.sharding.modules) if self.sharding is not None else 0

    def gather_unit(self, unit: int) -> None:
        """All-gather sharded module ``unit``'s parameters (kept until the step's last backward reshards them)."""
        assert self.sharding is not None
        self.sharding.modules[unit].unshard()

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
        all_gather_single(out, value.reshape(1))
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
