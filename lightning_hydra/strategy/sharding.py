"""Sharded training state with FSDP2 over the dynamic-CP pool.

Modes (``HydraStrategy(sharding=...)``):

- ``"none"``: every rank holds a full replica; gradients are summed by
  :class:`~lightning_hydra.strategy.gradients.GradientReducer`.
- ``"zero2"``: parameters, gradients and optimizer state sharded over the pool (1-D mesh). Every sharded module is
  gathered at the start of the step, on every rank, in one order (the step's list says so:
  :mod:`lightning_hydra.schedule`), and kept gathered until the last backward (``reshard_after_forward=False``, no
  reshard between microbatches); gradients accumulate unsharded and are reduce-scattered once, in the step's last
  backward (every rank runs it, a zero-token pass where it sits the microbatch out), into the sharded (float32 under
  ``bf16-mixed``) gradients the optimizer steps on. Gathering at a rank's first forward instead put a rank idle in
  microbatch 0 out of step with the others (its gathers fell between its first microbatch's CP collectives).
- ``"zero3"``: parameters resharded after every forward and backward, gradients reduce-scattered in every
  microbatch (no full gradient is ever held). Every collective of FSDP runs in every microbatch, so every rank runs
  every microbatch: a rank whose group is idle runs a zero-token pass.
- ``"hsdp"``: ``zero2`` inside a node, replicated across nodes (2-D mesh ``(replicate, shard)`` = ``(nodes,
  ranks_per_node)``); the gradient reduction is a reduce-scatter inside the node and an all-reduce across nodes.

Every transformer block and the root module are ``fully_shard``-ed (the model's
``transformer_blocks()`` if it has one, otherwise its largest ``nn.ModuleList``). Losses are sums normalised by
the global batch's token count, so reductions are plain sums: ``set_gradient_divide_factor(1.0)`` and
``set_force_sum_reduction_for_comms(True)`` on every sharded module (the factor alone selects ``PREMUL_SUM``, which
gloo rejects; set on the root alone, the blocks still average). Under ``bf16-mixed`` FSDP's mixed-precision policy
computes in bf16 from float32 master weights and reduces gradients in float32.

Under tensor parallelism with sequence parallelism, a norm's weight is replicated over the TP group and its gradient
is a partial sum (each TP rank saw ``1 / T`` of the tokens). FSDP2 completes it (``Partial -> Replicate``, an
all-reduce over TP) in its post-backward *before* its cast to the reduce dtype, so in bf16 under ``bf16-mixed``
wherever the syncing backward finds no float32 gradient held from an earlier one (zero3: every microbatch; zero2 and
hsdp: a rank's only backward of a step). :func:`shard_model` moves such a group's gradients into FSDP's own float32
accumulator first (:func:`sum_partial_gradients_in_reduce_dtype`): the TP sum is float32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_hydra.models.checkpointing import largest_module_list
from lightning_hydra.planner.memory import SHARDING_MODES

__all__ = [
    "sync_module_states",
    "SHARDING_MODES",
    "ShardedGradientSync",
    "ShardingPlan",
    "build_mesh",
    "shard_model",
    "state_bytes",
    "sum_partial_gradients_in_reduce_dtype",
    "transformer_blocks",
]

log = logging.getLogger(__name__)

ShardingMode = Literal["none", "zero2", "zero3", "hsdp"]


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: ``module.transformer_blocks()`` when defined, otherwise the children
    of the ``nn.ModuleList`` holding the most parameters (the decoder layers of a Llama-style model)."""
    explicit = getattr(module, "transformer_blocks", None)
    return list(explicit()) if callable(explicit) else largest_module_list(module)


