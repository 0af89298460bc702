"""The runtime a :class:`~lightning_hydra.HydraModule` and the :class:`~lightning_hydra.HydraDataModule` talk to.

One typed interface, :class:`HydraRuntime`, with two implementations: :class:`LocalRuntime` here (one process, no
strategy: the whole global batch in one microbatch at degree 1) and
:class:`~lightning_hydra.strategy.pool.PoolRuntime` (the dynamic-CP pool of a :class:`~lightning_hydra.HydraStrategy`:
plans, communicators, digest checks, gradient sums, measurement gathers, calibration).

A step is data: :meth:`HydraRuntime.program` states this rank's operations in order (:mod:`lightning_hydra.schedule`:
the plan's digest check, FSDP gathers, every forward, backward and pipeline exchange, the gradient sum, the loss sum,
the measurement gather, the cost model's broadcast, the gradient norm), and
:class:`~lightning_hydra.strategy.step.StepRunner` executes it, calling back into the runtime for each: every rank's
list is built from the same rules over the same plan, so the members of every communicator issue its collectives in
the same order, which nccl and gloo require (the tests check the lists of random plans, and that real runs issue
exactly their lists).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from lightning_hydra.cp import CommClock, CPGroup
from lightning_hydra.metrics.record import StepRecord, step_row
from lightning_hydra.metrics.timing import StepTiming
from lightning_hydra.planner import BatchPlanner, CostModel, DegreeRules, Group, Plan, PlannerConfig
from lightning_hydra.planner.calibration import NUM_FEATURES, CostCalibrator
from lightning_hydra.schedule import Op, StepLayout, StepOptions, Work, rank_program
from lightning_hydra.strategy.clipping import clip_grad_norm

__all__ = [
    "GradientSync",
    "HydraRuntime",
    "LocalRuntime",
    "model_cost",
    "model_heads",
    "with_node_size",
]

log = logging.getLogger(__name__)


def model_heads(module: Any) -> tuple[int | None, int | None]:
    """``(num_heads, num_kv_heads)`` of a module with ``attention_heads()`` (``(None, None)`` otherwise)."""
    heads = getattr(module, "attention_heads", None)
    return heads() if callable(heads) else (None, None)


def with_node_size(cost: CostModel, ranks_per_node: int, pool: int) -> CostModel:
    """``cost`` with the pool's node size (``ranks_per_node``, at most the ``pool``'s ranks) where it has none: a ring
    whose group lies inside a node runs on the intra-node link (a model from an older checkpoint, or one built
    without the topology, learns it here)."""
    if cost.ranks_per_node:
        return cost
    return cost.replace(ranks_per_node=min(ranks_per_node, pool))


def model_cost(module: Any) -> CostModel:
    """The analytic cost model of a :class:`~lightning_hydra.HydraModule` (``TypeError`` for other modules)."""
    make = getattr(module, "cost_model", None)
    if not callable(make):
        raise TypeError(f"{type(module).__name__} has no cost_model(): subclass lightning_hydra.HydraModule")
    return make()


class GradientSync(Protocol):
    """How a step's gradients become the pool's sum: ``begin`` at the start of the step, ``arm`` before the last
    microbatch's backward, ``finish`` after the last microbatch."""

    def begin(self) -> None:
        """Start a step."""

    def arm(self) -> None:
        """The next backward is the step's last."""

    def finish(self) -> None:
        """Complete the sum (blocking)."""

    def collectives(self) -> tuple[tuple[str, str, int, str], ...]:
        """The collectives :meth:`finish` issues, in order, as ``(communicator kind, function, numel, dtype)``
        (see :attr:`~lightning_hydra.schedule.StepOptions.grad_calls`)."""


