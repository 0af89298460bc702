"""Megatron's indexed token files (``<prefix>.bin`` and ``<prefix>.idx``): read memory-mapped, written byte for byte
as megatron-core's ``IndexedDatasetBuilder`` writes them.

The ``.bin`` file is every sequence's token ids, one after the other, in one integer type. The ``.idx`` file is::

    9 bytes   b"MMIDIDX\\x00\\x00"
    8 bytes   version, little-endian uint64: 1
    1 byte    dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    8 bytes   sequence count N (uint64)
    8 bytes   document count D (uint64): the entries of the document index, N + 1 for one sequence per document
    4N bytes  every sequence's length in tokens (int32)
    8N bytes  every sequence's byte offset in the .bin file (int64)
    8D bytes  the document index (int64): sequence numbers where documents start, 0 first and N last
    [N bytes  each sequence's mode (int8), in multimodal files only]

(``megatron/core/datasets/indexed_dataset.py``: ``_IndexWriter`` and ``_IndexReader``; the layout is the same from
megatron-core 0.5 to 0.19.) Megatron-LM's ``tools/preprocess_data.py``, NeMo and MaxText write and read these
files. Like megatron-core's ``GPTDataset``, :class:`IndexedTokens` trains each *sequence* as a document (a corpus
prepared with sentence splitting has several sequences per document).

Nothing is read at set-up but the 34-byte header: the lengths, offsets and tokens are memory maps, and a rank reads
the pages of the sequences it trains. The checks that need no pass over the data are made when the files are
opened (:func:`read_index`): both files present, the header, the version, an integer type, the index's size, the
``.bin`` file's size against the last sequence's end. Token ids are checked against the model's vocabulary on a
sample at set-up and on every read (:class:`~lightning_hydra.data.mixture.Mixture`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_hydra.errors import ConfigError

__all__ = [
    "DTYPE_CODES",
    "HEADER",
    "HEADER_BYTES",
    "VERSION",
    "IndexFile",
    "IndexedTokens",
    "IndexedWriter",
    "dtype_code",
    "optimal_dtype",
    "read_index",
]

HEADER = b"MMIDIDX\x00\x00"
"""The first 9 bytes of every ``.idx`` file."""
VERSION = 1
"""The index version megatron-core writes and reads."""
HEADER_BYTES = 34
"""Header, version, dtype code, sequence count and document count."""
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""megatron-core's ``DType`` codes."""
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


def dtype_code(dtype: type[np.generic] | np.dtype) -> int:
    """megatron-core's code of a token type (``KeyError`` for a type it does not define)."""
    return _CODE_OF[np.dtype(dtype)]


