"""A simulated job's memory per rank, from the planner's own memory model (:mod:`lightning_hydra.planner.memory`).

The simulator's headroom is what :class:`~lightning_hydra.HydraStrategy` would size the job with: model state for
the job's ``sharding`` and ``precision`` over one stage's pool (a stage holds ``1 / pp`` of the model, a TP rank
``1 / tp`` of every block's projections), its communicators, and activation bytes per token for its
``activation_checkpointing`` (under 1F1B the first stage keeps ``pp`` microbatches of its ``layers / pp`` blocks, as
many per token as the whole model). No margin is kept here: the headroom is the share of the device left, margin
included. The model's shape is a Llama-style decoder with untied embeddings (Llama-3's).
"""

from __future__ import annotations

from lightning_hydra.planner.memory import MemoryBreakdown, ModelMemoryShape, memory_capacity
from lightning_hydra.sim.hardware import Hardware, ModelShape

__all__ = ["job_memory", "memory_headroom", "memory_shape"]


def memory_shape(model: ModelShape) -> ModelMemoryShape:
    """The memory model's shape of the simulator's model (untied embeddings)."""
    return ModelMemoryShape.for_decoder(
        model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads, model.ffn_hidden_size,
        model.vocab_size,
    )  # fmt: skip


def job_memory(job, model: ModelShape, hardware: Hardware, *, ranks_per_node: int) -> MemoryBreakdown:
    """The memory model's breakdown of one rank of ``job`` (a :class:`~lightning_hydra.sim.Job`) on ``hardware``:
    ``available`` is what its device leaves for activations, ``per_token["total"]`` what a token of a microbatch
    takes (the capacity it reports is the tokens that fit with no margin).

    Args:
        job: The job (its ``sharding``, ``precision``, ``activation_checkpointing``, ``communicator_bytes``, pool,
            pipeline and TP sizes, microbatches).
        model: The model's shape.
        hardware: The device (its ``memory_bytes`` is the budget).
        ranks_per_node: Ranks of the pool per node (``hsdp`` shards over them).
    """
    return memory_capacity(
        memory_shape(model),
        budget=hardware.memory_bytes,
        sharding=job.sharding,
        precision=job.precision,
        checkpointing=job.activation_checkpointing,
        world_size=job.pool,
        ranks_per_node=ranks_per_node,
        num_microbatches=job.num_microbatches,
        communicator_bytes=job.communicator_bytes,
        margin=0.0,
        multiple_of=1,
        pipeline_stages=job.pp,
        tensor_parallel=job.tp,
        sequence_parallel=job.sequence_parallel,
    )


def memory_headroom(memory: MemoryBreakdown, tokens: float) -> float:
    """Share of the device left on a rank holding ``tokens`` tokens in a microbatch (below 0: it does not fit)."""
    return (memory.available - memory.per_token["total"] * tokens) / memory.budget
