"""Models trained under HydraStrategy: the reference decoder and Hugging Face causal LMs."""

from lightning_hydra.models.decoder import DecoderLM
from lightning_hydra.models.module import HydraModule

__all__ = ["DecoderLM", "HydraModule"]
