"""What the default cost model assumes of a device: its achieved FLOP rate and its links, by device name.

The analytic :class:`~lightning_hydra.planner.CostModel` needs a FLOP rate and two link bandwidths. On a CPU rank the
package assumes one core and gloo over loopback (:data:`CPU_RATES`); on a GPU it looks the device's name up in
:data:`GPU_RATES` (datasheet figures and stated assumptions, no GPU of this project has measured them) and uses the
run's precision for the bytes per element. Calibration (on by default on CUDA) then refits the coefficients from
measured step times; these defaults only have to be right within a small factor, which the CPU constants are not on
a GPU (about 50,000x too slow compute and 100x too slow links: rings and cross-node CP would look free).

Pure data: the simulator's hardware descriptions (:mod:`lightning_hydra.sim.hardware`) take their datasheet figures
from here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["CPU_RATES", "GPU_RATES", "DeviceRates", "bytes_per_element", "gpu_rates", "rates_for"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DeviceRates:
    """A device's rates as the default cost model takes them."""

    name: str
    """Label."""
    peak_flops: float
    """Dense peak FLOP/s in the training dtype (bf16 on GPUs)."""
    achieved_share: float
    """Share of the peak a long-context training step achieves (the cost model's FLOP rate is ``peak_flops *
    achieved_share``)."""
    intra_node_bandwidth: float
    """Bytes/s one device moves to another of its node."""
    inter_node_bandwidth: float
    """Bytes/s one device moves to another node."""
    memory_bytes: float
    """Device memory."""
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """Where each figure comes from."""

    @property
    def flops_per_second(self) -> float:
        """The achieved FLOP rate the cost model assumes."""
        return self.peak_flops * self.achieved_share


CPU_RATES = DeviceRates(
    name="cpu",
    peak_flops=20e9,
    achieved_share=1.0,
    intra_node_bandwidth=2e9,
    inter_node_bandwidth=2e9,
    memory_bytes=0.0,
    sources={"all": "assumed, not measured: one CPU core, gloo over loopback"},
)
"""One CPU core and gloo on one machine (the package's defaults since its start)."""

_SHARE = "assumed (not measured): 40-55% of peak is typical of large long-context training steps"

_H100 = DeviceRates(
    name="h100",
    peak_flops=989e12,
    achieved_share=0.5,
    intra_node_bandwidth=360e9,
    inter_node_bandwidth=40e9,
    memory_bytes=80e9,
    sources={
        "peak_flops": "datasheet: H100 SXM dense BF16 989 TFLOP/s",
        "achieved_share": _SHARE,
        "intra_node_bandwidth": "datasheet 450 GB/s per direction (NVLink 4, 900 GB/s bidirectional); 80% assumed",
        "inter_node_bandwidth": "datasheet 400 Gb/s NDR InfiniBand per GPU = 50 GB/s; 80% assumed",
        "memory_bytes": "datasheet: 80 GB HBM3",
    },
)

GPU_RATES: dict[str, DeviceRates] = {
    "h100": _H100,
    "h200": DeviceRates(
        name="h200",
        peak_flops=_H100.peak_flops,
        achieved_share=_H100.achieved_share,
        intra_node_bandwidth=_H100.intra_node_bandwidth,
        inter_node_bandwidth=_H100.inter_node_bandwidth,
        memory_bytes=141e9,
        sources={**_H100.sources, "memory_bytes": "datasheet: 141 GB HBM3e (same compute as H100 SXM)"},
    ),
    "a100": DeviceRates(
        name="a100",
        peak_flops=312e12,
        achieved_share=0.5,
        intra_node_bandwidth=240e9,
        inter_node_bandwidth=20e9,
        memory_bytes=80e9,
        sources={
            "peak_flops": "datasheet: A100 dense BF16 312 TFLOP/s",
            "achieved_share": _SHARE,
            "intra_node_bandwidth": "datasheet 300 GB/s per direction (NVLink 3); 80% assumed",
            "inter_node_bandwidth": "datasheet 200 Gb/s HDR InfiniBand per GPU = 25 GB/s; 80% assumed",
            "memory_bytes": "datasheet: 80 GB HBM2e",
        },
    ),
}
"""Known GPUs by the key their CUDA device name contains (case-insensitive)."""


def gpu_rates(device_name: str) -> DeviceRates | None:
    """The rates of a GPU whose CUDA name (``torch.cuda.get_device_name``) contains a key of :data:`GPU_RATES`
    (``"NVIDIA H100 80GB HBM3"``: H100); ``None`` for an unknown one."""
    lowered = device_name.lower()
    return next((rates for key, rates in GPU_RATES.items() if key in lowered), None)


def rates_for(device_type: str, device_name: str = "") -> DeviceRates:
    """The rates the default cost model assumes on a device: a known GPU's (:func:`gpu_rates` of its CUDA name), an
    H100's for an unknown GPU (said once in the log), one CPU core's off CUDA.

    Args:
        device_type: ``torch.device.type`` (``"cuda"``, ``"cpu"``, ...).
        device_name: The CUDA device's name (``torch.cuda.get_device_name``).
    """
    if device_type != "cuda":
        return CPU_RATES
    rates = gpu_rates(device_name)
    if rates is None:
        log.warning(
            "no rates known for the GPU %r: the default cost model assumes an H100's (calibration refits)", device_name
        )
        rates = GPU_RATES["h100"]
    return rates


def bytes_per_element(precision: str | None) -> int:
    """Bytes of an activation on the wire under a Lightning precision (``"bf16-mixed"``: 2; ``"32-true"``: 4)."""
    return 2 if precision is not None and "16" in str(precision) else 4
