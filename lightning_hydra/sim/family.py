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
"""

from __future__ import annotations

from lightning_hydra.sim.hardware import PRESETS, Hardware

__all__ = ["PLANNER_BANDWIDTHS", "TRUTHS", "truth"]

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


def truth(name: str, num_layers: int, base: Hardware | None = None) -> Hardware:
    """The hardware of truth ``name`` (see :data:`TRUTHS`).

    Args:
        name: A key of :data:`TRUTHS`.
        num_layers: Layers the model has (``seq_overhead`` is given over all layers; the hardware holds it per
            layer).
        base: The device (default: the ``h100`` preset at the planner's default bandwidths, no per-sequence
            overhead).
    """
    if name not in TRUTHS:
        raise ValueError(f"unknown truth {name!r}; choose one of {sorted(TRUTHS)}")
    intra, inter = PLANNER_BANDWIDTHS
    hw = base or PRESETS["h100"].replace(
        name="h100-planner-links", intra_node_bandwidth=intra, inter_node_bandwidth=inter, seq_overhead=0.0
    )
    knobs = dict(TRUTHS[name])
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
