"""``HydraDataModule``: global batches in tokens, planned onto the pool, one loader item per optimizer step."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, IterableDataset
from typing_extensions import override

from lightning_hydra.data.batching import global_batches
from lightning_hydra.data.corpus import PAD_ID, StdlibCorpus
from lightning_hydra.data.packing import StepBatch, pack_rank, trained_tokens
from lightning_hydra.planner import Plan
from lightning_hydra.planner.calibration import bin_features

__all__ = ["HydraDataModule"]

log = logging.getLogger(__name__)


def _as_tensor(item: Any) -> torch.Tensor:
    """A dataset item as a 1-D long tensor (tensors, lists, numpy arrays, or a dict with ``input_ids``)."""
    if isinstance(item, dict):
        item = item["input_ids"]
    t = torch.as_tensor(np.asarray(item) if not isinstance(item, torch.Tensor) else item)
    if t.dim() != 1:
        raise ValueError(f"every dataset item must be a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    return t.long()


class _Source:
    """A map-style dataset with its lengths computed once (truncated when asked)."""

    def __init__(self, dataset: Any, name: str, max_seq_len: int | None, truncate: bool) -> None:
        if dataset is None or len(dataset) == 0:
            raise ValueError(f"the {name} dataset is empty")
        self.dataset = dataset
        self.name = name
        if hasattr(dataset, "lengths"):
            lengths = np.asarray(dataset.lengths(), dtype=np.int64)
        else:
            lengths = np.asarray(
                [
                    len(dataset[i]) if not isinstance(dataset[i], dict) else len(dataset[i]["input_ids"])
                    for i in range(len(dataset))
                ],
                dtype=np.int64,
            )
        if (lengths <= 0).any():
            bad = int(np.flatnonzero(lengths <= 0)[0])
            raise ValueError(f"{name} dataset item {bad} is empty")
        self.max_seq_len = max_seq_len if truncate else None
        self.lengths = np.minimum(lengths, max_seq_len) if (truncate and max_seq_len) else lengths

    def item(self, index: int) -> torch.Tensor:
        t = _as_tensor(self.dataset[index])
        return t[: self.max_seq_len] if self.max_seq_len else t


class _StepStream(IterableDataset):
    """Yields this rank's :class:`StepBatch` for every global batch of the current epoch."""

    def __init__(self, dm: HydraDataModule, split: str) -> None:
        self.dm = dm
        self.split = split

    def __iter__(self) -> Iterator[StepBatch]:
        dm = self.dm
        source = dm._sources[self.split]
        training = self.split == "train"
        epoch = dm.current_epoch() if training else 0
        batches = global_batches(
            source.lengths, dm.global_batch_tokens, seed=dm.seed, epoch=epoch, shuffle=dm.shuffle and training
        )
        start = dm._take_resume_step(epoch) if training else 0
        if training:
            dm._epoch_started(epoch, start)
        for step in range(start, len(batches)):
            yield dm.make_step(source, epoch, step, batches[step])


