"""Checkpoints of a sharded pool: ``torch.distributed.checkpoint`` shards plus one metadata file.

A sharded model (``zero2``, ``zero3``, ``hsdp``) saves to a directory: every rank writes its shards of the model and
optimizer state (``get_model_state_dict`` / ``get_optimizer_state_dict``), rank 0 writes ``meta.pt`` with the rest
of Lightning's checkpoint (loop and data-module positions, the calibrated cost model and the calibrator). Loading
reshards to the pool at hand: a checkpoint saved on 4 ranks resumes on 2, and since global batches never depend on
the world size the run continues with the same batches. A replica pool keeps Lightning's single file (rank 0
writes it from its own state dict; no rank gathers another's), which loads into either kind of pool, and reads a
sharded directory whole (:func:`load_full_checkpoint`). Neither path gathers state as pickled objects: the distributed
checkpoint exchanges only its save plans, and :func:`full_state_dict` moves tensors point to point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save, _is_sharded_checkpoint
from lightning.fabric.strategies.model_parallel import _load_checkpoint as _fabric_load_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.optim import Optimizer

__all__ = [
    "full_state_dict",
    "is_sharded_checkpoint",
    "load_full_checkpoint",
    "load_sharded_checkpoint",
    "save_sharded_checkpoint",
]


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by :func:`save_sharded_checkpoint`."""
    return _is_sharded_checkpoint(Path(path))


def save_sharded_checkpoint(checkpoint: dict[str, Any], path: str | Path, *, global_rank: int) -> None:
    """Write ``checkpoint`` (Lightning's dict, with sharded ``state_dict`` and ``optimizer_states``) to ``path``.

    Collective: every rank calls it with the same ``path``.
    """
    path = Path(path)
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    converted = {"state_dict": checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    _distributed_checkpoint_save(converted, path)
    if global_rank == 0:
        torch.save(checkpoint, path / _METADATA_FILENAME)


def load_sharded_checkpoint(
    path: str | Path, model: nn.Module, optimizers: list[Optimizer], *, strict: bool = True
) -> dict[str, Any]:
    """Load a sharded directory into ``model`` (FSDP-sharded, a pipeline stage, or both) and its ``optimizers``,
    each rank reading only what it holds; returns the rest of the checkpoint. A single full file (from a replica
    pool) loads into a sharded model too. Collective."""
    path = Path(path)
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


def full_state_dict(
    model: nn.Module, *, sharded: bool, staged: bool, device: torch.device, stage_roots: tuple[int, ...] = (0,)
) -> dict[str, Any]:
    """The model's full (unsharded, CPU) state dict on world rank 0 (``{}`` on the others where a gather was needed;
    a replica's own state dict without stages); collective when ``sharded`` or ``staged``.

    No rank gathers the others' state as objects: a sharded stage gathers its full tensors to its pool position 0
    (FSDP2's full state dict), and with stages every stage's position 0 sends rank 0 the names, shapes and dtypes
    of its tensors (one small object, no tensor), then the tensors themselves, one point-to-point transfer each.
    Only rank 0 ever holds more than its stage.

    Args:
        model: This rank's model (its stage's layers, under a pipeline).
        sharded: Whether the state is FSDP2-sharded over the pool.
        staged: Whether the world holds pipeline stages.
        device: Where the tensors rank 0 receives land (the strategy's root device: NCCL's CUDA device, gloo's CPU).
        stage_roots: World rank of every stage's pool position 0, in stage order (staged only).
    """
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # unstaged: rank 0 alone receives the CPU copy; staged: each stage's full tensors, sent on by its root
        options = StateDictOptions(full_state_dict=True, cpu_offload=not staged)
        mine = get_model_state_dict(model, options=options)
    else:
        mine = model.state_dict()
    if not staged:
        return {k: v.detach().cpu() for k, v in mine.items()}
    rank = dist.get_rank()
    merged: dict[str, Any] = {k: v.detach().cpu() for k, v in mine.items()} if rank == 0 else {}
    for root in stage_roots:
        if root == 0:
            continue
        if rank == root:
            tensors = [(k, v.detach().contiguous()) for k, v in mine.items()]
            dist.send_object_list([[(k, tuple(v.shape), v.dtype) for k, v in tensors]], dst=0)
            for _, tensor in tensors:
                dist.send(tensor, dst=0)
        elif rank == 0:
            names: list[Any] = [None]
            dist.recv_object_list(names, src=root)
            for key, shape, dtype in names[0]:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(tensor, src=root)
                merged[key] = tensor.cpu()
    return merged
