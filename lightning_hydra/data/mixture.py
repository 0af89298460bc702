"""A split's data as the planner sees it: units (documents, or the consecutive pieces of longer ones) drawn from one
source or blended from several by weight, each epoch's order and global batches formed in NumPy.

**Sources.** A source is a map-style dataset of token sequences (:class:`MapSource` over
:class:`~lightning_hydra.data.source.DatasetSource`, as before), Megatron indexed token files
(:class:`~lightning_hydra.data.indexed.IndexedTokens`) or Arrow/parquet data
(:class:`~lightning_hydra.data.arrow.ArrowTokens`), given by path in a recipe (:func:`parse_sources`,
:func:`open_source`). Empty documents of a file source are left out (its index may hold some); a source left with
no document is an error.

**Units.** A document longer than ``max_seq_len`` is an error (``long="error"``), cut (``"truncate"``: its tail is
not trained) or split into consecutive pieces of ``max_seq_len`` tokens, the last shorter (``"split"``). Each piece
is planned and trained as a document of its own: positions restart at 0 and its last token has no label, so a
document of ``p`` pieces trains ``p - 1`` fewer labels than it would whole. The units of a source are its documents'
first pieces, in document order, then the further pieces (a small table where few documents are long), so that
without long documents unit ``i`` is document ``i``.

**Orders.** One source (or validation data, read in order): every unit once per epoch, in the order of
:func:`~lightning_hydra.data.batching.epoch_permutation` (the batches of today's loop for the same seed). Several
sources with weights (training): a blend, as Megatron's blended datasets do it. Weights are shares of tokens. An
epoch of the blend draws as many tokens as its sources hold together: ``round(w_s * T / mean_s)`` units of source
``s`` (``T`` the sources' tokens, ``mean_s`` the source's mean unit length), at least one where ``w_s > 0``. Those
draws are shuffled among each other by the seed and the epoch; each source hands out its units in its own epochs
(a permutation each, by the seed, the source and its epoch), continuing where the last blend epoch stopped, so that
a source drawn more than its size is repeated a whole source epoch at a time and one drawn less continues in the
next blend epoch. Every unit is trained exactly once per epoch of its source. The realised shares differ from the
weights by the sampling error of which units were drawn (nothing where a source is drawn whole source epochs).

Everything is a function of the sources' lengths, the weights, the seed and the epoch: not of the world size, the
tensor-parallel degree or the step a run resumed at.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_hydra.data.batching import EpochBatches, index_dtype
from lightning_hydra.data.source import DatasetSource
from lightning_hydra.errors import ConfigError

__all__ = ["LONG_DOCUMENTS", "MapSource", "Mixture", "SourceSpec", "open_source", "parse_sources"]

LONG_DOCUMENTS = ("error", "truncate", "split")
"""What happens to a document longer than ``max_seq_len``."""

_BLEND = 0xB1E9D
"""Salt of the blend's seeds (a source's epochs, the draws' shuffle), apart from the single-source permutation's."""

_SAMPLE_DOCS = 16
"""Documents of each file source whose token ids are checked against the vocabulary at set-up (besides the first
and the last)."""
_SAMPLE_TOKENS = 1 << 16
"""Tokens read at most from each sampled document."""


# ---------------------------------------------------------------------------------------------- sources by path
@dataclass(frozen=True)
class SourceSpec:
    """A source given by path (a recipe's ``sources:`` entry)."""

    path: str | tuple[str, ...]
    """Indexed token files' prefix (or several, read as one source), a ``save_to_disk`` directory, an ``.arrow`` or
    ``.parquet`` file, or a directory of parquet files."""
    weight: float = 1.0
    """Share of the blend's tokens (relative to the other sources' weights)."""
    name: str = ""
    """What messages and metrics call it (default: the path's file name)."""
    column: str = "input_ids"
    """Column of token-id lists (Arrow and parquet)."""
    split: str = "train"
    """Split of a ``DatasetDict`` directory."""


_KEYS = ("path", "weight", "name", "column", "split")


def _indexed(path: str) -> bool:
    base = path[:-4] if path.endswith((".bin", ".idx")) else path
    return Path(base + ".idx").exists() or Path(base + ".bin").exists()


def parse_sources(value: Any, what: str = "sources") -> list[SourceSpec]:
    """Sources from a recipe's value: a path, a ``{path, weight, name, column, split}`` mapping, or a list of
    either. :class:`~lightning_hydra.errors.ConfigError` on a path that holds no data, a negative or non-finite
    weight, weights that are all zero, an unknown key or a repeated name."""
    if value is None:
        return []
    items = [value] if isinstance(value, str | Path | dict | SourceSpec) else list(value)
    if not items:
        raise ConfigError(f"{what} is empty: give at least one path")
    specs: list[SourceSpec] = []
    for k, item in enumerate(items):
        if isinstance(item, SourceSpec):
            spec = item
        elif isinstance(item, str | Path):
            spec = SourceSpec(path=str(item))
        elif isinstance(item, dict):
            unknown = sorted(set(item) - set(_KEYS))
            if unknown:
                raise ConfigError(f"{what}[{k}] has unknown key(s) {unknown}; a source has {list(_KEYS)}")
            if "path" not in item:
                raise ConfigError(f"{what}[{k}] has no path")
            raw = item["path"]
            path = str(raw) if isinstance(raw, str | Path) else tuple(str(p) for p in raw)
            weight = item.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise ConfigError(f"{what}[{k}] has weight {weight!r}: a number >= 0")
            spec = SourceSpec(
                path=path,
                weight=float(weight),
                name=str(item.get("name") or ""),
                column=str(item.get("column", "input_ids")),
                split=str(item.get("split", "train")),
            )
        else:
            raise ConfigError(f"{what}[{k}] is {type(item).__name__}: give a path or a mapping with a path")
        if not math.isfinite(spec.weight) or spec.weight < 0:
            raise ConfigError(f"{what}[{k}] ({spec.path}) has weight {spec.weight}: weights must be >= 0")
        for p in [spec.path] if isinstance(spec.path, str) else spec.path:
            if not (_indexed(p) or Path(p).exists()):
                raise ConfigError(
                    f"{what}[{k}]: {p} is neither a file, a directory nor the prefix of indexed token files "
                    f"({p}.bin and {p}.idx)"
                )
        specs.append(spec)
    if sum(s.weight for s in specs) <= 0:
        raise ConfigError(f"the weights of {what} are all zero: give at least one a positive weight")
    names: list[str] = []
    for spec in specs:
        first = spec.path if isinstance(spec.path, str) else spec.path[0]
        name = spec.name or Path(first[:-4] if first.endswith((".bin", ".idx")) else first).name
        if name in names:
            if spec.name:
                raise ConfigError(f"two sources of {what} are named {name!r}: give each its own name")
            name = f"{name}_{len(names)}"
        names.append(name)
    return [SourceSpec(s.path, s.weight, n, s.column, s.split) for s, n in zip(specs, names, strict=True)]


def open_source(spec: SourceSpec) -> Any:
    """The token source a spec names: indexed token files where ``<path>.idx`` or ``<path>.bin`` exists, else Arrow
    or parquet data (:class:`~lightning_hydra.errors.ConfigError` on anything else)."""
    from lightning_hydra.data.arrow import ArrowTokens, arrow_kind
    from lightning_hydra.data.indexed import IndexedTokens

    paths = [spec.path] if isinstance(spec.path, str) else list(spec.path)
    if all(_indexed(p) for p in paths):
        return IndexedTokens(paths, name=spec.name)
    if len(paths) == 1 and arrow_kind(Path(paths[0])) is not None:
        return ArrowTokens(paths[0], column=spec.column, split=spec.split, name=spec.name)
    raise ConfigError(
        f"{', '.join(paths)}: not indexed token files (<prefix>.bin/.idx), a datasets directory (save_to_disk), "
        "an .arrow file or parquet"
    )


class MapSource:
    """A map-style dataset, its lengths known (:class:`~lightning_hydra.data.source.DatasetSource`), as a source:
    its items, their checks and their messages are the dataset source's."""

    def __init__(self, source: DatasetSource) -> None:
        self.source = source
        self.name = source.name

    def __len__(self) -> int:
        return len(self.source.lengths)

    def lengths(self) -> np.ndarray:
        """The checked (and, when truncating, cut) lengths."""
        return self.source.lengths

    def describe(self, index: int) -> str:
        """Item ``index`` as messages name it."""
        return f"{self.name} item {index}"


# ---------------------------------------------------------------------------------------------- the mixture
def _metric_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "source"


class Mixture:
    """A split's units over its sources (see the module's docstring): their lengths, each epoch's global batches,
    and each unit's tokens as a 1-D long tensor, checked.

    Args:
        sources: Token sources (:class:`MapSource`, :class:`~lightning_hydra.data.indexed.IndexedTokens`,
            :class:`~lightning_hydra.data.arrow.ArrowTokens`, or any object with ``name``, ``lengths()``,
            ``read(i, offset, count)`` and ``describe(i)``).
        name: The split's name in messages (``"train"``, ``"validation"``).
        weights: Each source's weight; with ``blend``, the blend's token shares.
        max_seq_len: Longest unit (``None``: no limit).
        long: What happens to longer documents (:data:`LONG_DOCUMENTS`).
        blend: Draw the sources by weight (training), else read every unit once per epoch.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        name: str,
        *,
        weights: Sequence[float] | None = None,
        max_seq_len: int | None = None,
        long: str = "error",
        blend: bool = False,
    ) -> None:
        if long not in LONG_DOCUMENTS:
            raise ValueError(f"long must be one of {LONG_DOCUMENTS}, got {long!r}")
        self.sources = list(sources)
        self.name = name
        weights = [1.0] * len(self.sources) if weights is None else [float(w) for w in weights]
        total = sum(weights)
        self.weights = np.asarray([w / total for w in weights], dtype=np.float64)
        self.max_seq_len = max_seq_len
        self.long = long
        self.blend = bool(blend) and len(self.sources) > 1
        self._vocab_size: int | None = None
        self._build()

    # ------------------------------------------------------------------ units
    def _build(self) -> None:
        cap = self.max_seq_len
        self._kept: list[np.ndarray | None] = []  # the non-empty documents of each source (None: all)
        self._extra: list[tuple[np.ndarray, np.ndarray] | None] = []  # further pieces: (document, offset)
        self._first: list[int] = []  # units that are a document's first piece
        parts = []
        for src in self.sources:
            raw = np.asarray(src.lengths())
            kept = None
            if raw.size and int(raw.min()) <= 0:
                kept = np.flatnonzero(raw > 0).astype(index_dtype(len(raw)))
            docs = raw if kept is None else raw[kept]
            if docs.size == 0:
                empty = f" (all {raw.size} are empty)" if raw.size else ""
                raise ConfigError(f"the {self.name} source {src.name} holds no documents{empty}")
            extra = None
            if cap and self.long != "error" and int(docs.max()) > cap:
                units = np.minimum(docs, cap)
                if self.long == "split":
                    pieces = (docs.astype(np.int64) + cap - 1) // cap
                    long_docs = np.flatnonzero(pieces > 1)
                    more = pieces[long_docs] - 1
                    doc = np.repeat(long_docs, more)
                    first = np.cumsum(more) - more
                    offset = (np.arange(len(doc)) - np.repeat(first, more) + 1) * cap
                    length = np.minimum(cap, docs[doc].astype(np.int64) - offset)
                    units = np.concatenate([units, length.astype(units.dtype)])
                    extra = (doc, offset)
            else:
                units = docs
            self._kept.append(kept)
            self._extra.append(extra)
            self._first.append(len(docs))
            parts.append(units)
        counts = [len(p) for p in parts]
        self.offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        """First unit of each source (and the total last)."""
        self.lengths: np.ndarray = parts[0] if len(parts) == 1 else np.concatenate(parts)
        """Every unit's length."""
        self.source_units = np.asarray(counts, dtype=np.int64)
        """Units of each source."""
        self.source_tokens_total = np.asarray([int(p.sum(dtype=np.int64)) for p in parts], dtype=np.int64)
        """Tokens of each source's units."""
        self.unit_source = np.repeat(np.arange(len(parts), dtype=np.int16), counts) if len(parts) > 1 else None
        """Source of every unit (several sources only)."""
        self.draws = self._draws() if self.blend else None
        """Units drawn from each source per epoch of the blend."""

    def _draws(self) -> np.ndarray:
        total = float(self.source_tokens_total.sum())
        mean = self.source_tokens_total / self.source_units
        draws = np.floor(self.weights * total / mean + 0.5).astype(np.int64)
        return np.where(self.weights > 0, np.maximum(draws, 1), 0)

    _DERIVED = ("_kept", "_extra", "_first", "offsets", "lengths", "source_units", "source_tokens_total",
                "unit_source", "draws")  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        """File sources pickle as their paths and the units are rebuilt where unpickled (no array is sent)."""
        state = dict(self.__dict__)
        if not any(isinstance(s, MapSource) for s in self.sources):
            for key in self._DERIVED:
                state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "lengths" not in state:
            self._build()

    @property
    def names(self) -> tuple[str, ...]:
        """The sources' names."""
        return tuple(str(s.name) for s in self.sources)

    @property
    def vocab_size(self) -> int | None:
        """Token ids must lie in ``[0, vocab_size)`` (``None``: unchecked); set by the data module at set-up."""
        return self._vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int | None) -> None:
        self._vocab_size = value
        for src in self.sources:
            if isinstance(src, MapSource):
                src.source.vocab_size = value

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, unit: int) -> tuple[int, int, int, int]:
        """``(source, document, offset, length)`` of unit ``unit``: its source, the document in the source's
        numbering, where the piece starts in it, and its tokens."""
        s = 0 if len(self.sources) == 1 else int(np.searchsorted(self.offsets, unit, side="right")) - 1
        u = unit - int(self.offsets[s])
        if u < self._first[s]:
            pos, offset = u, 0
        else:
            doc, off = self._extra[s]  # type: ignore[misc]
            pos, offset = int(doc[u - self._first[s]]), int(off[u - self._first[s]])
        kept = self._kept[s]
        return s, int(kept[pos]) if kept is not None else pos, offset, int(self.lengths[unit])

    def describe(self, unit: int) -> str:
        """Unit ``unit`` as messages name it (its document, the piece, the file)."""
        s, doc, offset, length = self.locate(unit)
        piece = f"tokens {offset}..{offset + length - 1} of " if offset else ""
        return piece + self.sources[s].describe(doc)

    # ------------------------------------------------------------------ reading
    def item(self, unit: int) -> torch.Tensor:
        """Unit ``unit`` as a 1-D long tensor, its length and token ids checked (``ValueError`` naming the
        document and the file: this rank read data that disagrees with its index or the model's vocabulary)."""
        s, doc, offset, length = self.locate(int(unit))
        src = self.sources[s]
        if isinstance(src, MapSource):
            t = src.source.item(doc)  # its own checks and messages
            return t[offset : offset + length] if self.long == "split" else t
        t = torch.from_numpy(np.array(src.read(doc, offset, length), dtype=np.int64))  # a copy of the mapped view
        if t.numel() != length:
            raise ValueError(
                f"{self.name}: {src.describe(doc)} gave {t.numel()} tokens at offset {offset}, where {length} "
                "were planned"
            )
        if self._vocab_size is not None and t.numel():
            bad = _outside(t.numpy(), self._vocab_size)
            if bad is not None:
                raise ValueError(self._vocab_message(src, doc, offset + bad[0], bad[1]))
        return t

    def _vocab_message(self, src: Any, doc: int, position: int, token: int) -> str:
        v = self._vocab_size
        return (
            f"{src.describe(doc)} holds token id {token} (at token {position}), outside the model's vocabulary of "
            f"{v} (ids 0..{v - 1}): tokenize with the model's tokenizer, or give the model a larger vocab_size"
        )

    def check_sample(self, vocab_size: int | None, seed: int = 0) -> None:
        """Check a sample of every file source's token ids against the vocabulary (the first and last document and
        :data:`_SAMPLE_DOCS` drawn by ``seed``, at most :data:`_SAMPLE_TOKENS` tokens of each):
        :class:`~lightning_hydra.errors.ConfigError` naming the id, the document and the file. Every read is
        checked again when it is trained (:meth:`item`)."""
        if vocab_size is None:
            return
        rng = np.random.default_rng([seed, _BLEND])
        for src in self.sources:
            if isinstance(src, MapSource):
                continue
            n = len(src)
            picks = sorted({0, n - 1, *rng.integers(0, n, size=min(n, _SAMPLE_DOCS)).tolist()})
            for doc in picks:
                tokens = np.asarray(src.read(doc, 0, _SAMPLE_TOKENS))
                bad = _outside(tokens, vocab_size)
                if bad is not None:
                    self._vocab_size = vocab_size
                    raise ConfigError(self._vocab_message(src, doc, bad[0], bad[1]))

    # ------------------------------------------------------------------ epochs
    def epoch_batches(self, budget: int, *, seed: int, epoch: int, shuffle: bool) -> EpochBatches:
        """The global batches of ``epoch`` (a blend counts each source's tokens before every batch)."""
        if not self.blend:
            return EpochBatches(self.lengths, budget, seed=seed, epoch=epoch, shuffle=shuffle)
        order = self.blend_order(seed, epoch, shuffle)
        return EpochBatches(self.lengths, budget, order=order, groups=self.unit_source, num_groups=len(self.sources))

    def blend_order(self, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
        """The units of blend epoch ``epoch`` in visiting order (see the module's docstring)."""
        draws = self.draws
        assert draws is not None
        slots = np.repeat(np.arange(len(self.sources), dtype=np.int16), draws)
        if shuffle:
            np.random.default_rng([seed, epoch, _BLEND]).shuffle(slots)
        else:  # spread evenly: slot j of source s at (j + 1/2) / draws[s] of the epoch
            keys = np.concatenate([(np.arange(c) + 0.5) / c for c in draws if c])
            slots = slots[np.argsort(keys, kind="stable")]
        order = np.empty(len(slots), dtype=index_dtype(len(self)))
        for s, count in enumerate(draws.tolist()):
            if count:
                order[slots == s] = self.offsets[s] + self.stream(s, seed, epoch * count, count, shuffle)
        return order

    def stream(self, source: int, seed: int, start: int, count: int, shuffle: bool = True) -> np.ndarray:
        """Positions ``start : start + count`` of a source's endless stream of units: its epochs one after the
        other, each a permutation by the seed, the source and its epoch (index order without ``shuffle``)."""
        n = int(self.source_units[source])
        out = np.empty(count, dtype=index_dtype(n))
        done = 0
        while done < count:
            epoch, at = divmod(start + done, n)
            take = min(n - at, count - done)
            if shuffle:
                order = np.arange(n, dtype=out.dtype)
                np.random.default_rng([seed, epoch, _BLEND, source]).shuffle(order)
            else:
                order = np.arange(n, dtype=out.dtype)
            out[done : done + take] = order[at : at + take]
            done += take
        return out

    def source_tokens(self, units: np.ndarray) -> np.ndarray | None:
        """Tokens of each source among ``units`` (``None`` for one source)."""
        if self.unit_source is None:
            return None
        units = np.asarray(units, dtype=np.int64)
        return np.bincount(
            self.unit_source[units], weights=self.lengths[units].astype(np.float64), minlength=len(self.sources)
        ).astype(np.int64)

    def metric_names(self) -> tuple[str, ...]:
        """The sources' names as metric names use them."""
        return tuple(_metric_name(n) for n in self.names)

    def fingerprint(self) -> dict[str, Any]:
        """What the batches depend on besides the seed (a checkpoint records it; a resumed run must match it)."""
        return {
            "sources": list(self.names),
            "units": self.source_units.tolist(),
            "weights": [round(float(w), 12) for w in self.weights] if self.blend else None,
            "max_seq_len": self.max_seq_len,
            "long": self.long,
        }


def _outside(tokens: np.ndarray, vocab_size: int) -> tuple[int, int] | None:
    """``(position, id)`` of the first token id outside ``[0, vocab_size)`` (``None``: all inside)."""
    if tokens.size == 0:
        return None
    low, high = int(tokens.min()), int(tokens.max())
    if low >= 0 and high < vocab_size:
        return None
    position = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
    return position, int(tokens[position])
