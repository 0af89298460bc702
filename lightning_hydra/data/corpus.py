"""The embedded demo corpus: the running interpreter's standard-library sources, read as bytes.

Every Python install carries these files, so nothing is downloaded: real documents with a real long-tailed
length distribution (a few hundred bytes to a few hundred kilobytes).
"""

from __future__ import annotations

import hashlib
import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["EOS_ID", "PAD_ID", "VOCAB_SIZE", "StdlibCorpus", "stdlib_files", "stdlib_lengths"]

PAD_ID = 256
"""Padding token of the byte vocabulary."""
EOS_ID = 257
"""End-of-document token appended to every file."""
VOCAB_SIZE = 258
"""256 byte values plus PAD and EOS."""


@lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """The standard library's ``.py`` files (tests and site-packages excluded), sorted for determinism."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("site-packages", "dist-packages") or "test" in parts or "tests" in parts:
            continue
        if path.is_file() and path.stat().st_size > 0:
            files.append(path)
    if not files:
        raise RuntimeError(f"no standard-library sources found under {root}")
    return tuple(files)


def stdlib_lengths() -> np.ndarray:
    """Byte length of every standard-library file of :func:`stdlib_files`."""
    return np.asarray([p.stat().st_size for p in stdlib_files()], dtype=np.int64)


class StdlibCorpus(Dataset):
    """The standard library's sources as documents of byte tokens (each file ends with ``EOS_ID``).

    Files are split into train and validation by a hash of their path (stable across runs and machines with the
    same Python), and filtered by length.
    """

    def __init__(
        self, split: str = "train", *, min_bytes: int = 64, max_bytes: int | None = 65536, val_share: float = 0.05
    ) -> None:
        """Select the corpus documents.

        Args:
            split: ``"train"``, ``"val"`` or ``"all"``.
            min_bytes: Files shorter than this are left out.
            max_bytes: Files longer than this are left out (``None``: keep all).
            val_share: Share of files held out for validation.
        """
        if split not in ("train", "val", "all"):
            raise ValueError(f"split must be train, val or all, got {split!r}")
        root = Path(sysconfig.get_paths()["stdlib"])
        keep = []
        for path in stdlib_files():
            size = path.stat().st_size
            if size < min_bytes or (max_bytes is not None and size > max_bytes):
                continue
            bucket = int(hashlib.sha256(str(path.relative_to(root)).encode()).hexdigest()[:8], 16) / 2**32
            if split == "all" or (split == "val") == (bucket < val_share):
                keep.append(path)
        if not keep:
            raise ValueError(f"the {split} split of the standard-library corpus is empty with these length filters")
        self.files = keep

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        data = self.files[index].read_bytes()
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        return torch.cat([tokens, torch.tensor([EOS_ID])])

    def lengths(self) -> np.ndarray:
        """Token count of every document without reading the files (size + EOS)."""
        return np.asarray([p.stat().st_size + 1 for p in self.files], dtype=np.int64)
