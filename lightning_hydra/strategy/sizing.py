"""Whether the data fits the pool: every sizing problem in one message, with values that fit.

Two things must fit a pool of ``W`` ranks of ``max_tokens_per_rank`` tokens each, run ``num_microbatches`` times
per step: the global batch (``global_batch_tokens <= W x max_tokens_per_rank x num_microbatches``) and the longest
sequence (its zigzag shard at the largest degree the pool, the heads and the caps allow must fit one rank). With
pipeline stages and tensor parallelism the pool is ``devices / (stages x T)`` positions (a position is a TP group,
whose ranks hold the same tokens), and the message says so in those words. A user sizing a run by hand meets both
at once, so both are checked before either is reported, and the message gives settings that make every check pass
(pure: no process group).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from lightning_hydra.errors import ConfigError
from lightning_hydra.planner import DegreeRules, PlannerConfig
from lightning_hydra.planner.degrees import shard_tokens
from lightning_hydra.strategy.layout import RunLayout

__all__ = ["check_sizing", "min_capacity"]


def min_capacity(length: int, rules: DegreeRules) -> int:
    """The fewest tokens per rank that hold a sequence of ``length`` tokens at some degree ``rules`` allow (its
    zigzag shard at the best allowed degree)."""
    return min(int(shard_tokens(length, d)) for d in rules.degrees(fine=True))


def check_sizing(
    config: PlannerConfig,
    world_size: int,
    num_heads: int | None,
    *,
    longest: Mapping[str, int],
    global_batch_tokens: int,
    stages: int = 1,
    tensor: int = 1,
) -> None:
    """Raise one :class:`~lightning_hydra.errors.ConfigError` naming every sizing problem (the global batch, the
    longest sequence of each split) and values of ``max_tokens_per_rank`` / ``num_microbatches`` that fit.

    Args:
        config: The planner settings.
        world_size: Positions in the pool (each stage's pool: ``devices / (stages x T)``; ranks without TP).
        num_heads: Attention heads of the model (``None``: any Ulysses degree).
        longest: The longest sequence of each data split, by split name.
        global_batch_tokens: Tokens per global batch.
        stages: Pipeline stages (for the message).
        tensor: The TP degree ``T`` (for the message: a position is a TP group of ``T`` ranks).
    """
    cap, micro = config.max_tokens_per_rank, config.num_microbatches
    rules = DegreeRules(
        world_size=world_size,
        ranks_per_node=min(config.ranks_per_node, world_size),
        num_heads=num_heads,
        max_ulysses=config.max_ulysses,
        max_ring=config.max_ring,
    )
    problems = []
    held = world_size * cap * micro
    unit = "ranks" if tensor == 1 else "positions"
    if global_batch_tokens > held:
        problems.append(
            f"global_batch_tokens={global_batch_tokens} exceeds what {micro} microbatch{'es' if micro > 1 else ''} "
            f"of {world_size} {unit} x {cap} tokens hold ({held})"
        )
    need = 1  # tokens per rank that the longest sequence of every split needs
    for split, length in longest.items():
        fewest = min_capacity(length, rules)
        need = max(need, fewest)
        if fewest > cap:  # no allowed degree's shard fits the capacity
            problems.append(
                f"the {split} data holds a sequence of {length} tokens, more than the pool can hold ({world_size} "
                f"{unit} x {cap} tokens)"
            )
    if not problems:
        return
    fits = [f"max_tokens_per_rank={max(need, cap, math.ceil(global_batch_tokens / (world_size * micro)))}"]
    if need <= cap:  # only the batch is too large: more microbatches also fit
        fits.append(f"num_microbatches={math.ceil(global_batch_tokens / (world_size * cap))}")
    elif global_batch_tokens > world_size * need * micro:
        fits.append(
            f"max_tokens_per_rank={need} with num_microbatches={math.ceil(global_batch_tokens / (world_size * need))}"
        )
    where = ""
    split = [name for name, value in (("pipeline_stages", stages), ("tensor_parallel", tensor)) if value > 1]
    if split:
        layout = RunLayout(world_size * stages * tensor, tensor, stages)
        whose = f"each of the {stages} stages plans the batch on its own pool" if stages > 1 else "the batch is planned"
        whose += f" of {world_size} {unit}" if stages > 1 else f" on a pool of {world_size} {unit}"
        groups = f", each a TP group of {tensor} ranks holding the same tokens" if tensor > 1 else ""
        over = f"({' x '.join(split)})" if len(split) > 1 else split[0]
        where = f"{layout.settings()} ({layout.degrees()}): {whose} (devices / {over}){groups}: "
    other = "; or add devices" + (f" (or lower {' or '.join(split)})" if split else "")
    other += ", or set HydraDataModule(max_seq_len=..., truncate=True)" if need > cap else ""
    raise ConfigError(f"{where}{'; '.join(problems)}. Values that fit: {' or '.join(fits)}{other}")
