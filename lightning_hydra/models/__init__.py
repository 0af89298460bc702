"""Models trained under HydraStrategy: the reference decoder and Hugging Face causal LMs.

The names load their modules on first use (:mod:`lightning_hydra._lazy`): the pipeline's stage helpers in
:mod:`~lightning_hydra.models.stages` import without Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_hydra._lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_hydra.models.decoder import DecoderLM
    from lightning_hydra.models.module import HydraModule

__all__ = ["DecoderLM", "HydraModule"]

__getattr__, __dir__ = lazy_exports(
    __name__, {"DecoderLM": "lightning_hydra.models.decoder", "HydraModule": "lightning_hydra.models.module"}
)
