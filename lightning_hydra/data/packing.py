"""From a plan to one rank's packed microbatches.

For every microbatch the rank's group processes a bin (the concatenation of its sequences); the rank gets its
zigzag shard of the bin's token ids, of the labels (shifted *before* sharding, since the next token of a chunk's
last token usually lives in another chunk), and of every token's position inside its own document (for RoPE).
Padding tokens carry ``pad_id`` and ``ignore_index`` labels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lightning_hydra.cp.layout import ZigzagMeta, zigzag_source_index
from lightning_hydra.planner import Group, Plan

__all__ = [
    "IGNORE_INDEX",
    "RankMicrobatch",
    "StepBatch",
    "pack_groups",
    "pack_rank",
    "rank_sequences",
    "trained_tokens",
]

IGNORE_INDEX = -100
"""Label of tokens that are not trained (the last token of a document, padding)."""


@dataclass
class RankMicrobatch:
    """One rank's share of one microbatch (empty when the rank's group is idle)."""

    input_ids: torch.Tensor
    """``[t]`` token ids of the shard (``pad_id`` on padding)."""
    labels: torch.Tensor
    """``[t]`` next-token labels (``IGNORE_INDEX`` on padding and at each document's end)."""
    position_ids: torch.Tensor
    """``[t]`` position of every token inside its own document."""
    cu_seqlens: tuple[int, ...]
    """Unpadded boundaries of the group's whole bin."""
    group: Group
    """The plan's group this rank belongs to in this microbatch (its ``seq_ids`` index the global batch)."""
    seq_ids: tuple[int, ...]
    """Dataset indices of the bin's sequences, in bin order."""

    @property
    def num_tokens(self) -> int:
        """Tokens (padding included) this rank holds."""
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RankMicrobatch:
        """A copy with the tensors on ``device`` (Lightning's batch transfer calls this)."""
        move = {"device": device, "non_blocking": non_blocking}
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(**move),
            labels=self.labels.to(**move),
            position_ids=self.position_ids.to(**move),
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        """Pool ranks of the group."""
        return self.group.ranks

    @property
    def ulysses(self) -> int:
        """Ulysses degree of the group."""
        return self.group.ulysses

    @property
    def ring(self) -> int:
        """Ring degree of the group."""
        return self.group.ring


@dataclass
class StepBatch:
    """Everything one rank needs for one optimizer step: its microbatches and the step's global facts."""

    epoch: int
    """Epoch of the step."""
    step: int
    """Index of the step inside its epoch."""
    microbatches: list[RankMicrobatch]
    """This rank's share of every microbatch of the plan (same count on every rank)."""
    trained_tokens: int
    """Labelled tokens of the whole global batch (the loss normaliser)."""
    digest: str
    """Digest of the plan (every rank must hold the same)."""
    groups: tuple[Group, ...] = field(default_factory=tuple)
    """Every distinct group shape of the plan (ranks, Ulysses and ring degrees; no sequences), sorted: what the
    communicators must cover."""
    world_size: int = 1
    """Ranks of the pool the plan was made for."""
    schedule_ms: float = 0.0
    """Wall time of planning this global batch."""
    cost_version: int = 0
    """Which cost model planned it: the number of cost-model updates (refits) the runtime had made when planning
    started (see :class:`~lightning_hydra.HydraDataModule`)."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StepBatch:
        """A copy with every microbatch's tensors on ``device`` (Lightning's batch transfer calls this)."""
        moved = [mb.to(device, non_blocking=non_blocking) for mb in self.microbatches]
        return dataclasses.replace(self, microbatches=moved)

    predicted_loads: tuple[float, ...] = ()
    """The cost model's prediction of this rank's time in every microbatch."""
    features: tuple[tuple[float, ...], ...] = ()
    """Calibration features of this rank's work in every microbatch (see
    :func:`lightning_hydra.planner.calibration.bin_features`)."""
    sources: tuple[str, ...] = ()
    """Of a blend (:mod:`lightning_hydra.data.mixture`): the sources' names (empty otherwise)."""
    source_tokens: tuple[int, ...] = ()
    """Of a blend: each source's tokens in this global batch."""
    source_epoch_tokens: tuple[int, ...] = ()
    """Of a blend: each source's tokens in the epoch's global batches up to this one."""
    source_weights: tuple[float, ...] = ()
    """Of a blend: each source's asked share of the tokens."""

    def source_metrics(self) -> dict[str, float]:
        """Of a blend, per source: ``data/tokens/<name>`` (tokens of this step), ``data/share/<name>`` (its share of
        the epoch's tokens so far: the realised mixture) and ``data/weight/<name>`` (the asked share); empty
        otherwise. The same on every rank (:class:`~lightning_hydra.BubbleMonitor` logs them)."""
        if not self.sources:
            return {}
        total = sum(self.source_epoch_tokens)
        out: dict[str, float] = {}
        for name, tokens, seen, weight in zip(
            self.sources, self.source_tokens, self.source_epoch_tokens, self.source_weights, strict=True
        ):
            out[f"data/tokens/{name}"] = float(tokens)
            out[f"data/share/{name}"] = seen / total if total else float("nan")
            out[f"data/weight/{name}"] = float(weight)
        return out


