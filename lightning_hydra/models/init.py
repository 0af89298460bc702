"""Initialisation that does not need the whole model: every parameter from a generator of its own.

A model built on the ``meta`` device (``DecoderLM(init_device="meta")``, ``HFCausalLM(pretrained=...)``) holds no
memory; :class:`~lightning_hydra.HydraStrategy` lays it out (pipeline stage, tensor parallelism, FSDP2), allocates
each rank's shards with ``to_empty`` on its device and fills them (:meth:`HydraModule.materialize
<lightning_hydra.HydraModule.materialize>`). For a random initialisation to equal one process's, each parameter is
drawn from a generator seeded by the model's seed and the parameter's name (:func:`param_seed`): a rank draws the
full parameter on its device, one parameter at a time, and keeps its shard (:func:`fill_`). The model's seed is one
draw from the global CPU generator at construction, before any submodule is built, so ``torch.manual_seed(s);
Model(...)`` gives the same weights on the CPU, on the meta device then materialised whole, or as any rank's shards.

Random streams are per device type: a CUDA rank's draws equal a one-process CUDA initialisation, not a CPU one.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = [
    "draw_seed",
    "fill_",
    "is_meta",
    "local_part",
    "local_slice",
    "param_seed",
    "peak_memory",
    "reset_peak_memory",
    "to_empty_keeping_ties",
]


def draw_seed() -> int:
    """One draw from the global CPU generator (the model's seed; the same under a ``torch.device("meta")``
    context, which does not consume it)."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s own generator."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (built without memory)."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def to_empty_keeping_ties(module: nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=device)``, then the parameters that were one parameter under several names (a tied
    output head) made one again: moving off the meta device makes a new parameter for every name."""
    first: dict[int, str] = {}
    ties = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    module.to_empty(device=device)
    for name, source in ties:
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, module.get_parameter(source))


def local_slice(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The index of the part of the full tensor that ``tensor`` holds on this rank: everything for a plain tensor,
    the local shard's offsets and shape for a DTensor (tensor parallelism, FSDP2, both), by torch's own shard
    arithmetic."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of the full tensor ``full`` that ``like`` holds (:func:`local_slice`): ``full`` itself for a plain
    tensor, this rank's shard for a DTensor."""
    return full if getattr(like, "placements", None) is None else full[local_slice(like)]


def fill_(tensor: torch.Tensor, seed: int, name: str, draw: Callable[[torch.Tensor, torch.Generator], None]) -> None:
    """Fill ``tensor`` (a plain tensor, or a DTensor's local shard) with its part of the full tensor that ``draw``
    writes from parameter ``name``'s generator. A DTensor's full value is drawn on its device and dropped once its
    part is copied: one full parameter at a time."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    device = local.device
    generator = torch.Generator(device=device).manual_seed(param_seed(seed, name))
    with torch.no_grad():
        if local is tensor:
            draw(tensor, generator)
            return
        full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        draw(full, generator)
        local.copy_(local_part(full, tensor))
        del full


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring the peak memory of this process on ``device`` (CUDA: the allocator's peak; CPU: the
    resident set's high-water mark, reset through ``/proc/self/clear_refs`` where Linux allows it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes since :func:`reset_peak_memory` (CPU: the resident set's high-water mark, the whole process's;
    ``None`` where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
