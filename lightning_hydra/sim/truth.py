"""The simulated truth: how long a rank's share of a bin takes on given hardware.

Deliberately not the planner's :class:`~lightning_hydra.planner.CostModel`: kernels run at a size-dependent
efficiency (short GEMMs and short attention chunks are slow), every layer pays fixed launch overheads and per-
sequence bookkeeping, every all-to-all and ring step pays a latency, and ring transfers are hidden only behind the
attention of the same step of the same layer. For one rank of a group of degree ``d = u * r`` on a bin ``Ls``, per
pipeline stage of ``layers`` layers and tensor parallelism ``tp``::

    gemm  = 6 * (params_per_layer * layers + head) / tp * T / (peak * gemm_eff(T))            T = sum(L) / d
    attn  = sum_L 6 * hidden * layers * L**2 / (d * tp) / (peak * attn_eff(L / d))
    a2a   = [u > 1] (a2a_bytes(T) / intra_bw + 4 * layers * a2a_latency)
    ring  = [r > 1] layers * (r - 1) * (max(0, step_bytes / bw - attn / (layers * r)) + 2 * p2p_latency
                                         + ring_step_overhead)
    fixed = layers * (layer_overhead + seq_overhead * len(Ls))

A time with ``timer_includes_comm=False`` (a CPU thread timer) leaves out ``a2a`` bandwidth time and exposed ring
transfers but keeps the local overheads.
"""

from __future__ import annotations

import numpy as np

from lightning_hydra.planner import Plan
from lightning_hydra.sim.hardware import Hardware, ModelShape

__all__ = ["bin_time", "plan_times"]


def bin_time(
    lengths: np.ndarray,
    ulysses: int,
    ring: int,
    *,
    model: ModelShape,
    hardware: Hardware,
    layers: int,
    tp: int = 1,
    head_share: float = 0.0,
    include_comm: bool = True,
) -> float:
    """Seconds one member of a group spends on its bin (forward plus backward of ``layers`` layers).

    Args:
        lengths: Lengths of the bin's sequences.
        ulysses: Ulysses degree.
        ring: Ring degree.
        model: The model's shape.
        hardware: The device.
        layers: Layers of this pipeline stage.
        tp: Tensor-parallel size (divides GEMM and attention work and activation traffic).
        head_share: Share of the LM head's parameters this stage holds (1 on the last stage, spread evenly
            ``1 / pp`` in the simulator).
        include_comm: Include communication bandwidth time and exposed transfers.
    """
    lens = np.asarray(lengths, dtype=np.float64)
    if lens.size == 0:
        return 0.0
    hw = hardware
    d = ulysses * ring
    tokens = float(lens.sum()) / d
    linear_flops = 6.0 * (model.layer_params * layers + head_share * model.hidden_size * model.vocab_size)
    gemm = linear_flops / tp * tokens / (hw.peak_flops * max(hw.gemm_eff(tokens), 1e-9))
    chunk = lens / d
    attn_eff = hw.attn_efficiency * chunk / (chunk + hw.attn_half_len)
    attn_flops = 6.0 * model.hidden_size * layers * lens * lens / (d * tp)
    attn = float(np.sum(attn_flops / (hw.peak_flops * attn_eff)))
    total = gemm + attn + layers * (hw.layer_overhead + hw.seq_overhead * lens.size)
    elem = model.bytes_per_element
    if ulysses > 1:
        # q, k, v in and the output back, forward; the same again backward
        a2a_bytes = 2 * (2 * model.hidden_size + 2 * model.kv_dim) * elem * layers / tp * tokens
        share = (ulysses - 1) / ulysses
        total += (a2a_bytes * share / hw.intra_node_bandwidth if include_comm else 0.0) + 4 * layers * hw.a2a_latency
    if ring > 1:
        bw = hw.inter_node_bandwidth if d > hw.gpus_per_node else hw.intra_node_bandwidth
        # one KV block per step: k, v forward; k, v and dk, dv backward
        step_bytes = 6 * model.kv_dim * elem / tp * (float(lens.sum()) / ring / ulysses)
        hidden = attn / (layers * ring)  # the attention one step of one layer can hide a transfer behind
        exposed = max(0.0, step_bytes / bw - hidden) if include_comm else 0.0
        total += layers * (ring - 1) * (exposed + 2 * hw.p2p_latency + hw.ring_step_overhead)
    return float(total)


def plan_times(
    plan: Plan,
    *,
    model: ModelShape,
    hardware: Hardware,
    layers: int,
    tp: int = 1,
    head_share: float = 0.0,
    include_comm: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Simulated busy time ``[M, N]`` of every rank in every microbatch, and each rank's group leader ``[M, N]``.

    Args:
        plan: The plan of a global batch.
        model: The model's shape.
        hardware: The device.
        layers: Layers of one pipeline stage.
        tp: Tensor-parallel size.
        head_share: Share of the LM head per stage.
        include_comm: Include communication (see :func:`bin_time`).
    """
    lengths = np.asarray(plan.lengths, dtype=np.float64)
    times = np.zeros((plan.num_microbatches, plan.world_size))
    leader = np.zeros((plan.num_microbatches, plan.world_size), dtype=np.int64)
    for m, groups in enumerate(plan.microbatches):
        for g in groups:
            ranks = list(g.ranks)
            leader[m, ranks] = g.ranks[0]
            if g.seq_ids:
                times[m, ranks] = bin_time(
                    lengths[list(g.seq_ids)], g.ulysses, g.ring, model=model, hardware=hardware, layers=layers,
                    tp=tp, head_share=head_share, include_comm=include_comm,
                )  # fmt: skip
    return times, leader
