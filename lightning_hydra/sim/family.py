"""A family of cost truths apart from the planner's :class:`~lightning_hydra.planner.CostModel`.

Every truth is the simulator's hardware model (:mod:`lightning_hydra.sim.truth`: kernels at size-dependent
efficiencies, per-layer launches and latencies, ring transfers hidden behind the same step's attention) on an
H100-class device whose links run at the planner's default bandwidths, with one or more knobs turned to a form the
planner's model does not have:

===========  =====================================================================================================
``base``     the hardware model as is (no tile floor, no per-sequence overhead)
``share0``   every ring transfer hidden whatever the attention (a ring costs only its latencies)
``share25``  25% of ring traffic exposed whatever attention hides
``share50``  50% of ring traffic exposed whatever attention hides
``a2a-full`` Ulysses moves k and v at the full hidden size (no GQA saving)
``bw0.5``    both links at half the planner's default bandwidth
``bw2``      both links at twice the planner's default bandwidth
``tile512``  attention runs no faster below 512 tokens per rank
``seq50``    50 us per sequence per rank (all layers) of bookkeeping
``worst``    share50, a2a-full, bw0.5, tile512 and seq50 together
===========  =====================================================================================================

:data:`DEVICE_TRUTHS` keep the form and change the device's constants instead (``python -m
lightning_hydra.bench.robust --truths gemm2k attn4k ...``): a check on truths the planner was not tuned against.
:data:`DEAR_TRUTHS` are a regime where communication is dear (issue 58): the H100's own link rates
(:data:`~lightning_hydra.planner.devices.GPU_RATES`: 360 GB/s inside a node, 40 GB/s between nodes), a fixed share
of every ring transfer exposed (a ring that leaves a node pays it on the inter-node link), the Ulysses all-to-alls of
every layer at the NVLink rate and no per-sequence overhead beyond the kernels'; there Megatron's memory-minimal
degrees are the cheap ones and raising a degree costs about what it buys in balance.
:func:`random_truth` draws both at once (``random0``, ``random1``, ...: every constant and knob of
:data:`RANDOM_RANGES` at random, ``--random-truths K``): held-out truths no one chose.
"""

from __future__ import annotations

import numpy as np

from lightning_hydra.planner.devices import GPU_RATES
from lightning_hydra.sim.hardware import PRESETS, Hardware

__all__ = [
    "DEAR_TRUTHS", "DEVICE_TRUTHS", "LEAN_KERNELS", "PLANNER_BANDWIDTHS", "RANDOM_PREFIX", "RANDOM_RANGES", "TRUTHS",
    "random_truth", "truth",
]  # fmt: skip

PLANNER_BANDWIDTHS = (400e9, 50e9)
"""The planner's default intra- and inter-node bandwidths (:meth:`CostModel.for_transformer`)."""

TRUTHS: dict[str, dict[str, float | bool]] = {
    "base": {},
    "share0": {"ring_share": 0.0},
    "share25": {"ring_share": 0.25},
    "share50": {"ring_share": 0.5},
    "a2a-full": {"a2a_full_heads": True},
    "bw0.5": {"bandwidth": 0.5},
    "bw2": {"bandwidth": 2.0},
    "tile512": {"attn_tile_tokens": 512.0},
    "seq50": {"seq_overhead": 50e-6},
    "worst": {
        "ring_share": 0.5,
        "a2a_full_heads": True,
        "bandwidth": 0.5,
        "attn_tile_tokens": 512.0,
        "seq_overhead": 50e-6,
    },
}
"""Knobs of each truth: ``bandwidth`` scales both links; ``seq_overhead`` is per sequence over all layers."""

