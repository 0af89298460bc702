"""``HydraStrategy``: load-driven dynamic context parallelism as a Lightning strategy."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from typing_extensions import override

from lightning_hydra.cp import CPContext, CPGroup, GroupCache, apply_cp, remove_cp
from lightning_hydra.metrics.record import StepGather, StepRecord, step_row
from lightning_hydra.planner import CostModel, DegreeRules, Plan, PlannerConfig, shard_tokens
from lightning_hydra.planner.calibration import NUM_FEATURES, CostCalibrator

__all__ = ["HydraStrategy", "SingleProcessPlanner", "check_digests", "check_pool"]

log = logging.getLogger(__name__)


def check_pool(world_size: int, ranks_per_node: int) -> None:
    """Raise ``ValueError`` unless the pool is whole nodes, or a part of one node that divides it."""
    if world_size >= ranks_per_node and world_size % ranks_per_node:
        raise ValueError(f"world size {world_size} is not a multiple of ranks_per_node={ranks_per_node}")
    if world_size < ranks_per_node and ranks_per_node % world_size:
        raise ValueError(
            f"a world of {world_size} ranks smaller than a node must divide ranks_per_node={ranks_per_node}"
        )


def check_digests(digest: str, world_size: int) -> None:
    """All-gather a plan digest and raise ``RuntimeError`` naming the ranks that disagree with rank 0 (no hang:
    every rank takes part and every rank raises)."""
    mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    values = [int(x.item()) for x in gathered]
    odd = [r for r, v in enumerate(values) if v != values[0]]
    if odd:
        raise RuntimeError(
            f"plan digests differ across ranks: ranks {odd} disagree with rank 0. Every rank must see the same "
            "dataset, seed, planner settings and cost model"
        )


def _model_heads(module: Any) -> tuple[int | None, int | None]:
    heads = getattr(module, "attention_heads", None)
    return heads() if callable(heads) else (None, None)


def _model_cost(module: Any) -> CostModel:
    make = getattr(module, "cost_model", None)
    if not callable(make):
        raise TypeError(f"{type(module).__name__} has no cost_model(): subclass lightning_hydra.HydraModule")
    return make()


class HydraStrategy(DDPStrategy):
    """Dynamic context parallelism for a pool of data-parallel ranks, planned per global batch.

    Every rank holds a full model replica. For every optimizer step the :class:`~lightning_hydra.HydraDataModule`
    plans the global batch (the same plan on every rank, checked by digest) into microbatches of CP groups; this
    strategy prepares the groups' communicators (collectively, once), makes each microbatch's group current for the
    model's attention, and sums the gradients over the pool once per step, so that they equal one process's
    gradients on the whole global batch. The model is not wrapped in ``DistributedDataParallel``.
    """

    strategy_name = "hydra"

    def __init__(
        self,
        policy: str = "hydra",
        max_tokens_per_rank: int = 4096,
        num_microbatches: int = 1,
        ranks_per_node: int = 8,
        ulysses_degree: int | Literal["auto"] = "auto",
        max_ring: int | None = None,
        cost: CostModel | None = None,
        kernel: str = "auto",
        calibrate: bool = False,
        calibration: CostCalibrator | None = None,
        monitor: Any = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        """Args:
        policy: ``"hydra"`` (load-driven), ``"mcore"`` (Megatron-Core Dynamic-CP) or ``"static"`` (fixed degree).
        max_tokens_per_rank: Tokens one rank may hold in one microbatch (the memory limit).
        num_microbatches: Microbatches per optimizer step (gradient accumulation).
        ranks_per_node: Ranks per node (Ulysses all-to-alls stay inside a node).
        ulysses_degree: Cap on the Ulysses degree, or ``"auto"`` (the node size, within the heads).
        max_ring: Cap on the ring degree (``None``: none).
        cost: Cost model of the planner (``None``: from the model's shape, see ``HydraModule.cost_model``).
        kernel: Attention kernel: ``"auto"``, ``"cpu"`` or ``"flash"``.
        calibrate: Refit the cost model's compute coefficients every step from the measured busy times of all
            ranks (closed loop); the next plans use them, and checkpoints carry them.
        calibration: Settings of the refit (window, ridge, guards); default ``CostCalibrator()``.
        monitor: ``True`` adds a :class:`~lightning_hydra.BubbleMonitor` unless the trainer has one, a
            ``BubbleMonitor`` instance is added as given, ``False`` adds none (measurements are still gathered).
        accelerator: See ``DDPStrategy``.
        parallel_devices: See ``DDPStrategy``.
        cluster_environment: See ``DDPStrategy``.
        checkpoint_io: See ``DDPStrategy``.
        precision_plugin: See ``DDPStrategy``.
        process_group_backend: ``"gloo"`` or ``"nccl"`` (default: by accelerator).
        timeout: Collective timeout.
        start_method: How Lightning launches the processes (``"popen"``, ``"spawn"``, ...).
        """
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        if ulysses_degree != "auto" and (not isinstance(ulysses_degree, int) or ulysses_degree < 1):
            raise ValueError(f"ulysses_degree must be a positive int or 'auto', got {ulysses_degree!r}")
        self.planner_config = PlannerConfig(
            policy=policy,
            max_tokens_per_rank=max_tokens_per_rank,
            num_microbatches=num_microbatches,
            ranks_per_node=ranks_per_node,
            max_ulysses=None if ulysses_degree == "auto" else int(ulysses_degree),
            max_ring=max_ring,
            cost=cost,
        )
        self.cp = CPContext(kernel)
        self.group_cache: GroupCache | None = None
        self._cost: CostModel | None = cost
        self._wrapped = 0
        self.calibrate = calibrate
        self.calibrator = calibration if calibration is not None else CostCalibrator()
        self.monitor = monitor
        self.last_record: StepRecord | None = None
        """Every rank's measurements of the last training step (the same on every rank)."""
        self._gathers: dict[int, StepGather] = {}
        self.measure_seconds = 0.0
        """Wall seconds the last :meth:`finish_step` took (gathering and calibration: the cost of measuring)."""

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def is_distributed(self) -> bool:
        """Always a multi-process strategy (Lightning reads this to enable ``sync_dist`` logging)."""
        return True

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "hydra" not in strategy_registry:
            strategy_registry.register("hydra", cls, description="Load-driven dynamic context parallelism (HyDra)")

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        check_pool(self.world_size, self.planner_config.ranks_per_node)
        self.group_cache = GroupCache(backend=self.process_group_backend)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # gradients are summed by reduce_gradients, once per optimizer step

    @override
    def _register_ddp_hooks(self) -> None:
        pass

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        self._wrapped = apply_cp(model, self.cp)
        heads = _model_heads(model)[0]
        if heads is not None and self.planner_config.max_ulysses and heads % self.planner_config.max_ulysses:
            raise ValueError(
                f"{heads} attention heads cannot be split over ulysses_degree={self.planner_config.max_ulysses}"
            )
        rank_zero_info(f"HydraStrategy: {self._wrapped} attention modules route through the CP engine")
        self._add_monitor(model)

    def _add_monitor(self, model: pl.LightningModule) -> None:
        from lightning_hydra.metrics.monitor import BubbleMonitor

        trainer = getattr(model, "_trainer", None)
        if trainer is None or self.monitor is False:
            return
        if any(isinstance(c, BubbleMonitor) for c in trainer.callbacks):
            return
        monitor = self.monitor if isinstance(self.monitor, BubbleMonitor) else BubbleMonitor()
        trainer.callbacks.append(monitor)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            remove_cp(module)
        super().teardown()

    # ------------------------------------------------------------------ planning
    @property
    def cost_model(self) -> CostModel:
        """The cost model the planner uses (given, or derived from the model's shape)."""
        if self._cost is None:
            self._cost = _model_cost(self.lightning_module)
        return self._cost

    @cost_model.setter
    def cost_model(self, cost: CostModel) -> None:
        self._cost = cost

    def plan_batch(self, lengths: np.ndarray, *, seed: int) -> Plan:
        """Plan one global batch (pure and deterministic: every rank gets the same plan)."""
        heads, kv_heads = _model_heads(self.lightning_module)
        return self.planner_config.schedule(
            lengths, world_size=self.world_size, cost=self.cost_model, num_heads=heads, num_kv_heads=kv_heads, seed=seed
        )

    def check_fits(self, longest: int, split: str, global_batch_tokens: int) -> None:
        """Raise ``ValueError`` when a sequence of ``longest`` tokens cannot fit the pool at any degree, or a global
        batch of ``global_batch_tokens`` cannot fit its microbatches."""
        pool = self.world_size * self.planner_config.max_tokens_per_rank * self.planner_config.num_microbatches
        if global_batch_tokens > pool:
            raise ValueError(
                f"global_batch_tokens={global_batch_tokens} exceeds what {self.planner_config.num_microbatches} "
                f"microbatches of {self.world_size} ranks x {self.planner_config.max_tokens_per_rank} tokens hold "
                f"({pool}); raise num_microbatches or max_tokens_per_rank"
            )
        heads, _ = _model_heads(self.lightning_module)
        rules = DegreeRules(
            world_size=self.world_size,
            ranks_per_node=min(self.planner_config.ranks_per_node, self.world_size),
            num_heads=heads,
            max_ulysses=self.planner_config.max_ulysses,
            max_ring=self.planner_config.max_ring,
        )
        if rules.memory_min(longest, self.planner_config.max_tokens_per_rank, fine=True) is None:
            raise ValueError(
                f"the {split} data holds a sequence of {longest} tokens, more than the pool can hold "
                f"({self.world_size} ranks x {self.planner_config.max_tokens_per_rank} tokens); raise "
                "max_tokens_per_rank, add ranks, or set HydraDataModule(max_seq_len=..., truncate=True)"
            )

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        checkpoint["hydra"] = {"cost_model": self.cost_model.to_dict(), "calibrator": self.calibrator.state_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get("hydra")
        if saved is not None and self.calibrate:
            self._cost = CostModel.from_dict(saved["cost_model"])
            self.calibrator.load_state_dict(saved["calibrator"])
            rank_zero_info("HydraStrategy: restored the calibrated cost model from the checkpoint")
        return checkpoint

    # ------------------------------------------------------------------ per step
    @property
    def timer_includes_comm(self) -> bool:
        """Whether measured busy time includes communication (CUDA events) rather than excluding it (CPU time)."""
        return self.root_device.type == "cuda"

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this host than CPU cores (CPU runs only): wall clocks then measure time slicing."""
        if self.root_device.type == "cuda":
            return False
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return self.num_processes > cores

    def finish_step(self, batch: Any, busy: list[float], comm: list[float], wall: float, step: int) -> StepRecord:
        """Gather every rank's measurements of a training step (one collective, via torchmetrics) and, with
        ``calibrate``, refit the cost model from them, identically on every rank.

        Args:
            batch: The step's :class:`~lightning_hydra.data.packing.StepBatch`.
            busy: This rank's busy seconds per microbatch.
            comm: This rank's seconds in CP collectives per microbatch.
            wall: This rank's wall seconds of the step.
            step: The global step.

        Returns:
            The gathered :class:`StepRecord` (also kept as :attr:`last_record`).
        """
        start = time.perf_counter()
        row = step_row(batch, busy, comm, wall, includes_comm=self.timer_includes_comm)
        gather = self._gathers.get(row.size)
        if gather is None:
            gather = self._gathers[row.size] = StepGather(self.world_size, row.size)
        gather.reset()
        gather.update(self.global_rank, row)
        table = gather.compute().cpu().numpy()
        record = StepRecord.from_table(
            table,
            step=step,
            num_microbatches=len(busy),
            trained_tokens=batch.trained_tokens,
            includes_comm=self.timer_includes_comm,
        )
        if self.calibrate:
            features = record.features.reshape(-1, NUM_FEATURES)
            self.calibrator.add(features, record.busy.ravel(), includes_comm=record.includes_comm)
            self._cost = self.calibrator.refit(self.cost_model)
        self.last_record = record
        self.measure_seconds = time.perf_counter() - start
        return record

    def begin_step(self, digest: str, groups: Any) -> None:
        """Check that every rank holds the same plan, then prepare its groups' communicators (collectively)."""
        check_digests(digest, self.world_size)
        assert self.group_cache is not None
        self.group_cache.prepare(_GroupRec(r, u, g) for r, u, g in groups)

    def group(self, ranks: tuple[int, ...], ulysses: int, ring: int) -> CPGroup:
        """The communicator handle of a prepared group."""
        assert self.group_cache is not None
        return self.group_cache.get(ranks, ulysses, ring)

    def reduce_gradients(self, module: nn.Module) -> None:
        """Sum every parameter's gradient over the pool (missing gradients count as zero)."""
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a tensor over the pool."""
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out


class _GroupRec:
    __slots__ = ("ranks", "ring", "ulysses")

    def __init__(self, ranks: tuple[int, ...], ulysses: int, ring: int) -> None:
        self.ranks, self.ulysses, self.ring = tuple(ranks), ulysses, ring


class SingleProcessPlanner:
    """Planning on one device (no HydraStrategy): the whole global batch in one microbatch at degree 1."""

    global_rank = 0
    world_size = 1

    def __init__(self, module: Any, global_batch_tokens: int) -> None:
        self.module = module
        self.global_batch_tokens = global_batch_tokens
        self._cost: CostModel | None = None

    @property
    def cost_model(self) -> CostModel:
        """The model's analytic cost model (built on first use)."""
        if self._cost is None:
            self._cost = _model_cost(self.module)
        return self._cost

    def plan_batch(self, lengths: np.ndarray, *, seed: int) -> Plan:
        """One microbatch holding every sequence on rank 0."""
        capacity = sum(shard_tokens(int(n), 1) for n in lengths)
        heads, kv_heads = _model_heads(self.module)
        config = PlannerConfig(policy="hydra", max_tokens_per_rank=capacity, num_microbatches=1, ranks_per_node=1)
        return config.schedule(
            lengths, world_size=1, cost=self.cost_model, num_heads=heads, num_kv_heads=kv_heads, seed=seed
        )

    def check_fits(self, longest: int, split: str, global_batch_tokens: int) -> None:
        """Anything fits one process (memory permitting)."""

    def begin_step(self, digest: str, groups: Any) -> None:
        """Nothing to agree on with one process."""

    def group(self, ranks: tuple[int, ...], ulysses: int, ring: int) -> CPGroup:
        """The local degree-1 group."""
        return CPContext.local_group()

    def reduce_gradients(self, module: nn.Module) -> None:
        """Nothing to reduce with one process."""

    def finish_step(self, batch: Any, busy: list[float], comm: list[float], wall: float, step: int) -> StepRecord:
        """This process's measurements as a one-rank :class:`StepRecord`."""
        row = step_row(batch, busy, comm, wall, includes_comm=False)
        return StepRecord.from_table(
            row[None, :],
            step=step,
            num_microbatches=len(busy),
            trained_tokens=batch.trained_tokens,
            includes_comm=False,
        )

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The value itself."""
        return value.detach()


HydraStrategy.register_strategies(StrategyRegistry)
