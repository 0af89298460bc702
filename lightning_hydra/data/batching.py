"""Global batches: a deterministic function of the dataset's lengths, the token budget, the seed and the epoch.

The world size plays no part, so runs at different world sizes train on exactly the same batches.

Sequences are visited in a seeded per-epoch order and packed greedily: a batch closes when the next sequence would
exceed the budget (a sequence longer than the budget forms a batch of its own). :class:`EpochBatches` forms the
batches without a Python loop per sequence: the order is one NumPy shuffle (the permutation
``numpy.random.default_rng([seed, epoch]).permutation(n)``, held as ``int32`` where ``n`` fits), and the batch ends
are found by binary search in running sums of the ordered lengths, taken a block of :data:`CHUNK` sequences at a
time (one ``searchsorted`` per batch, none per sequence). The batches are those of the sequence-by-sequence loop,
:func:`reference_global_batches`, kept as the specification: ``tests/test_data_scale.py`` compares the two, and
``python -m lightning_hydra.bench.data`` times them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

__all__ = [
    "CHUNK",
    "EpochBatches",
    "batch_starts",
    "epoch_permutation",
    "global_batches",
    "index_dtype",
    "reference_global_batches",
]

CHUNK = 1 << 22
"""Sequences whose running sums are held at once while batch ends are searched (32 MiB of ``int64``)."""


def index_dtype(n: int) -> type[np.integer]:
    """The narrowest of ``int32`` and ``int64`` that indexes ``n`` items."""
    return np.int32 if n < 2**31 else np.int64


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """``numpy.random.default_rng([seed, epoch]).permutation(n)``, the same values, as ``int32`` where ``n`` fits
    (``Generator.permutation`` shuffles ``arange(n)``, and the shuffle's draws do not depend on the array's type)."""
    order = np.arange(n, dtype=index_dtype(n))
    np.random.default_rng([seed, epoch]).shuffle(order)
    return order


def batch_starts(
    lengths: np.ndarray,
    order: np.ndarray,
    budget: int,
    *,
    groups: np.ndarray | None = None,
    num_groups: int = 0,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Where each greedy batch of ``lengths[order]`` starts, and (with ``groups``) every group's tokens before it.

    Args:
        lengths: Length of every sequence (any integer type; a memory map is read a block at a time).
        order: The visiting order (positions into ``lengths``).
        budget: Tokens per batch.
        groups: Optional group (source) of every sequence, ``[len(lengths)]`` small integers.
        num_groups: Number of groups (with ``groups``).

    Returns:
        ``starts``: ``[K + 1]`` positions into ``order``, ``starts[k]:starts[k + 1]`` being batch ``k`` (``starts[K]``
        is ``len(order)``); and, with ``groups``, ``[K + 1, num_groups]`` tokens of each group in the batches before
        batch ``k`` (``None`` without).
    """
    if budget < 1:
        raise ValueError(f"global_batch_tokens must be positive, got {budget}")
    n = len(order)
    found: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
    per_group: list[np.ndarray] = [np.zeros((1, num_groups), dtype=np.int64)] if groups is not None else []
    carried = np.zeros(num_groups, dtype=np.int64)  # each group's tokens before this block
    start = 0  # position of the open batch's first sequence
    held = 0  # its tokens before this block
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        block = order[a:b]
        sums = np.empty(b - a + 1, dtype=np.int64)  # sums[j]: the open batch's tokens if it ended before a + j
        sums[0] = held
        sums[1:] = lengths[block]  # the one random-access pass over the lengths
        np.cumsum(sums, out=sums)
        base, ends = 0, []  # base: sums at the open batch's start (0 while it started in an earlier block)
        while True:
            e = int(np.searchsorted(sums, base + budget, side="right")) - 1  # the last end that fits
            if a + e == start:  # even the first sequence exceeds the budget: it forms a batch of its own
                e += 1
            elif e == b - a:  # the open batch runs into the next block
                break
            ends.append(e)
            start, base = a + e, int(sums[e])
            if e == b - a:
                break
        held = int(sums[-1]) - base
        local = np.asarray(ends, dtype=np.int64)
        found.append(a + local)
        if groups is not None:  # each group's running tokens, read at this block's batch starts
            group = np.asarray(groups[block], dtype=np.intp)
            sizes = np.diff(sums)
            rows = np.empty((len(local), num_groups), dtype=np.int64)
            for g in range(num_groups):
                running = np.zeros(b - a + 1, dtype=np.int64)
                np.cumsum(np.where(group == g, sizes, 0), out=running[1:])
                rows[:, g] = carried[g] + running[local]
                carried[g] += running[-1]
            per_group.append(rows)
    starts = np.concatenate(found)
    if starts[-1] != n:
        starts = np.append(starts, n)
        if groups is not None:
            per_group.append(carried[None, :].copy())
    tokens = np.concatenate(per_group) if groups is not None else None
    return starts, tokens