DEVICE_TRUTHS: dict[str, dict[str, float | bool]] = {
    "gemm2k": {"gemm_half_tokens": 2048.0},
    "attn4k": {"attn_half_len": 4096.0},
    "launch": {"layer_overhead": 1e-3, "ring_step_overhead": 200e-6},
    "lat100": {"a2a_latency": 100e-6, "p2p_latency": 100e-6},
    "a100": {"peak_flops": 312e12, "intra_node_bandwidth": 240e9, "inter_node_bandwidth": 25e9},
    "fastgpu": {"peak_flops": 2.5e15},
    "node4": {"gpus_per_node": 4},
    "node16": {"gpus_per_node": 16},
    "tile1024": {"attn_tile_tokens": 1024.0},
    "a2a-lat": {"a2a_latency": 150e-6},
    "ring-lat": {"p2p_latency": 100e-6, "ring_step_overhead": 100e-6},
    "mix": {
        "gemm_half_tokens": 1024.0,
        "attn_half_len": 2048.0,
        "layer_overhead": 300e-6,
        "ring_share": 0.3,
        "intra_node_bandwidth": 200e9,
        "inter_node_bandwidth": 30e9,
    },
}
"""Truths of other device constants, each a set of :class:`~lightning_hydra.sim.hardware.Hardware` fields (absolute
values): GEMMs at half efficiency at 2,048 tokens (``gemm2k``: a fixed cost per bin that dense packing saves),
attention at half efficiency at 4,096-token chunks (``attn4k``), 10x launch and ring-step overheads (``launch``),
100 us per collective call (``lat100``), an A100-class device (``a100``: 312 TFLOP/s, 240 and 25 GB/s), compute
2.5x faster over the same links (``fastgpu``), 4 or 16 devices per node while the planner assumes 8 (``node4``,
``node16``), attention no faster below 1,024 tokens per rank (``tile1024``), an all-to-all call 10x slower than
the base device's while ring steps keep theirs (``a2a-lat``: 150 us) and ring steps dearer than the all-to-all
(``ring-lat``: 100 us a transfer and 100 us a step), and several at once (``mix``). ``node16`` to ``ring-lat`` were
added by issue 46 for the waiting's breakdown at 32K (truths the planner was not tuned against)."""


LEAN_KERNELS: dict[str, float] = {"gemm_half_tokens": 128.0, "attn_half_len": 256.0, "layer_overhead": 20e-6}
"""Kernels near their best efficiency at every size the benchmarks reach: GEMMs at half efficiency at 128 tokens,
attention at 256-token chunks, 20 us of launches per layer and microbatch (the grid's device: 512, 1,024 and 100
us). On such a device little of the step is kernel overhead, so the ceiling is high and what a plan loses is mostly
waiting and communication."""

DEAR_TRUTHS: dict[str, dict[str, float | bool]] = {
    "dear25": {"ring_share": 0.25},
    "dear50": {"ring_share": 0.5},
    "dear25-lean": {"ring_share": 0.25, **LEAN_KERNELS},
    "dear50-lean": {"ring_share": 0.5, **LEAN_KERNELS},
}
"""Truths where communication is dear (issue 58), each a set of :class:`~lightning_hydra.sim.hardware.Hardware`
fields on the grid's device with the H100's own link rates (:data:`~lightning_hydra.planner.devices.GPU_RATES`: 360
and 40 GB/s, below the planner's default 400 and 50): 25% or 50% of every ring transfer exposed whatever attention
hides (``ring_share``; a ring whose ranks span nodes pays it on the inter-node link), the all-to-alls of every layer
at the intra-node rate, no per-sequence overhead; with the device's kernels (``dear25``, ``dear50``) or kernels near
their best at every size (``-lean``: :data:`LEAN_KERNELS`). A raised degree's ring and all-to-all then cost about
what its balance buys, so Megatron's memory-minimal degrees are the cheap ones and the waiting its placement
leaves (8-10% of the step at 256K on 512 ranks) is what remains to win."""

_DEAR_LINKS = {
    "intra_node_bandwidth": GPU_RATES["h100"].intra_node_bandwidth,
    "inter_node_bandwidth": GPU_RATES["h100"].inter_node_bandwidth,
}
"""The links of every :data:`DEAR_TRUTHS` member: the H100's rates."""


RANDOM_PREFIX = "random"
"""Truth ``random<k>`` (``k`` = 0, 1, ...) is :func:`random_truth` of ``k``."""

RANDOM_RANGES: dict[str, tuple[float, float]] = {
    "peak_flops": (300e12, 2.5e15),
    "gemm_efficiency": (0.5, 0.85),
    "gemm_half_tokens": (0.0, 4096.0),
    "attn_efficiency": (0.3, 0.6),
    "attn_half_len": (0.0, 8192.0),
    "bandwidth": (0.4, 2.0),
    "a2a_latency": (5e-6, 150e-6),
    "p2p_latency": (5e-6, 150e-6),
    "layer_overhead": (20e-6, 1e-3),
    "seq_overhead": (0.0, 50e-6),
    "ring_step_overhead": (0.0, 200e-6),
    "ring_share": (0.0, 0.5),
}
"""Ranges :func:`random_truth` draws from: ``peak_flops``, ``bandwidth`` (each link's factor on the planner's default,
drawn apart), the latencies and ``layer_overhead`` log-uniformly, the others uniformly; ``seq_overhead`` is per
sequence over all layers (as in :data:`TRUTHS`). Besides: 4 devices per node with probability 1/4 (the planner
assumes 8), a tile floor of 256, 512 or 1,024 tokens with probability 1/2 (each 1/6), ``ring_share`` drawn with
probability 1/2 (else exposure is what attention fails to hide), the all-to-all without the GQA saving with
probability 0.3."""