def trained_tokens(lengths: Sequence[int] | np.ndarray) -> int:
    """Labelled tokens of a batch: every token but each document's last."""
    return int(np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0).sum())


def pack_rank(
    sequences: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
    plan: Plan,
    rank: int,
    pad_id: int = 0,
    dataset_ids: Sequence[int] | None = None,
) -> list[RankMicrobatch]:
    """This rank's microbatches of ``plan``.

    Args:
        sequences: ``sequences[i]`` is the 1-D token tensor of batch sequence ``i``; only the sequences of this
            rank's groups are read (:func:`rank_sequences`), so a mapping holding just those is enough.
        plan: The plan of the global batch.
        rank: This rank.
        pad_id: Token id of padding.
        dataset_ids: Dataset index of every batch sequence (recorded in ``seq_ids``); default the batch index.
    """
    return pack_groups(sequences, plan.groups_of(rank), rank, pad_id, dataset_ids)


def pack_groups(
    sequences: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
    groups: Sequence[Group],
    rank: int,
    pad_id: int = 0,
    dataset_ids: Sequence[int] | None = None,
) -> list[RankMicrobatch]:
    """:func:`pack_rank` from the rank's group in every microbatch (:meth:`Plan.groups_of`) instead of the whole plan
    (what a planning process sends back, :class:`~lightning_hydra.planner.worker.PlannedStep`)."""
    out = []
    for g in groups:
        if not g.seq_ids:
            empty = torch.zeros(0, dtype=torch.long)
            out.append(RankMicrobatch(empty, empty.clone(), empty.clone(), (0,), g, ()))
            continue
        docs = [sequences[i].long() for i in g.seq_ids]
        tokens = torch.cat(docs)
        labels = torch.cat([torch.cat([d[1:], d.new_full((1,), IGNORE_INDEX)]) for d in docs])
        cu = [0]
        for d in docs:
            cu.append(cu[-1] + d.numel())
        meta = ZigzagMeta.from_cu_seqlens(cu, g.degree)
        positions, source = zigzag_source_index(meta, g.index(rank))
        real = source >= 0
        ids = torch.full((meta.shard_len,), pad_id, dtype=torch.long)
        lab = torch.full((meta.shard_len,), IGNORE_INDEX, dtype=torch.long)
        ids[real] = tokens[source[real]]
        lab[real] = labels[source[real]]
        seq_ids = g.seq_ids if dataset_ids is None else tuple(int(dataset_ids[i]) for i in g.seq_ids)
        out.append(RankMicrobatch(ids, lab, positions, tuple(cu), g, seq_ids))
    return out


def rank_sequences(plan: Plan | Sequence[Group], rank: int) -> list[int]:
    """Batch indices of the sequences ``rank`` holds a shard of in any microbatch (what it must read), sorted.

    Args:
        plan: The plan of the global batch, or the rank's group in every microbatch (:meth:`Plan.groups_of`).
        rank: This rank.
    """
    groups = plan.groups_of(rank) if isinstance(plan, Plan) else plan
    return sorted({i for g in groups for i in g.seq_ids})
