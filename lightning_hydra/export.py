"""Trained weights out: any checkpoint this package writes as a standard Hugging Face model directory.

``lightning-hydra export CHECKPOINT OUT_DIR`` (and :func:`export_checkpoint`) reads a checkpoint of any layout (a
replica pool's single file, a ``torch.distributed.checkpoint`` directory saved under FSDP2, tensor parallelism,
pipeline stages, at any world size) and writes what ``transformers`` writes with ``save_pretrained``:

- ``config.json`` (the model's own config for a :class:`~lightning_hydra.models.hf.HFCausalLM`; for the reference
  :class:`~lightning_hydra.DecoderLM` a ``LlamaForCausalLM`` config, the architecture it computes exactly: RMSNorm,
  non-interleaved RoPE on true positions, GQA, SwiGLU, an untied head), ``generation_config.json`` where the source
  had one;
- ``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json`` above
  ``max_shard_size`` (transformers' default, 5 GB), in the dtype asked for (``bf16`` by default); a tied output
  head is left out, as transformers leaves it out;
- the tokenizer files of the run's pretrained directory (or of ``tokenizer=``) where there are any.

The tensors are read one output shard at a time (a sharded directory through ``torch.distributed.checkpoint``'s own
reader with only those tensors asked for; a single file memory-mapped), so the exporting process holds one output
shard, not the model. What describes the model travels in every checkpoint (``checkpoint["hf_export"]``, written by
:meth:`HydraModule.on_save_checkpoint <lightning_hydra.HydraModule.export_spec>`); a model without one is refused
in one line, as are a torn checkpoint and an output directory that exists and is not empty (unless ``overwrite``).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_hydra.errors import ConfigError

__all__ = ["DTYPES", "EXPORT_KEY", "TOKENIZER_FILES", "export_checkpoint", "read_spec"]

EXPORT_KEY = "hf_export"
"""Key of a checkpoint holding what :func:`export_checkpoint` needs: ``config`` (a ``transformers`` config dict),
``rename`` (``[pattern, replacement]`` regular expressions from the module's parameter names to the Hugging Face
names), ``generation_config`` (a dict or ``None``) and ``source`` (the pretrained directory, or ``None``)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""``--dtype`` choices."""

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
"""The files of a Hugging Face tokenizer directory that are copied."""

_DCP_PREFIX = "state_dict."
"""How ``torch.distributed.checkpoint`` names the model's tensors in a sharded directory (the state dict is saved
under ``state_dict``, flattened with dots)."""


def _parse_size(text: str | int) -> int:
    from lightning_hydra.planner.memory import parse_bytes

    return int(parse_bytes(text))


def read_spec(meta: dict[str, Any], where: Path) -> dict[str, Any]:
    """The export description of a checkpoint's non-tensor part; a one-line error when it has none."""
    spec = meta.get(EXPORT_KEY)
    if spec is None:
        raise ConfigError(
            f"checkpoint {where} does not say which Hugging Face architecture its model is (no {EXPORT_KEY!r} entry: "
            "saved by a model without export_spec(), or by an older version of lightning-hydra)"
        )
    if isinstance(spec, str):  # the model's one-line reason
        raise ConfigError(f"checkpoint {where} cannot be exported: {spec}")
    return spec


class _Source:
    """A checkpoint's model tensors: names, shapes, dtypes, and reading some of them."""

    def __init__(self, path: Path) -> None:
        from lightning_hydra.strategy.checkpoint import check_complete, is_sharded_checkpoint

        check_complete(path)
        self.path = path
        self.sharded = is_sharded_checkpoint(path)
        if self.sharded:
            from torch.distributed.checkpoint import FileSystemReader

            self.meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
            metadata = FileSystemReader(path).read_metadata().state_dict_metadata
            self.shapes = {
                key[len(_DCP_PREFIX) :]: (tuple(value.size), value.properties.dtype)
                for key, value in metadata.items()
                if key.startswith(_DCP_PREFIX) and hasattr(value, "size")
            }
        else:
            self.meta = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            self.state = self.meta.pop("state_dict")
            self.shapes = {k: (tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full tensors ``names`` (a sharded directory: only these are read, each rank's chunks reassembled)."""
        if not self.sharded:
            return {name: self.state[name] for name in names}
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        wanted = {name: torch.empty(self.shapes[name][0], dtype=self.shapes[name][1], device="cpu") for name in names}
        dcp.load({"state_dict": wanted}, storage_reader=FileSystemReader(self.path), no_dist=True)
        return wanted


def _renamed(names: list[str], rename: list[list[str]]) -> dict[str, str]:
    out = {}
    for name in names:
        new = name
        for pattern, replacement in rename:
            new = re.sub(pattern, replacement, new)
        out[name] = new
    return out


def _shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Consecutive groups of names whose bytes stay within ``limit`` (a tensor larger than it alone), as
    transformers splits."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export target {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"export target {out} exists and is not empty (pass --overwrite to replace it)")


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "bf16",
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    tokenizer: str | Path | None = None,
) -> Path:
    """Write ``checkpoint``'s model as a Hugging Face directory (see the module's documentation); returns it.

    The directory is written under a hidden sibling name and renamed into place once complete (an existing one is
    removed only then, with ``overwrite``).

    Args:
        checkpoint: A checkpoint file or directory this package wrote (a link to one, as ``last.ckpt``, too).
        out_dir: The directory to write.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        overwrite: Replace ``out_dir`` if it exists and is not empty.
        max_shard_size: Bytes per safetensors file (a number or a string such as ``"5GB"``).
        tokenizer: A tokenizer directory whose files to copy (default: the run's pretrained directory, if any).

    Raises:
        ConfigError: A torn or unknown checkpoint, an unknown dtype, a target that exists and is not empty.
    """
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source_path, out = Path(checkpoint), Path(out_dir)
    _check_out(out, overwrite)
    source = _Source(source_path)
    spec = read_spec(source.meta, source_path)
    config = _config(spec, DTYPES[dtype])
    names = list(source.shapes)
    hf_names = _renamed(names, spec.get("rename", []))
    if getattr(config, "tie_word_embeddings", False):
        names = [n for n in names if hf_names[n] != "lm_head.weight"]  # transformers ties it to the embedding
    target = DTYPES[dtype]
    sizes = []
    for n in names:
        shape, stored = source.shapes[n]
        numel = int(torch.Size(shape).numel())
        sizes.append((n, numel * (target.itemsize if stored.is_floating_point else stored.itemsize)))
    shards = _shards(sizes, _parse_size(max_shard_size))
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, tensor in source.read(group).items():
            value = tensor.to(target) if tensor.is_floating_point() else tensor
            tensors[hf_names[name]] = value.contiguous()
            weight_map[hf_names[name]] = file
            total += value.numel() * value.element_size()
        save_file(tensors, str(staging / file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.save_pretrained(staging)
    if spec.get("generation_config"):
        from transformers import GenerationConfig

        GenerationConfig.from_dict(spec["generation_config"]).save_pretrained(staging)
    for file in _tokenizer_files(tokenizer if tokenizer is not None else spec.get("source")):
        shutil.copy2(file, staging / file.name)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def _config(spec: dict[str, Any], dtype: torch.dtype) -> Any:
    from transformers import AutoConfig

    fields = {k: v for k, v in spec["config"].items() if not k.startswith("_")}
    fields.pop("transformers_version", None)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    config.dtype = dtype
    return config


def _tokenizer_files(where: str | Path | None) -> Iterator[Path]:
    if where is None or not Path(where).is_dir():
        return
    for name in TOKENIZER_FILES:
        path = Path(where) / name
        if path.is_file():
            yield path
