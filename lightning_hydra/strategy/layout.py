"""The run's layout as users of Megatron and torchtitan write it, and its one-line errors before launch.

``HydraStrategy(tensor_parallel=T, pipeline_stages=P)`` on ``D`` devices is ``P`` stages x a pool of ``N = D / (P x
T)`` positions x ``T`` (:mod:`~lightning_hydra.strategy.tensor`): every plan is made for the ``N`` positions of a
stage's pool, and one position is one device without TP, a TP group of ``T`` devices with it. Inside the pool context
parallelism is dynamic (every sequence gets its own CP degree), so the pool is what Megatron calls DP x CP, and the run
reads ``D devices = DP N x TP T x PP P`` with DP the pool (CP degrees vary by sequence inside it).

:func:`check_layout` raises the layout's errors in those terms: the devices, ``tensor_parallel``,
``pipeline_stages``, the pool they leave (``devices / (stages x T)``) and the node, with values that fit the given
devices. It needs no process group (pure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_hydra.errors import ConfigError

__all__ = ["RunLayout", "check_layout", "check_pool", "divisors", "tensor_fits"]


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` (ascending)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_fits(devices: int, ranks_per_node: int) -> list[int]:
    """TP degrees that fit ``devices`` on nodes of ``ranks_per_node``: a TP group lies inside one node and the
    devices are whole TP groups, so ``T`` divides both (on a world smaller than a node, the world is the node)."""
    return divisors(math.gcd(devices, ranks_per_node))


def check_pool(world_size: int, ranks_per_node: int) -> None:
    """Raise :class:`~lightning_hydra.errors.ConfigError` unless the pool is whole nodes, or a part of one node that
    divides it."""
    if world_size < 1 or ranks_per_node < 1:
        raise ConfigError(f"world size ({world_size}) and ranks_per_node ({ranks_per_node}) must be positive")
    if world_size >= ranks_per_node and world_size % ranks_per_node:
        raise ConfigError(
            f"world size {world_size} is not a multiple of ranks_per_node={ranks_per_node}: set "
            "HydraStrategy(ranks_per_node=...) to the ranks (GPUs) of one node, and run whole nodes"
        )
    if world_size < ranks_per_node and ranks_per_node % world_size:
        raise ConfigError(
            f"a world of {world_size} ranks smaller than a node must divide ranks_per_node={ranks_per_node}"
        )


@dataclass(frozen=True)
class RunLayout:
    """Devices = pool (DP x CP) x TP x PP.

    Args:
        devices: Devices (ranks) of the whole run.
        tensor: TP degree ``T``.
        stages: Pipeline stages ``P``.
        ranks_per_node: Devices of one node (``None``: not stated).
    """

    devices: int
    tensor: int = 1
    stages: int = 1
    ranks_per_node: int | None = None

    @property
    def pool(self) -> int:
        """Positions of one stage's pool, ``devices / (stages x T)`` (what every plan is made for)."""
        return self.devices // (self.tensor * self.stages)

    @property
    def nodes(self) -> int | None:
        """Nodes of the run (``None`` without ``ranks_per_node``; 1 for a world within one node)."""
        if self.ranks_per_node is None:
            return None
        return max(1, self.devices // self.ranks_per_node)

    def degrees(self) -> str:
        """``"DP 32 x TP 8"``, ``"DP 4 x TP 2 x PP 2"``: DP is the pool (dynamic CP inside it); TP and PP only when
        above 1."""
        parts = [f"DP {self.pool}"]
        parts += [f"TP {self.tensor}"] if self.tensor > 1 else []
        parts += [f"PP {self.stages}"] if self.stages > 1 else []
        return " x ".join(parts)

    def describe(self, unit: str = "devices") -> str:
        """``"256 GPUs = DP 32 x TP 8 (32 nodes x 8 GPUs)"``: the layout as Megatron and torchtitan users write it.

        Args:
            unit: What a device is called (``"GPUs"``, ``"devices"``, ``"ranks"``).
        """
        text = f"{self.devices:,} {unit} = {self.degrees()}"
        nodes = self.nodes
        if nodes is not None and self.ranks_per_node is not None:
            per = min(self.ranks_per_node, self.devices)
            text += f" ({nodes:,} node{'s' * (nodes > 1)} x {per} {unit})"
        return text

    def position_ranks(self, position: int, stage: int = 0) -> range:
        """The global ranks of pool ``position`` of ``stage``: ``T`` consecutive ranks (one without TP)."""
        first = (stage * self.pool + position) * self.tensor
        return range(first, first + self.tensor)

    def settings(self) -> str:
        """``"4 devices with tensor_parallel=2 and pipeline_stages=2"`` (the settings given, for messages)."""
        given = [f"tensor_parallel={self.tensor}"] if self.tensor > 1 else []
        given += [f"pipeline_stages={self.stages}"] if self.stages > 1 else []
        return f"{self.devices} devices" + (f" with {' and '.join(given)}" if given else "")

    def to_json(self) -> dict[str, Any]:
        """The layout as the step records keep it (``devices``, ``tp``, ``pp``, ``pool``, ``ranks_per_node``)."""
        out: dict[str, Any] = {"devices": self.devices, "tp": self.tensor, "pp": self.stages, "pool": self.pool}
        if self.ranks_per_node is not None:
            out["ranks_per_node"] = self.ranks_per_node
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunLayout:
        """Inverse of :meth:`to_json`."""
        return cls(
            devices=int(data["devices"]),
            tensor=int(data.get("tp", 1)),
            stages=int(data.get("pp", 1)),
            ranks_per_node=data.get("ranks_per_node"),
        )


def check_layout(devices: int, *, tensor: int = 1, stages: int = 1, ranks_per_node: int) -> RunLayout:
    """The run's layout, or a one-line :class:`~lightning_hydra.errors.ConfigError` naming the devices,
    ``tensor_parallel``, ``pipeline_stages`` and the pool they leave, with values that fit these devices.

    Checked: a TP group lies inside a node (``T`` divides ``ranks_per_node`` and the devices), the devices form
    ``stages x T``-device pool positions, and a stage's pool is whole nodes or a part of one node that divides it
    (:func:`check_pool`, whose own message speaks for a run without TP or stages).

    Args:
        devices: Devices (ranks) of the whole run.
        tensor: ``tensor_parallel``.
        stages: ``pipeline_stages``.
        ranks_per_node: Devices of one node.
    """
    layout = RunLayout(devices, tensor, stages, ranks_per_node)
    if devices < 1 or tensor < 1 or stages < 1 or ranks_per_node < 1:
        raise ConfigError(
            f"devices ({devices}), tensor_parallel ({tensor}), pipeline_stages ({stages}) and ranks_per_node "
            f"({ranks_per_node}) must be positive"
        )
    fits = tensor_fits(devices, ranks_per_node)
    if tensor > 1 and (ranks_per_node % tensor or devices % tensor):
        where = (
            f"ranks_per_node={ranks_per_node}: a TP group must lie inside one node"
            if ranks_per_node % tensor
            else f"the {devices} devices: they must be whole TP groups"
        )
        fit = [t for t in fits if (devices // t) % stages == 0]
        raise ConfigError(
            f"tensor_parallel={tensor} does not divide {where}; use tensor_parallel in {fit} on {devices} devices "
            f"with ranks_per_node={ranks_per_node}"
        )
    if devices % (stages * tensor):
        share = f"{devices} / ({stages} x {tensor})" if tensor > 1 else f"{devices} / {stages}"
        options = [f"a multiple of {stages * tensor} devices"]
        stage_fit = divisors(devices // tensor)
        options.append(f"pipeline_stages in {stage_fit}")
        tensor_fit = [t for t in fits if (devices // t) % stages == 0]
        if tensor > 1 and tensor_fit:
            options.append(f"tensor_parallel in {tensor_fit}")
        raise ConfigError(
            f"{layout.settings()} leave no whole pool: devices / (pipeline_stages x tensor_parallel) = {share} is "
            f"not a whole number of pool positions; use {', or '.join(options)}"
        )
    per_node = ranks_per_node // tensor
    if tensor == 1 and stages == 1:
        check_pool(layout.pool, per_node)
        return layout
    pool = layout.pool
    if (pool >= per_node and pool % per_node) or (pool < per_node and per_node % pool):
        step = stages * tensor
        good = [d for d in range(step, 4 * max(devices, ranks_per_node) + 1, step) if _pool_fits(d // step, per_node)]
        good = sorted(sorted(good, key=lambda d: (abs(d - devices), -d))[:3])  # the nearest to the devices given
        node = f"a node (ranks_per_node={ranks_per_node}) holds {per_node} positions of {tensor} devices"
        node = node if tensor > 1 else f"a node holds ranks_per_node={ranks_per_node} of them"
        whose = "each stage a pool" if stages > 1 else "a pool"
        raise ConfigError(
            f"{layout.settings()} leave {whose} of {pool} position{'s' * (pool > 1)} "
            f"(devices / (pipeline_stages x tensor_parallel)), and {node}: a pool must be whole nodes or divide one; "
            f"use {', '.join(map(str, good))} devices"
        )
    return layout


def _pool_fits(pool: int, per_node: int) -> bool:
    """Whether a pool of ``pool`` positions is whole nodes of ``per_node`` positions, or divides one."""
    return pool % per_node == 0 if pool >= per_node else per_node % pool == 0


def sharding_layout(mode: str, mesh: Any, layout: RunLayout) -> str:
    """How FSDP2 lays the training state over the pool, for the start-up line: ``"over the 2 positions of the pool
    (...)"``, or hsdp's ``"replicate 2 x shard 2"`` layout.

    Args:
        mode: The sharding mode.
        mesh: FSDP's device mesh (1-D: the pool; 2-D: hsdp's ``(replicate, shard)``).
        layout: The run's layout.
    """
    shape = tuple(mesh.shape)
    unit = "positions" if layout.tensor > 1 else "ranks"
    pool = "each stage's pool" if layout.stages > 1 else "the pool"
    tp = f"; each of a TP group's {layout.tensor} ranks shards its own TP slices" if layout.tensor > 1 else ""
    if len(shape) == 2:
        replicate, shard = shape
        nodes = f"{replicate} node{'s' * (replicate > 1)}"
        return (
            f"over the {replicate * shard} {unit} of {pool} as replicate {replicate} x shard {shard} (a node's "
            f"{shard} {unit} shard the state, {nodes} replicate it{tp})"
        )
    return f"over the {shape[0]} {unit} of {pool}" + (f" ({tp[2:]})" if tp else "")
