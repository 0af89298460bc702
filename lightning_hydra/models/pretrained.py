"""Pretrained Hugging Face weights in, each rank reading only the slices it holds.

:class:`~lightning_hydra.models.hf.HFCausalLM` ``(pretrained="/models/Llama-3.1-8B")`` reads the directory's
``config.json`` (with overrides for context extension: ``rope_theta``, ``rope_scaling`` such as ``llama3``, ``yarn`` or
``linear``, ``max_position_embeddings``), checks the safetensors headers against the config (names and shapes, nothing
read beyond the headers) and builds the model on the ``meta`` device. :class:`~lightning_hydra.HydraStrategy` lays it
out (pipeline stage, tensor parallelism, FSDP2), allocates each rank's shards on its device and calls
:func:`load_pretrained`, which reads for every tensor the slice of the full tensor that the rank holds (by torch's shard
arithmetic, :func:`~lightning_hydra.models.init.local_slice`) with ``safe_open(...).get_slice(name)[index]`` from the
memory-mapped safetensors file: a rank reads its TP and FSDP shards of its stage's tensors and nothing else, converting
them to the parameters' dtype as it copies. Non-persistent buffers (the rotary tables) are computed again by
transformers' own ``_init_weights``.

Bad input is one line, raised where the module is built (before any rank starts): a directory without
``config.json`` or safetensors weights, weights whose names or shapes disagree with the config, and (through
:func:`~lightning_hydra.models.hf.apply_hf`) an attention or rotary type the CP engine refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_hydra.errors import ConfigError
from lightning_hydra.models.init import local_slice

__all__ = [
    "check_buffers",
    "check_pretrained_dir",
    "check_weights",
    "generation_config",
    "load_pretrained",
    "read_config",
    "reinit_buffers",
    "safetensors_shapes",
    "weight_files",
]


def check_pretrained_dir(path: str | Path) -> Path:
    """``path`` as a local Hugging Face checkpoint directory, or a one-line :class:`ConfigError`."""
    where = Path(path)
    if not where.is_dir():
        raise ConfigError(f"pretrained={str(path)!r} is not a directory (a local Hugging Face checkpoint is needed)")
    if not (where / "config.json").is_file():
        raise ConfigError(f"pretrained={str(path)!r} is not a Hugging Face checkpoint directory: it has no config.json")
    if not any(where.glob("*.safetensors")):
        raise ConfigError(
            f"pretrained={str(path)!r} has no *.safetensors weights (convert .bin weights with transformers' "
            "save_pretrained(safe_serialization=True))"
        )
    return where


def read_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Any:
    """The directory's config with ``overrides``: ``rope_theta``, ``rope_scaling`` (a dict with ``rope_type`` or
    ``type``: ``linear``, ``llama3``, ``yarn``, ...; ``None``: the default rotary), ``rope_parameters``, and any
    other attribute (``max_position_embeddings``, ...). transformers' own ``from_pretrained(**kwargs)`` drops a
    ``rope_theta`` override and a scaling's theta; here both end up in ``rope_parameters``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    overrides = dict(overrides or {})
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and ("rope_type" in rope or "rope_theta" in rope):
        rope = dict(rope)
        if "rope_parameters" in overrides:
            rope = {"rope_theta": rope.get("rope_theta"), **dict(overrides.pop("rope_parameters") or {})}
        if "rope_scaling" in overrides:
            scaling = dict(overrides.pop("rope_scaling") or {"rope_type": "default"})
            if "type" in scaling:
                scaling["rope_type"] = scaling.pop("type")
            rope = {**scaling, "rope_theta": rope.get("rope_theta")}
        if "rope_theta" in overrides:
            rope["rope_theta"] = float(overrides.pop("rope_theta"))
    for key, value in overrides.items():
        setattr(config, key, value)
    if isinstance(rope, dict):
        config.rope_parameters = rope
        validate = getattr(config, "validate_rope", None)
        if callable(validate):
            validate()
    return config


