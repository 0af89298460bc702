"""``HydraStrategy``: load-driven dynamic context parallelism as a Lightning strategy."""

from __future__ import annotations

import logging
import shutil
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from typing_extensions import override

from lightning_hydra.console import adapt_console, quiet_known_noise
from lightning_hydra.cp import CPContext, apply_cp, remove_cp
from lightning_hydra.cp.kernels import KERNEL_NAMES
from lightning_hydra.metrics.record import StepRecord
from lightning_hydra.models.checkpointing import check_checkpointing_mode
from lightning_hydra.models.init import is_meta
from lightning_hydra.planner import POLICIES, CostModel, PlannerConfig
from lightning_hydra.planner.calibration import CostCalibrator
from lightning_hydra.planner.devices import rates_for
from lightning_hydra.planner.memory import MemoryBreakdown, parse_bytes
from lightning_hydra.schedule import save_program
from lightning_hydra.strategy.capacity import configure_cuda_allocator, device_budget, pool_memory
from lightning_hydra.strategy.checkpoint import (
    CheckpointSaver,
    check_complete,
    full_state_dict,
    is_sharded_checkpoint,
    load_full_checkpoint,
    load_sharded_checkpoint,
    new_token,
)
from lightning_hydra.strategy.checks import check_arguments, check_fits, check_heads
from lightning_hydra.strategy.guard import RunGuard
from lightning_hydra.strategy.layout import RunLayout, check_layout, check_pool, sharding_layout
from lightning_hydra.strategy.pipeline import PipelineLayout
from lightning_hydra.strategy.pool import PoolRuntime
from lightning_hydra.strategy.prelaunch import CheckedSubprocessLauncher, SpawnLauncher
from lightning_hydra.strategy.runtime import model_heads, with_node_size
from lightning_hydra.strategy.sharding import SHARDING_MODES, build_mesh, shard_model, sync_module_states
from lightning_hydra.strategy.tensor import check_tensor_parallel, parallelize, resolve_sequence_parallel
from lightning_hydra.strategy.tensor_pool import TensorPoolRuntime
from lightning_hydra.strategy.watchdog import Watchdog, collective_timeout, watchdog_limit

__all__ = ["HydraStrategy"]

