"""Pipeline parallelism under dynamic CP: stages of the model and our own 1F1B schedule.

**Layout.** With ``HydraStrategy(pipeline_stages=P)`` the world is ``P`` stages of a pool of ``N = world / P``
ranks: stage ``s`` holds global ranks ``[s * N, (s + 1) * N)`` and pool position ``i`` of stage ``s`` is global rank
``s * N + i``. Every stage plans the same global batch onto its pool (the same plan: the digest check covers the
whole world), so stage ``s`` position ``i`` and stage ``s + 1`` position ``i`` hold the same zigzag layout in every
microbatch: activations ``[tokens_on_rank, hidden]`` go from one to the other (stage-to-stage traffic between
matching pool positions, across nodes when a stage fills whole nodes), gradients come back the same way.

**Stages of a model.** A :class:`~lightning_hydra.HydraModule` splits through two methods:
``pipeline_stage(stage, stages)`` keeps only that stage's parameters (embedding with the first blocks, ..., the
last blocks with the final norm and head) and ``stage_forward(mb, hidden)`` runs them (the first stage from token
ids, the others from the previous stage's activations; the last returns the microbatch's loss sum).
:func:`stage_layers` balances contiguous blocks by per-token FLOPs (embedding lookups cost nothing, the head ``2 V
h``), the reference decoder and Hugging Face Llama-family models use it.

**Schedule.** Each stage runs one 1F1B order over all the step's microbatches
(:func:`~lightning_hydra.metrics.bubbles.one_f_one_b_order`: ``P - s - 1`` warm-up forwards, one forward / one
backward alternating, the remaining backwards), and each pool position drops from it the microbatches it sits out
(a position idle in a microbatch is idle at every stage: same plan). The order, the exchanges with the neighbouring
stages and everything else a step does are each rank's operation list (:mod:`lightning_hydra.schedule`), which
:class:`~lightning_hydra.strategy.step.StepRunner` executes: an exchange pairs a send with the receive the next
operation needs, the same pairs in the same order on both ends of every link, so NCCL cannot deadlock on sends and
receives posted in opposite orders; and the members of a CP group meet their shared microbatches in the same order
(a per-position 1F1B over only the microbatches a position runs did not: two positions sharing groups in
microbatches 4 and 6 ran ``B4 F6`` and ``F6 B4`` and hung). Every transfer's shape comes from the list and its
dtype from the model (:func:`wire_dtype`). The loss lives on the last stage, normalised by the global batch's
trained tokens, so the run stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_hydra.models.stages import stage_layers

__all__ = ["PipelineLayout", "stage_layers", "wire_dtype"]


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Stages x pool: stage ``s`` is global ranks ``[s * pool, (s + 1) * pool)``."""

    stages: int
    """Pipeline stages ``P``."""
    pool: int
    """Ranks per stage (the dynamic-CP pool every plan is made for)."""

    def __post_init__(self) -> None:
        if self.stages < 1 or self.pool < 1:
            raise ValueError(f"pipeline stages ({self.stages}) and pool ({self.pool}) must be positive")

    @classmethod
    def of_world(cls, world_size: int, stages: int) -> PipelineLayout:
        """The layout of ``world_size`` ranks in ``stages`` stages (``ValueError`` unless it divides)."""
        if stages < 1:
            raise ValueError(f"pipeline_stages must be positive, got {stages}")
        if world_size % stages:
            raise ValueError(f"a world of {world_size} ranks cannot form {stages} pipeline stages of equal pools")
        return cls(stages=stages, pool=world_size // stages)

    @property
    def world_size(self) -> int:
        """``stages * pool``."""
        return self.stages * self.pool

    def stage(self, global_rank: int) -> int:
        """The stage of a global rank."""
        return global_rank // self.pool

    def position(self, global_rank: int) -> int:
        """The pool position of a global rank (its rank in every plan)."""
        return global_rank % self.pool

    def global_rank(self, stage: int, position: int) -> int:
        """The global rank at ``position`` of ``stage``."""
        return stage * self.pool + position

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks of a stage's pool."""
        return tuple(range(stage * self.pool, (stage + 1) * self.pool))


def wire_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype activations and their gradients travel in between stages: the model's (first floating-point
    parameter's; float32 without one). Every stage derives the same one; a stage output of another dtype (autocast)
    is cast to it."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
