"""Data: the embedded corpus, packing and the HydraDataModule."""

from lightning_hydra.data.corpus import EOS_ID, PAD_ID, VOCAB_SIZE, StdlibCorpus, stdlib_files, stdlib_lengths
from lightning_hydra.data.packing import IGNORE_INDEX, RankMicrobatch, StepBatch, pack_rank, trained_tokens

__all__ = [
    "EOS_ID",
    "IGNORE_INDEX",
    "PAD_ID",
    "VOCAB_SIZE",
    "RankMicrobatch",
    "StdlibCorpus",
    "StepBatch",
    "pack_rank",
    "stdlib_files",
    "stdlib_lengths",
    "trained_tokens",
]
