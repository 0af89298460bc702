"""``HydraDataModule``: global batches in tokens, planned onto the pool, one loader item per optimizer step."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, IterableDataset
from typing_extensions import override

from lightning_hydra.data.batching import EpochBatches
from lightning_hydra.data.corpus import PAD_ID, StdlibCorpus
from lightning_hydra.data.mixture import MapSource, Mixture, SourceSpec, open_source, parse_sources
from lightning_hydra.data.packing import StepBatch, pack_groups, rank_sequences, trained_tokens
from lightning_hydra.data.source import DatasetSource, checked_lengths, in_memory_lengths, scan_lengths
from lightning_hydra.errors import ConfigError, check_bool, check_int
from lightning_hydra.planner import CostModel
from lightning_hydra.planner.worker import PlanWorker, plan_step, read_plan

if TYPE_CHECKING:
    from lightning_hydra.strategy.runtime import HydraRuntime


__all__ = ["FailedStep", "HydraDataModule", "PendingStep", "model_vocab_size", "resolve", "scan_lengths"]

log = logging.getLogger(__name__)


def model_vocab_size(module: Any) -> int | None:
    """Vocabulary size of a model: ``model_shape()["vocab_size"]`` of a ``HydraModule``, else the rows of the input
    embedding (``get_input_embeddings()``, as Hugging Face models have); ``None`` when unknown."""
    shape = getattr(module, "model_shape", None)
    if callable(shape):
        size = shape().get("vocab_size")
        if size:
            return int(size)
    embeddings = getattr(module, "get_input_embeddings", None)
    if callable(embeddings):
        layer = embeddings()
        if layer is not None and hasattr(layer, "num_embeddings"):
            return int(layer.num_embeddings)
    return None


def _check_map_style(dataset: Any, name: str) -> None:
    if dataset is None:
        return
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"{name} must be a map-style dataset (with __len__ and __getitem__: a list, a torch Dataset, a datasets "
            f"column), got {type(dataset).__name__}: planning needs every sequence's length before the epoch"
        )


class PendingStep:
    """A step whose plan and packing run in a background thread; Lightning's batch transfer (:meth:`to`) waits
    for it, so planning step ``k + 1`` overlaps step ``k``."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def result(self) -> StepBatch:
        """The planned step (re-raises what planning raised)."""
        return self.future.result()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StepBatch:
        """The planned step, on ``device``."""
        return self.result().to(device, non_blocking=non_blocking)


class FailedStep:
    """What a rank's loader hands its step when planning or reading the step failed there: the step's check
    (:meth:`~lightning_hydra.strategy.runtime.HydraRuntime.begin_step`, the step's one control all-reduce) tells every
    rank, and every rank raises the failing rank's message."""

    def __init__(self, error: BaseException) -> None:
        """Args:
        error: What planning or reading raised.
        """
        self.error = error


def resolve(batch: StepBatch | PendingStep) -> StepBatch:
    """The :class:`StepBatch` of a loader item (waiting for its plan if needed)."""
    return batch.result() if isinstance(batch, PendingStep) else batch


class _StepStream(IterableDataset):
    """Yields this rank's :class:`StepBatch` for every global batch of the current epoch."""

    def __init__(self, dm: HydraDataModule, split: str) -> None:
        self.dm = dm
        self.split = split

    def __iter__(self) -> Iterator[StepBatch | PendingStep]:
        dm = self.dm
        source = dm._sources[self.split]
        training = self.split == "train"
        epoch = dm.current_epoch() if training else 0
        batches = _epoch_batches(source, dm.global_batch_tokens, dm.seed, epoch, dm.shuffle and training)
        start = dm._take_resume_step(epoch) if training else 0
        if training:
            dm._epoch_started(epoch, start)
        runtime = dm._runtime()
        if not dm.plan_ahead:
            for step in range(start, len(batches)):
                done: Future = Future()  # planned here, on the loader's critical path
                try:
                    done.set_result(
                        dm.make_step(
                            source,
                            epoch,
                            step,
                            batches[step],
                            runtime.cost_model,
                            runtime.cost_version,
                            epoch_tokens=batches.tokens_before(step + 1),
                        )
                    )
                except Exception as exc:  # reported at batch transfer, after the ranks agreed (see below)
                    done.set_exception(exc)
                yield PendingStep(done)
            return
        # One planning thread: the item for step k is asked for (Lightning prefetches one) while step k - 1 trains;
        # it is planned with the cost model of that moment, in the background, and waited for at batch transfer. The
        # thread hands the planning to the planning process (``planning_process``), waiting on a pipe (holding no
        # lock), and reads and packs the rank's sequences itself.
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hydra-plan")
        try:
            for step in range(start, len(batches)):
                cost, version = runtime.cost_model, runtime.cost_version
                mix = batches.tokens_before(step + 1)
                yield PendingStep(
                    executor.submit(dm.make_step, source, epoch, step, batches[step], cost, version, epoch_tokens=mix)
                )
        finally:
            executor.shutdown(wait=False, cancel_futures=True)


