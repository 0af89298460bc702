"""The simulated truth: how long a rank's share of a bin takes on given hardware.

Deliberately not the planner's :class:`~lightning_hydra.planner.CostModel`: kernels run at a size-dependent
efficiency (short GEMMs and short attention chunks are slow), every layer pays fixed launch overheads and per-
sequence bookkeeping, every all-to-all and ring step pays a latency, and ring transfers are hidden only behind the
attention of the same step of the same layer. For one rank of a group of degree ``d = u * r`` on a bin ``Ls``, per
pipeline stage of ``layers`` layers and tensor parallelism ``tp``::

    gemm  = 6 * (params_per_layer * layers + head) / tp * T / (peak * gemm_eff(T))            T = sum(L) / d
    attn  = sum_L 6 * hidden * layers * L**2 / (e * tp) / (peak * attn_eff(L / e))    e = min(d, max(1, L / tile))
    a2a   = [u > 1] (a2a_bytes(T) / intra_bw + 4 * layers * a2a_latency)
    ring  = [r > 1] layers * (r - 1) * (exposed + 2 * p2p_latency + ring_step_overhead)
    tp    = [tp > 1] layers * calls * (tp_latency + (sent(T) + tp_half_bytes) / intra_bw)      (tp_collective_time)
    fixed = layers * (layer_overhead + seq_overhead * len(Ls))

where one ring step of one layer moves ``step = kv_bytes * sum(L) / d`` (k and v forward; k, v and dK, dV
backward) over the intra-node link when the group's ranks lie in one node and the inter-node link when they span
nodes (a ring runs at its slowest hop; without a layout, a group spans nodes when it is larger than one), and
``exposed``
is ``max(0, step / bw - attn / (layers * r))`` (what that step's attention fails to hide) or, with
``ring_share``, ``ring_share * step / bw`` whatever attention hides. ``a2a_bytes`` counts q, k, v in and the
output back, forward and backward, with k and v at the KV heads (or the full width with ``a2a_full_heads``).

Tensor parallelism's own collectives (:func:`tp_collective_time`) run inside the node, exposed (nothing overlaps
them): per block and microbatch, ``calls`` collectives (:data:`TP_COLLECTIVES`), each sending ``sent(T)`` bytes
of a ``[T, hidden]`` activation (``T`` the CP rank's tokens) from every device at a size-dependent rate
``intra_bw * sent / (sent + tp_half_bytes)`` after a fixed ``tp_latency``.

Engines (:data:`ENGINES`): ``"hydra"`` is this package's Ulysses-in-ring engine (dK/dV travel in float32);
``"te-p2p"`` is Transformer Engine's ring for packed (THD) input, ``cp_comm_type="p2p"``, the only CP type it
supports for THD and the one Megatron's Dynamic-CP hands its per-microbatch groups to: a ring over the whole group
(no Ulysses level, ``u = 1``), dK/dV in the activation dtype (assumed).

A time with ``timer_includes_comm=False`` (a CPU thread timer) leaves out ``a2a`` and TP bandwidth time and exposed
ring transfers but keeps the local overheads and latencies. Everything is vectorised over the groups of a plan.
"""

from __future__ import annotations

import numpy as np

from lightning_hydra.planner import Plan
from lightning_hydra.sim.hardware import Hardware, ModelShape

__all__ = [
    "ENGINES",
    "TP_COLLECTIVES",
    "bin_time",
    "group_times",
    "plan_times",
    "plan_tp_times",
    "tp_collective_bytes",
    "tp_collective_time",
    "useful_time",
]

ENGINES = {"hydra": 4, "te-p2p": None}
"""CP engines the truth times, with the bytes per element of dK/dV on the ring (``None``: the activation dtype)."""


