"""Token ids in Arrow: a Hugging Face ``datasets`` dataset saved with ``save_to_disk``, parquet files, or a
``datasets.Dataset`` object, with a column of token-id lists (``input_ids``).

Read with ``pyarrow`` alone (the ``data`` extra). Arrow files (what ``save_to_disk`` writes) are memory-mapped: every
row's length is the difference of the list column's offsets (vectorised, nothing else read), and a row's tokens are
a view of the mapped values. Parquet files are compressed, so their lengths cost one decoding pass over the column
at set-up (each rank makes it, a row group at a time), and a rank decodes the row groups of the rows it reads (the
last few kept). For a large parquet corpus, ``lightning-hydra prepare`` writes indexed token files once.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_hydra.errors import ConfigError

__all__ = ["ArrowTokens", "arrow_kind"]

_ROW_GROUPS_KEPT = 4
"""Decoded parquet row groups a reader keeps (the rows of a step are spread over a few)."""


def _pyarrow() -> Any:
    try:
        import pyarrow as pa
    except ImportError as exc:  # pragma: no cover - the data extra
        raise ConfigError("reading Arrow or parquet data needs pyarrow: pip install 'lightning-hydra[data]'") from exc
    return pa


def arrow_kind(path: Path) -> str | None:
    """``"dict"`` (a ``DatasetDict`` saved to disk), ``"arrow"`` (a ``Dataset`` saved to disk, or ``.arrow``
    files), ``"parquet"``, or ``None`` where ``path`` holds none of them."""
    if path.is_file():
        return {".arrow": "arrow", ".parquet": "parquet"}.get(path.suffix)
    if not path.is_dir():
        return None
    if (path / "dataset_dict.json").is_file():
        return "dict"
    if (path / "state.json").is_file() or any(path.glob("*.arrow")):
        return "arrow"
    if any(path.rglob("*.parquet")):
        return "parquet"
    return None


def _check_type(column_type: Any, column: str, where: str) -> None:
    pa = _pyarrow()
    ok = (
        pa.types.is_list(column_type) or pa.types.is_large_list(column_type) or pa.types.is_fixed_size_list(column_type)
    ) and pa.types.is_integer(column_type.value_type)
    if not ok:
        hint = (
            " (text: tokenize it first, e.g. with `lightning-hydra prepare`)" if pa.types.is_string(column_type) else ""
        )
        raise ConfigError(f"column {column!r} of {where} is {column_type}, not a list of integer token ids{hint}")


class ArrowTokens(torch.utils.data.Dataset):
    """Rows of an Arrow or parquet dataset as a map-style dataset of token sequences: ``lengths()`` from the list
    offsets, ``read(i, offset, count)`` any part of row ``i``.

    It pickles as its path (each process maps the files again); built from a ``datasets.Dataset``, as that dataset
    (a dataset loaded from disk pickles as its files).

    Args:
        source: A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``, an ``.arrow``
            file, a ``.parquet`` file, a directory of parquet files (read in sorted order, subdirectories too), or a
            ``datasets.Dataset``.
        column: The column of token-id lists.
        split: The split of a ``DatasetDict`` directory.
        name: What messages and metrics call it (default: the path's name).
    """

    def __init__(self, source: Any, *, column: str = "input_ids", split: str = "train", name: str | None = None):
        self.column = column
        self.split = split
        if isinstance(source, str | os.PathLike):
            self.path: Path | None = Path(source)
            self.dataset = None
            self.name = name or self.path.name
        else:
            self.path, self.dataset = None, source
            self.name = name or "dataset"
        self._open()

    # ------------------------------------------------------------------ opening
    def _open(self) -> None:
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lengths: np.ndarray | None = None
        self._rows: np.ndarray | None = None  # a datasets.Dataset's indices mapping (select, shuffle, filter)
        if self.dataset is not None:
            self._open_dataset()
            return
        path = self.path
        kind = arrow_kind(path)
        if kind is None:
            what = "does not exist" if not path.exists() else "holds no Arrow dataset, .arrow or .parquet file"
            raise ConfigError(f"{path} {what}")
        if kind == "dict":
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            if self.split not in splits:
                raise ConfigError(f"{path} holds the splits {splits}, not {self.split!r}")
            path = path / self.split
            kind = "arrow"
        self.kind = kind
        if kind == "arrow":
            self._open_arrow(path)
        else:
            self._open_parquet(path)

    def _open_arrow(self, path: Path) -> None:
        pa = _pyarrow()
        if path.is_file():
            files = [path]
        elif (path / "state.json").is_file():
            state = json.loads((path / "state.json").read_text())
            files = [path / f["filename"] for f in state.get("_data_files", [])]
        else:
            files = sorted(path.glob("*.arrow"))
        tables = []
        for file in files:
            if not file.is_file():
                raise ConfigError(f"{path}: {file.name} is listed in state.json but missing")
            source = pa.memory_map(str(file))
            try:
                tables.append(pa.ipc.open_stream(source).read_all())  # what datasets writes
            except pa.ArrowInvalid:
                tables.append(pa.ipc.open_file(source).read_all())
        if not tables:
            raise ConfigError(f"{path} holds no data file (.arrow)")
        self._set_table(pa.concat_tables(tables) if len(tables) > 1 else tables[0], str(path))

    def _open_dataset(self) -> None:
        data = self.dataset
        table = getattr(getattr(data, "data", None), "table", None)
        if table is None:
            raise ConfigError(f"{type(data).__name__} is not a datasets.Dataset (no Arrow table)")
        self.kind = "arrow"
        self._set_table(table, f"the {self.name}")
        indices = getattr(data, "_indices", None)
        if indices is not None:
            self._rows = np.asarray(indices.column(0).to_numpy(), dtype=np.int64)

    def _set_table(self, table: Any, where: str) -> None:
        if self.column not in table.column_names:
            raise ConfigError(f"{where} has no column {self.column!r} (columns: {', '.join(table.column_names)})")
        column = table.column(self.column)
        _check_type(column.type, self.column, where)
        self._where = where
        self._chunks = []
        starts = [0]
        for chunk in column.chunks:
            if chunk.values.null_count:
                raise ConfigError(f"column {self.column!r} of {where} holds null token ids")
            self._chunks.append(
                (np.asarray(chunk.offsets) if hasattr(chunk, "offsets") else None, chunk.values.to_numpy(), chunk)
            )
            starts.append(starts[-1] + len(chunk))
        self._starts = np.asarray(starts, dtype=np.int64)

    def _open_parquet(self, path: Path) -> None:
        pa = _pyarrow()
        import pyarrow.parquet as pq

        files = [path] if path.is_file() else sorted(path.rglob("*.parquet"))
        self._files = []
        groups = []  # (file, row group) per row group, in row order
        starts = [0]
        for file in files:
            handle = pq.ParquetFile(str(file))
            schema = handle.schema_arrow
            if self.column not in schema.names:
                raise ConfigError(f"{file} has no column {self.column!r} (columns: {', '.join(schema.names)})")
            _check_type(schema.field(self.column).type, self.column, str(file))
            self._files.append(file)
            for g in range(handle.metadata.num_row_groups):
                groups.append((len(self._files) - 1, g))
                starts.append(starts[-1] + handle.metadata.row_group(g).num_rows)
        if not files:
            raise ConfigError(f"{path} holds no .parquet file")
        self._groups = groups
        self._starts = np.asarray(starts, dtype=np.int64)
        self._handles: dict[int, Any] = {}
        self._where = str(path)
        del pa

    def __getstate__(self) -> dict[str, Any]:
        keep = ("path", "dataset", "column", "split", "name")
        return {k: getattr(self, k) for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return int(self._starts[-1]) if self._rows is None else len(self._rows)

    def lengths(self) -> np.ndarray:
        """Every row's number of token ids (``int32`` where they fit), from the list offsets."""
        if self._lengths is None:
            if self.kind == "arrow":
                parts = [self._chunk_lengths(offsets, chunk) for offsets, _, chunk in self._chunks]
            else:
                parts = [self._group_lengths(g) for g in range(len(self._groups))]
            lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            if self._rows is not None:
                lengths = lengths[self._rows]
            self._lengths = lengths.astype(np.int32) if lengths.size and lengths.max() < 2**31 else lengths
        return self._lengths

    @staticmethod
    def _chunk_lengths(offsets: np.ndarray | None, chunk: Any) -> np.ndarray:
        if offsets is None:  # a fixed-size list
            return np.full(len(chunk), chunk.type.list_size, dtype=np.int64)
        return np.diff(offsets).astype(np.int64)

    def _group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Offsets and values of parquet row group ``g`` (decoded; the last few kept)."""
        key = self._groups[g]
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        import pyarrow.parquet as pq

        f, group = key
        if f not in self._handles:
            self._handles[f] = pq.ParquetFile(str(self._files[f]))
        column = self._handles[f].read_row_group(group, columns=[self.column]).column(0).combine_chunks()
        if column.values.null_count:
            raise ConfigError(f"column {self.column!r} of {self._files[f]} holds null token ids")
        offsets = (
            np.asarray(column.offsets)
            if hasattr(column, "offsets")
            else np.arange(len(column) + 1) * column.type.list_size
        )
        entry = (offsets, column.values.to_numpy())
        self._cache[key] = entry
        if len(self._cache) > _ROW_GROUPS_KEPT:
            self._cache.popitem(last=False)
        return entry

    def _group_lengths(self, g: int) -> np.ndarray:
        offsets, _ = self._group(g)
        return np.diff(offsets).astype(np.int64)

    def _row(self, index: int) -> tuple[np.ndarray, int, int]:
        """Values holding row ``index``, and where in them it starts and ends."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        row = int(self._rows[index]) if self._rows is not None else index
        k = int(np.searchsorted(self._starts, row, side="right")) - 1
        if self.kind == "arrow":
            offsets, values, chunk = self._chunks[k]
            if offsets is None:
                size = chunk.type.list_size
                first = (chunk.offset + row - int(self._starts[k])) * size
                return values, first, first + size
        else:
            offsets, values = self._group(k)
        i = row - int(self._starts[k])
        return values, int(offsets[i]), int(offsets[i + 1])

    def describe(self, index: int) -> str:
        """Row ``index`` as messages name it."""
        return f"row {index} of {self._where}"

    def read(self, index: int, offset: int = 0, count: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + count`` of row ``index`` (to its end where ``count`` is ``None``)."""
        values, first, last = self._row(int(index))
        start = first + offset
        stop = last if count is None else min(last, start + count)
        return values[start:stop]

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.read(int(index)), dtype=np.int64))  # a copy: the read is a view