def random_truth(index: int, num_layers: int, base: Hardware | None = None) -> Hardware:
    """Truth ``random<index>``: every constant of the device and every knob of the family drawn at once from
    :data:`RANDOM_RANGES` (the same hardware for the same ``index`` on every machine: numpy's PCG64 seeded with
    ``index``).

    Args:
        index: Which draw (non-negative).
        num_layers: Layers the model has (``seq_overhead`` is drawn over all layers).
        base: The device whose other fields are kept (default: as :func:`truth`).
    """
    if index < 0:
        raise ValueError(f"random truths are numbered from 0, got {index}")
    rng = np.random.default_rng(index)
    hw = base or _base()

    def draw(name: str, log: bool = False) -> float:
        lo, hi = RANDOM_RANGES[name]
        return float(np.exp(rng.uniform(np.log(lo), np.log(hi)))) if log else float(rng.uniform(lo, hi))

    intra, inter = PLANNER_BANDWIDTHS
    return hw.replace(
        name=f"{hw.name}/{RANDOM_PREFIX}{index}",
        peak_flops=draw("peak_flops", log=True),
        gemm_efficiency=draw("gemm_efficiency"),
        gemm_half_tokens=draw("gemm_half_tokens"),
        attn_efficiency=draw("attn_efficiency"),
        attn_half_len=draw("attn_half_len"),
        intra_node_bandwidth=intra * draw("bandwidth", log=True),
        inter_node_bandwidth=inter * draw("bandwidth", log=True),
        gpus_per_node=4 if rng.random() < 0.25 else 8,
        a2a_latency=draw("a2a_latency", log=True),
        p2p_latency=draw("p2p_latency", log=True),
        layer_overhead=draw("layer_overhead", log=True),
        seq_overhead=draw("seq_overhead") / num_layers,
        ring_step_overhead=draw("ring_step_overhead"),
        attn_tile_tokens=float(rng.choice([0.0, 0.0, 0.0, 256.0, 512.0, 1024.0])),
        ring_share=draw("ring_share") if rng.random() < 0.5 else None,
        a2a_full_heads=bool(rng.random() < 0.3),
    )


def _base() -> Hardware:
    """The grid's device: the ``h100`` preset at the planner's default bandwidths, no per-sequence overhead."""
    intra, inter = PLANNER_BANDWIDTHS
    return PRESETS["h100"].replace(
        name="h100-planner-links", intra_node_bandwidth=intra, inter_node_bandwidth=inter, seq_overhead=0.0
    )


def truth(name: str, num_layers: int, base: Hardware | None = None) -> Hardware:
    """The hardware of truth ``name`` (see :data:`TRUTHS`).

    Args:
        name: A key of :data:`TRUTHS`, :data:`DEVICE_TRUTHS` or :data:`DEAR_TRUTHS`, or ``random<k>``
            (:func:`random_truth` of ``k``).
        num_layers: Layers the model has (``seq_overhead`` is given over all layers; the hardware holds it per
            layer).
        base: The device (default: the ``h100`` preset at the planner's default bandwidths, no per-sequence
            overhead).
    """
    if name.startswith(RANDOM_PREFIX) and name[len(RANDOM_PREFIX) :].isdigit():
        return random_truth(int(name[len(RANDOM_PREFIX) :]), num_layers, base)
    known = [*TRUTHS, *DEVICE_TRUTHS, *DEAR_TRUTHS]
    if name not in known:
        raise ValueError(f"unknown truth {name!r}; choose one of {sorted(known)} or {RANDOM_PREFIX}<k>")
    hw = base or _base()
    if name in DEAR_TRUTHS:
        return hw.replace(name=f"{hw.name}/{name}", seq_overhead=0.0, **_DEAR_LINKS, **DEAR_TRUTHS[name])
    knobs = dict(TRUTHS[name] if name in TRUTHS else DEVICE_TRUTHS[name])
    scale = float(knobs.pop("bandwidth", 1.0))
    changes: dict[str, float | bool | str] = {
        "name": f"{hw.name}/{name}",
        "intra_node_bandwidth": hw.intra_node_bandwidth * scale,
        "inter_node_bandwidth": hw.inter_node_bandwidth * scale,
    }
    if "seq_overhead" in knobs:
        changes["seq_overhead"] = float(knobs.pop("seq_overhead")) / num_layers
    changes.update(knobs)
    return hw.replace(**changes)
