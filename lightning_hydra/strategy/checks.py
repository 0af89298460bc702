"""Checks every rank runs identically: the pool's shape, heads against the Ulysses cap, the data against the pool
(pure: callable before any process starts), and at every step's start the step's control all-reduce (a collective:
the plan's digest, a data error on any rank, SIGTERM on any rank)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_hydra.errors import ConfigError, check_bool
from lightning_hydra.planner import CostModel, PlannerConfig
from lightning_hydra.planner.calibration import CostCalibrator
from lightning_hydra.strategy.sizing import check_sizing

__all__ = [
    "DigestMismatch",
    "agree_step",
    "all_gather_single",
    "check_arguments",
    "check_digests",
    "check_fits",
    "check_heads",
    "digest_word",
]


def check_arguments(*, cost: Any, calibrate: Any, calibration: Any, monitor: Any, timeout: Any) -> None:
    """Type checks of ``HydraStrategy``'s object arguments (``TypeError`` saying what is expected)."""
    from lightning_hydra.metrics.monitor import BubbleMonitor

    if cost is not None and not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a lightning_hydra.CostModel or None, got {type(cost).__name__}")
    if calibrate is not None:
        check_bool("calibrate", calibrate)
    if calibration is not None and not isinstance(calibration, CostCalibrator):
        raise TypeError(f"calibration must be a CostCalibrator or None, got {type(calibration).__name__}")
    if not isinstance(monitor, (bool, BubbleMonitor)):
        raise TypeError(f"monitor must be True, False or a BubbleMonitor, got {monitor!r}")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")


def check_heads(num_heads: int | None, max_ulysses: int | None) -> None:
    """Raise :class:`~lightning_hydra.errors.ConfigError` when a Ulysses cap cannot split the attention heads."""
    if num_heads is not None and max_ulysses and num_heads % max_ulysses:
        raise ConfigError(
            f"{num_heads} attention heads cannot be split over ulysses_degree={max_ulysses}; use a divisor of "
            f"{num_heads} or 'auto'"
        )


class DigestMismatch(RuntimeError):
    """The ranks hold different plans of one step (raised on every rank alike)."""


def digest_word(digest: str) -> int:
    """The int64 a plan digest (hex) contributes to the step's checks: its first 60 bits."""
    return int(digest[:15], 16)


def agree_step(
    digest: str | None,
    *,
    device: torch.device,
    world_size: int,
    error: BaseException | None = None,
    stop: bool = False,
    group: dist.ProcessGroup | None = None,
) -> bool:
    """The step's control all-reduce: every rank's plan digest, data error flag and SIGTERM flag in one
    ``all_reduce(MAX)`` of ``[error, stop, digest, -digest]`` (int64; :func:`~lightning_hydra.schedule.control_words`
    values), read to the host once. Call it on every rank at the start of a step, before the step's other
    collectives. On the rare paths every rank takes the same further collectives and raises the same error (no
    hang): a data error on any rank raises the failing rank's message, after gathering the messages; disagreeing
    digests (``max(digest) != -max(-digest)``) raise :class:`DigestMismatch` naming the ranks that disagree with rank 0,
    after gathering the digests.

    Args:
        digest: This rank's plan digest (hex); ``None`` where planning or reading failed (``error`` given).
        device: Device of the exchanged tensor: the backend's (CUDA for nccl).
        world_size: Ranks of ``group`` (1: nothing is exchanged).
        error: What planning or reading this step's data raised on this rank (``None``: nothing).
        stop: This process received SIGTERM.
        group: Process group (default: the world).

    Returns:
        Whether any rank received SIGTERM.

    Raises:
        ConfigError: Planning or reading the step's data failed on some rank: that rank's message (the lowest such
            rank's) and every failing rank.
        DigestMismatch: The ranks' plan digests differ.
    """
    if world_size == 1:
        if error is not None:
            raise ConfigError(_error_message(error)) from error
        return stop
    word = digest_word(digest) if digest is not None and error is None else 0
    mine = [int(error is not None), int(stop), word, -word]
    values = torch.tensor(mine, dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    failed, stopped, high, low = values.tolist()  # the step's one read to the host
    if failed:
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, None if error is None else _error_message(error), group=group)
        found = [(r, m) for r, m in enumerate(out) if m is not None]
        ranks = ", ".join(str(r) for r, _ in found)
        raise ConfigError(f"{found[0][1]} (found by rank{'s' * (len(found) > 1)} {ranks})") from error
    if high != -low:
        check_digests(digest or "0", world_size, device=device, group=group)  # names the ranks; raises
        raise DigestMismatch("plan digests differ across ranks")  # not reached: the gather saw them differ
    return bool(stopped)


def _error_message(error: BaseException) -> str:
    """A data error as one line: a ``ValueError``'s message (what the data checks raise), else its repr."""
    return str(error) if isinstance(error, ValueError) else repr(error)


def check_digests(
    digest: str, world_size: int, *, device: torch.device, group: dist.ProcessGroup | None = None
) -> None:
    """All-gather a plan digest and raise :class:`DigestMismatch` naming the ranks that disagree with rank 0 (no
    hang: every rank takes part and every rank raises). A step checks its digest in :func:`agree_step`, which calls
    this only when the digests differ.

    Args:
        digest: This rank's plan digest (hex).
        world_size: Ranks of ``group``.
        device: Device of the exchanged tensor: the backend's (CUDA for nccl).
        group: Process group (default: the world).
    """
    mine = torch.tensor([digest_word(digest)], dtype=torch.int64, device=device)
    gathered = torch.zeros(world_size, dtype=torch.int64, device=device)
    all_gather_single(gathered, mine, group=group)
    values = gathered.tolist()
    odd = [r for r, v in enumerate(values) if v != values[0]]
    if odd:
        raise DigestMismatch(
            f"plan digests differ across ranks: ranks {odd} disagree with rank 0. Every rank must see the same "
            "dataset, seed, planner settings and cost model"
        )


def all_gather_single(out: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Gather every rank's ``value`` into ``out`` (rank order along dim 0): ``torch.distributed.all_gather_single``,
    or its name before torch 2.12 (``all_gather_into_tensor``, deprecated since)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, value, group=group)


def check_fits(
    config: PlannerConfig,
    world_size: int,
    num_heads: int | None,
    *,
    longest: int,
    split: str,
    global_batch_tokens: int,
    tensor: int | None = None,
) -> None:
    """Raise :class:`~lightning_hydra.errors.ConfigError` when a sequence of ``longest`` tokens cannot fit the pool at
    any degree, or a global batch of ``global_batch_tokens`` cannot fit its microbatches, both in one message with
    values that fit (pure: callable before any process starts; see :mod:`lightning_hydra.strategy.sizing`).

    Args:
        config: The planner settings (its ``pipeline_stages`` name the stages in the message).
        world_size: Positions in one stage's pool (ranks without TP).
        num_heads: Attention heads of the model (``None``: any Ulysses degree).
        longest: The longest sequence of the data.
        split: Name of the data split (for the message).
        global_batch_tokens: Tokens per global batch.
        tensor: The TP degree, for the message (``None``: in a rank at set-up, the world's devices over the stages'
            pools; 1 before any process group exists).
    """
    stages = config.pipeline_stages
    if tensor is None:
        devices = dist.get_world_size() if dist.is_available() and dist.is_initialized() else world_size * stages
        tensor = max(1, devices // (world_size * stages))
    check_sizing(
        config,
        world_size,
        num_heads,
        longest={split: longest},
        global_batch_tokens=global_batch_tokens,
        stages=stages,
        tensor=tensor,
    )