log = logging.getLogger(__name__)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class HydraStrategy(ParallelStrategy):
    """Dynamic context parallelism for a pool of data-parallel ranks, planned per global batch.

    Every rank holds a full model replica. For every optimizer step the :class:`~lightning_hydra.HydraDataModule`
    plans the global batch (the same plan on every rank, checked by digest) into microbatches of CP groups; this
    strategy owns the communicators of those groups (created once, at set-up, for every aligned Ulysses block the
    pool can use), makes each microbatch's group current for the model's attention, and sums the gradients over
    the pool once per step (in buckets, overlapped with the last microbatch's backward), so that they equal one
    process's gradients on the whole global batch. The model is not wrapped in ``DistributedDataParallel``.

    The pool is the default process group: global rank ``g`` is pool position ``g``; ranks ``[k * ranks_per_node,
    (k + 1) * ranks_per_node)`` share node ``k`` (Ulysses all-to-alls stay inside a node, rings cross nodes).
    """

    strategy_name = "hydra"

    def __init__(
        self,
        policy: str = "hydra",
        max_tokens_per_rank: int | Literal["auto"] = 4096,
        num_microbatches: int = 1,
        ranks_per_node: int = 8,
        ulysses_degree: int | Literal["auto"] = "auto",
        max_ring: int | None = None,
        cost: CostModel | None = None,
        kernel: str = "auto",
        calibrate: bool | None = None,
        calibration: CostCalibrator | None = None,
        monitor: Any = True,
        sharding: str = "none",
        activation_checkpointing: str = "none",
        memory_budget: int | float | str | None = None,
        pipeline_stages: int = 1,
        tensor_parallel: int = 1,
        sequence_parallel: bool | None = None,
        async_checkpoint: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        """Configure the pool, the planner, the CP engine, sharding, memory and pipeline stages.

        Args:
            policy: ``"hydra"`` (load-driven), ``"mcore"`` (Megatron-Core Dynamic-CP) or ``"static"`` (fixed degree).
            max_tokens_per_rank: Tokens one rank may hold in one microbatch (the memory limit), or ``"auto"``: what the
                memory model (:mod:`lightning_hydra.planner.memory`) leaves of ``memory_budget`` (default: the device's
                memory) after model state, communicators and a margin, divided by activation bytes per token; the
                breakdown is printed at set-up. An explicit number always wins.
            num_microbatches: Microbatches per optimizer step (gradient accumulation).
            ranks_per_node: Ranks per node (Ulysses all-to-alls stay inside a node).
            ulysses_degree: Cap on the Ulysses degree, or ``"auto"`` (the node size, within the heads).
            max_ring: Cap on the ring degree (``None``: none).
            cost: Cost model of the planner (``None``: from the model's shape, see ``HydraModule.cost_model``).
            kernel: Attention kernel (one of :data:`lightning_hydra.cp.kernels.KERNEL_NAMES`; ``"auto"`` picks by
                device and what is installed).
            calibrate: Refit the cost model every step from the measured busy times of all ranks (closed loop); the
                next plans use it, and checkpoints carry it. ``None``: on for CUDA devices (the analytic model's
                device rates are datasheet figures and assumptions), off on CPU.
            calibration: Settings of the refit (window, ridge, guards); default ``CostCalibrator()``.
            monitor: ``True`` adds a :class:`~lightning_hydra.BubbleMonitor` unless the trainer has one, a
                ``BubbleMonitor`` instance is added as given, ``False`` adds none (measurements are still gathered).
            sharding: ``"none"`` (a replica per rank), ``"zero2"``, ``"zero3"`` or ``"hsdp"``: FSDP2 over the pool
                (see :mod:`lightning_hydra.strategy.sharding`). Under ``precision="bf16-mixed"`` FSDP computes in bf16
                from float32 master weights and reduces gradients in float32.
            activation_checkpointing: ``"none"`` or ``"selective"``: recompute norms and MLPs in backward, never the
                CP attention (see :mod:`lightning_hydra.models.checkpointing`).
            memory_budget: Bytes per rank for ``max_tokens_per_rank="auto"`` (a number or a string such as
                ``"80GB"``); default the device's memory (CUDA) or the host's memory shared by its ranks (CPU).
            pipeline_stages: Pipeline stages ``P``: the world is ``P`` stages x a pool of ``world / P`` ranks (stage
                ``s`` = global ranks ``[s * pool, (s + 1) * pool)``), every stage plans the same global batch onto its
                pool and runs our 1F1B schedule; see :mod:`lightning_hydra.strategy.pipeline`. The model must split
                (``pipeline_stage``/``stage_forward``: DecoderLM and Llama-family HFCausalLM do).
            tensor_parallel: TP degree ``T`` (``T`` consecutive ranks inside a node split every block by torch's
                ``parallelize_module``; plans are made for the ``world / T`` pool positions and the CP groups formed
                per TP rank); see :mod:`lightning_hydra.strategy.tensor`. The reference decoder and Llama-family
                HFCausalLM, with any ``sharding``: ``"zero2"`` or ``"zero3"`` (FSDP2 over the mesh's ``"pool"``
                dimension, as torchtitan composes them), ``"hsdp"`` (FSDP2 over the pool split into ``("replicate",
                "shard")``: a node's pool positions shard, nodes replicate), and any ``pipeline_stages`` (a stage's
                blocks are split after the stage split).
            sequence_parallel: Under TP, shard the residual stream between blocks and the norms by tokens over the
                TP group (torch's ``SequenceParallel``: norm activations and block inputs are ``1 / T`` per rank; a
                norm's output is all-gathered before the projections, o and down reduce-scatter instead of
                all-reducing; norm weight gradients are summed over the group). ``None``: on when
                ``tensor_parallel > 1`` for blocks it can split, off (with a message) for a Hugging Face layer with
                norms besides its two pre-norms (Gemma's sandwich norms); ``True`` refuses such a layer before
                launch; ignored at ``tensor_parallel=1``.
            async_checkpoint: Write checkpoints in the background: a save blocks the step only while the state is
                copied to host memory, the write overlaps the next steps, a second save waits for the first, and the
                end of ``fit`` and SIGTERM wait for the write (see
                :class:`~lightning_hydra.strategy.checkpoint.CheckpointSaver`). Lightning's ``AsyncCheckpointIO``
                plugin as ``checkpoint_io`` turns it on too. Every save, either way, is atomic: the checkpoint's name
                is published once all of it is written.
            accelerator: The accelerator (set by the Trainer).
            parallel_devices: Devices of this node's ranks (set by the Trainer).
            cluster_environment: Where ranks, world size and the main address come from (set by the Trainer).
            checkpoint_io: How checkpoints are written.
            precision_plugin: The precision plugin (set by the Trainer).
            process_group_backend: ``"gloo"`` or ``"nccl"`` (default: by accelerator).
            timeout: Collective timeout (default: ``LIGHTNING_HYDRA_COLLECTIVE_TIMEOUT`` seconds where set, else
                torch's 30 minutes). An operation of a step that runs half as long is reported, on every rank that
                waits in it, with its communicators (:mod:`lightning_hydra.strategy.watchdog`).
            start_method: How Lightning launches the processes (``"popen"``, ``"spawn"``, ``"fork"``,
                ``"forkserver"``; a ``forkserver`` rank gets the launching process's environment, global state and a
                copy of the model of its own, as a ``spawn`` rank does).

        Raises:
            ValueError: An unknown name or an out-of-range number, with what is allowed.
        """
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        if kernel not in KERNEL_NAMES:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {list(KERNEL_NAMES)}")
        if ulysses_degree != "auto":
            _positive_int("ulysses_degree (or 'auto')", ulysses_degree)
        if max_ring is not None:
            _positive_int("max_ring", max_ring)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be popen, spawn, fork or forkserver, got {start_method!r}")
        check_arguments(cost=cost, calibrate=calibrate, calibration=calibration, monitor=monitor, timeout=timeout)
        quiet_known_noise()
        if sharding not in SHARDING_MODES:
            raise ValueError(f"unknown sharding {sharding!r}; choose one of {list(SHARDING_MODES)}")
        check_checkpointing_mode(activation_checkpointing)
        self.auto_capacity = max_tokens_per_rank == "auto"
        """Whether ``max_tokens_per_rank`` is resolved from the memory model at set-up."""
        if not self.auto_capacity:
            _positive_int("max_tokens_per_rank (or 'auto')", max_tokens_per_rank)
        self.pipeline_stages = _positive_int("pipeline_stages", pipeline_stages)
        self.tensor_parallel = _positive_int("tensor_parallel", tensor_parallel)
        check_tensor_parallel(self.tensor_parallel, world=None, ranks_per_node=ranks_per_node)
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be True, False or None, got {sequence_parallel!r}")
        self._sequence_parallel_asked = sequence_parallel
        if sequence_parallel and self.tensor_parallel == 1:
            rank_zero_info(
                "HydraStrategy: sequence_parallel=True is ignored at tensor_parallel=1 (it splits tokens over a TP "
                "group; set tensor_parallel > 1 to use it)"
            )
        self.sequence_parallel = self.tensor_parallel > 1 and sequence_parallel is not False
        """Whether the TP blocks run sequence-parallel norms (``sequence_parallel`` resolved against ``T``, and against
        the model's blocks by :meth:`resolve_sequence_parallel`)."""
        self.layout: PipelineLayout | None = None
        """Stages x pool (after set-up)."""
        self.sharding = sharding
        self.activation_checkpointing = activation_checkpointing
        self.memory_budget = parse_bytes(memory_budget) if memory_budget is not None else None
        self.memory: MemoryBreakdown | None = None
        """The memory model's breakdown behind an ``"auto"`` capacity (after set-up)."""
        self.planner_config = PlannerConfig(
            policy=policy,
            max_tokens_per_rank=1 if self.auto_capacity else int(max_tokens_per_rank),
            num_microbatches=_positive_int("num_microbatches", num_microbatches),
            ranks_per_node=_positive_int("ranks_per_node", ranks_per_node) // self.tensor_parallel,
            max_ulysses=None if ulysses_degree == "auto" else int(ulysses_degree),
            max_ring=max_ring,
            cost=cost,
            pipeline_stages=self.pipeline_stages,
        )
        self.cp = CPContext(kernel)
        self._calibrate_asked = calibrate
        self.calibrator = calibration if calibration is not None else CostCalibrator()
        self.monitor = monitor
        self.runtime: PoolRuntime | None = None
        """The pool's runtime (plans, communicators, gradient sums, measurements); built at the first set-up."""
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = collective_timeout(timeout) if timeout is default_pg_timeout else timeout
        self._start_method = start_method
        self._wrapped = 0
        self._staged = False
        self._parallelized = False
        self._restored_cost: CostModel | None = None
        if not isinstance(async_checkpoint, bool):
            raise ValueError(f"async_checkpoint must be True or False, got {async_checkpoint!r}")
        self.checkpoints = CheckpointSaver(asynchronous=async_checkpoint)
        """How checkpoints are written (atomically; in the background with ``async_checkpoint``)."""
        self.startup_memory: dict[str, int | None] | None = None
        """This rank's memory around the materialisation of a model built on the meta device: ``before`` and
        ``peak`` (bytes: CUDA's allocator, or the process's resident set on CPU) and ``share`` (its parameter
        shards' bytes); ``None`` for a model built on a real device."""

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def calibrate(self) -> bool:
        """Whether the cost model is refitted every step: as asked, or (``calibrate=None``) on CUDA devices."""
        if self._calibrate_asked is not None:
            return self._calibrate_asked
        return self.parallel_devices is not None and self.root_device.type == "cuda"

    @property
    def run_layout(self) -> RunLayout:
        """Devices = pool (DP x CP) x TP x PP, as Megatron and torchtitan users write it (the devices are known once
        the Trainer has connected them)."""
        return RunLayout(
            self.world_size,
            self.tensor_parallel,
            self.pipeline_stages,
            self.planner_config.ranks_per_node * self.tensor_parallel,
        )

    @property
    def is_distributed(self) -> bool:
        """Always a multi-process strategy (Lightning reads this to enable ``sync_dist`` logging)."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Nodes of the run (set by the Trainer's ``num_nodes``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Ranks on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        """The backend of the default process group."""
        return self._process_group_backend

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "hydra" not in strategy_registry:
            strategy_registry.register("hydra", cls, description="Load-driven dynamic context parallelism (HyDra)")

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":  # Lightning's launchers, with the pre-launch checks first
            self._launcher = CheckedSubprocessLauncher(
                self, self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = SpawnLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        """Global rank and world size from the node rank, the local rank and the node's devices."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        quiet_known_noise()  # in every rank (spawned ranks do not inherit warning filters)
        configure_cuda_allocator(self.root_device)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        kwargs["device_id"] = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        tensor = self.tensor_parallel
        check_layout(
            self.world_size,
            tensor=tensor,
            stages=self.pipeline_stages,
            ranks_per_node=self.planner_config.ranks_per_node * tensor,
        )
        self.layout = PipelineLayout.of_world(self.world_size // tensor, self.pipeline_stages)
        check_pool(self.layout.pool, self.planner_config.ranks_per_node)
        self._setup_runtime()
        self._setup_checkpoints()

    def _setup_checkpoints(self) -> None:
        """The checkpoint saver's communicator and stager (asynchronous saves; collective)."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        if isinstance(self._checkpoint_io, AsyncCheckpointIO):  # Lightning's plugin: our own asynchronous saves
            self.checkpoints.asynchronous = True
            # and not its thread: what else this rank writes through the plugin (the spawn launcher's weights file
            # for the launching process) is written before the rank returns, and no thread outlives the run
            self._checkpoint_io = TorchCheckpointIO()
        if self.checkpoints.setup(self.root_device):
            rank_zero_info(
                "HydraStrategy: asynchronous checkpoints (staged to host memory, written in the background on a "
                "gloo communicator of their own)"
            )

    def resolve_sequence_parallel(self, module: pl.LightningModule) -> bool:
        """Resolve :attr:`sequence_parallel` against ``module``'s blocks (before launch and at set-up, before the
        runtime's cost model and the memory model read it): ``sequence_parallel=None`` turns it off, with a message,
        for blocks it cannot split (Gemma's sandwich norms); ``True`` raises a one-line ``ConfigError`` for them.

        Args:
            module: The model to train (its ``transformer_blocks()``).
        """
        blocks = getattr(module, "transformer_blocks", None)
        asked, tensor = self._sequence_parallel_asked, self.tensor_parallel
        if not callable(blocks) or tensor == 1 or asked is False:
            return self.sequence_parallel
        self.sequence_parallel = resolve_sequence_parallel(asked, tensor, blocks())  # from the setting, every time
        if not self.sequence_parallel:
            rank_zero_info(
                f"HydraStrategy: sequence parallelism off: {type(module).__name__}'s blocks have norms other than "
                "the two pre-norms (tensor parallelism without it)"
            )
        return self.sequence_parallel

    def _setup_runtime(self) -> None:
        if self.runtime is None or self.runtime.closed:
            assert self.layout is not None
            if self.lightning_module is not None:
                self.resolve_sequence_parallel(self.lightning_module)
            tensor = self.tensor_parallel
            kwargs: dict[str, Any] = (
                {"tensor": tensor, "sequence_parallel": self.sequence_parallel} if tensor > 1 else {}
            )
            if tensor > 1 and self.sharding == "hsdp":  # a node's pool positions shard, nodes replicate
                kwargs["hsdp_shard"] = min(self.planner_config.ranks_per_node, self.layout.pool)
            self.runtime = (TensorPoolRuntime if tensor > 1 else PoolRuntime)(
                planner_config=self.planner_config,
                device=self.root_device,
                global_rank=self.layout.position(self.global_rank // tensor),
                world_size=self.layout.pool,
                layout=self.layout,
                world_rank=self.global_rank,
                calibrate=self.calibrate,
                calibrator=self.calibrator,
                backend=self._process_group_backend,
                local_world_size=self.num_processes,
                replicas=self.sharding == "none",
                **kwargs,
            )
        limit = watchdog_limit(self._timeout)
        if limit is not None and self.runtime.watchdog is None:
            self.runtime.watchdog = Watchdog(self.global_rank, limit)
        if self._restored_cost is not None:
            self.runtime.cost_model = self._restored_cost
            self._restored_cost = None
        assert self.lightning_module is not None
        self.runtime.bind(self.lightning_module)
        self._say_cost_defaults(self.lightning_module)
        made = self.runtime.setup()
        cache = self.runtime.cache
        if made:
            own = ", ".join(name for name, held in self.runtime.step_communicators.items() if held) or "none"
            rank_zero_info(
                f"HydraStrategy: created {made} CP communicators ({len(cache.member_of(self.global_rank))} on rank "
                f"{self.global_rank}) in {cache.setup_seconds:.2f} s, and the step's own ({own})"
            )
        if self.auto_capacity:
            self._resolve_capacity(len(cache.member_of(self.global_rank)))

    def _say_cost_defaults(self, module: pl.LightningModule) -> None:
        """Say, once, which of the cost model's values come from the device (``flops_per_second=None``, no
        ``cost``) and whether calibration refits them."""
        if self.planner_config.cost is not None or not hasattr(module, "flops_per_second"):
            return
        device = self.root_device
        rates = rates_for(device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else "")
        rate = module.flops_per_second or rates.flops_per_second
        origin = "given" if module.flops_per_second else f"{rates.name}'s, derived"
        links = f"{rates.intra_node_bandwidth / 1e9:g} / {rates.inter_node_bandwidth / 1e9:g} GB/s"
        rank_zero_info(
            f"HydraStrategy: cost model at {rate / 1e12:.3g} TFLOP/s ({origin}), links {links} inside / across nodes "
            f"({rates.name}'s); calibration " + ("on" if self.calibrate else "off")
        )

    def memory_breakdown(self, ulysses_blocks: int = 3) -> MemoryBreakdown:
        """The memory model of this strategy's pool, model, precision, sharding and checkpointing (pure)."""
        return pool_memory(
            self.lightning_module,
            device=self.root_device,
            budget=device_budget(self.root_device, memory_budget=self.memory_budget, local_ranks=self.num_processes),
            precision=str(getattr(self.precision_plugin, "precision", "32-true")),
            sharding=self.sharding,
            checkpointing=self.activation_checkpointing,
            pool=self.world_size // (self.pipeline_stages * self.tensor_parallel),
            ranks_per_node=self.planner_config.ranks_per_node,
            num_microbatches=self.planner_config.num_microbatches,
            pipeline_stages=self.pipeline_stages,
            ulysses_blocks=ulysses_blocks,
            tensor_parallel=self.tensor_parallel,
            sequence_parallel=self.sequence_parallel,
        )

    def _resolve_capacity(self, ulysses_blocks: int) -> None:
        self.memory = self.memory_breakdown(ulysses_blocks)
        rank_zero_info(
            "HydraStrategy: max_tokens_per_rank='auto' from the memory model\n  " + "\n  ".join(self.memory.lines())
        )
        if self.memory.capacity < 1:
            raise ValueError(
                f"the model state does not fit: {self.memory.available / 2**30:.1f} GiB left for activations out of "
                f"{self.memory.budget / 2**30:.1f} GiB with sharding={self.sharding!r}; shard the state "
                "(sharding='zero2', 'zero3' or 'hsdp'), add ranks, or raise memory_budget"
            )
        self.planner_config.max_tokens_per_rank = self.memory.capacity

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        deferred = is_meta(self.model)  # built on the meta device: laid out first, then allocated shard by shard
        self.model = self.precision_plugin.convert_module(self.model)
        if not deferred:
            self.model_to_device()
            sync_module_states(self.model, self.root_device)
        if self.pipeline_stages > 1 and self.runtime is not None and not self._staged:
            split = getattr(self.model, "pipeline_stage", None)
            if not callable(split):
                raise TypeError(f"{type(self.model).__name__} cannot be split into stages: subclass HydraModule")
            split(self.runtime.stage, self.pipeline_stages)
            self._staged = True
            rank_zero_info(
                f"HydraStrategy: {self.pipeline_stages} pipeline stages, each a pool of {self.runtime.world_size} "
                f"{'positions' if self.tensor_parallel > 1 else 'ranks'} ({self.run_layout.describe()})"
            )
        if isinstance(self.runtime, TensorPoolRuntime) and not self._parallelized:
            assert self.runtime.mesh is not None
            blocks = parallelize(self.model, self.runtime.mesh["tp"], sequence_parallel=self.sequence_parallel)
            self._parallelized = True  # the model is split once, whatever fits follow
            rank_zero_info(
                f"HydraStrategy: tensor parallelism {self.tensor_parallel} over {blocks} blocks "
                f"({self.run_layout.describe()})" + (", sequence-parallel norms" if self.sequence_parallel else "")
            )
        self._setup_memory(self.model)
        if deferred:
            self._materialize(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _materialize(self, model: nn.Module) -> None:
        """Allocate a model built on the meta device, laid out already (stage, TP, FSDP2), on this rank's device and
        fill its shards (:meth:`HydraModule.materialize <lightning_hydra.HydraModule.materialize>`: a random
        initialisation equal to one process's, or pretrained weights read slice by slice); no rank holds the whole
        model and nothing is broadcast. Says each rank's peak memory during it (the largest, over the ranks)."""
        from lightning_hydra.models.init import peak_memory, reset_peak_memory
        from lightning_hydra.strategy.sharding import state_bytes

        materialize = getattr(model, "materialize", None)
        if not callable(materialize):
            raise TypeError(
                f"{type(model).__name__} is on the meta device and has no materialize(): subclass HydraModule"
            )
        device = self.root_device
        reset_peak_memory(device)
        before = peak_memory(device) or 0
        materialize(device)
        after = peak_memory(device)
        share = state_bytes(model)["params"]
        self.startup_memory = {"before": before, "peak": after, "share": share}
        figures = torch.tensor([(after or 0) - before, share], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        kind = "device memory" if device.type == "cuda" else "resident host memory"
        rank_zero_info(
            f"HydraStrategy: materialised each rank's shards on its device (meta-device build, no broadcast): peak "
            f"{kind} rose by at most {float(figures[0]) / 2**20:,.1f} MiB on a rank, whose parameter shards take "
            f"at most {float(figures[1]) / 2**20:,.1f} MiB"
        )

    def _setup_memory(self, model: nn.Module) -> None:
        """Selective activation checkpointing, then FSDP2 sharding over the pool (sharding needs the replicas
        identical, which they are after :func:`sync_module_states`)."""
        if self.activation_checkpointing != "none":
            toggle = getattr(model, "set_activation_checkpointing", None)
            if not callable(toggle):
                raise TypeError(f"{type(model).__name__} cannot checkpoint activations: subclass HydraModule")
            units = toggle(self.activation_checkpointing)
            rank_zero_info(f"HydraStrategy: selective activation checkpointing in {units} places")
        if self.sharding == "none":
            return
        assert self.runtime is not None
        if self.runtime.sharding is not None:
            return  # a second fit of the same strategy: the model is sharded already
        assert self.layout is not None
        if isinstance(self.runtime, TensorPoolRuntime):  # FSDP2 over the pool dimension(s) of the TP mesh
            assert self.runtime.mesh is not None
            mesh = self.runtime.mesh["replicate", "shard"] if self.sharding == "hsdp" else self.runtime.mesh["pool"]
        else:
            mesh = build_mesh(
                self.sharding,
                self.layout.pool,
                min(self.planner_config.ranks_per_node, self.layout.pool),
                self.root_device.type,
                stages=self.layout.stages,
            )
        mixed = str(getattr(self.precision_plugin, "precision", "")) == "bf16-mixed"
        self.runtime.sharding = shard_model(model, self.sharding, mesh, mixed_precision=mixed)
        rank_zero_info(
            f"HydraStrategy: {self.sharding} {sharding_layout(self.sharding, mesh, self.run_layout)}, "
            f"{len(self.runtime.sharding.modules)} sharded modules"
            + (", bf16 compute from float32 master weights" if mixed else "")
        )

    @property
    def is_sharded(self) -> bool:
        """Whether a rank holds only part of the training state (sharding, or pipeline stages): checkpoints are
        then ``torch.distributed.checkpoint`` directories."""
        return self.sharding != "none" or self.pipeline_stages > 1 or self.tensor_parallel > 1

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self.is_sharded  # a sharded checkpoint loads into the sharded model and optimizer

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self.is_sharded

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self.is_sharded:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self.is_sharded:
            super().load_optimizer_state_dict(checkpoint)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.is_sharded:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self.is_sharded:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None
        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

    def full_state_dict(self) -> dict[str, Any]:
        """The model's full (unsharded, CPU) state dict on world rank 0 (collective when sharded or staged; see
        :func:`~lightning_hydra.strategy.checkpoint.full_state_dict`)."""
        assert self.model is not None
        runtime = self.runtime
        staged = runtime is not None and runtime.stages > 1
        roots = tuple(runtime.layout.stage_ranks(s)[0] for s in range(runtime.stages)) if staged else (0,)
        sharded = self.sharding != "none" or self.tensor_parallel > 1  # DTensors, gathered to full tensors
        return full_state_dict(self.model, sharded=sharded, staged=staged, device=self.root_device, stage_roots=roots)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        self._wrapped = apply_cp(model, self.cp)
        heads = model_heads(model)[0]
        check_heads(None if heads is None else heads // self.tensor_parallel, self.planner_config.max_ulysses)
        rank_zero_info(f"HydraStrategy: {self._wrapped} attention modules route through the CP engine")
        self._add_monitor(model)
        trainer = getattr(model, "_trainer", None)
        adapt_console(trainer)  # Lightning's progress bar and summary without v_num, "Epoch 0/-2", "FLOPs 0"
        if trainer is not None and not any(isinstance(c, RunGuard) for c in trainer.callbacks):
            trainer.callbacks.append(RunGuard())  # SIGTERM: checkpoint and stop together; no empty run folders

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
        try:
            self.checkpoints.close()  # the end of a run waits for an asynchronous write to be published
        finally:
            self._teardown_rest()

    def _teardown_rest(self) -> None:
        module = self.lightning_module
        if module is not None:
            remove_cp(module)
            # Lightning skips the DataModule's teardown where a fit fails; its planning process stops here too
            close = getattr(getattr(getattr(module, "_trainer", None), "datamodule", None), "close_planning", None)
            if callable(close):
                close()
        if self.runtime is not None:
            cache = self.runtime.cache
            log.debug("HydraStrategy teardown: %d CP communicators held, %d created", len(cache), cache.created)
            if self.runtime.watchdog is not None:
                self.runtime.watchdog.stop()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    def destroy_groups(self) -> int:
        """Destroy the CP communicators now (every rank; the default process group must still exist). The next
        set-up creates them again. Returns how many were destroyed."""
        return self.runtime.close() if self.runtime is not None else 0

    def check_fits(self, longest: int, split: str, global_batch_tokens: int) -> None:
        """Raise ``ValueError`` when the data cannot be planned onto this strategy's pool (no process group needed;
        see :func:`lightning_hydra.strategy.checks.check_fits`). With ``max_tokens_per_rank="auto"`` the capacity
        is known only after set-up, and the check waits for it."""
        if self.auto_capacity and self.memory is None:
            return
        heads = model_heads(self.lightning_module)[0]
        check_fits(
            self.planner_config,
            max(self.world_size // (self.pipeline_stages * self.tensor_parallel), 1),  # the pool: one stage's
            None if heads is None else heads // self.tensor_parallel,
            longest=longest,
            split=split,
            global_batch_tokens=global_batch_tokens,
            tensor=self.tensor_parallel,
        )

    # ------------------------------------------------------------------ what the monitor and users read
    @property
    def cost_model(self) -> CostModel:
        """The cost model plans use now (given, analytic from the model's shape, or calibrated). Before setup, a model
        without a node size gets the one the pool will give it (the runtime's), so that it predicts what plans will
        use: a ring inside a node runs on the intra-node link."""
        if self.runtime is not None:
            return self.runtime.cost_model
        cost = self.planner_config.cost
        if cost is None:
            from lightning_hydra.strategy.runtime import model_cost

            cost = model_cost(self.lightning_module)
        pool = max(self.world_size // (self.pipeline_stages * self.tensor_parallel), 1)
        return with_node_size(cost, self.planner_config.ranks_per_node, pool)

    @property
    def last_record(self) -> StepRecord | None:
        """Every rank's measurements of the last training step (the same on every rank)."""
        return self.runtime.last_record if self.runtime is not None else None

    @property
    def measure_seconds(self) -> float:
        """Wall seconds the last step spent gathering measurements and calibrating."""
        return self.runtime.measure_seconds if self.runtime is not None else 0.0

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this host than CPU cores (CPU runs only)."""
        return self.runtime.oversubscribed if self.runtime is not None else False

    # ------------------------------------------------------------------ checkpoints
    def _atomic(self, filepath: Any) -> bool:
        """Whether this strategy writes the checkpoint itself (atomically): a local path, and no checkpoint IO plugin
        of the user's besides Lightning's default and its ``AsyncCheckpointIO``."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        io = self._checkpoint_io
        own = io is None or type(io) is TorchCheckpointIO or isinstance(io, AsyncCheckpointIO)
        return own and _is_local_file_protocol(filepath)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a checkpoint: a replica pool's single file (rank 0) or a sharded directory (every rank), in either
        case under a hidden name first and published by one rename once complete
        (:mod:`~lightning_hydra.strategy.checkpoint`); in the background with ``async_checkpoint``."""
        checkpoint["hydra"] = {"cost_model": self.cost_model.to_dict(), "calibrator": self.calibrator.state_dict()}
        if not self.is_sharded:
            if not self._atomic(filepath):
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
                return
            if storage_options is not None:
                raise TypeError("HydraStrategy writes checkpoints itself: storage_options is not supported")
            self.checkpoints.save_full(checkpoint, Path(filepath), token=new_token(), rank=self.global_rank)
            return
        if storage_options is not None:
            raise TypeError("HydraStrategy writes sharded checkpoints itself: storage_options is not supported")
        observer = self.runtime.observer if self.runtime is not None else None
        with observer.running(save_program(self.runtime.step_layout())) if observer is not None else nullcontext():
            path, token = self.broadcast((str(filepath), new_token()))  # rank 0's: one save, one hidden name
            self.checkpoints.save_sharded(checkpoint, Path(path), token=token, rank=self.global_rank)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save is written and published (a no-op otherwise)."""
        self.checkpoints.wait()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self._atomic(filepath):  # the name, and the hidden directory it links to; after a pending write
            self.checkpoints.remove(Path(filepath), rank=self.global_rank)
        elif self.is_global_zero and is_sharded_checkpoint(filepath):
            shutil.rmtree(filepath)
        elif not self.is_sharded:
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.checkpoints.wait()
        if self.is_sharded:
            path = self.broadcast(checkpoint_path)
            assert self.model is not None
            checkpoint = load_sharded_checkpoint(path, self.model, list(self.optimizers))
        elif is_sharded_checkpoint(checkpoint_path):  # a sharded or TP pool's directory into a replica pool
            checkpoint = load_full_checkpoint(checkpoint_path)
        else:
            check_complete(checkpoint_path)
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get("hydra")
        if saved is not None and self.calibrate:
            cost = CostModel.from_dict(saved["cost_model"])
            if self.runtime is not None:
                self.runtime.cost_model = cost
            else:
                self._restored_cost = cost
            self.calibrator.load_state_dict(saved["calibrator"])
            rank_zero_info("HydraStrategy: restored the calibrated cost model from the checkpoint")
        return checkpoint


HydraStrategy.register_strategies(StrategyRegistry)