def optimal_dtype(vocab_size: int | None) -> type[np.integer]:
    """The token type megatron-core's ``DType.optimal_dtype`` picks for a vocabulary: ``uint16`` below 65,500 ids,
    else ``int32``."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def _paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """The ``.bin`` and ``.idx`` files of a prefix (a path given with either suffix names the same pair)."""
    text = str(prefix)
    if text.endswith((".bin", ".idx")):
        text = text[:-4]
    return Path(text + ".bin"), Path(text + ".idx")


@dataclass(frozen=True)
class IndexFile:
    """What an ``.idx`` file says, the arrays memory-mapped (nothing read but the header)."""

    path: Path
    """The ``.idx`` file."""
    bin_path: Path
    """Its ``.bin`` file."""
    dtype: np.dtype
    """Type of the token ids in the ``.bin`` file."""
    lengths: np.ndarray
    """``[N]`` tokens of every sequence (``int32``)."""
    pointers: np.ndarray
    """``[N]`` byte offset of every sequence in the ``.bin`` file (``int64``)."""
    document_index: np.ndarray
    """``[D]`` sequence numbers where documents start, ``N`` last (``int64``)."""
    multimodal: bool
    """Whether the index holds a mode per sequence."""


def read_index(prefix: str | os.PathLike) -> IndexFile:
    """Open the index of ``prefix`` and check it against its ``.bin`` file without a pass over either
    (:class:`~lightning_hydra.errors.ConfigError` naming the file and what is wrong)."""
    bin_path, idx_path = _paths(prefix)
    missing = [p.name for p in (bin_path, idx_path) if not p.is_file()]
    if missing:
        raise ConfigError(
            f"indexed token files {bin_path.with_suffix('')}: {' and '.join(missing)} not found (a prefix names "
            "<prefix>.bin and <prefix>.idx, as Megatron's tools/preprocess_data.py or `lightning-hydra prepare` "
            "write them)"
        )
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != HEADER:
        raise ConfigError(f"{idx_path} is not a Megatron index: it does not start with {HEADER!r}")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise ConfigError(f"{idx_path} is an index of version {version}; this reader reads version {VERSION}")
    code = head[17]
    if code not in DTYPE_CODES:
        raise ConfigError(f"{idx_path} names token type code {code}, which megatron-core does not define (1..8)")
    dtype = np.dtype(DTYPE_CODES[code])
    if dtype.kind == "f":
        raise ConfigError(f"{idx_path} holds {dtype} values; token files hold integer ids")
    count, docs = struct.unpack("<QQ", head[18:34])
    plain = HEADER_BYTES + 12 * count + 8 * docs
    if size not in (plain, plain + count):
        raise ConfigError(
            f"{idx_path} has {size} bytes; an index of {count} sequences and {docs} document entries has {plain} "
            f"(or {plain + count} with modes): the file is truncated or was written by another format"
        )
    whole = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = whole[HEADER_BYTES : HEADER_BYTES + 4 * count].view(np.int32)
    pointers = whole[HEADER_BYTES + 4 * count : HEADER_BYTES + 12 * count].view(np.int64)
    document_index = whole[HEADER_BYTES + 12 * count : plain].view(np.int64)
    if docs == 0 or document_index[0] != 0 or document_index[-1] != count:
        raise ConfigError(
            f"{idx_path}: the document index must run from sequence 0 to {count}, got "
            f"{document_index[:1].tolist()}..{document_index[-1:].tolist()}"
        )
    data = bin_path.stat().st_size
    end = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if count else 0
    if count and (int(pointers[0]) != 0 or end != data):
        raise ConfigError(
            f"{bin_path} has {data} bytes but its index places the last sequence's end at byte {end}: the files "
            "do not belong together (or one is truncated)"
        )
    return IndexFile(idx_path, bin_path, dtype, lengths, pointers, document_index, size != plain)


class IndexedTokens(torch.utils.data.Dataset):
    """Megatron indexed token files (one prefix or several, one after the other) as a map-style dataset of
    sequences: ``lengths()`` from the indexes, ``read(i, offset, count)`` any part of sequence ``i`` (memory-mapped;
    only the pages read are loaded).

    It pickles as its prefixes (each process maps the files again), so the data module sends it to the ranks for
    nothing.

    Args:
        prefixes: ``<prefix>`` of ``<prefix>.bin`` and ``<prefix>.idx`` (or several).
        name: What messages and metrics call it (default: the first prefix's file name).
    """

    def __init__(self, prefixes: str | os.PathLike | Sequence[str | os.PathLike], *, name: str | None = None) -> None:
        if isinstance(prefixes, str | os.PathLike):
            prefixes = [prefixes]
        if not prefixes:
            raise ConfigError("IndexedTokens needs at least one prefix")
        self.prefixes = [str(p)[:-4] if str(p).endswith((".bin", ".idx")) else str(p) for p in prefixes]
        self.name = name or Path(self.prefixes[0]).name
        self._open()

    def _open(self) -> None:
        self.files = [read_index(p) for p in self.prefixes]
        counts = [len(f.lengths) for f in self.files]
        self.offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        """First sequence of each file in this dataset's numbering (and the total last)."""
        self._bins: list[np.memmap | None] = [None] * len(self.files)

    def __getstate__(self) -> dict[str, Any]:
        return {"prefixes": self.prefixes, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefixes, self.name = state["prefixes"], state["name"]
        self._open()

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        """Every sequence's length (``int32``; for one prefix the index's memory map itself, no copy)."""
        if len(self.files) == 1:
            return self.files[0].lengths
        return np.concatenate([f.lengths for f in self.files])

    def locate(self, index: int) -> tuple[int, int]:
        """``(file, sequence in the file)`` of sequence ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} of {len(self)}")
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return k, index - int(self.offsets[k])

    def describe(self, index: int) -> str:
        """Sequence ``index`` as messages name it: its number in its file, and the file."""
        k, i = self.locate(index)
        return f"sequence {i} of {self.files[k].bin_path}"

    def read(self, index: int, offset: int = 0, count: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + count`` of sequence ``index`` (to its end where ``count`` is ``None``), a
        read-only view of the memory map in the file's type."""
        k, i = self.locate(index)
        f = self.files[k]
        length = int(f.lengths[i])
        count = length - offset if count is None else min(count, length - offset)
        if self._bins[k] is None:
            self._bins[k] = np.memmap(f.bin_path, dtype=np.uint8, mode="r")
        start = int(f.pointers[i]) + offset * f.dtype.itemsize
        return self._bins[k][start : start + count * f.dtype.itemsize].view(f.dtype)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.read(int(index)).astype(np.int64))


class IndexedWriter:
    """Write ``<prefix>.bin`` and ``<prefix>.idx`` byte for byte as megatron-core's ``IndexedDatasetBuilder`` does
    with ``add_item`` then ``end_document`` per document (one sequence per document), or ``add_document`` with
    several sequences.

    Args:
        prefix: The output prefix.
        dtype: Type of the token ids (:func:`optimal_dtype` of the vocabulary).
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type[np.integer] | np.dtype = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF or self.dtype.kind == "f":
            raise ValueError(f"token type {self.dtype} is not one of megatron-core's integer types")
        self.bin_path, self.idx_path = _paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._data = open(self.bin_path, "wb")  # noqa: SIM115 - closed by finalize (or the context's exit)
        self._lengths: list[np.ndarray] = []
        self._documents: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._count = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents of one sequence each: ``tokens`` is their ids one after the other, ``lengths`` how many
        belong to each."""
        lengths = np.asarray(lengths, dtype=np.int64)
        tokens = np.asarray(tokens)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"{tokens.size} tokens for documents of {int(lengths.sum())} in all")
        if tokens.size and (tokens.min() < np.iinfo(self.dtype).min or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {self.dtype}")
        self._data.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(lengths.astype(np.int32))
        self._documents.append(self._count + np.arange(1, len(lengths) + 1, dtype=np.int64))
        self._count += len(lengths)

    def add_document(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, lengths: Sequence[int] | None = None):
        """Append one document: one sequence, or several of ``lengths`` (megatron-core's ``add_document``)."""
        array = np.asarray(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)
        parts = np.asarray([array.size] if lengths is None else lengths, dtype=np.int64)
        if int(parts.sum()) != array.size:
            raise ValueError(f"{array.size} tokens for sequences of {int(parts.sum())} in all")
        self._data.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(parts.astype(np.int32))
        self._count += len(parts)
        self._documents.append(np.asarray([self._count], dtype=np.int64))

    def finalize(self) -> None:
        """Close the ``.bin`` file and write the ``.idx`` file."""
        self._data.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.concatenate(self._documents)
        with open(self.idx_path, "wb") as f:
            f.write(HEADER)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", _CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(documents)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(documents.tobytes(order="C"))

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.finalize()
        else:
            self._data.close()
