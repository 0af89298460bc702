"""Checkpoints of a sharded pool: ``torch.distributed.checkpoint`` shards plus one metadata file, written so that a
save never tears.

A sharded model (``zero2``, ``zero3``, ``hsdp``, tensor parallelism, pipeline stages) saves to a directory: every
rank writes its shards of the model and optimizer state (``get_model_state_dict`` / ``get_optimizer_state_dict``),
rank 0 writes ``meta.pt`` with the rest of Lightning's checkpoint (loop and data-module positions, the calibrated cost
model and the calibrator). Loading reshards to the pool at hand: a checkpoint saved on 4 ranks resumes on 2, and
since global batches never depend on the world size the run continues with the same batches. A replica pool keeps
Lightning's single file (rank 0 writes it from its own state dict; no rank gathers another's), which loads into
either kind of pool, and reads a sharded directory whole (:func:`load_full_checkpoint`). Neither path gathers state
as pickled objects: the distributed checkpoint exchanges only its save plans, and :func:`full_state_dict` moves
tensors point to point.

**Atomic saves.** A save never writes over the checkpoint it replaces. It writes a new hidden sibling,
``.<name>.<token>`` (a directory of shards, or a file), every file fsynced (``torch.distributed.checkpoint``'s writer
fsyncs the shards and its ``.metadata``; ``meta.pt`` and a replica's file are fsynced here), and only when all of it
is complete does rank 0 make the checkpoint's name point at it, in one ``rename``: a file is renamed over the name,
a directory is named through a symbolic link ``<name> -> .<name>.<token>`` that is replaced by renaming a new link
over it (:func:`publish`). The name Lightning lists (``last.ckpt``, ``--ckpt_path last``) therefore always names a
complete checkpoint, the previous one until the new one is whole; a rank killed at any moment of a save leaves at
most an unreferenced hidden sibling, which the next save of that name removes. The checkpoint replaced is removed
after the new one is published, never before. :func:`check_complete` names what a directory lacks (a save
interrupted before this scheme, or a copy cut short).
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.strategies.model_parallel import _load_checkpoint as _fabric_load_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.optim import Optimizer

from lightning_hydra.errors import ConfigError

__all__ = [
    "CheckpointSaver",
    "check_complete",
    "full_state_dict",
    "is_sharded_checkpoint",
    "load_full_checkpoint",
    "load_sharded_checkpoint",
    "new_token",
    "publish",
    "remove_checkpoint",
    "save_full_checkpoint",
    "save_sharded_checkpoint",
    "staged_path",
    "write_sharded",
]

DCP_METADATA = ".metadata"
"""The file ``torch.distributed.checkpoint`` writes last, once every rank's shards are written."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by :func:`save_sharded_checkpoint` (or a link to one)."""
    return _is_sharded_checkpoint(Path(path))


# ---------------------------------------------------------------------------------------------- atomic publication
def new_token() -> str:
    """A fresh name part for a save's hidden sibling (unique per save: a save never reuses a published one)."""
    return uuid.uuid4().hex[:12]