class EpochBatches(Sequence):
    """The global batches of one epoch, formed at once in NumPy (see the module's docstring) and handed out as
    views: ``batches[k]`` is the sequence indices of batch ``k`` (``int64``).

    Args:
        lengths: Length of every sequence.
        budget: Tokens per batch.
        order: The visiting order (default: every sequence, shuffled by ``seed`` and ``epoch`` where ``shuffle``).
        seed: Seed of the shuffle.
        epoch: The epoch.
        shuffle: Shuffle (else visit the sequences in index order).
        groups: Optional group (source) of every sequence: :attr:`group_tokens` then counts each group's tokens.
        num_groups: Number of groups.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        budget: int,
        *,
        order: np.ndarray | None = None,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        groups: np.ndarray | None = None,
        num_groups: int = 0,
    ) -> None:
        if order is None:
            n = len(lengths)
            order = epoch_permutation(n, seed, epoch) if shuffle else np.arange(n, dtype=index_dtype(n))
        self.order = order
        """Every sequence of the epoch in visiting order."""
        self.starts, self.group_tokens = batch_starts(lengths, order, budget, groups=groups, num_groups=num_groups)
        """``starts``: where each batch starts in :attr:`order` (and its end); ``group_tokens``: ``[K + 1, G]``
        tokens of each group before each batch (``None`` without groups)."""

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, k: int) -> np.ndarray:  # type: ignore[override]
        if not -len(self) <= k < len(self):
            raise IndexError(f"batch {k} of an epoch of {len(self)}")
        k %= len(self)
        return self.order[self.starts[k] : self.starts[k + 1]].astype(np.int64)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[k] for k in range(len(self)))

    def tokens_before(self, k: int) -> np.ndarray | None:
        """Each group's tokens in the batches before batch ``k`` (``None`` without groups)."""
        return None if self.group_tokens is None else self.group_tokens[k]


def global_batches(
    lengths: np.ndarray, global_batch_tokens: int, *, seed: int, epoch: int, shuffle: bool = True
) -> list[np.ndarray]:
    """Dataset indices of every global batch of an epoch (:class:`EpochBatches` as a list).

    Sequences are visited in a seeded per-epoch order and packed greedily: a batch closes when the next sequence
    would exceed ``global_batch_tokens``. A sequence longer than the budget forms a batch of its own. Every sequence
    appears in exactly one batch.
    """
    return list(EpochBatches(np.asarray(lengths), global_batch_tokens, seed=seed, epoch=epoch, shuffle=shuffle))


def reference_global_batches(
    lengths: np.ndarray, global_batch_tokens: int, *, seed: int, epoch: int, shuffle: bool = True
) -> list[np.ndarray]:
    """The batches of :func:`global_batches` by the sequence-by-sequence loop it replaced (the specification the
    vectorised batches are tested against, and the baseline of ``python -m lightning_hydra.bench.data``)."""
    if global_batch_tokens < 1:
        raise ValueError(f"global_batch_tokens must be positive, got {global_batch_tokens}")
    n = len(lengths)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    batches: list[np.ndarray] = []
    current: list[int] = []
    held = 0
    for i in order.tolist():
        size = int(lengths[i])
        if current and held + size > global_batch_tokens:
            batches.append(np.asarray(current, dtype=np.int64))
            current, held = [], 0
        current.append(i)
        held += size
    if current:
        batches.append(np.asarray(current, dtype=np.int64))
    return batches
