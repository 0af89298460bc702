"""The best efficiency any plan of a batch can reach under a truth: a ceiling that tells a scheduler's loss from a
truth's.

Efficiency under a truth (:func:`~lightning_hydra.sim.truth.useful_time` over the pool, divided by the sum over
microbatches of the slowest rank's time) counts as waste what no plan avoids: GEMMs on a rank's share of tokens
below their peak, attention on per-rank chunks below its peak, per-rank and per-sequence overheads, and the
communication of every sequence too long for one rank. :func:`span_floor` bounds from below the span of *every*
plan that keeps each rank within ``capacity`` tokens, whatever its scheduler, degrees, microbatches or layout:

- the sum over microbatches of the slowest rank's time is at least the sum of all ranks' times over ``N``;
- a rank's GEMMs and per-layer overheads (:func:`~lightning_hydra.sim.truth.group_times`) sum, over the busy ranks of
  all microbatches, to ``linear * (tokens + half * B) / (peak * eff) + layers * layer_overhead * B``, and ``B``
  (busy rank-microbatches) is at least ``tokens / capacity``;
- what each sequence adds to the ranks' sum (its attention at its group's degree, its share of the all-to-all bytes
  and of the exposed ring bytes, its bookkeeping on every rank of its group) depends on its own degree, the
  factorisation ``u * r`` and the ring's link only; charged the faster of the two links up to a node's ranks (a
  layout may or may not cross a node there) and the inter-node link above, it grows with ``r`` at a fixed ``u``
  (attention below peak on shorter chunks, more ring steps, the inter-node link): its least value over the Ulysses
  degrees, each at the smallest ring that holds the sequence (``ceil(L / capacity)`` ranks at least), is a floor;
- what a plan may share between sequences (each group's all-to-all and ring-step latencies, and the ring traffic
  that attention hides where the truth has no fixed ring share) is left out, so the floor holds for every plan.

The ceiling ``useful / N / floor`` is therefore an upper bound, not a target a scheduler can always reach: it
assumes perfect balance and every sequence at its cheapest degree at once. Where it lies below a target, no plan
meets the target under that truth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_hydra.planner.degrees import DegreeRules
from lightning_hydra.sim.hardware import Hardware, ModelShape
from lightning_hydra.sim.truth import ENGINES, useful_time

__all__ = ["efficiency_ceiling", "span_floor"]


def span_floor(
    lengths: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    model: ModelShape,
    hardware: Hardware,
    layers: int,
    head_share: float = 0.0,
    ulysses: Sequence[int] | None = None,
    engine: str = "hydra",
) -> float:
    """The least span (seconds: sum over microbatches of the slowest rank's time) of any plan of ``lengths`` on
    ``world_size`` ranks of at most ``capacity`` tokens each, under ``hardware`` (tensor parallelism 1, timers
    including communication, as :func:`~lightning_hydra.sim.truth.plan_times`).

    Args:
        lengths: The batch's sequence lengths.
        world_size: Ranks of the pool.
        capacity: Most tokens a rank holds in one microbatch.
        model: The model's shape.
        hardware: The truth.
        layers: Layers timed (all of them without pipeline stages).
        head_share: Share of the LM head's parameters timed (1 without pipeline stages).
        ulysses: The Ulysses degrees a plan may use (a superset of them keeps the floor valid). Default:
            :meth:`~lightning_hydra.planner.DegreeRules.ulysses_options` of a pool whose ``ranks_per_node`` is the
            hardware's GPUs per node (as in the robustness benchmark); pass larger ones for plans made with more
            ranks per node.
        engine: The CP engine (:data:`~lightning_hydra.sim.truth.ENGINES`: the bytes of dK and dV on the ring).

    Raises:
        ValueError: If a sequence needs more ranks than the pool has, ``ulysses`` is empty, or an argument is out of
            range.
    """
    if world_size < 1 or capacity < 1:
        raise ValueError(f"world_size and capacity must be positive, got {world_size} and {capacity}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {sorted(ENGINES)}")
    lens = np.asarray(lengths, dtype=np.float64)
    if lens.size == 0:
        return 0.0
    if (lens <= 0).any():
        raise ValueError("sequence lengths must be positive")
    need = np.ceil(lens / capacity)
    if need.max() > world_size:
        raise ValueError(
            f"a sequence of {int(lens.max())} tokens needs {int(need.max())} ranks of {capacity} tokens; the pool has"
            f" {world_size}"
        )
    hw = hardware
    if ulysses is None:  # what DegreeRules allows when a plan's ranks per node are the hardware's GPUs per node
        rules = DegreeRules(world_size=world_size, ranks_per_node=hw.gpus_per_node, num_heads=model.num_heads)
        ulysses = rules.ulysses_options()
    if len(ulysses) == 0 or min(ulysses) < 1:
        raise ValueError(f"Ulysses degrees must be positive and at least one, got {list(ulysses)}")
    # per busy rank-microbatch: GEMMs (their ``half`` tokens) and per-layer launches; at least tokens / capacity
    busy = math.ceil(float(lens.sum()) / capacity)
    linear = 6.0 * (model.layer_params * layers + head_share * model.hidden_size * model.vocab_size)
    ranks = linear * (float(lens.sum()) + hw.gemm_half_tokens * busy) / (hw.peak_flops * hw.gemm_efficiency)
    ranks += layers * hw.layer_overhead * busy
    # per sequence, summed over its group's ranks, at its cheapest factorisation
    elem = model.bytes_per_element
    a2a_width = 4 * model.hidden_size if hw.a2a_full_heads else 2 * model.hidden_size + 2 * model.kv_dim
    a2a_per_token = 2 * a2a_width * elem * layers / hw.intra_node_bandwidth
    dkv = ENGINES[engine]
    kv_per_token = 4 * model.kv_dim * elem + 2 * model.kv_dim * (elem if dkv is None else dkv)
    attn_flops = 6.0 * model.hidden_size * layers * lens * lens
    best = np.full(lens.size, np.inf)
    for u in sorted(set(int(x) for x in ulysses)):
        ring = np.maximum(1.0, np.ceil(need / u))
        d = u * ring
        ok = d <= world_size
        eff = np.minimum(d, np.maximum(1.0, lens / hw.attn_tile_tokens)) if hw.attn_tile_tokens > 0 else d
        chunk = lens / eff
        cost = d * attn_flops / eff * (chunk + hw.attn_half_len) / (chunk * hw.peak_flops * hw.attn_efficiency)
        cost += d * layers * hw.seq_overhead
        if u > 1:
            cost += a2a_per_token * lens * (u - 1) / u
        if hw.ring_share is not None:  # a group above a node crosses one; a smaller one may, laid out unaligned
            fast = max(hw.inter_node_bandwidth, hw.intra_node_bandwidth)
            bw = np.where(d > hw.gpus_per_node, hw.inter_node_bandwidth, fast)
            cost += layers * (ring - 1) * hw.ring_share * kv_per_token * lens / bw
        best = np.where(ok, np.minimum(best, cost), best)
    return float((ranks + best.sum()) / world_size)


def efficiency_ceiling(
    lengths: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    model: ModelShape,
    hardware: Hardware,
    layers: int | None = None,
    head_share: float = 1.0,
    ulysses: Sequence[int] | None = None,
    engine: str = "hydra",
) -> float:
    """The highest efficiency any plan of ``lengths`` can reach under ``hardware``: the batch's useful time over
    the pool divided by :func:`span_floor` (the same efficiency as ``bench.robust.efficiency``).

    Takes :func:`span_floor`'s arguments, with ``layers`` defaulting to all of the model's and ``head_share`` to 1
    (the whole model timed, as the robustness benchmark does).
    """
    layers = model.num_layers if layers is None else layers
    floor = span_floor(
        lengths, world_size=world_size, capacity=capacity, model=model, hardware=hardware, layers=layers,
        head_share=head_share, ulysses=ulysses, engine=engine,
    )  # fmt: skip
    if floor <= 0:
        return 1.0
    useful = useful_time(lengths, model=model, hardware=hardware, layers=layers, head_share=head_share)
    return useful / world_size / floor