def staged_path(path: str | Path, token: str) -> Path:
    """Where a save of ``path`` writes before it is published: the hidden sibling ``.<name>.<token>``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{token}")


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: a rename or a new file in it)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # a file system that cannot open a directory for reading: nothing more to do
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path``, fsynced."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_bytes(data: bytes, path: Path) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _our_sibling(path: Path, target: Path) -> bool:
    """Whether ``target`` is a hidden sibling a save of ``path`` wrote (``.<name>.<token>`` in the same folder)."""
    return target.parent == path.parent and target.name.startswith(f".{path.name}.")


def _published_target(path: Path) -> Path | None:
    """The hidden sibling ``path`` names through its link, or ``None`` (no link, or a link elsewhere)."""
    if not path.is_symlink():
        return None
    target = path.parent / os.readlink(path)
    return target if _our_sibling(path, target) else None


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def publish(staged: Path, path: str | Path) -> None:
    """Make ``path`` name the complete checkpoint ``staged`` (its hidden sibling) in one rename, then remove what
    ``path`` named before and any sibling an interrupted save of ``path`` left. Rank 0 only, after every rank's part
    of ``staged`` is written and fsynced.

    A file is renamed over ``path``; a directory is named through a link: a new link ``.<name>.<token>.link ->
    .<name>.<token>`` is renamed over ``path`` (a rename replaces a link atomically; a directory cannot be renamed
    over a non-empty one). ``path`` a real directory (written in place before this scheme) is first moved aside:
    the one moment, once, at which the name is missing.
    """
    path = Path(path)
    _fsync(staged)
    previous = _published_target(path)
    if path.is_dir() and not path.is_symlink():
        aside = staged_path(path, f"{new_token()}.old")
        os.rename(path, aside)
        previous = aside
    if staged.is_dir():
        link = staged.with_name(staged.name + ".link")
        _remove(link)
        os.symlink(staged.name, link)
        os.replace(link, path)
    else:
        os.replace(staged, path)
    _fsync(path.parent)
    keep = {staged.name, path.name}
    for sibling in path.parent.glob(f".{path.name}.*"):
        if sibling.name not in keep and (previous is None or sibling != previous):
            _remove(sibling)  # left by a save that was interrupted
    if previous is not None and previous.name != staged.name:
        _remove(previous)


def remove_checkpoint(path: str | Path) -> None:
    """Remove a checkpoint this package wrote: its name and, for a directory named through a link, the directory
    (rank 0 only)."""
    path = Path(path)
    target = _published_target(path)
    _remove(path)
    if target is not None:
        _remove(target)


def check_complete(path: str | Path) -> None:
    """Raise a one-line :class:`~lightning_hydra.errors.ConfigError` naming what a checkpoint directory lacks: its
    ``torch.distributed.checkpoint`` metadata, ``meta.pt``, or a shard file (missing or shorter than the metadata
    says). A file, or a directory that is whole, passes. No collective: every rank reads the same files."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist" + (" (a dangling link)" * path.is_symlink()))
    if not path.is_dir():
        return
    torn = f"checkpoint {path} is torn (a save that did not finish): "
    if not (path / DCP_METADATA).is_file():
        raise ConfigError(torn + f"it has no {DCP_METADATA} (torch.distributed.checkpoint writes it last)")
    if not (path / _METADATA_FILENAME).is_file():
        raise ConfigError(torn + f"it has no {_METADATA_FILENAME}")
    from torch.distributed.checkpoint import FileSystemReader

    needed: dict[str, int] = {}
    for info in FileSystemReader(path).read_metadata().storage_data.values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise ConfigError(torn + f"shard {name} is missing")
        if shard.stat().st_size < size:
            raise ConfigError(torn + f"shard {name} has {shard.stat().st_size} bytes of {size}")


