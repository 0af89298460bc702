"""Checks run once, in the launching process, before any rank starts.

Lightning's launchers start the ranks inside ``trainer.fit``; the strategy, the model and the data module already
exist in the launching process then. :func:`preflight` checks there what needs no process group: the pool's shape
(each pipeline stage's pool) against the node size, the attention heads against the Ulysses cap, ``pad_id``
against the model's vocabulary, and, for data whose lengths are known without reading it (given lengths,
``dataset.lengths()``, the embedded corpus), ``max_seq_len``, the longest sequence and the global batch against the
pool (unless ``max_tokens_per_rank="auto"``, resolved at set-up). A bad setting is then one error in one process,
before any rank has started or any log directory is created.

The launchers below are Lightning's own, running :func:`preflight` first. Where processes are created outside
(``torchrun``, SLURM), every rank runs the same checks on the same input and raises the same
:class:`~lightning_hydra.errors.ConfigError`, which the ``lightning-hydra`` command prints once.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing,
    _GlobalStateSnapshot,
    _WorkerOutput,
)
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_hydra._environ import LaunchEnvironment
from lightning_hydra.data.datamodule import HydraDataModule, model_vocab_size
from lightning_hydra.errors import RankDiedError
from lightning_hydra.strategy.checks import check_heads
from lightning_hydra.strategy.exits import LAUNCHER_PID_ENV, LauncherWatch, RankWatch, exit_reason
from lightning_hydra.strategy.layout import check_layout
from lightning_hydra.strategy.runtime import model_heads
from lightning_hydra.strategy.sizing import check_sizing
from lightning_hydra.strategy.tensor import check_tensor_block, check_tensor_parallel, known_blocks

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy as HydraStrategy  # the HydraStrategy that launches
    # (named by its base class: its module imports this one)

__all__ = [
    "DEATH_WAIT_S",
    "EXIT_SETTLE_S",
    "CheckedMultiProcessingLauncher",
    "CheckedSubprocessLauncher",
    "SpawnLauncher",
    "preflight",
]

DEATH_WAIT_S = 3.0
"""Seconds the launching process, failing, waits for a rank's exit status that would explain its failure."""

EXIT_SETTLE_S = 0.05
"""Seconds a worker that returned normally waits, the GIL released, after destroying its process groups and before
its interpreter finalises (see :meth:`CheckedMultiProcessingLauncher._wrapping_function`)."""

log = logging.getLogger(__name__)


def preflight(
    strategy: HydraStrategy,
    model: pl.LightningModule | None,
    datamodule: pl.LightningDataModule | None,
    stage: TrainerFn | str | None = TrainerFn.FITTING,
) -> None:
    """Check the run before launch; raise :class:`~lightning_hydra.errors.ConfigError` (or ``ValueError``) with
    what to change.

    Args:
        strategy: The strategy (its planner settings, nodes and devices).
        model: The module to train (``None``: model checks skipped).
        datamodule: The data module (checked when it is a :class:`~lightning_hydra.HydraDataModule`).
        stage: ``"fit"`` checks the training split and, if any, the validation split; ``"validate"`` only the
            latter; other stages check the pool and the model only.
    """
    config = strategy.planner_config
    world = max(1, strategy.num_nodes) * max(1, strategy.num_processes)
    tensor = getattr(strategy, "tensor_parallel", 1)
    stages = getattr(strategy, "pipeline_stages", 1)
    # devices = stages x pool x TP: with TP the pool counts one position per TP group, and each stage's pool plans
    # the batch
    layout = check_layout(world, tensor=tensor, stages=stages, ranks_per_node=config.ranks_per_node * tensor)
    pool = layout.pool
    check_tensor(strategy, model, world)
    heads = model_heads(model)[0] if model is not None else None
    heads = heads // tensor if heads is not None else None  # what Ulysses splits
    check_heads(heads, config.max_ulysses)
    if not isinstance(datamodule, HydraDataModule):
        return
    datamodule.check_vocabulary(model_vocab_size(model) if model is not None else None)
    splits = {"fit": ("train", "validation"), "validate": ("validation",)}.get(str(getattr(stage, "value", stage)), ())
    if not splits:
        return
    longest = {
        split: datamodule.check_longest(split, lengths)
        for split, lengths in datamodule.lengths_before_setup().items()
        if split in splits
    }
    if longest and not getattr(strategy, "auto_capacity", False):  # "auto" is resolved at set-up, checked there
        check_sizing(
            config,
            pool,
            heads,
            longest=longest,
            global_batch_tokens=datamodule.global_batch_tokens,
            stages=stages,
            tensor=tensor,
        )


