"""The embedded demo corpus: the running interpreter's standard-library sources, read as bytes.

Every Python install carries these files, so nothing is downloaded: real documents with a real long-tailed
length distribution (a few hundred bytes to a few hundred kilobytes).
"""

from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np

__all__ = ["stdlib_files", "stdlib_lengths"]


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
