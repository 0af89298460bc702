"""Scenarios: a model, hardware, a job shape and a workload, loaded from ``recipes/sim-*.yaml``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from lightning_hydra.bench.batches import DISTRIBUTIONS
from lightning_hydra.planner import POLICIES, CostModel
from lightning_hydra.sim.footprint import job_memory
from lightning_hydra.sim.hardware import PRESETS, Hardware, ModelShape
from lightning_hydra.sim.truth import ENGINES

__all__ = ["Job", "Scenario", "Workload", "load_scenario"]


@dataclass(kw_only=True)
class Job:
    """How the GPUs are used: ``pool = gpus / (tp * pp)`` ranks of one pipeline stage form the dynamic-CP pool."""

    gpus: int
    """Devices of the job."""
    tp: int = 1
    """Tensor-parallel size (inside a node)."""
    pp: int = 1
    """Pipeline-parallel depth."""
    max_tokens_per_rank: int
    """Tokens one rank holds per microbatch (the planner's memory limit)."""
    num_microbatches: int = 8
    """Microbatches per optimizer step."""
    sharding: str = "zero2"
    """How model state is sharded over the pool, as ``HydraStrategy(sharding=...)`` (``"zero2"``: bf16 weights and
    float32 gradients whole, optimizer state sharded, Megatron's distributed optimizer); the memory headroom's
    model state (:func:`~lightning_hydra.sim.footprint.job_memory`)."""
    precision: str = "bf16-mixed"
    """The Trainer's precision the memory model charges (``"bf16-mixed"``, ``"bf16-true"``, ``"32-true"``)."""
    activation_checkpointing: str = "selective"
    """``HydraStrategy(activation_checkpointing=...)``: ``"selective"`` or ``"none"`` (activation bytes per token)."""
    communicator_bytes: float = 0.5e9
    """Bytes per communicator (NCCL's, about 0.5 GB each; 0 on CPU)."""
    projected_stages: int = 4
    """Pipeline depth of the projected ``bubble_pp`` when the job has no pipeline (``pp == 1``)."""
    sequence_parallel: bool = True
    """Whether a TP group runs sequence parallelism (``HydraStrategy(sequence_parallel=...)``): TP's collectives are
    all-gathers and reduce-scatters instead of all-reduces, timed by the truth and costed by the planner's starting
    model; on by default (the strategy's default under TP). No effect at ``tp`` 1."""

    @property
    def pool(self) -> int:
        """Ranks of the dynamic-CP pool (data x context ranks of one pipeline stage)."""
        return self.gpus // (self.tp * self.pp)


@dataclass(kw_only=True)
class Workload:
    """The global batches."""

    distribution: str = "lognormal"
    """``lognormal`` (a long-tailed mixture scaled to the context), ``stdlib`` (this Python's standard-library file
    sizes) or ``corpus`` (the embedded corpus exactly as ``HydraDataModule`` batches it)."""
    context: int = 32768
    """Longest sequence."""
    fill: float = 0.75
    """Share of the pool's tokens a global batch fills (``lognormal``, ``stdlib``)."""
    global_batch_tokens: int | None = None
    """Tokens per global batch (``corpus``; default ``fill`` of the pool)."""
    corpus_max_bytes: int = 8128
    """Length filter of the embedded corpus (``corpus``)."""


@dataclass(kw_only=True)
class Scenario:
    """Everything one simulation needs."""

    name: str
    """Label."""
    model: ModelShape
    """The model's shape."""
    hardware: Hardware
    """The device the truth times."""
    job: Job
    """The job's shape."""
    workload: Workload = field(default_factory=Workload)
    """The data."""
    policies: list[str] = field(default_factory=lambda: ["static", "mcore", "hydra"])
    """Policies compared on the same batches."""
    steps: int = 8
    """Global batches simulated."""
    seed: int = 0
    """Seed of the batches and of the planner's tie-breaking."""
    calibrate: bool = True
    """Refit the planner's cost model from the simulated measurements each step (and report the uncalibrated
    throughput beside)."""
    analytic_efficiency: float = 0.5
    """Share of peak the planner's starting (analytic) cost model assumes for all work."""
    planner: dict[str, Any] = field(default_factory=dict)
    """Overrides of :meth:`CostModel.for_transformer` for the starting cost model (e.g. a recorded run's)."""
    ranks_per_node: int | None = None
    """Ranks per node of the pool (default: devices per node over ``tp``)."""
    engine: str = "hydra"
    """CP engine the truth times: ``"hydra"`` (Ulysses nested in a ring) or ``"te-p2p"`` (Transformer Engine's ring
    for packed input, Megatron Dynamic-CP's engine: ring only, so plans are made with ``max_ulysses=1``)."""

    def starting_cost(self) -> CostModel:
        """The planner's analytic cost model before any calibration.

        A CP rank of a tensor-parallel job is ``tp`` devices: the model is built as the planner builds it for
        ``HydraStrategy(tensor_parallel=tp)`` (:meth:`CostModel.for_transformer` with ``tensor_parallel``), from one
        device's FLOP rate and links: a ``tp``-th of the blocks' compute and of every all-to-all and ring transfer
        (each device moves its share over a link of its own, as the truth times it,
        :mod:`lightning_hydra.sim.truth`), the head whole, and TP's collectives inside the node costed (all-reduces, or
        with the job's ``sequence_parallel`` all-gathers and reduce-scatters)."""
        hw = self.hardware
        args: dict[str, Any] = {
            "flops_per_second": hw.peak_flops * self.analytic_efficiency,
            "bytes_per_element": self.model.bytes_per_element,
            "intra_node_bandwidth": hw.intra_node_bandwidth,
            "inter_node_bandwidth": hw.inter_node_bandwidth,
            "ranks_per_node": self.node_size(),
            "tensor_parallel": self.job.tp,
            "sequence_parallel": self.job.sequence_parallel,
        }
        args.update(self.planner)
        shape = self.model.cost_model_args()
        # a pipeline stage holds layers / pp of the model: scale the per-layer coefficients
        shape["num_layers"] = max(1, self.model.num_layers // self.job.pp)
        return CostModel.for_transformer(**shape, **args)

    def node_size(self) -> int:
        """Ranks of the pool per node."""
        return self.ranks_per_node or max(1, self.hardware.gpus_per_node // self.job.tp)


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    types = {f.name: str(f.type) for f in fields(cls)}
    unknown = set(values) - set(types)
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(types)})")
    out = dict(values)
    for name, value in values.items():
        # YAML 1.1 reads 6.07e10 (no dot before the exponent sign) as a string: take it as the number it means
        if isinstance(value, str) and types[name].split(" ")[0] in ("float", "int"):
            try:
                out[name] = float(value) if types[name].startswith("float") else int(float(value))
            except ValueError:
                raise ValueError(f"{where}: {name} must be a number, got {value!r}") from None
    return cls(**out)


_POSITIVE = {
    "hardware": ("peak_flops", "gemm_efficiency", "attn_efficiency", "intra_node_bandwidth", "inter_node_bandwidth",
                 "gpus_per_node", "memory_bytes"),
    "job": ("gpus", "tp", "pp", "max_tokens_per_rank", "num_microbatches", "projected_stages"),
    "workload": ("context", "fill", "corpus_max_bytes"),
    "": ("steps", "analytic_efficiency"),
}  # fmt: skip
"""Fields that must be finite and positive (a context of 0 drew empty batches for ever, a negative peak printed a
table of nonsense)."""
_NON_NEGATIVE = {
    "hardware": ("gemm_half_tokens", "attn_half_len", "layer_overhead", "seq_overhead", "ring_step_overhead",
                 "attn_tile_tokens", "tp_latency", "tp_half_bytes"),
    "job": ("communicator_bytes",),
}  # fmt: skip
"""Fields that must be finite and at least 0."""


def _check_ranges(scenario: Scenario, where: str) -> None:
    """``ValueError`` naming the first field of ``scenario`` out of its range (:data:`_POSITIVE`,
    :data:`_NON_NEGATIVE`), a ``calibrate`` that is not a boolean or a ``global_batch_tokens`` below 1."""
    for bounds, low in ((_POSITIVE, "positive"), (_NON_NEGATIVE, "non-negative")):
        for section, names in bounds.items():
            owner = getattr(scenario, section) if section else scenario
            for name in names:
                value = getattr(owner, name)
                number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                if not number or (value <= 0 if low == "positive" else value < 0):
                    label = f"{section}.{name}" if section else name
                    raise ValueError(f"{where}: {label} must be a {low} number, got {value!r}")
    if not isinstance(scenario.job.sequence_parallel, bool):
        raise ValueError(
            f"{where}: job.sequence_parallel must be true or false, got {scenario.job.sequence_parallel!r}"
        )
    if not isinstance(scenario.calibrate, bool):
        raise ValueError(f"{where}: calibrate must be true or false, got {scenario.calibrate!r}")
    for name in ("steps", "seed"):
        value = getattr(scenario, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    policies = scenario.policies
    if not isinstance(policies, list) or not policies or any(p not in POLICIES for p in policies):
        raise ValueError(f"{where}: policies must be a non-empty list of static, mcore and hydra, got {policies!r}")
    if scenario.workload.distribution not in (*DISTRIBUTIONS, "corpus"):
        known = sorted((*DISTRIBUTIONS, "corpus"))
        raise ValueError(f"{where}: unknown workload.distribution {scenario.workload.distribution!r} (known: {known})")
    tokens = scenario.workload.global_batch_tokens
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"{where}: workload.global_batch_tokens must be a positive integer, got {tokens!r}")


def load_scenario(path: str | Path, **overrides: Any) -> Scenario:
    """Read a ``sim-*.yaml`` recipe.

    The ``hardware`` section names a preset (``preset: h100``) and overrides any of its constants, or gives every
    constant. ``overrides`` replace top-level fields (``steps``) or, as ``"job.gpus"``-style keys, fields of a
    section.
    """
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a scenario mapping")
    missing = [section for section in ("hardware", "model", "job") if not isinstance(raw.get(section), dict)]
    if missing:
        raise ValueError(f"{path}: the sections {missing} are missing (each a mapping)")
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        (raw.setdefault(section, {}) if section else raw)[name] = value
    hw_raw = dict(raw.pop("hardware"))
    preset = hw_raw.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"{path}: unknown hardware preset {preset!r} (known: {sorted(PRESETS)})")
        hardware = PRESETS[preset].replace(**hw_raw)
    else:
        hardware = _build(Hardware, hw_raw, f"{path}: hardware")
    scenario = _build(
        Scenario,
        {
            **{k: v for k, v in raw.items() if k != "planner"},
            "planner": {k: float(v) if isinstance(v, str) else v for k, v in raw.get("planner", {}).items()},
            "hardware": hardware,
            "model": _build(ModelShape, raw["model"], f"{path}: model"),
            "job": _build(Job, raw["job"], f"{path}: job"),
            "workload": _build(Workload, raw.get("workload", {}), f"{path}: workload"),
        },
        str(path),
    )
    _check_ranges(scenario, str(path))
    try:  # the model, the hardware and the planner's overrides build the analytic model: refused here, named
        scenario.starting_cost()
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{path}: the planner's starting cost model (sections model, hardware, planner): {exc}"
        ) from None
    job = scenario.job
    try:  # the job's memory settings, as the strategy would refuse them
        job_memory(job, scenario.model, scenario.hardware, ranks_per_node=scenario.node_size())
    except ValueError as exc:
        raise ValueError(f"{path}: job (memory: sharding, precision, activation_checkpointing): {exc}") from None
    if scenario.engine not in ENGINES:
        raise ValueError(f"{path}: unknown engine {scenario.engine!r} (known: {sorted(ENGINES)})")
    if job.gpus % (job.tp * job.pp):
        raise ValueError(f"{path}: {job.gpus} GPUs do not split into tp={job.tp} x pp={job.pp}")
    if scenario.model.num_heads % job.tp or scenario.model.num_kv_heads % job.tp:
        raise ValueError(f"{path}: heads do not split over tp={job.tp}")
    return scenario
