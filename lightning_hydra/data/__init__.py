"""Data: the embedded corpus, packing and the HydraDataModule."""

from lightning_hydra.data.corpus import stdlib_files, stdlib_lengths

__all__ = ["stdlib_files", "stdlib_lengths"]