def _epoch_batches(source: Any, budget: int, seed: int, epoch: int, shuffle: bool) -> EpochBatches:
    """The global batches of an epoch of a split (a :class:`~lightning_hydra.data.mixture.Mixture`, or a bare
    :class:`~lightning_hydra.data.source.DatasetSource`)."""
    if isinstance(source, Mixture):
        return source.epoch_batches(budget, seed=seed, epoch=epoch, shuffle=shuffle)
    return EpochBatches(source.lengths, budget, seed=seed, epoch=epoch, shuffle=shuffle)


def _file_source(dataset: Any) -> bool:
    """Whether a dataset reads parts of its sequences by itself (indexed token files, Arrow or parquet data)."""
    return all(callable(getattr(dataset, name, None)) for name in ("read", "describe", "lengths"))


def _arrow_dataset(dataset: Any) -> bool:
    """Whether a dataset is a ``datasets.Dataset`` with an ``input_ids`` column (read through its Arrow table)."""
    return type(dataset).__module__.startswith("datasets.") and "input_ids" in (
        getattr(dataset, "column_names", None) or ()
    )


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
        train_lengths: Sequence[int] | None = None,
        val_lengths: Sequence[int] | None = None,
        plan_ahead: bool = True,
        planning_process: bool = True,
        sources: str | list[str | dict[str, Any]] | None = None,
        val_sources: str | list[str | dict[str, Any]] | None = None,
        split_long: bool = False,
    ) -> None:
        """Describe the data and the global batches.

        Args:
            train_dataset: Map-style dataset of token-id sequences (1-D tensors, lists, numpy arrays, dicts with
                ``input_ids``, a Hugging Face ``datasets.Dataset`` or column, or
                :class:`~lightning_hydra.data.indexed.IndexedTokens` /
                :class:`~lightning_hydra.data.arrow.ArrowTokens`). ``None``: ``sources`` if given, else the
                embedded standard-library corpus.
            global_batch_tokens: Tokens per global batch (one optimizer step over the whole pool).
            val_dataset: Validation dataset; ``None`` with the embedded corpus uses its validation split, otherwise
                there is no validation.
            seed: Seed of the per-epoch shuffle (and of tie-breaking in the planner).
            shuffle: Shuffle the training sequences every epoch.
            max_seq_len: Longest sequence allowed; longer ones are an error unless ``truncate``.
            truncate: Cut sequences longer than ``max_seq_len`` (their tail is not trained: an explicit, lossy choice).
            pad_id: Token id of padding.
            corpus_max_bytes: Length filter of the embedded corpus.
            train_lengths: Token count of every training item, if known (an index): the dataset is then not scanned
                at set-up. Otherwise ``train_dataset.lengths()`` if it has one, else every item is read once, the pool
                sharing the reads.
            val_lengths: The same for the validation dataset.
            plan_ahead: Plan (and read) step ``k + 1`` in a background thread while step ``k`` trains, with the cost
                model current when that step's item is requested (Lightning asks for it one step ahead, so step ``k``'s
                plan uses the model refitted after step ``k - 2``). ``False``: plan on the loader's critical path.
            planning_process: With ``plan_ahead``, run the planner in a process of its own, one per rank
                (:class:`~lightning_hydra.planner.worker.PlanWorker`), so that it holds no lock the training loop
                needs: in the planning thread it holds Python's interpreter lock, and the loop, which launches the
                kernels from Python, waits for it (a host-bound CPU training step measured 1.9-2.1x as long beside
                a 2,048-rank plan in a thread, 1.04-1.23x beside one in a process). The plans are the same; a
                worker that fails is reported and the thread plans instead. ``False``: plan in the thread.
            sources: Training data by path, instead of ``train_dataset``: Megatron indexed token files (the prefix
                of ``.bin``/``.idx``), a ``datasets`` directory written by ``save_to_disk``, an ``.arrow`` file, a
                parquet file or a directory of them; or several, blended by weight::

                    sources:
                      - {path: data/web_text_document, weight: 0.7}
                      - {path: data/code, weight: 0.3, column: input_ids}

                (see :mod:`lightning_hydra.data.mixture`; each source's tokens are logged per step by
                :class:`~lightning_hydra.BubbleMonitor`).
            val_sources: Validation data by path (every document once, in order; weights are ignored).
            split_long: Split documents longer than ``max_seq_len`` into consecutive pieces of ``max_seq_len``
                tokens (the last shorter), each trained as a document of its own: every token is trained (unlike
                ``truncate``), and each piece boundary loses one label.
        """
        super().__init__()
        check_int("global_batch_tokens", global_batch_tokens)
        check_int("seed", seed, low=0)
        check_bool("shuffle", shuffle)
        check_int("max_seq_len", max_seq_len, none=True)
        check_bool("truncate", truncate)
        check_int("pad_id", pad_id, low=0)
        check_int("corpus_max_bytes", corpus_max_bytes, none=True)
        check_bool("plan_ahead", plan_ahead)
        check_bool("planning_process", planning_process)
        _check_map_style(train_dataset, "train_dataset")
        _check_map_style(val_dataset, "val_dataset")
        if truncate and not max_seq_len:
            raise ValueError("truncate=True needs max_seq_len")
        check_bool("split_long", split_long)
        if split_long and not max_seq_len:
            raise ValueError("split_long=True needs max_seq_len")
        if split_long and truncate:
            raise ValueError("choose one of truncate=True (cut long documents) and split_long=True (split them)")
        if sources is not None and train_dataset is not None:
            raise ValueError("give the training data once: train_dataset or sources")
        if val_sources is not None and val_dataset is not None:
            raise ValueError("give the validation data once: val_dataset or val_sources")
        self.sources: list[SourceSpec] = parse_sources(sources, "sources")
        self.val_sources: list[SourceSpec] = parse_sources(val_sources, "val_sources")
        self.split_long = split_long
        for name, lengths, dataset in (("train", train_lengths, train_dataset), ("val", val_lengths, val_dataset)):
            if lengths is not None and dataset is None:
                raise ValueError(f"{name}_lengths is given without {name}_dataset")
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.global_batch_tokens = int(global_batch_tokens)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.max_seq_len = max_seq_len
        self.truncate = truncate
        self.pad_id = pad_id
        self.corpus_max_bytes = corpus_max_bytes
        self.train_lengths = train_lengths
        self.val_lengths = val_lengths
        self.plan_ahead = plan_ahead
        self.planning_process = planning_process
        self._worker = PlanWorker()
        self._sources: dict[str, Mixture] = {}
        self._opened: dict[str, Mixture] = {}  # data by path opened before set-up (the pre-launch checks)
        self._resume: tuple[int, int] | None = None
        self._resume_data: dict[str, Any] | None = None
        self._epoch_start_step = 0
        self._epoch = 0

    # ------------------------------------------------------------------ datasets
    def _datasets(self) -> tuple[Any, Any]:
        """The training and validation datasets (the embedded corpus' splits when neither ``train_dataset`` nor
        ``sources`` is given)."""
        train, val = self.train_dataset, self.val_dataset
        if train is None and not self.sources:
            train = StdlibCorpus("train", max_bytes=self.corpus_max_bytes)
            val = StdlibCorpus("val", max_bytes=self.corpus_max_bytes) if val is None and not self.val_sources else val
        return train, val

    @property
    def long_documents(self) -> str:
        """What happens to documents longer than ``max_seq_len``: ``"error"``, ``"truncate"`` or ``"split"``."""
        return "split" if self.split_long else "truncate" if self.truncate else "error"

    def _by_path(self, split: str) -> Mixture | None:
        """The split's data given by path, opened once (``None`` where it is not given by path)."""
        specs = self.sources if split == "train" else self.val_sources
        if not specs:
            return None
        if split not in self._opened:
            name = "train" if split == "train" else "validation"
            self._opened[split] = Mixture(
                [open_source(spec) for spec in specs],
                name,
                weights=[spec.weight for spec in specs],
                max_seq_len=self.max_seq_len,
                long=self.long_documents,
                blend=split == "train",
            )
        return self._opened[split]

    def _mixture(self, split: str, dataset: Any, lengths: Any, runtime: Any) -> Mixture | None:
        """The split's units: by path, or over a dataset (a file dataset read as such, a map-style one through a
        :class:`~lightning_hydra.data.source.DatasetSource`)."""
        opened = self._by_path(split)
        if opened is not None or dataset is None:
            return opened
        name = "train" if split == "train" else "validation"
        if lengths is None and _arrow_dataset(dataset):
            from lightning_hydra.data.arrow import ArrowTokens

            dataset = ArrowTokens(dataset, name=name)
        if lengths is None and _file_source(dataset):
            return Mixture([dataset], name, max_seq_len=self.max_seq_len, long=self.long_documents)
        source = DatasetSource(dataset, name, self.max_seq_len, self.truncate, lengths=lengths, runtime=runtime)
        return Mixture([MapSource(source)], name, max_seq_len=self.max_seq_len, long=self.long_documents)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_opened"] = {}  # each process opens the data by path itself (the pickle stays small)
        return state

    def lengths_before_setup(self) -> dict[str, np.ndarray]:
        """Lengths of the splits that are known without reading items (given, ``dataset.lengths()``, or a dataset
        held in memory: a list or tuple of sequences), checked and truncated as at set-up: what the pre-launch checks
        use. Splits whose lengths need a scan are left out (they are checked at set-up, identically on every rank)."""
        train, val = self._datasets()
        out = {}
        for split, name in (("train", "train"), ("val", "validation")):
            opened = self._by_path(split)
            if opened is not None:
                out[name] = opened.lengths
        for name, dataset, given in (("train", train, self.train_lengths), ("validation", val, self.val_lengths)):
            if dataset is None:
                continue
            if len(dataset) == 0:
                raise ConfigError(f"the {name} dataset is empty")
            lengths = given if given is not None else (dataset.lengths() if hasattr(dataset, "lengths") else None)
            lengths = in_memory_lengths(dataset, name) if lengths is None else lengths
            if lengths is None:
                continue
            if given is None and _file_source(dataset):  # its units, empty documents left out
                out[name] = Mixture([dataset], name, max_seq_len=self.max_seq_len, long=self.long_documents).lengths
                continue
            lengths = checked_lengths(lengths, len(dataset), name, self.max_seq_len, self.truncate)
            out[name] = np.minimum(lengths, self.max_seq_len) if self.split_long else lengths
        return out

    def check_longest(self, split: str, lengths: np.ndarray) -> int:
        """The longest sequence of a split; ``ConfigError`` when it exceeds ``max_seq_len`` (without ``truncate``)."""
        longest = int(lengths.max())
        if self.max_seq_len and longest > self.max_seq_len:
            index = int(lengths.argmax())
            mixture = self._sources.get("train" if split == "train" else "val") or self._opened.get(
                "train" if split == "train" else "val"
            )
            where = ""
            if mixture is not None and not isinstance(mixture.sources[0], MapSource) and index < len(mixture):
                where = f" ({mixture.describe(index)})"
            raise ConfigError(
                f"{split} sequence {index}{where} has {longest} tokens, over max_seq_len={self.max_seq_len}; "
                "pass truncate=True to cut it (its tail will not be trained), or split_long=True to train it in "
                "pieces"
            )
        return longest

    def check_vocabulary(self, vocab_size: int | None) -> None:
        """``ConfigError`` unless ``pad_id`` is a token of a vocabulary of ``vocab_size`` (``None``: unknown, no
        check)."""
        if vocab_size is not None and self.pad_id >= vocab_size:
            raise ConfigError(
                f"pad_id={self.pad_id} is outside the model's vocabulary of {vocab_size} tokens "
                f"(ids 0..{vocab_size - 1}): pass HydraDataModule(pad_id=...) with a token of the model's vocabulary "
                "(its padding or EOS id)"
            )
        for split in ("train", "val"):  # data by path: a sample of its token ids (every read is checked again)
            opened = self._by_path(split)
            if opened is not None:
                opened.check_sample(vocab_size, self.seed)

    @override
    def setup(self, stage: str) -> None:
        runtime = self._runtime()
        module = self.trainer.lightning_module if self.trainer is not None else None
        vocab = model_vocab_size(module)
        self.check_vocabulary(vocab)
        if "train" not in self._sources:
            train, val = self._datasets()
            self._sources["train"] = self._mixture("train", train, self.train_lengths, runtime)  # type: ignore[assignment]
            val_mixture = self._mixture("val", val, self.val_lengths, runtime)
            if val_mixture is not None:
                self._sources["val"] = val_mixture
            for mixture in self._sources.values():
                mixture.check_sample(vocab, self.seed)
        if "val" not in self._sources:
            if stage == "validate":
                raise ConfigError("there is no validation data: pass HydraDataModule(val_dataset=...)")
            if self.trainer is not None and stage == "fit":
                # no validation data, no validation loop (instead of an empty one that Lightning would warn about:
                # "Total length of `list` across ranks is zero")
                self.trainer.limit_val_batches = 0
        for source in self._sources.values():
            source.vocab_size = vocab
            longest = self.check_longest(source.name, source.lengths)
            runtime.check_fits(longest, source.name, self.global_batch_tokens)
        if self.plan_ahead and self.planning_process:
            self._worker.start()  # its imports overlap the rest of the set-up

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_StepStream(self, "train"), batch_size=None, num_workers=0)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if "val" not in self._sources:
            return []
        return DataLoader(_StepStream(self, "val"), batch_size=None, num_workers=0)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The planned step; if planning or reading it failed here, a :class:`FailedStep` that stops every rank.

        A rank reads only the sequences it holds a shard of, so bad data (a token id outside the vocabulary, an item
        shorter than its recorded length) may surface on some ranks only. The ranks learn of it in the step's check
        (its first operation, the step's one control all-reduce: the plan digest and the data error and SIGTERM
        flags, read to the host once), before the step's other collectives, so every rank stops with the failing
        rank's message (a :class:`~lightning_hydra.errors.ConfigError`, printed once by the command line) instead of
        the others waiting in a collective for a rank that has gone. One process raises the error here.
        """
        if not isinstance(batch, PendingStep):
            return batch
        error = batch.future.exception()  # waits for the plan
        if error is None:
            return batch.result()
        runtime = self._runtime()
        layout = getattr(runtime, "layout", None)  # with pipeline stages every stage plans the batch: the world agrees
        if (layout.world_size if layout is not None else runtime.world_size) > 1:
            return FailedStep(error)
        return batch.result()  # raises

    # ------------------------------------------------------------------ planning
    def _runtime(self) -> HydraRuntime:
        strategy = self.trainer.strategy if self.trainer is not None else None
        if hasattr(strategy, "planner_config"):  # a HydraStrategy (its module imports this one's users: no import)
            if strategy.runtime is None:
                raise RuntimeError("HydraStrategy has not set up its process group yet")
            return strategy.runtime
        world = getattr(strategy, "world_size", 1) if strategy is not None else 1
        if world > 1:
            raise ValueError(f"HydraDataModule needs HydraStrategy to run on {world} processes")
        module = self.trainer.lightning_module if self.trainer is not None else None
        runtime = getattr(module, "runtime", None)
        if callable(runtime):
            return runtime()
        from lightning_hydra.strategy.runtime import LocalRuntime

        return LocalRuntime(module)

    def make_step(
        self,
        source: Mixture | DatasetSource,
        epoch: int,
        step: int,
        indices: np.ndarray,
        cost: CostModel | None = None,
        cost_version: int = 0,
        *,
        epoch_tokens: np.ndarray | None = None,
    ) -> StepBatch:
        """Plan one global batch and pack this rank's share of it (safe in a planning thread: no collectives).

        Args:
                source: The split's units (or a dataset and its lengths).
                epoch: The epoch.
                step: The step inside the epoch.
                indices: Unit (dataset) indices of the global batch.
                cost: The cost model to plan with (default: the runtime's current one).
                cost_version: Its version (recorded in the step).
                epoch_tokens: Of a blend: each source's tokens in the epoch's steps up to this one.
        """
        runtime = self._runtime()
        cost = cost or runtime.cost_model
        indices = np.asarray(indices, dtype=np.int64)
        lengths = np.asarray(source.lengths[indices], dtype=np.int64)
        rank = runtime.global_rank
        seed = self.seed + epoch * 1_000_003 + step
        from lightning_hydra.strategy.runtime import HydraRuntime

        if type(runtime).plan_batch is not HydraRuntime.plan_batch:  # a runtime of the user's that plans its own way
            start = time.perf_counter()
            plan = runtime.plan_batch(lengths, seed=seed, cost=cost)
            planned = read_plan(plan, cost, rank, 1e3 * (time.perf_counter() - start))
        elif self.plan_ahead and self.planning_process:
            planned = self._worker.plan_step(runtime.batch_planner(), lengths, seed=seed, cost=cost, rank=rank)
        else:
            planned = plan_step(runtime.batch_planner(), lengths, seed=seed, cost=cost, rank=rank)
        mine = rank_sequences(planned.rank_groups, rank)  # read only the sequences this rank holds a shard of
        sequences = {i: source.item(int(indices[i])) for i in mine}
        micro = pack_groups(sequences, planned.rank_groups, rank, self.pad_id, dataset_ids=indices)
        mix = source.source_tokens(indices) if isinstance(source, Mixture) else None
        blend = {}
        if mix is not None and source.blend:
            blend = {
                "sources": source.metric_names(),
                "source_tokens": tuple(int(x) for x in mix),
                "source_epoch_tokens": tuple(int(x) for x in (epoch_tokens if epoch_tokens is not None else mix)),
                "source_weights": tuple(float(w) for w in source.weights),
            }
        return StepBatch(
            epoch=epoch,
            step=step,
            microbatches=micro,
            trained_tokens=trained_tokens(lengths),
            digest=planned.digest,
            groups=planned.groups,
            world_size=planned.world_size,
            schedule_ms=planned.schedule_ms,
            cost_version=cost_version,
            predicted_loads=tuple(float(x) for x in planned.loads),
            # this rank's rows of the plan's features (each ring at the link its layout gives it)
            features=tuple(tuple(float(x) for x in f) for f in planned.features),
            **blend,
        )

    @override
    def teardown(self, stage: str) -> None:
        """Stop the planning process (a later loop's set-up starts a new one)."""
        self.close_planning()

    def close_planning(self) -> None:
        """Stop the planning process (:class:`~lightning_hydra.HydraStrategy` also calls this at its teardown,
        which Lightning runs where a fit fails too, when the DataModule's is skipped)."""
        self._worker.close()

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
        saved, train = self._resume_data, self._sources.get("train")
        if saved is not None and train is not None and saved != train.fingerprint():
            raise ConfigError(
                f"the checkpoint was made with other training data ({_differs(saved, train.fingerprint())}): its "
                "batches cannot be continued"
            )
        if saved_epoch != epoch:
            return 0
        rank_zero_info(f"HydraDataModule: resuming epoch {epoch} at step {step}")
        return step

    @override
    def state_dict(self) -> dict[str, Any]:
        done = (int(self.trainer.global_step) if self.trainer is not None else 0) - self._epoch_start_step
        state = {"seed": self.seed, "epoch": self._epoch, "step": max(0, done)}
        if "train" in self._sources:
            state["data"] = self._sources["train"].fingerprint()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict.get("seed", self.seed)) != self.seed:
            raise ValueError(f"checkpoint was made with seed {state_dict['seed']}, this run has seed {self.seed}")
        self._resume = (int(state_dict["epoch"]), int(state_dict["step"]))
        self._resume_data = state_dict.get("data")


def _differs(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """The first entry of two data fingerprints that differs, as ``key: saved -> now``."""
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            return f"{key}: {saved.get(key)} -> {now.get(key)}"
    return "same"