class HydraDataModule(pl.LightningDataModule):
    """Global batches of a token budget, planned onto the dynamic-CP pool, one loader item per optimizer step.

    Batches depend on the dataset, ``global_batch_tokens``, the seed and the epoch only (not the world size).
    Every rank plans the same batch with the same settings and gets the same plan; each yields its own share of
    every microbatch, so all ranks see the same number of steps and microbatches. Use it with
    :class:`lightning_hydra.HydraStrategy` for multi-process runs; on a single device it plans for one rank.
    """

    def __init__(
        self,
        train_dataset: Dataset | Sequence | None = None,
        *,
        global_batch_tokens: int,
        val_dataset: Dataset | Sequence | None = None,
        seed: int = 0,
        shuffle: bool = True,
        max_seq_len: int | None = None,
        truncate: bool = False,
        pad_id: int = PAD_ID,
        corpus_max_bytes: int | None = 65536,
    ) -> None:
        """Args:
        train_dataset: Map-style dataset of token-id sequences (1-D tensors, lists, numpy arrays, dicts with
            ``input_ids``, or a Hugging Face ``datasets`` column). ``None``: the embedded standard-library corpus.
        global_batch_tokens: Tokens per global batch (one optimizer step over the whole pool).
        val_dataset: Validation dataset; ``None`` with the embedded corpus uses its validation split, otherwise none.
        seed: Seed of the per-epoch shuffle (and of tie-breaking in the planner).
        shuffle: Shuffle the training sequences every epoch.
        max_seq_len: Longest sequence allowed; longer ones are an error unless ``truncate``.
        truncate: Cut sequences longer than ``max_seq_len`` (their tail is not trained: an explicit, lossy choice).
        pad_id: Token id of padding.
        corpus_max_bytes: Length filter of the embedded corpus.
        """
        super().__init__()
        if global_batch_tokens < 1:
            raise ValueError(f"global_batch_tokens must be positive, got {global_batch_tokens}")
        if truncate and not max_seq_len:
            raise ValueError("truncate=True needs max_seq_len")
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.global_batch_tokens = int(global_batch_tokens)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.max_seq_len = max_seq_len
        self.truncate = truncate
        self.pad_id = pad_id
        self.corpus_max_bytes = corpus_max_bytes
        self._sources: dict[str, _Source] = {}
        self._resume: tuple[int, int] | None = None
        self._epoch_start_step = 0
        self._epoch = 0

    # ------------------------------------------------------------------ datasets
    @override
    def setup(self, stage: str) -> None:
        if "train" not in self._sources:
            train = self.train_dataset
            val = self.val_dataset
            if train is None:
                train = StdlibCorpus("train", max_bytes=self.corpus_max_bytes)
                val = StdlibCorpus("val", max_bytes=self.corpus_max_bytes) if val is None else val
            self._sources["train"] = _Source(train, "train", self.max_seq_len, self.truncate)
            if val is not None:
                self._sources["val"] = _Source(val, "validation", self.max_seq_len, self.truncate)
        for source in self._sources.values():
            longest = int(source.lengths.max())
            if self.max_seq_len and longest > self.max_seq_len:
                index = int(source.lengths.argmax())
                raise ValueError(
                    f"{source.name} sequence {index} has {longest} tokens, over max_seq_len={self.max_seq_len}; "
                    "pass truncate=True to cut it (its tail will not be trained)"
                )
            self._planner().check_fits(longest, source.name, self.global_batch_tokens)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_StepStream(self, "train"), batch_size=None, num_workers=0)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if "val" not in self._sources:
            return []
        return DataLoader(_StepStream(self, "val"), batch_size=None, num_workers=0)

    # ------------------------------------------------------------------ planning
    def _planner(self) -> Any:
        strategy = self.trainer.strategy if self.trainer is not None else None
        from lightning_hydra.strategy import HydraStrategy, SingleProcessPlanner

        if isinstance(strategy, HydraStrategy):
            return strategy
        world = getattr(strategy, "world_size", 1) if strategy is not None else 1
        if world > 1:
            raise ValueError(f"HydraDataModule needs HydraStrategy to run on {world} processes")
        module = self.trainer.lightning_module if self.trainer is not None else None
        return SingleProcessPlanner(module, self.global_batch_tokens)

    def make_step(self, source: _Source, epoch: int, step: int, indices: np.ndarray) -> StepBatch:
        """Plan one global batch and pack this rank's share of it."""
        planner = self._planner()
        lengths = source.lengths[indices]
        start = time.perf_counter()
        plan: Plan = planner.plan_batch(lengths, seed=self.seed + epoch * 1_000_003 + step)
        elapsed = 1e3 * (time.perf_counter() - start)
        rank = planner.global_rank
        sequences = [source.item(int(i)) for i in indices]
        micro = pack_rank(sequences, plan, rank, self.pad_id, dataset_ids=indices.tolist())
        cost = planner.cost_model
        loads = plan.loads(cost)[:, rank]
        features = []
        for m in range(plan.num_microbatches):
            g = plan.group_of(m, rank)
            f = bin_features(cost, [plan.lengths[i] for i in g.seq_ids], g.ulysses, g.ring)
            features.append(tuple(float(x) for x in f))
        groups = tuple(sorted({(g.ranks, g.ulysses, g.ring) for mb in plan.microbatches for g in mb}))
        return StepBatch(
            epoch=epoch,
            step=step,
            microbatches=micro,
            trained_tokens=trained_tokens(lengths),
            digest=plan.digest(),
            groups=groups,
            schedule_ms=elapsed,
            predicted_loads=tuple(float(x) for x in loads),
            features=tuple(features),
        )

    # ------------------------------------------------------------------ resume
    def current_epoch(self) -> int:
        """The trainer's epoch (0 without a trainer)."""
        return int(self.trainer.current_epoch) if self.trainer is not None else 0

    def _epoch_started(self, epoch: int, start: int) -> None:
        self._epoch = epoch
        self._epoch_start_step = (int(self.trainer.global_step) if self.trainer is not None else 0) - start

    def _take_resume_step(self, epoch: int) -> int:
        if self._resume is None:
            return 0
        saved_epoch, step = self._resume
        self._resume = None
        if saved_epoch != epoch:
            return 0
        rank_zero_info(f"HydraDataModule: resuming epoch {epoch} at step {step}")
        return step

    @override
    def state_dict(self) -> dict[str, Any]:
        done = (int(self.trainer.global_step) if self.trainer is not None else 0) - self._epoch_start_step
        return {"seed": self.seed, "epoch": self._epoch, "step": max(0, done)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict.get("seed", self.seed)) != self.seed:
            raise ValueError(f"checkpoint was made with seed {state_dict['seed']}, this run has seed {self.seed}")
        self._resume = (int(state_dict["epoch"]), int(state_dict["step"]))