def build_mesh(mode: str, world_size: int, ranks_per_node: int, device_type: str, *, stages: int = 1) -> DeviceMesh:
    """The FSDP mesh of a mode over one pool: 1-D, or ``(replicate, shard)`` = ``(nodes, ranks_per_node)`` for
    hsdp. With pipeline stages the world mesh is ``(stage, ...)`` and this rank's stage's sub-mesh is returned.

    Args:
        mode: The sharding mode.
        world_size: Ranks in one pool (the world with one stage).
        ranks_per_node: Ranks per node.
        device_type: ``"cuda"`` or ``"cpu"``.
        stages: Pipeline stages (pools) of the world.

    Raises:
        ValueError: An hsdp pool that is not whole nodes.
    """
    if mode == "hsdp":
        if world_size % ranks_per_node or world_size < ranks_per_node:
            raise ValueError(f"hsdp needs whole nodes: {world_size} ranks with ranks_per_node={ranks_per_node}")
        shape, names = (world_size // ranks_per_node, ranks_per_node), ("replicate", "shard")
    else:
        shape, names = (world_size,), ("shard",)
    if stages == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    mesh = init_device_mesh(device_type, (stages, *shape), mesh_dim_names=("stage", *names))
    return mesh[names] if len(names) > 1 else mesh[names[0]]


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """What :func:`shard_model` did."""

    mode: str
    """The sharding mode."""
    modules: tuple[FSDPModule, ...]
    """Every ``fully_shard``-ed module, blocks first, the root last."""
    mixed_precision: bool
    """Whether FSDP computes in bf16 from float32 master weights."""


def shard_model(model: nn.Module, mode: str, mesh: DeviceMesh, *, mixed_precision: bool = False) -> ShardingPlan:
    """``fully_shard`` every transformer block and then ``model`` itself, with plain-sum gradient reductions.

    Args:
        model: The model (on its device, replicas already identical).
        mode: ``"zero2"``, ``"zero3"`` or ``"hsdp"``.
        mesh: From :func:`build_mesh`.
        mixed_precision: bf16 compute, float32 master weights and gradient reductions.

    Raises:
        ValueError: An unknown mode, or a model without parameters to shard.
    """
    if mode not in ("zero2", "zero3", "hsdp"):
        raise ValueError(f"shard_model takes zero2, zero3 or hsdp, not {mode!r}")
    if not any(True for _ in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no parameters to shard")
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    reshard = mode == "zero3"
    blocks = transformer_blocks(model)
    sharded: list[FSDPModule] = []
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        sharded.append(block)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    sharded.append(model)  # type: ignore[arg-type]
    for m in sharded:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
        if mixed_precision:
            sum_partial_gradients_in_reduce_dtype(m)
    log.debug("sharded %d blocks and the root (%s)", len(blocks), mode)
    return ShardingPlan(mode=mode, modules=tuple(sharded), mixed_precision=mixed_precision)


def sum_partial_gradients_in_reduce_dtype(module: FSDPModule) -> int:
    """Have FSDP2 sum ``module``'s partial (``Partial`` DTensor) gradients over their TP mesh in its reduce dtype
    (float32 under ``bf16-mixed``), not in the compute dtype; returns the parameter groups it applies to.

    FSDP2's post-backward redistributes each unsharded gradient to its parameter's TP placements (``Partial ->
    Replicate``: an all-reduce over TP) in the dtype the gradient has, and only then casts it to the reduce dtype
    for the reduce-scatter over the pool (``foreach_reduce``, which takes one dtype per parameter group). Gradients
    that an earlier backward without sync left in FSDP's float32 accumulator (``unsharded_accumulated_grad``) are
    summed in float32; gradients of the syncing backward itself when nothing was held (zero3's every microbatch; a
    zero2 or hsdp rank's only backward of a step) in bf16: one more bf16 rounding per TP sum, ``T - 1`` along a ring
    of ``T`` ranks. This wraps the post-backward of each parameter group holding DTensor parameters: when one of its
    gradients is partial in another dtype than the reduce dtype, every gradient of the group is first moved into the
    float32 accumulator, as FSDP itself does in a backward without sync, so the TP sum and the reduce-scatter both
    run in float32. Groups without partial gradients, and backwards without sync (FSDP accumulates in float32 there
    itself), are unchanged; otherwise the cost is one cast of the group's gradients to float32 before FSDP's
    reduce-scatter copy-in (which then copies without casting), the group's gradients held in 4 bytes per parameter
    instead of 2 until then.

    FSDP2 has no public option for this (its ``MixedPrecisionPolicy`` is per module, and norms given float32
    parameters by a ``fully_shard`` of their own would be units of their own, with collectives of their own, and
    would make their outputs, which sequence parallelism all-gathers, float32). This uses FSDP2's private
    ``FSDPParamGroup`` and ``FSDPParam`` (torch 2.13); where those names are missing it does nothing and logs a
    warning (the sum then stays bf16).

    Args:
        module: A ``fully_shard``-ed module (its own parameter groups; nested FSDP modules are not visited).
    """
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)  # type: ignore[operator]
    needed = ("fsdp_params", "post_backward")
    if groups is None or not all(hasattr(g, name) for g in groups for name in needed):
        log.warning("FSDP2's parameter groups are not where torch 2.13 keeps them: partial gradients sum in bf16")
        return 0
    count = 0
    for group in groups:
        if not any(getattr(p, "is_dtensor", False) for p in group.fsdp_params):
            continue  # no TP placement: no partial gradient
        if not all(hasattr(p, "unsharded_accumulated_grad") for p in group.fsdp_params):
            log.warning("FSDP2's FSDPParam has no unsharded_accumulated_grad: partial gradients sum in bf16")
            return count
        group.post_backward = partial(_post_backward_in_reduce_dtype, group, group.post_backward)
        count += 1
    return count


def _post_backward_in_reduce_dtype(group: Any, post_backward: Callable[..., Any], *args: Any) -> Any:
    """``FSDPParamGroup.post_backward`` that first moves every gradient of the group into FSDP's reduce-dtype
    accumulator when one of them is a partial DTensor of another dtype (see
    :func:`sum_partial_gradients_in_reduce_dtype`). A backward without sync is left to FSDP, which moves every
    gradient into the accumulator itself (after resharding, to hold less)."""
    if not getattr(group, "reduce_grads", True):
        return post_backward(*args)
    held = []
    for fsdp_param in group.fsdp_params:
        param = getattr(fsdp_param, "_unsharded_param", None)  # absent before the first all-gather
        if param is not None and param.grad is not None:
            held.append((fsdp_param, param))
    if any(_partial_in_other_dtype(param.grad, fsdp_param.reduce_dtype) for fsdp_param, param in held):
        for fsdp_param, param in held:
            grad = param.grad.to(fsdp_param.reduce_dtype)
            param.grad = None
            if fsdp_param.unsharded_accumulated_grad is None:
                fsdp_param.unsharded_accumulated_grad = grad
            else:
                fsdp_param.unsharded_accumulated_grad += grad
    return post_backward(*args)


def _partial_in_other_dtype(grad: torch.Tensor, reduce_dtype: torch.dtype | None) -> bool:
    return (
        reduce_dtype is not None
        and isinstance(grad, DTensor)
        and grad.dtype != reduce_dtype
        and any(p.is_partial() for p in grad.placements)
    )


class ShardedGradientSync:
    """The gradient sync of a sharded model (see the module docstring for what each mode synchronises when)."""

    def __init__(self, plan: ShardingPlan) -> None:
        """Args:
        plan: The sharded model.
        """
        self.plan = plan
        self.root = plan.modules[-1]

    @property
    def every_microbatch(self) -> bool:
        """zero3: FSDP collectives run in every forward and backward, so every rank runs every microbatch."""
        return self.plan.mode == "zero3"

    def collectives(self) -> tuple[tuple[str, str, int, str], ...]:
        """None of its own: FSDP gathers where the step's list says (zero2, hsdp: at the start; zero3: in every
        forward and backward) and reduce-scatters inside the backwards (zero2, hsdp: the step's last, which every
        rank runs)."""
        return ()

    def begin(self) -> None:
        """Start a step: accumulate locally until the last backward (zero2, hsdp), sync every microbatch (zero3)."""
        if self.every_microbatch:
            self.root.set_requires_gradient_sync(True)
            self.root.set_reshard_after_backward(True)
        else:
            self.root.set_requires_gradient_sync(False)
            self.root.set_reshard_after_backward(False)

    def arm(self) -> None:
        """The next backward is the step's last: reduce-scatter and reshard in it."""
        self.root.set_requires_gradient_sync(True)
        self.root.set_reshard_after_backward(True)

    def finish(self) -> None:
        """Nothing left: FSDP waits for its reductions at the end of the last backward."""

    def reshard(self) -> None:
        """Reshard every module (after a forward-only step, e.g. validation, that left parameters gathered)."""
        for m in self.plan.modules:
            m.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (the local shards of DTensors), measured
    from the tensors themselves."""

    def size(t: torch.Tensor) -> int:
        local = _local(t)
        return local.numel() * local.element_size()

    params = list(module.parameters())
    out = {
        "params": sum(size(p) for p in params),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(size(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def sync_module_states(module: nn.Module, device: torch.device) -> None:
    """Broadcast every parameter and buffer from rank 0, so that all replicas start identical (what DDP's
    constructor does; this strategy does not wrap the model in DDP)."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.numel()]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _), group in sorted(by_kind.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in group]).to(dtype)
        dist.broadcast(flat, src=0)
        offset = 0
        with torch.no_grad():
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