# ---------------------------------------------------------------------------------------------- saving
def _split(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Take the model and optimizer state out of Lightning's ``checkpoint`` (in place) in the distributed
    checkpoint's layout: ``state_dict`` and ``optimizer_<i>``."""
    converted = {"state_dict": checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return converted


def write_sharded(state: dict[str, Any], staged: Path, *, process_group: Any = None) -> None:
    """Write this rank's shards of ``state`` into ``staged`` (collective: ``torch.distributed.checkpoint.save``;
    every file fsynced, the metadata written last by the coordinator)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(state, storage_writer=FileSystemWriter(staged, sync_files=True), process_group=process_group)


def save_sharded_checkpoint(
    checkpoint: dict[str, Any], path: str | Path, *, global_rank: int, token: str | None = None
) -> None:
    """Write ``checkpoint`` (Lightning's dict, with sharded ``state_dict`` and ``optimizer_states``) as a directory
    that ``path`` names once it is complete (see the module's documentation).

    Collective: every rank calls it with the same ``path`` and ``token`` (``None``: rank 0's fresh token, broadcast
    as one small object).
    """
    path = Path(path)
    if token is None:
        holder = [new_token() if global_rank == 0 else None]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(holder, src=0)
        token = str(holder[0])
    staged = staged_path(path, token)
    write_sharded(_split(checkpoint), staged)
    if global_rank == 0:
        _write_file(checkpoint, staged / _METADATA_FILENAME)
        publish(staged, path)


def save_full_checkpoint(checkpoint: dict[str, Any], path: str | Path, *, token: str | None = None) -> None:
    """Write a replica pool's single-file checkpoint atomically (rank 0 only): the hidden sibling, fsynced, then
    renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staged_path(path, token or new_token())
    _write_file(checkpoint, staged)
    publish(staged, path)


def serialize_meta(checkpoint: dict[str, Any]) -> bytes:
    """``torch.save`` of the rest of a checkpoint into memory (frozen at the save, written later)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def finish_sharded(meta: bytes, staged: Path, path: Path) -> None:
    """Rank 0, once every rank's shards and the metadata are written: ``meta.pt``, then :func:`publish`."""
    _write_bytes(meta, staged / _METADATA_FILENAME)
    publish(staged, path)


def finish_full(data: bytes | Callable[[Path], None], staged: Path, path: Path) -> None:
    """Write a replica's file (its bytes, or a writer) to ``staged``, fsynced, and :func:`publish` it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if callable(data):
        data(staged)
    else:
        _write_bytes(data, staged)
    publish(staged, path)


class CheckpointSaver:
    """How a :class:`~lightning_hydra.HydraStrategy` writes checkpoints: synchronously, or in the background.

    Synchronous: the save returns once the checkpoint is written and published. Asynchronous
    (``HydraStrategy(async_checkpoint=True)``): the save blocks only while the state is copied to host memory
    (``torch.distributed.checkpoint``'s ``DefaultStager``; pinned memory on CUDA, kept between saves), then a
    background thread writes it (a sharded checkpoint: ``async_save``, its collectives on a gloo communicator of its
    own, never the step's) and rank 0 publishes it once every rank's part is written. A save waits for the previous
    one first; :meth:`wait` (called by the strategy at the end of a run, and by the SIGTERM guard after its save)
    returns once the write is published, on every rank (the ranks' writer threads agree on it over the
    checkpoint's communicator), and raises an error the write hit: a shard's on every rank, as
    ``torch.distributed.checkpoint`` reports it, and rank 0's failure to write ``meta.pt`` or publish on every
    rank too (the others as a ``RuntimeError`` naming rank 0). Removing a checkpoint while a write is
    pending waits for it to be published (older checkpoints go only after the new one is complete).

    Not run on a GPU here: pinned staging is torch's, selected on CUDA devices only.
    """

    def __init__(self, *, asynchronous: bool = False) -> None:
        """Args:
        asynchronous: Write in the background (see above).
        """
        self.asynchronous = asynchronous
        self.group: Any = None
        """The checkpoint's own communicator (asynchronous sharded saves), created by :meth:`setup`."""
        self._world: Any = None
        self._stager: Any = None
        self._executor: Any = None
        self._pending: Any = None
        self._removals: list[Path] = []
        self._lock = threading.Lock()
        self.blocked_seconds: list[float] = []
        """Seconds each save blocked its caller (on rank 0 of a replica pool; every rank of a sharded one): the whole
        write when synchronous; when asynchronous, waiting for the previous save's write (if still running) and
        staging."""

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the strategy goes to spawned ranks): the setting only; each process makes its own state."""
        return {"asynchronous": self.asynchronous}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def setup(self, device: torch.device) -> bool:
        """Create the stager and the checkpoint communicator (asynchronous only; collective: every rank calls it at
        the same point). Again after :meth:`close` (another ``fit`` in the same process) and under a new default
        process group. Returns whether a communicator was created.

        Args:
            device: The rank's device (CUDA: staging into pinned host memory with non-blocking copies).
        """
        if not self.asynchronous:
            return False
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
        if not (dist.is_available() and dist.is_initialized()):
            return False
        world = dist.group.WORLD
        if self.group is not None and self._world is world:
            return False
        self.group, self._world = dist.new_group(backend="gloo"), world
        return True

    @property
    def pending(self) -> bool:
        """Whether a write is still running."""
        return self._pending is not None and not self._pending.done()

    def _submit(self, work: Callable[[], None]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hydra-checkpoint")
        self._pending = self._executor.submit(work)

    def save_sharded(self, checkpoint: dict[str, Any], path: Path, *, token: str, rank: int) -> None:
        """Save a sharded checkpoint (collective; see the class documentation)."""
        import time

        start = time.perf_counter()
        self.wait()
        if not self.asynchronous:
            save_sharded_checkpoint(checkpoint, path, global_rank=rank, token=token)
            self.blocked_seconds.append(time.perf_counter() - start)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        if self._stager is None:
            raise RuntimeError("CheckpointSaver.setup() must run before an asynchronous save")
        state = _split(checkpoint)
        meta = serialize_meta(checkpoint) if rank == 0 else b""
        staged = staged_path(path, token)
        writer = FileSystemWriter(staged, sync_files=True)
        upload = dcp.async_save(state, storage_writer=writer, process_group=self.group, async_stager=self._stager)
        upload = getattr(upload, "upload_completion", upload)
        del state

        group = self.group

        def finish() -> None:
            upload.result()  # every rank's shards and the metadata are written (a write error: on every rank)
            self._publish_on_zero(rank, group, path, lambda: finish_sharded(meta, staged, path))

        self._submit(finish)
        self.blocked_seconds.append(time.perf_counter() - start)

    def save_full(self, checkpoint: dict[str, Any], path: Path, *, token: str, rank: int) -> None:
        """Save a replica pool's file (rank 0 stages and writes it; asynchronously, the other ranks' writes end
        when rank 0 has published it)."""
        import time

        start = time.perf_counter()
        self.wait()
        group = self.group
        if rank != 0:
            if self.asynchronous and group is not None:  # the write ends here once rank 0 has published it
                self._submit(lambda: self._publish_on_zero(rank, group, path, lambda: None))
            return
        staged = staged_path(path, token)
        if not self.asynchronous:
            save_full_checkpoint(checkpoint, path, token=token)
            self.blocked_seconds.append(time.perf_counter() - start)
            return
        if self._stager is None:
            raise RuntimeError("CheckpointSaver.setup() must run before an asynchronous save")
        copy = self._stager.stage(checkpoint)
        write = lambda: finish_full(lambda where: _write_file(copy, where), staged, path)  # noqa: E731
        self._submit(lambda: self._publish_on_zero(rank, group, path, write))
        self.blocked_seconds.append(time.perf_counter() - start)

    def _publish_on_zero(self, rank: int, group: Any, path: Path, publish_it: Callable[[], None]) -> None:
        """Writer thread, every rank: rank 0 runs ``publish_it`` (and the removals waiting for it), then the ranks
        agree over ``group`` whether it succeeded, so that every rank's write ends once the checkpoint is published
        and rank 0's failure is raised on every rank (the others as a ``RuntimeError`` naming rank 0)."""
        failure: BaseException | None = None
        if rank == 0:
            try:
                publish_it()
                self._apply_removals()
            except BaseException as exc:  # told to every rank below, then raised here
                failure = exc
        if group is not None:
            failed = torch.tensor([int(failure is not None)], dtype=torch.int64, device="cpu")  # a gloo group
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
            if failure is None and failed.item():
                raise RuntimeError(f"rank 0 failed to publish the checkpoint {path} (its error is on rank 0)")
        if failure is not None:
            raise failure

    def remove(self, path: Path, *, rank: int) -> None:
        """Remove a checkpoint (rank 0): now, or once the pending write is published."""
        if rank != 0:
            return
        with self._lock:
            if self.pending:
                self._removals.append(path)
                return
        remove_checkpoint(path)

    def _apply_removals(self) -> None:
        with self._lock:
            removals, self._removals = self._removals, []
        for path in removals:
            remove_checkpoint(path)

    def wait(self) -> None:
        """Block until the pending write (if any) is written and published; raise the error it hit."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        self._apply_removals()

    def close(self) -> None:
        """Wait for the pending write, then release the stager and the thread (the communicator stays: the
        strategy's process groups end with the run)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


# ---------------------------------------------------------------------------------------------- loading
def load_sharded_checkpoint(
    path: str | Path, model: nn.Module, optimizers: list[Optimizer], *, strict: bool = True
) -> dict[str, Any]:
    """Load a sharded directory into ``model`` (FSDP-sharded, a pipeline stage, or both) and its ``optimizers``,
    each rank reading only what it holds; returns the rest of the checkpoint. A single full file (from a replica
    pool) loads into a sharded model too. A torn directory raises :func:`check_complete`'s one line. Collective."""
    path = Path(path)
    check_complete(path)
    if not is_sharded_checkpoint(path):
        state: dict[str, Any] = {"state_dict": model, **{f"optimizer_{i}": o for i, o in enumerate(optimizers)}}
        return _fabric_load_checkpoint(
            path=path, state=state, strict=strict, optimizer_states_from_list=True, weights_only=False
        )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    wanted: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for i, optimizer in enumerate(optimizers):
        wanted[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(wanted, checkpoint_id=path)
    set_model_state_dict(model, wanted["state_dict"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, wanted[f"optimizer_{i}"])
    return torch.load(path / _METADATA_FILENAME, weights_only=False)


def load_full_checkpoint(path: str | Path) -> dict[str, Any]:
    """A sharded directory (saved by a sharded, staged or tensor-parallel pool) as a replica pool's single-file
    checkpoint: the whole model state and each optimizer's state in ``torch.optim``'s own form (parameters
    numbered in its groups' order, as the saving optimizer held them), with the rest of the checkpoint. Every rank
    reads the whole checkpoint; no collective.

    Args:
        path: The directory :func:`save_sharded_checkpoint` wrote.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    check_complete(path)
    saved: dict[str, Any] = {}
    _load_state_dict(saved, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    checkpoint = torch.load(path / _METADATA_FILENAME, weights_only=False)
    checkpoint["state_dict"] = saved.pop("state_dict")
    optimizers = []
    for i in range(len(saved)):
        named = saved[f"optimizer_{i}"]  # get_optimizer_state_dict's form: parameters by their names
        index = {name: k for k, name in enumerate(n for group in named["param_groups"] for n in group["params"])}
        groups = [{**group, "params": [index[n] for n in group["params"]]} for group in named["param_groups"]]
        optimizers.append({"state": {index[n]: v for n, v in named["state"].items()}, "param_groups": groups})
    checkpoint["optimizer_states"] = optimizers
    return checkpoint


# ---------------------------------------------------------------------------------------------- full weights
def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (collective over its mesh), a plain tensor as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def full_state_dict(
    model: nn.Module, *, sharded: bool, staged: bool, device: torch.device, stage_roots: tuple[int, ...] = (0,)
) -> dict[str, Any]:
    """The model's full (unsharded, CPU) state dict on world rank 0 (``{}`` on the others where a gather was needed;
    a replica's own state dict without stages); collective when ``sharded`` or ``staged``.

    One tensor at a time: every rank of a stage gathers one full tensor (an all-gather over the tensor's mesh, the
    same order on every rank: the state dict's), the stage's root sends it to rank 0 (rank 0 copies its own stage's
    to the CPU) and every rank frees it before the next; a rank's device holds its shards and one full tensor at
    most, never its whole stage. With stages, each stage root first sends rank 0 the names, shapes and dtypes of its
    tensors (one small object, no tensor). No rank gathers the others' state as objects; only rank 0 holds more
    than one tensor of the whole model, on the host.

    Args:
        model: This rank's model (its stage's layers, under a pipeline).
        sharded: Whether the state is FSDP2-sharded or tensor-parallel (DTensors).
        staged: Whether the world holds pipeline stages.
        device: Where the tensors rank 0 receives land before the host copy (the strategy's root device: NCCL's
            CUDA device, gloo's CPU).
        stage_roots: World rank of every stage's pool position 0, in stage order (staged only).
    """
    if sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        mine = get_model_state_dict(model)  # this rank's shards (DTensors), by the module's own names
    else:
        mine = model.state_dict()
    if not staged and not sharded:
        return {k: v.detach().cpu() for k, v in mine.items()}
    rank = dist.get_rank()
    root = next((r for r in sorted(stage_roots, reverse=True) if r <= rank), 0) if staged else 0
    merged: dict[str, Any] = {}
    if staged and rank == root and root != 0:
        dist.send_object_list([[(k, tuple(v.shape), v.dtype) for k, v in mine.items()]], dst=0)
    for key, value in mine.items():
        full = _full(value.detach())
        if rank == 0:
            merged[key] = full.cpu()
        elif staged and rank == root:
            dist.send(full.contiguous(), dst=0)
        del full
    if not staged or rank != 0:
        return merged
    for other in stage_roots:
        if other == 0:
            continue
        names: list[Any] = [None]
        dist.recv_object_list(names, src=other)
        for key, shape, dtype in names[0]:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src=other)
            merged[key] = tensor.cpu()
            del tensor
    return merged
