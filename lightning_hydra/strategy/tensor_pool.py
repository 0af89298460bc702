"""The pool's runtime under tensor parallelism: ``T`` copies of every CP group, one per TP rank.

Plans are made for the pool's ``N`` positions (see :mod:`lightning_hydra.strategy.tensor` for the layout); this
runtime maps a plan's group of positions to the global ranks of this rank's TP index, creates the communicators of
every TP index's copy, and sums gradients, losses and objects over the ``"pool"`` dimension of the device mesh
(TP-rank-equal ranks of one stage), where :class:`~lightning_hydra.strategy.pool.PoolRuntime` uses the world.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from lightning_hydra.planner import CostModel, Group
from lightning_hydra.schedule import StepLayout
from lightning_hydra.strategy.gradients import DEFAULT_BUCKET_BYTES, GradientReducer
from lightning_hydra.strategy.pipeline import PipelineLayout
from lightning_hydra.strategy.pool import PoolRuntime
from lightning_hydra.strategy.runtime import GradientSync
from lightning_hydra.strategy.tensor import tensor_mesh

__all__ = ["TensorGradientSync", "TensorPoolRuntime", "sum_partial_gradients"]


def sum_partial_gradients(params: list[nn.Parameter]) -> int:
    """Sum every gradient that is a partial DTensor over its mesh, in one flat all-reduce per mesh and dtype, and
    give it its parameter's placements; returns the gradients summed.

    Under sequence parallelism a norm's weight is replicated over the TP group but each TP rank saw ``1 / T`` of
    the tokens: its gradient is ``Partial``. The TP ranks of a pool position run the same microbatches (an idle
    position is idle with its whole group), so they hold the same partial gradients and call the same collectives.

    Args:
        params: The parameters whose gradients to complete (those without one are skipped).
    """
    groups: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((id(g.device_mesh), g.dtype), []).append(p)
    for members in groups.values():
        mesh = members[0].grad.device_mesh  # type: ignore[union-attr]
        locals_ = [p.grad.to_local() for p in members]  # type: ignore[union-attr]
        _all_reduce_in_place(locals_, mesh.get_group())
        for p, full in zip(members, locals_, strict=True):
            placements = p.placements if isinstance(p, DTensor) else (Replicate(),) * mesh.ndim
            p.grad = DTensor.from_local(full, mesh, placements, run_check=False)
    return sum(len(m) for m in groups.values())


def _all_reduce_in_place(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` (one dtype) over ``group`` in one flat all-reduce, written back into each."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


class TensorGradientSync(GradientReducer):
    """Sums this rank's gradients (DTensor shards as their local tensors) over the pool in buckets, launched as the
    last backward fills them, as a replica's :class:`~lightning_hydra.strategy.gradients.GradientReducer` does.

    A DTensor parameter's gradient is a DTensor whose local tensor is its slice of the bucket, in the placements
    autograd gives it (learnt from the gradient of the first step, which the backward hook copies into the bucket;
    from then on autograd accumulates in place): no gradient is copied and no flat copy of all of them is made.
    Under sequence parallelism the replicated parameters' gradients (the norms') are partial sums over the TP
    group, completed by the step's ``partial_sum`` operation after the backward (:func:`sum_partial_gradients`):
    they go into buckets of their own after all others (*late*), launched by :meth:`finish` only. The buckets
    launched early carry only complete gradients and go, in one order on every rank, to the pool's communicator
    only (:meth:`collectives` lists them all, then, in the first step, the bucket-order gather).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        *,
        partial_sums: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        """Args:
        params: The parameters to reduce (those with ``requires_grad``), in registration order.
        group: The pool's process group of this rank's TP index and stage.
        partial_sums: Some gradients are partial over the TP group (sequence parallelism) and are summed there
            first (the step's ``partial_sum`` operation): the replicated DTensor parameters' buckets wait for it.
        bucket_bytes: Target bytes per bucket (of local shards).
        """
        self.partial_sums = partial_sums
        self._placements: dict[int, tuple[Placement, ...]] = {}
        """The placements of each DTensor parameter's gradient as autograd makes them (from its first gradient)."""
        super().__init__(params, group=group, bucket_bytes=bucket_bytes, alone=dist.get_world_size(group) == 1)

    def _late(self, p: nn.Parameter) -> bool:
        """A replicated DTensor parameter under sequence parallelism: its gradient is partial until summed over the
        TP group after the backward."""
        return self.partial_sums and isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)

    def _wrap(self, p: DTensor, flat: torch.Tensor, placements: tuple[Placement, ...]) -> DTensor:
        local = flat.view(self._shapes[id(p)])
        return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=p.shape, stride=p.stride())

    def _as_grad(self, p: nn.Parameter, flat: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor | None:
        """A DTensor over ``flat`` in the placements of ``p``'s gradients (learnt from ``like``); ``None`` while they
        are unknown (the first step's backward hook copies autograd's gradient in and learns them)."""
        if not isinstance(p, DTensor):
            return flat.view(self._shapes[id(p)])
        if isinstance(like, DTensor):
            self._placements[id(p)] = tuple(like.placements)
        placements = self._placements.get(id(p))
        return None if placements is None else self._wrap(p, flat, placements)

    def _zeros(self, p: nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """Zeros in the gradient's placements (the parameter's while they are unknown)."""
        if not isinstance(p, DTensor):
            return flat.view(self._shapes[id(p)])
        return self._wrap(p, flat, self._placements.get(id(p), tuple(p.placements)))

    def sum_partials(self) -> None:
        """Sum the partial gradients over the TP group (the step's ``partial_sum`` operation: the TP ranks of a pool
        position ran the same microbatches, so they hold the same partial gradients and call the same
        collectives); they stay in their (late) buckets."""
        sum_partial_gradients(self.params)


class TensorPoolRuntime(PoolRuntime):
    """:class:`~lightning_hydra.strategy.pool.PoolRuntime` of a world of ``stages x pool x tensor`` ranks.

    ``global_rank`` and ``world_size`` stay this rank's pool position and the pool's size (what plans are made
    for); ``world_rank`` is the rank in the default process group, ``tensor_rank`` its index in its TP group.
    :attr:`positions` is the stages x pool positions layout plans are made for; :attr:`layout` the stages x
    ``pool * T`` global ranks (stage ``s`` is global ranks ``[s * pool * T, (s + 1) * pool * T)``), so that the
    pipeline's links, the stage sums and the world gathers of :class:`PoolRuntime` address global ranks.
    """

    def __init__(
        self,
        *,
        tensor: int,
        world_rank: int,
        hsdp_shard: int | None = None,
        sequence_parallel: bool = False,
        **kwargs: Any,
    ) -> None:
        """Args:
        tensor: The TP degree ``T``.
        sequence_parallel: Whether the blocks run sequence-parallel (the analytic cost model counts TP's
            collectives accordingly).
        hsdp_shard: Pool positions of one node under ``sharding="hsdp"`` (the mesh then splits the pool into
            ``("replicate", "shard")``, see :func:`~lightning_hydra.strategy.tensor.tensor_mesh`); ``None``: not hsdp.
        world_rank: This rank in the default process group.
        **kwargs: See :class:`~lightning_hydra.strategy.pool.PoolRuntime` (``layout``: stages x pool positions).
        """
        super().__init__(world_rank=world_rank // tensor, **kwargs)  # stage and offset in pool positions
        self.positions = self.layout
        """Stages x pool positions (what plans are made for)."""
        self.layout = PipelineLayout(stages=self.positions.stages, pool=self.positions.pool * tensor)
        self.tensor = tensor
        self.hsdp_shard = hsdp_shard
        self.sequence_parallel = sequence_parallel
        self.tensor_rank = world_rank % tensor
        self.world_rank = world_rank
        self.mesh: DeviceMesh | None = None
        """The device mesh ``("pp", "pool", "tp")`` (after :meth:`setup`)."""
        self.tensor_equal_group: dist.ProcessGroup | None = None
        """The ranks of this TP index in every stage (after :meth:`setup`): losses are summed over it."""
        self._tensor_sync: TensorGradientSync | None = None

    @property
    def heads(self) -> tuple[int | None, int | None]:
        """``(num_heads, num_kv_heads)`` of one TP rank's attention (what Ulysses splits)."""
        heads, kv_heads = super().heads
        return (None if heads is None else heads // self.tensor, None if kv_heads is None else kv_heads // self.tensor)

    @property
    def cost_model(self) -> CostModel:
        """The cost model plans use now: given, calibrated, or the module's analytic one for a TP rank."""
        if self._cost is None:
            build = self.module.cost_model  # type: ignore[union-attr]
            kwargs: dict[str, Any] = {"tensor_parallel": self.tensor}
            if "sequence_parallel" in inspect.signature(build).parameters:  # an override written before it existed
                kwargs["sequence_parallel"] = self.sequence_parallel
            self._cost = self._with_node(build(**kwargs))
        return self._cost

    @cost_model.setter
    def cost_model(self, cost: CostModel) -> None:
        PoolRuntime.cost_model.fset(self, cost)  # type: ignore[attr-defined]

    @property
    def world(self) -> int:
        """Ranks of the default process group (every stage, position and TP rank)."""
        return self.layout.world_size

    def _ranks(self, positions: tuple[int, ...], stage: int, tensor_rank: int) -> tuple[int, ...]:
        base = stage * self.positions.pool
        return tuple((base + p) * self.tensor + tensor_rank for p in positions)

    def copies(self, positions: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Global ranks of a group of positions in every stage and TP index, in one global order."""
        return [self._ranks(positions, s, t) for s in range(self.positions.stages) for t in range(self.tensor)]

    def setup(self) -> int:
        """Create the device mesh (its ``"pool"`` dimension is the gradient sum's group) and, with stages, each TP
        index's group over every stage; then, as the pool does, every TP index's copy of every aligned Ulysses
        block's communicator; a second call creates none. Returns the CP communicators created."""
        if self.mesh is None:
            self.mesh = tensor_mesh(
                self.device.type,
                stages=self.positions.stages,
                pool=self.positions.pool,
                tensor=self.tensor,
                shard=self.hsdp_shard,
            )
            self.stage_group = self.mesh["pool"].get_group()
            self.tensor_equal_group = self.stage_group
            if self.stages > 1:  # every rank creates every TP index's group (all stages), in order
                for t in range(self.tensor):
                    pg = dist.new_group(list(range(t, self.world, self.tensor)))
                    if t == self.tensor_rank:
                        self.tensor_equal_group = pg
        return super().setup()

    def step_layout(self) -> StepLayout:
        """Stages x pool positions x TP and the sharding (hsdp's nodes: :attr:`hsdp_shard` positions)."""
        mode = self.sharding.mode if self.sharding is not None else "none"
        positions = self.positions
        node = self.hsdp_shard or positions.pool
        return StepLayout(stages=positions.stages, pool=positions.pool, tensor=self.tensor, sharding=mode, node=node)

    def to_global(self, record: Group) -> Group:
        """A plan's group (pool positions) as global ranks of this stage and TP index."""
        return Group(
            self._ranks(record.ranks, self.stage, self.tensor_rank), record.ulysses, record.ring, record.seq_ids
        )

    def gradient_sync(self, module: nn.Module) -> GradientSync:
        """FSDP's reduce-scatter over the pool for a sharded model; otherwise the bucketed sum of local gradient
        shards over the pool (:class:`TensorGradientSync`; built once, rebuilt if the parameters change)."""
        if self.sharding is not None:
            return super().gradient_sync(module)
        params = [p for p in module.parameters() if p.requires_grad]
        if self._tensor_sync is None or [id(p) for p in self._tensor_sync.params] != [id(p) for p in params]:
            assert self.stage_group is not None, "TensorPoolRuntime.setup has not run"
            if self._tensor_sync is not None:
                self._tensor_sync.remove()
            self._tensor_sync = TensorGradientSync(params, self.stage_group, partial_sums=self.sequence_parallel)
        return self._tensor_sync

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a tensor over the pool of every stage (TP ranks hold the same value: each is counted once; a single
        position of a single stage, TP alone, holds the sum already)."""
        out = value.detach().clone()
        if dist.get_world_size(self.tensor_equal_group) > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.tensor_equal_group)
        return out

    def _gather_rows(self, row: np.ndarray) -> np.ndarray:
        """Every rank's row, then TP rank 0's of each position (its TP peers measured the same work)."""
        return super()._gather_rows(row)[:: self.tensor]