TP_COLLECTIVES = {False: (7, 2), True: (8, 1)}
"""Tensor parallelism's collectives per block, forward plus backward, keyed by sequence parallelism: ``(calls,
sent)``, each call sending ``sent * (tp - 1) / tp`` of a ``[tokens, hidden]`` activation from every device (a
ring's traffic). Without sequence parallelism 7 all-reduces (``sent`` 2: reduce-scatter plus all-gather): forward the
outputs of o and down, backward the input gradients of q, k and v (each projection reduces its own), gate and
up. With it 8 half-size calls: forward an all-gather before attention and before the MLP and a reduce-scatter
after o and after down; backward each one's transpose (a reduce-scatter of q/k/v's summed input gradient and of
gate/up's, an all-gather of the gradients of o's and down's outputs). 8 x 1 against 7 x 2: sequence parallelism
sends 4/7 of the bytes in one more call."""


def tp_collective_bytes(
    tokens: np.ndarray | float, *, model: ModelShape, tp: int, sequence_parallel: bool
) -> tuple[int, np.ndarray]:
    """``(calls, bytes)``: TP's collective calls of one block (forward plus backward) and the bytes one device
    sends in each, for a CP rank holding ``tokens`` tokens (zero calls at ``tp`` 1; see :data:`TP_COLLECTIVES`)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if tp <= 1:
        return 0, np.zeros_like(tokens)
    calls, sent = TP_COLLECTIVES[bool(sequence_parallel)]
    return calls, sent * (tp - 1) / tp * tokens * model.hidden_size * model.bytes_per_element


def tp_collective_time(
    tokens: np.ndarray | float,
    *,
    model: ModelShape,
    hardware: Hardware,
    layers: int,
    tp: int,
    sequence_parallel: bool = True,
    include_comm: bool = True,
) -> np.ndarray:
    """Seconds a device of a TP group of ``tp`` spends in TP's own collectives on ``tokens`` tokens of its CP rank
    in one microbatch (``layers`` blocks, forward plus backward; 0 at ``tp`` 1 or without tokens).

    Every call pays ``hardware.tp_latency`` and sends its bytes (:func:`tp_collective_bytes`) over the device's
    intra-node link at ``sent / (sent + tp_half_bytes)`` of ``intra_node_bandwidth``; nothing hides them. With
    ``include_comm=False`` (a CPU thread timer) only the latencies count, as for the all-to-alls."""
    tokens = np.asarray(tokens, dtype=np.float64)
    calls, sent = tp_collective_bytes(tokens, model=model, tp=tp, sequence_parallel=sequence_parallel)
    hw = hardware
    wire = (sent + hw.tp_half_bytes) / hw.intra_node_bandwidth if include_comm else 0.0
    return np.where(tokens > 0, layers * calls * (hw.tp_latency + wire), 0.0)


def _check_engine(engine: str) -> int | None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[engine]


def group_times(
    lengths: np.ndarray,
    group: np.ndarray,
    ulysses: np.ndarray,
    ring: np.ndarray,
    *,
    model: ModelShape,
    hardware: Hardware,
    layers: int,
    tp: int = 1,
    head_share: float = 0.0,
    include_comm: bool = True,
    engine: str = "hydra",
    crosses: np.ndarray | None = None,
    sequence_parallel: bool = True,
) -> np.ndarray:
    """Seconds one member of each group spends on its bin (forward plus backward of ``layers`` layers).

    Args:
        lengths: Length of every sequence placed.
        group: Group index (``0 .. G-1``) of every sequence.
        ulysses: Ulysses degree of every group ``[G]``.
        ring: Ring degree of every group ``[G]``.
        model: The model's shape.
        hardware: The device.
        layers: Layers of this pipeline stage.
        tp: Tensor-parallel size (divides GEMM and attention work and activation traffic).
        head_share: Share of the LM head's parameters this stage holds.
        include_comm: Include communication bandwidth time and exposed transfers.
        engine: ``"hydra"`` or ``"te-p2p"`` (see :data:`ENGINES`).
        crosses: Whether each group's ranks span nodes ``[G]`` (``None``: the groups larger than a node's
            ``gpus_per_node // tp`` CP ranks; a plan's layout decides in :func:`plan_times`).
        sequence_parallel: Whether the TP group runs sequence parallelism (:func:`tp_collective_time`; unused at
            ``tp`` 1).

    Returns:
        ``[G]`` seconds (0 for a group without sequences).
    """
    dkv_bytes = _check_engine(engine)
    hw = hardware
    u = np.asarray(ulysses, dtype=np.float64)
    r = np.asarray(ring, dtype=np.float64)
    if engine == "te-p2p" and (u > 1).any():
        raise ValueError("the te-p2p engine has no Ulysses level: plan with max_ulysses=1")
    n = u.size
    lens = np.asarray(lengths, dtype=np.float64)
    gid = np.asarray(group, dtype=np.int64)
    d = u * r
    count = np.bincount(gid, minlength=n).astype(np.float64)
    total = np.bincount(gid, weights=lens, minlength=n)
    tokens = total / d
    linear_flops = 6.0 * (model.layer_params * layers + head_share * model.hidden_size * model.vocab_size) / tp
    # gemm_eff(T) = g * T / (T + half): time = flops * (T + half) / (peak * g)
    gemm = np.where(tokens > 0, linear_flops * (tokens + hw.gemm_half_tokens) / (hw.peak_flops * hw.gemm_efficiency), 0)
    d_seq = d[gid]
    eff_deg = np.minimum(d_seq, np.maximum(1.0, lens / hw.attn_tile_tokens)) if hw.attn_tile_tokens > 0 else d_seq
    chunk = lens / eff_deg
    attn_flops = 6.0 * model.hidden_size * layers * lens * lens / (eff_deg * tp)
    attn_seq = attn_flops * (chunk + hw.attn_half_len) / (chunk * hw.peak_flops * hw.attn_efficiency)
    attn = np.bincount(gid, weights=attn_seq, minlength=n)
    busy = count > 0
    total_time = gemm + attn + np.where(busy, layers * (hw.layer_overhead + hw.seq_overhead * count), 0.0)
    elem = model.bytes_per_element
    a2a_width = 4 * model.hidden_size if hw.a2a_full_heads else 2 * model.hidden_size + 2 * model.kv_dim
    a2a_bytes = 2 * a2a_width * elem * layers / tp * tokens  # q, k, v in and the output back; again backward
    a2a = (a2a_bytes * (u - 1) / u / hw.intra_node_bandwidth if include_comm else 0.0) + 4 * layers * hw.a2a_latency
    total_time += np.where(busy & (u > 1), a2a, 0.0)
    total_time += tp_collective_time(
        np.where(busy, tokens, 0.0), model=model, hardware=hw, layers=layers, tp=tp,
        sequence_parallel=sequence_parallel, include_comm=include_comm,
    )  # fmt: skip
    kv_bytes = 4 * model.kv_dim * elem + 2 * model.kv_dim * (elem if dkv_bytes is None else dkv_bytes)
    node = max(1, hw.gpus_per_node // tp)  # CP ranks per node: each holds ``tp`` devices
    across = d > node if crosses is None else np.asarray(crosses, dtype=bool)
    bw = np.where(across, hw.inter_node_bandwidth, hw.intra_node_bandwidth)
    step = kv_bytes / tp * tokens / bw  # one KV block hop of one layer (forward plus backward)
    if not include_comm:
        exposed = np.zeros(n)
    elif hw.ring_share is not None:
        exposed = hw.ring_share * step
    else:
        exposed = np.maximum(0.0, step - attn / (layers * r))
    ring_time = layers * (r - 1) * (exposed + 2 * hw.p2p_latency + hw.ring_step_overhead)
    total_time += np.where(busy & (r > 1), ring_time, 0.0)
    return total_time


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
    engine: str = "hydra",
    sequence_parallel: bool = True,
) -> float:
    """Seconds one member of a group spends on its bin (:func:`group_times` of one group).

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
        engine: ``"hydra"`` or ``"te-p2p"``.
        sequence_parallel: Whether the TP group runs sequence parallelism (TP's collectives).
    """
    lens = np.asarray(lengths, dtype=np.float64)
    if lens.size == 0:
        return 0.0
    return float(
        group_times(
            lens, np.zeros(lens.size, dtype=np.int64), np.asarray([ulysses]), np.asarray([ring]), model=model,
            hardware=hardware, layers=layers, tp=tp, head_share=head_share, include_comm=include_comm, engine=engine,
            sequence_parallel=sequence_parallel,
        )[0]
    )  # fmt: skip


def useful_time(
    lengths: np.ndarray, *, model: ModelShape, hardware: Hardware, layers: int, tp: int = 1, head_share: float = 0.0
) -> float:
    """Ideal seconds of the batch's FLOPs on one device: GEMMs and attention at their best efficiencies, no
    overheads and no communication (the numerator of efficiency under this truth)."""
    lens = np.asarray(lengths, dtype=np.float64)
    hw = hardware
    linear_flops = 6.0 * (model.layer_params * layers + head_share * model.hidden_size * model.vocab_size) / tp
    attn_flops = 6.0 * model.hidden_size * layers / tp
    return float(
        linear_flops * lens.sum() / (hw.peak_flops * hw.gemm_efficiency)
        + attn_flops * (lens * lens).sum() / (hw.peak_flops * hw.attn_efficiency)
    )


def plan_times(
    plan: Plan,
    *,
    model: ModelShape,
    hardware: Hardware,
    layers: int,
    tp: int = 1,
    head_share: float = 0.0,
    include_comm: bool = True,
    engine: str = "hydra",
    sequence_parallel: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Simulated busy time ``[M, N]`` of every rank in every microbatch, and each rank's group leader ``[M, N]``.

    Args:
        plan: The plan of a global batch.
        model: The model's shape.
        hardware: The device.
        layers: Layers of one pipeline stage.
        tp: Tensor-parallel size.
        head_share: Share of the LM head per stage.
        include_comm: Include communication (see :func:`group_times`).
        engine: ``"hydra"`` or ``"te-p2p"``.
        sequence_parallel: Whether the TP groups run sequence parallelism (TP's collectives).
    """
    lengths = np.asarray(plan.lengths, dtype=np.float64)
    starts, sizes, us, rs, seqs, gids = [], [], [], [], [], []
    mb_of = []
    for m, groups in enumerate(plan.microbatches):
        for g in groups:
            gid = len(us)
            starts.append(g.ranks[0])
            sizes.append(g.degree)
            us.append(g.ulysses)
            rs.append(g.ring)
            mb_of.append(m)
            seqs.extend(g.seq_ids)
            gids.extend([gid] * len(g.seq_ids))
    seq = np.asarray(seqs, dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64)
    last = first + np.asarray(sizes, dtype=np.int64) - 1
    node = max(1, hardware.gpus_per_node // tp)  # CP ranks per node: each holds ``tp`` devices
    per_group = group_times(
        lengths[seq], np.asarray(gids, dtype=np.int64), np.asarray(us), np.asarray(rs), model=model,
        hardware=hardware, layers=layers, tp=tp, head_share=head_share, include_comm=include_comm, engine=engine,
        crosses=first // node != last // node, sequence_parallel=sequence_parallel,
    )  # fmt: skip
    times = np.zeros((plan.num_microbatches, plan.world_size))
    leader = np.zeros((plan.num_microbatches, plan.world_size), dtype=np.int64)
    for k, (m, start, size) in enumerate(zip(mb_of, starts, sizes, strict=True)):
        times[m, start : start + size] = per_group[k]
        leader[m, start : start + size] = start
    return times, leader


def plan_tp_times(
    plan: Plan,
    *,
    model: ModelShape,
    hardware: Hardware,
    layers: int,
    tp: int = 1,
    sequence_parallel: bool = True,
    include_comm: bool = True,
) -> np.ndarray:
    """The part of :func:`plan_times`' busy time ``[M, N]`` that every rank spends in TP's own collectives
    (:func:`tp_collective_time` of its group's tokens; zeros at ``tp`` 1)."""
    out = np.zeros((plan.num_microbatches, plan.world_size))
    if tp <= 1:
        return out
    lengths = np.asarray(plan.lengths, dtype=np.float64)
    for m, groups in enumerate(plan.microbatches):
        for g in groups:
            tokens = lengths[np.asarray(g.seq_ids, dtype=np.int64)].sum() / g.degree
            out[m, g.ranks[0] : g.ranks[0] + g.degree] = tp_collective_time(
                tokens, model=model, hardware=hardware, layers=layers, tp=tp, sequence_parallel=sequence_parallel,
                include_comm=include_comm,
            )  # fmt: skip
    return out
