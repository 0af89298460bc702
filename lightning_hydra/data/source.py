"""Reading a map-style dataset for planning: every item's length known once (given, from ``dataset.lengths()``, or
scanned with the pool sharing the reads) and each item read back as the 1-D token ids it was planned by.

An item that holds no token ids (an int, text, ``None``, a 0-d tensor, a dict without ``input_ids``), whose ids are
not integers, or whose length disagrees with its recorded one is an error naming the split and the item; in the
shared scan, one rank's failure is every rank's :class:`~lightning_hydra.errors.ConfigError` (no rank waits in a
gather for a rank that has gone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_hydra.errors import ConfigError

__all__ = ["DatasetSource", "checked_lengths", "in_memory_lengths", "scan_lengths"]


def _token_ids(item: Any) -> Any:
    """The token ids a dataset item holds: the item itself (a list, tensor or array) or its ``input_ids`` entry;
    ``ValueError`` saying what the item is where it holds none."""
    what = "every dataset item"
    if isinstance(item, Mapping):
        if "input_ids" not in item:
            keys = [repr(k) for k in list(item)[:6]]
            listed = ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
            raise ValueError(f"a dict item must hold its token ids under 'input_ids', got keys {listed or 'none'}")
        item, what = item["input_ids"], "a dict item's 'input_ids'"
    if isinstance(item, str | bytes):  # a bytearray is read as uint8 ids, as it always was
        raise ValueError(f"the item holds text ({type(item).__name__}), not token ids: tokenize the dataset first")
    if isinstance(item, torch.Tensor | np.ndarray) and item.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {tuple(item.shape)}")
    if not hasattr(item, "__len__"):
        hint = " (or a dict with 'input_ids')" if what == "every dataset item" else ""
        raise ValueError(f"{what} must be a 1-D sequence of token ids{hint}, got a value of type {type(item).__name__}")
    return item


def _as_tensor(item: Any) -> torch.Tensor:
    """A dataset item as a 1-D long tensor (tensors, lists, numpy arrays, or a dict with ``input_ids``)."""
    item = _token_ids(item)
    try:
        t = torch.as_tensor(np.asarray(item) if not isinstance(item, torch.Tensor) else item)
    except (TypeError, ValueError) as exc:  # ragged nesting, None or objects among the ids
        raise ValueError(f"every dataset item must be a 1-D sequence of token ids ({exc})") from None
    if t.dim() != 1:
        raise ValueError(f"every dataset item must be a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    if t.is_complex() or t.dtype == torch.bool or (t.is_floating_point() and not bool((t == t.trunc()).all())):
        # a cast would train other ids than the data holds (1.7 as 1, NaN as the most negative id)
        raise ValueError(
            f"every dataset item must hold integer token ids, got {t.dtype} values such as {t[:3].tolist()}"
        )
    return t.long()


def scan_lengths(dataset: Any, rank: int = 0, world_size: int = 1) -> dict[int, int]:
    """Lengths of the items ``rank, rank + world_size, ...`` of ``dataset``, each item read once (``ValueError``
    naming the first item that holds no token ids)."""
    return {i: _length_of(dataset, i) for i in range(rank, len(dataset), world_size)}


def in_memory_lengths(dataset: Any, name: str) -> list[int] | None:
    """Every item's length when the dataset is held in memory (a ``list`` or ``tuple`` of token-id sequences), where
    reading them costs nothing: the launching process checks them before any rank starts. ``None`` for any other
    dataset (its lengths are given, or scanned at set-up by the pool); an item that holds no token ids is a
    :class:`~lightning_hydra.errors.ConfigError` naming it."""
    return _scan(dataset, name, None) if isinstance(dataset, list | tuple) else None


def _length_of(dataset: Any, index: int) -> int:
    """The length of item ``index`` (``ValueError`` naming it where it holds no token ids)."""
    try:
        return len(_token_ids(dataset[index]))
    except ValueError as exc:
        raise ValueError(f"item {index}: {exc}") from None


class DatasetSource:
    """A map-style dataset with its lengths known once (given, from ``dataset.lengths()``, or scanned once with the
    pool sharing the reads), truncated when asked."""

    def __init__(
        self,
        dataset: Any,
        name: str,
        max_seq_len: int | None,
        truncate: bool,
        *,
        lengths: Sequence[int] | np.ndarray | None = None,
        runtime: Any = None,
    ) -> None:
        if dataset is None or len(dataset) == 0:
            raise ConfigError(f"the {name} dataset is empty")
        self.dataset = dataset
        self.name = name
        if lengths is None and hasattr(dataset, "lengths"):
            lengths = dataset.lengths()
        if lengths is None:
            lengths = in_memory_lengths(dataset, name)  # read where it is held: no gather across the pool
        if lengths is None:
            lengths = _scan(dataset, name, runtime)
        self.max_seq_len = max_seq_len if truncate else None
        self.lengths = checked_lengths(lengths, len(dataset), name, max_seq_len, truncate)
        self.vocab_size: int | None = None
        """Token ids must lie in ``[0, vocab_size)`` (``None``: unchecked); set by the data module at set-up."""

    def item(self, index: int) -> torch.Tensor:
        """Item ``index`` as a 1-D long tensor (cut to ``max_seq_len`` when truncating), its length and token ids
        checked (``ValueError``: this rank read a sequence that disagrees with its recorded length or vocabulary)."""
        try:
            t = _as_tensor(self.dataset[index])
        except ValueError as exc:
            raise ValueError(f"{self.name} item {index}: {exc}") from None
        read = t.numel()
        t = t[: self.max_seq_len] if self.max_seq_len else t
        if t.numel() != self.lengths[index]:  # when truncating, both are cut to max_seq_len
            cut = f" ({t.numel()} once cut to max_seq_len={self.max_seq_len})" if self.max_seq_len else ""
            raise ValueError(
                f"{self.name} item {index} has {read} tokens{cut}, but its recorded length is {self.lengths[index]}"
            )
        if self.vocab_size is not None and t.numel():
            low, high = int(t.min()), int(t.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"{self.name} item {index} holds token id {bad}, outside the model's vocabulary of "
                    f"{self.vocab_size} (ids 0..{self.vocab_size - 1}): tokenize with the model's tokenizer, or give "
                    "the model a larger vocab_size"
                )
        return t


def _scan(dataset: Any, name: str, runtime: Any) -> list[int]:
    """Every item's length, the pool sharing the reads. An item that holds no token ids, or a read that fails, is a
    :class:`~lightning_hydra.errors.ConfigError` on every rank naming the item and the rank that read it (the other
    ranks do not wait in the gather for a rank that has gone); on one process a failed read is raised as the dataset
    raised it."""
    rank, world = (runtime.global_rank, runtime.world_size) if runtime is not None else (0, 1)
    found: dict[int, int] = {}
    error, said = None, None
    for i in range(rank, len(dataset), world):
        try:
            found[i] = _length_of(dataset, i)
        except Exception as exc:  # whatever the read raised, every rank must hear of it
            error = exc
            said = str(exc) if isinstance(exc, ValueError) else f"item {i}: the read failed: {exc!r}"
            break
    if world == 1:
        if isinstance(error, ValueError):
            raise ConfigError(f"the {name} dataset's {said}") from error
        if error is not None:
            raise error  # the dataset's own failure, as it raised it
        return [found[i] for i in range(len(dataset))]
    parts = runtime.all_gather_object((found, said))
    failed = [(r, message) for r, (_, message) in enumerate(parts) if message is not None]
    if failed:
        raise ConfigError(f"the {name} dataset's {failed[0][1]} (read by rank {failed[0][0]})") from error
    merged: dict[int, int] = {}
    for part, _ in parts:
        merged.update(part)
    return [merged[i] for i in range(len(dataset))]


def checked_lengths(lengths: Any, size: int, name: str, max_seq_len: int | None, truncate: bool) -> np.ndarray:
    """The lengths of a dataset of ``size`` items as an array, checked (``ConfigError``) and cut when truncating."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (size,):
        raise ConfigError(f"{name} lengths hold {lengths.size} entries for a dataset of {size} items")
    if (lengths <= 0).any():
        bad = int(np.flatnonzero(lengths <= 0)[0])
        raise ConfigError(f"{name} dataset item {bad} is empty")
    return np.minimum(lengths, max_seq_len) if (truncate and max_seq_len) else lengths
