"""Data: the embedded corpus, token files by path (Megatron indexed files, Arrow, parquet), blends, packing and the
HydraDataModule (see docs/data.md)."""

from lightning_hydra.data.arrow import ArrowTokens
from lightning_hydra.data.batching import EpochBatches, global_batches
from lightning_hydra.data.corpus import EOS_ID, PAD_ID, VOCAB_SIZE, StdlibCorpus, stdlib_files, stdlib_lengths
from lightning_hydra.data.indexed import IndexedTokens, IndexedWriter
from lightning_hydra.data.mixture import Mixture
from lightning_hydra.data.packing import IGNORE_INDEX, RankMicrobatch, StepBatch, pack_rank, trained_tokens

__all__ = [
    "EOS_ID",
    "IGNORE_INDEX",
    "PAD_ID",
    "VOCAB_SIZE",
    "ArrowTokens",
    "EpochBatches",
    "IndexedTokens",
    "IndexedWriter",
    "Mixture",
    "RankMicrobatch",
    "StdlibCorpus",
    "StepBatch",
    "global_batches",
    "pack_rank",
    "stdlib_files",
    "stdlib_lengths",
    "trained_tokens",
]