def check_tensor(strategy: HydraStrategy, model: pl.LightningModule | None, world: int) -> int:
    """Check ``tensor_parallel`` against the node, the world and the model's heads, and resolve sequence parallelism
    against the model's blocks (one-line :class:`~lightning_hydra.errors.ConfigError`, see
    :func:`~lightning_hydra.strategy.tensor.check_tensor_parallel` and
    :func:`~lightning_hydra.strategy.tensor.resolve_sequence_parallel`); returns the TP degree."""
    tensor = getattr(strategy, "tensor_parallel", 1)
    heads, kv_heads = model_heads(model) if model is not None else (None, None)
    config = strategy.planner_config
    check_tensor_parallel(
        tensor,
        world=world,
        ranks_per_node=config.ranks_per_node * tensor,
        heads=heads,
        kv_heads=kv_heads,
        max_ulysses=config.max_ulysses,
    )
    blocks = getattr(model, "transformer_blocks", None)
    if tensor > 1 and callable(blocks):
        for block in known_blocks(blocks()):  # set-up names a block TP does not know
            check_tensor_block(block, tensor)
    resolve = getattr(strategy, "resolve_sequence_parallel", None)
    if callable(resolve) and model is not None:
        resolve(model)
    return tensor


def _run_preflight(strategy: HydraStrategy, trainer: pl.Trainer | None, args: tuple[Any, ...]) -> None:
    """:func:`preflight` with the model and data module of a ``Trainer.fit/validate/...`` launch."""
    if trainer is None:
        return
    model = args[0] if args and isinstance(args[0], pl.LightningModule) else None
    datamodule = next((a for a in args if isinstance(a, pl.LightningDataModule)), None)
    preflight(strategy, model, datamodule, trainer.state.fn)
    # Trainer.fit's arguments: (model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, ...)
    ckpt_path = args[4] if trainer.state.fn == TrainerFn.FITTING and len(args) > 4 else None
    if isinstance(ckpt_path, str | os.PathLike) and str(ckpt_path) not in ("last", "best", "hpc", "registry"):
        from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

        from lightning_hydra.strategy.checkpoint import check_complete

        if _is_local_file_protocol(ckpt_path):
            check_complete(ckpt_path)  # a torn or missing checkpoint: one line, before any rank starts


class CheckedSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (``start_method="popen"``), running :func:`preflight` before the ranks start and
    naming a rank that ended without a Python error (:class:`~lightning_hydra.strategy.exits.RankWatch`): a failure
    of the launching process caused by it is raised as :class:`~lightning_hydra.errors.RankDiedError`."""

    def __init__(self, strategy: HydraStrategy, *args: Any) -> None:
        """Build the launcher.

        Args:
            strategy: The strategy whose run is checked.
            *args: Arguments of ``_SubprocessScriptLauncher`` (cluster environment, processes, nodes).
        """
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        _run_preflight(self._strategy, trainer, args)
        # Lightning's launch, with a watch that names a rank that died (see lightning_hydra.strategy.exits)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        watch = None
        launcher = None
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the children's watch on this process
            self._call_children_scripts()
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            watch = RankWatch(self.procs, first_rank=first, trainer=trainer)
            watch.start()
        elif os.environ.get(LAUNCHER_PID_ENV) and self.cluster_environment.local_rank() > 0:
            launcher = LauncherWatch(
                int(os.environ[LAUNCHER_PID_ENV]),
                launcher_rank=self.cluster_environment.node_rank() * self.num_processes,
                local_rank=self.cluster_environment.local_rank(),
                trainer=trainer,
            )
            launcher.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            wait = 0.0 if isinstance(exc, ValueError | TypeError) else DEATH_WAIT_S
            if launcher is not None and launcher.gone(wait):  # caused by the launching process's end
                launcher.end()
            if watch is None:
                raise
            # a rank that went away shows here as a closed connection: wait a little for its exit status
            line = watch.death(0.0 if isinstance(exc, ValueError | TypeError) else DEATH_WAIT_S, stop=True)
            watch.stop(kill=line is not None)  # the others only noticed it; a rank with its own error says it
            if line is None:
                raise
            raise RankDiedError(line) from exc


class CheckedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher (``spawn``, ``fork``, ``forkserver``), running :func:`preflight` first
    and releasing the process groups when a worker's function returns normally.

    A worker that exits with Gloo communicators alive can abort in the interpreter's finalisation (``terminate
    called without an active exception``, SIGABRT): a Gloo worker thread that ran one of the last collectives may
    still hold that work's tensors when the main thread returns; freeing a tensor that has a Python object takes the
    GIL, and a thread asking for it once the interpreter finalises is ended inside a ``noexcept`` frame. So the
    worker destroys the CP communicators (their threads are joined), then the process groups; a communicator that
    stays referenced (FSDP2 keeps its mesh's groups for the model's lifetime) keeps its threads, and those get
    :data:`EXIT_SETTLE_S` with the GIL released to drop their last work (measured on 4 spawned Gloo ranks that
    train a FSDP2 model, gather its full weights and return: 4 aborts in 80 runs without the pause, none in 120
    with it).

    A ``forkserver`` rank starts as a ``spawn`` rank does: Lightning gives only ``spawn`` ranks the launching
    process's global state (random generators, deterministic flags) and private copies of the model's CPU tensors,
    and a rank forked from the server has the server's environment variables, not the launching process's. Without
    the copies, every rank of a CPU run would update the same shared parameter memory (each step applied once per
    rank); without the environment, ``PL_GLOBAL_SEED`` and any variable set before ``fit`` would be missing. The
    environment is set as the rank unpickles this launcher, before the trainer, model and data it is given (and
    what they import); modules the fork server itself imported keep what they read there."""

    _forkserver_state: tuple[dict[str, str], _GlobalStateSnapshot] | None = None

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        _run_preflight(self._strategy, trainer, args)
        if self._start_method == "forkserver":  # pickled with this launcher into each rank, then dropped
            environ = {**os.environ, "MASTER_PORT": str(self._strategy.cluster_environment.main_port)}  # as Lightning
            self._forkserver_state = (environ, _GlobalStateSnapshot.capture())
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except torch.multiprocessing.ProcessExitedException as exc:  # a rank ended without a Python error
            rank = self._strategy.node_rank * self._strategy.num_processes + exc.error_index
            reason = exit_reason(exc.exit_code) or f"exited with status {exc.exit_code} without a Python error"
            raise RankDiedError(f"rank {rank} (pid {exc.error_pid}) {reason}") from exc
        finally:
            self._forkserver_state = None

    @override
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        if self._forkserver_state is not None:  # first: set before anything else the rank is given is unpickled
            state = {"_environment": LaunchEnvironment(self._forkserver_state[0]), **state}
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled in a rank (the environment, if any, is set already)."""
        state.pop("_environment", None)
        self.__dict__.update(state)

    @override
    def _wrapping_function(
        self,
        process_idx: int,
        trainer: pl.Trainer | None,
        function: Callable,
        args: Any,
        kwargs: Any,
        *rest: Any,
    ) -> None:
        if self._forkserver_state is not None:
            self._forkserver_state[1].restore()
            if isinstance(self._strategy.accelerator, CPUAccelerator):
                args, kwargs = _disable_module_memory_sharing((args, kwargs))
        super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
        # after a normal return only: a rank that raised must not block in a collective teardown while its peers
        # may still wait in a collective (the error reaches the parent instead)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # each release on its own: a failure to destroy the CP communicators still leaves the world to destroy
            for what, release in (
                ("the CP communicators", self._strategy.destroy_groups),
                ("the process groups", torch.distributed.destroy_process_group),
            ):
                try:
                    release()
                except Exception as error:  # the run's results are already out: only say it
                    log.warning("HydraStrategy: destroying %s at the end of a worker failed: %s", what, error)
            gc.collect()  # communicators only a reference cycle still holds are destroyed now, not in finalisation
            time.sleep(EXIT_SETTLE_S)


class SpawnLauncher(CheckedMultiProcessingLauncher):
    """Lightning's spawn launcher (with the pre-launch checks), returning the full (unsharded) weights of a sharded
    model to the main process."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        strategy = self._strategy
        if not getattr(strategy, "is_sharded", False):
            return super()._collect_rank_zero_results(trainer, results)
        state_dict = strategy.full_state_dict()  # collective: every rank takes part
        if strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(None, weights_path, trainer.state, results, extra)

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        """Lightning's, except that a model the main process holds on the meta device (built with
        ``init_device="meta"`` or from pretrained weights: only the ranks allocated it) takes the trained weights'
        tensors as its own (``assign``) instead of copying into meta tensors, a no-op that warns once per tensor;
        buffers that are not in the weights are computed again where the module can (``materialize_buffers``)."""
        from lightning_hydra.models.init import is_meta

        module = trainer.lightning_module
        if worker_output.weights_path is None or not is_meta(module):
            super()._recover_results_in_main_process(worker_output, trainer)
            return
        weights = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
        module.load_state_dict(weights, strict=False, assign=True)
        rebuild = getattr(module, "materialize_buffers", None)
        if is_meta(module) and callable(rebuild):  # non-persistent buffers (rotary tables) are not in the weights
            rebuild("cpu")
        self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)