def generation_config(path: str | Path) -> dict[str, Any] | None:
    """The directory's ``generation_config.json`` (``None`` when it has none)."""
    file = Path(path) / "generation_config.json"
    return json.loads(file.read_text()) if file.is_file() else None


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _expected(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The parameters and persistent buffers the files must hold (a tied output head only once)."""
    return {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}


def _tied_names(model: nn.Module) -> set[str]:
    """Names of parameters that are another parameter (a tied output head): transformers saves them once."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        else:
            seen[id(param)] = name
    return tied


def check_weights(model: nn.Module, path: str | Path) -> None:
    """A one-line :class:`ConfigError` when the files' tensors disagree with ``model`` (built from the config):
    a shape that differs, or a tensor the model needs that the files lack (a tied head may be absent)."""
    shapes = safetensors_shapes(path)
    tied = _tied_names(model)
    for name, shape in _expected(model).items():
        if name not in shapes:
            if name in tied:
                continue
            raise ConfigError(f"pretrained={str(path)!r}: the weights have no {name} (of shape {list(shape)})")
        if shapes[name] != shape:
            raise ConfigError(
                f"pretrained={str(path)!r}: {name} has shape {list(shapes[name])} in the weights, {list(shape)} by "
                "the config (a config override that changes a shape?)"
            )


def weight_files(path: str | Path) -> dict[str, Path]:
    """Which safetensors file of the directory holds each tensor (``model.safetensors.index.json``'s weight map
    where there is one, else every file's header)."""
    from safetensors import safe_open

    where = Path(path)
    index = where / "model.safetensors.index.json"
    if index.is_file():
        return {name: where / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = {}
    for file in sorted(where.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), file))
    return files


def load_pretrained(model: nn.Module, path: str | Path) -> int:
    """Fill ``model`` (a ``transformers`` model, laid out and allocated: plain tensors, or DTensor shards under
    tensor parallelism and FSDP2; a pipeline stage's layers) from the directory's safetensors files, reading for
    each tensor only the slice this rank holds (``safe_open(...).get_slice(name)[index]``, from the memory-mapped
    file), converted to the tensor's dtype as it is copied into its place. A tied output head takes the embedding's
    values through the tie (transformers saves the tensor once); the non-persistent buffers (rotary tables) are
    computed again (:func:`reinit_buffers`). Not collective: every rank reads on its own. Returns the bytes read.

    Raises:
        ConfigError: The files lack a tensor that the model holds (and that is not tied to another).
    """
    from safetensors import safe_open

    files = weight_files(path)
    tied = _tied_names(model)
    done: set[int] = set()
    read = 0
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in done:
                continue
            if name not in files:
                if name in tied:
                    continue  # loaded under the name it is tied to
                raise ConfigError(f"pretrained={str(path)!r}: the weights have no {name}")
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            # opened for each tensor: closing unmaps the file pages the slice touched, so a rank's resident set
            # holds one tensor's pages at a time, not every page it read
            with safe_open(str(files[name]), framework="pt", device="cpu") as source:
                part = source.get_slice(name)[local_slice(tensor)] if tensor.dim() else source.get_tensor(name)
            local.copy_(part.reshape(local.shape))
            read += part.numel() * part.element_size()
            done.add(id(tensor))
            del part
    reinit_buffers(model)
    return read


def check_buffers(model: nn.Module, path: str | Path) -> None:
    """A one-line :class:`ConfigError` when ``model`` has a non-persistent buffer (not in the files) that
    :func:`reinit_buffers` cannot compute again after allocation: only the rotary tables of transformers' rotary
    modules (those with ``original_inv_freq``) are; any other would be left as ``to_empty`` leaves memory."""
    saved = set(model.state_dict(keep_vars=True))
    for module_name, module in model.named_modules():
        rotary = "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq")
        for name, buffer in module.named_buffers(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if buffer is not None and full not in saved and not rotary:
                raise ConfigError(
                    f"pretrained={str(path)!r}: {type(model).__name__} has a buffer {full} that is not in the "
                    "weights and that loading cannot compute again (only rotary tables are)"
                )


def reinit_buffers(model: nn.Module) -> None:
    """Compute the non-persistent buffers again (the rotary tables; ``to_empty`` left them uninitialised), with
    transformers' own ``_init_weights``."""
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and callable(init):
            with torch.no_grad():
                init(module)