class _NoSync:
    """Gradient sync of one process: nothing to do."""

    def begin(self) -> None:
        """Nothing."""

    def arm(self) -> None:
        """Nothing."""

    def finish(self) -> None:
        """Nothing."""

    def collectives(self) -> tuple[tuple[str, str, int, str], ...]:
        """None."""
        return ()


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
        self.world_rank = global_rank
        """This rank in the default process group (a pool position's rank, or another under pipelines and TP)."""
        self.observer: Any = None
        """Told when a step's list begins, which operation runs and when it ends
        (:class:`~lightning_hydra.strategy.recorder.StepObserver`: a test's recorder of the real collectives);
        ``None``: nobody listens."""
        self.watchdog: Any = None
        """Reports an operation of a step that runs too long (:class:`~lightning_hydra.strategy.watchdog.Watchdog`);
        ``None``: none."""
        self.calibrate = calibrate
        self.calibrator = calibrator if calibrator is not None else CostCalibrator()
        self.module: nn.Module | None = None
        self._cost: CostModel | None = None if planner_config.cost is None else self._with_node(planner_config.cost)
        self.cost_version = 0
        """Cost-model updates so far (0: the given or analytic model). A plan records the version it used."""
        self.last_record: StepRecord | None = None
        """Every rank's measurements of the last training step (the same on every rank)."""
        self.measure_seconds = 0.0
        """Wall seconds the last step's measurement gather and calibration took (the cost of measuring)."""
        self.stage = 0
        """This rank's pipeline stage (0 without a pipeline)."""
        self.stages = 1
        """Pipeline stages of the run."""
        self.offset = 0
        """Global rank of this stage's pool position 0."""
        self.comm_clock = CommClock.for_device(device)
        """Times this rank's CP collectives (CUDA events on GPU, the host clock on CPU), read once per step."""
        self.stop_requested: threading.Event | None = None
        """Set when this process received SIGTERM (a :class:`~lightning_hydra.strategy.guard.RunGuard` hands its event
        over); the next step's check (:meth:`begin_step`) tells every rank. ``None``: nobody listens."""
        self.stop_agreed = False
        """Some rank received SIGTERM: a step's check found its flag, on every rank alike."""
        self.stop: Callable[[], None] | None = None
        """What a step does when its check found that some rank received SIGTERM, before anything else of the step
        runs and once its list has unwound (the guard's: save a checkpoint, raise ``SIGTERMException``); ``None``:
        the step runs on (a sanity check's)."""

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
            self._cost = self._with_node(model_cost(self.module))
        return self._cost

    @cost_model.setter
    def cost_model(self, cost: CostModel) -> None:
        self._cost = self._with_node(cost)
        self.cost_version += 1

    def _with_node(self, cost: CostModel) -> CostModel:
        """``cost`` with the pool's node size where it has none (:func:`with_node_size`)."""
        return with_node_size(cost, self.planner_config.ranks_per_node, self.world_size)

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
    def batch_planner(self) -> BatchPlanner:
        """What a plan depends on besides the batch and the cost model (pure and picklable: a planning thread or
        a planning process, :mod:`lightning_hydra.planner.worker`, plans with it)."""

    def plan_batch(self, lengths: np.ndarray, *, seed: int, cost: CostModel | None = None) -> Plan:
        """Plan one global batch with ``cost`` (default: the current model). Pure: callable from a planning
        thread; the same inputs give the same plan on every rank."""
        return self.batch_planner().plan(lengths, seed=seed, cost=cost or self.cost_model)

    @abstractmethod
    def check_fits(self, longest: int, split: str, global_batch_tokens: int) -> None:
        """Raise ``ValueError`` when the data cannot be planned onto the pool."""

    # ------------------------------------------------------------------ per step (main thread, every rank)
    @abstractmethod
    def begin_step(self, batch: Any) -> None:
        """The step's check (its first operation): every rank holds the same plan, no rank's planning or reading of
        the step failed (a :class:`~lightning_hydra.data.datamodule.FailedStep` on some rank: every rank raises its
        error), whether any rank received SIGTERM (:attr:`stop_agreed`); then that the plan's groups' communicators
        exist."""

    @abstractmethod
    def group(self, record: Group) -> CPGroup:
        """The communicator handle of a group of the current plan."""

    @abstractmethod
    def gradient_sync(self, module: nn.Module) -> GradientSync:
        """The gradient sum of this step for ``module``'s parameters."""

    # ------------------------------------------------------------------ the step as data
    def step_layout(self) -> StepLayout:
        """Stages x pool x TP and the sharding (one process: a pool of one)."""
        return StepLayout(pool=1)

    def gather_units(self) -> int:
        """FSDP units this rank gathers at the start of a step (sharded state); 0 for replicas."""
        return 0

    def gather_unit(self, unit: int) -> None:
        """Gather FSDP unit ``unit`` (the ``gather`` operation)."""
        raise RuntimeError("a runtime without sharded state gathers nothing")

    def step_options(self, module: nn.Module, *, train: bool, clip: bool) -> StepOptions:
        """What this rank does around its microbatches (see :class:`~lightning_hydra.schedule.StepOptions`)."""
        sync = self.gradient_sync(module) if train else None
        return StepOptions(
            train=train,
            units=self.gather_units(),
            grad_calls=sync.collectives() if sync is not None else (),  # type: ignore[arg-type]
            partial_sum=bool(getattr(sync, "partial_sums", False)),
            calibrate=self.calibrate,
            refit_fields=len(dataclasses.fields(CostModel)),
            clip=clip,
        )

    def program(self, batch: Any, module: nn.Module, *, train: bool, clip: bool = False) -> list[Op]:
        """This rank's operations in the step of ``batch`` (:func:`~lightning_hydra.schedule.rank_program`), in the
        order :class:`~lightning_hydra.strategy.step.StepRunner` runs them.

        Args:
            batch: The step's :class:`~lightning_hydra.data.packing.StepBatch` (this rank's share of the plan).
            module: The model (its gradient sync).
            train: A training step (``False``: forwards only).
            clip: The gradients are clipped by the global norm after the sum.
        """
        work = [Work(mb.group.ranks, mb.num_tokens) for mb in batch.microbatches]
        options = self.step_options(module, train=train, clip=clip)
        return rank_program(self.step_layout(), work, self.world_rank, options)

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
        return clip_grad_norm(parameters, max_norm, device=self.device, stage_sum=self.stage_sum)

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (set-up time only: pickles)."""

    @abstractmethod
    def _gather_rows(self, row: np.ndarray) -> np.ndarray:
        """The ``[N, K]`` table of every rank's measurement row."""

    def _share_cost(self, cost: CostModel) -> CostModel:
        """The refitted model every rank adopts (distributed: rank 0's)."""
        return cost

    def adopt_refit(self) -> None:
        """Refit the cost model from the calibrator's window and adopt rank 0's result on every rank.

        Every rank joins the broadcast, refitted or not: ranks refit the same gathered table, but one whose refit a
        guard skipped (BLAS may round differently on another host) must not leave the others waiting in it. The
        model (and :attr:`cost_version`) changes only where rank 0's differs from the current one.
        """
        shared = self._share_cost(self.calibrator.refit(self.cost_model))
        if shared != self.cost_model:
            self.cost_model = shared

    @property
    def timer_includes_comm(self) -> bool:
        """Whether measured busy time includes communication (CUDA events) rather than excluding it (CPU time)."""
        return self.device.type == "cuda"

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this host than CPU cores (CPU runs only): wall clocks then measure time slicing."""
        return False

    def record_step(self, batch: Any, timing: StepTiming, step: int) -> StepRecord:
        """Gather every rank's measurements of a training step (the ``measure`` operation) and, with
        ``calibrate``, add them to the calibrator's window (the refit itself is the ``refit`` operation,
        :meth:`adopt_refit`).

        Args:
            batch: The step's :class:`~lightning_hydra.data.packing.StepBatch`.
            timing: This rank's busy and communication seconds per microbatch and the step's wall seconds.
            step: The global step.

        Returns:
            The gathered :class:`StepRecord` (also kept as :attr:`last_record`).
        """
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
            # The CommClock measures the time in CP collectives on the device that runs them (CUDA events on GPU,
            # the host clock on CPU): both it and the busy time are fitted (on CUDA the busy time includes it and
            # the calibrator subtracts it). On a host with more ranks than cores the wall time in collectives is
            # mostly waiting for time-sliced peers, not transfer (measured: it doubled the calibrated model's error
            # in the 4-rank demo on 2 cores), so it is not fitted there.
            comm = None if self.oversubscribed else record.comm.ravel()
            self.calibrator.add(features, record.busy.ravel(), includes_comm=record.includes_comm, comm=comm)
        self.last_record = record
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

    def batch_planner(self) -> BatchPlanner:
        """One microbatch holding every sequence on rank 0."""
        heads, kv_heads = self.heads
        return BatchPlanner(
            config=self.planner_config, world_size=1, num_heads=heads, num_kv_heads=kv_heads, whole_batch=True
        )

    def check_fits(self, longest: int, split: str, global_batch_tokens: int) -> None:
        """Anything fits one process (memory permitting)."""

    def begin_step(self, batch: Any) -> None:
        """Nothing to agree on with one process (SIGTERM: this process's own flag)."""
        if self.stop_requested is not None and self.stop_requested.is_set():
            self.stop_agreed = True

    def group(self, record: Group) -> CPGroup:
        """The local degree-1 group."""
        return CPGroup((0,), 1, 1, clock=self.comm_clock)

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
