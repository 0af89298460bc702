"""Tensor parallelism inside a node, composed with the dynamic-CP pool: torch's own ``parallelize_module``.

**Layout.** With ``HydraStrategy(tensor_parallel=T, pipeline_stages=P)`` the world is ``P`` stages x a pool of
``N`` positions x ``T``, one device mesh with dims ``("pp", "pool", "tp")``: global rank ``g = (s * N + i) * T +
t`` is TP rank ``t`` of pool position ``i`` of stage ``s``. A TP group is ``T`` consecutive ranks (inside one node:
``T`` divides the node). Every plan is made for the ``N`` pool positions; the TP ranks of one position hold the
same tokens, and the CP groups of a step are formed once per TP rank over the positions' ranks of that TP rank
(the same plan, ``T`` disjoint copies of every group).

**Heads.** TP splits the attention heads first, then Ulysses the heads that remain: ``H / (T x U)`` query heads and
``Hkv / T`` KV heads (replicated for GQA as the Ulysses degree needs) per rank.

**Plans.** q/k/v and gate/up are ``ColwiseParallel`` (their weights' rows split over the TP group, inputs
replicated: the backward all-reduces the input's gradient), o and down ``RowwiseParallel`` (the forward all-reduces
the output). Norms and embedding stay replicated: their gradients are the same on every TP rank, so the pool's
gradient sum treats them as a replica's. An untied LM head (``HydraModule.output_head()``: the reference
decoder's, a Hugging Face CausalLM's) is split by vocabulary rows (:mod:`lightning_hydra.models.vocab_parallel`:
its loss never gathers logits); a tied one stays whole. A rank idle in a microbatch is
idle with its whole TP group (same pool position), so TP's collectives stay aligned.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_hydra.errors import ConfigError

__all__ = ["BLOCK_LAYOUTS", "MESH_DIMS", "block_plan", "check_tensor_parallel", "parallelize", "tensor_mesh"]

MESH_DIMS = ("pp", "pool", "tp")
"""Names of the device mesh's dimensions, outermost first."""


def check_tensor_parallel(
    tensor: int,
    *,
    world: int,
    ranks_per_node: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    max_ulysses: int | None = None,
) -> None:
    """Raise a one-line :class:`~lightning_hydra.errors.ConfigError` when ``tensor_parallel`` cannot lay out the run.

    Args:
        tensor: The TP degree ``T``.
        world: Ranks of the whole run.
        ranks_per_node: Ranks (GPUs) of one node.
        heads: The model's query heads (``None``: not checked).
        kv_heads: The model's key/value heads (``None``: not checked).
        max_ulysses: The Ulysses cap (``None``: ``"auto"``, not checked).
    """
    if tensor == 1:
        return
    if ranks_per_node % tensor:
        raise ConfigError(
            f"tensor_parallel={tensor} does not divide ranks_per_node={ranks_per_node}: a TP group must lie inside "
            f"one node; use one of {_divisors(ranks_per_node)}"
        )
    if world % tensor:
        raise ConfigError(
            f"tensor_parallel={tensor} does not divide the world of {world} ranks; use one of {_divisors(world)}"
        )
    if heads is not None and heads % tensor:
        raise ConfigError(
            f"tensor_parallel={tensor} does not divide the model's {heads} attention heads; use one of "
            f"{_divisors(heads)}"
        )
    if kv_heads is not None and kv_heads % tensor:
        raise ConfigError(
            f"tensor_parallel={tensor} does not divide the model's {kv_heads} KV heads; use one of "
            f"{_divisors(kv_heads)}"
        )
    if heads is not None and max_ulysses and tensor * max_ulysses > heads:
        raise ConfigError(
            f"tensor_parallel={tensor} x ulysses_degree={max_ulysses} exceeds the model's {heads} attention heads; "
            f"use ulysses_degree <= {heads // tensor}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_mesh(device_type: str, *, stages: int, pool: int, tensor: int, shard: int | None = None) -> DeviceMesh:
    """The run's device mesh ``("pp", "pool", "tp")`` of shape ``(stages, pool, tensor)`` (collective: every rank
    calls it once, in the same order of process-group creation).

    With ``shard`` (``sharding="hsdp"``: the pool positions of one node) the pool is laid out as ``("replicate",
    "shard")`` = ``(pool / shard, shard)``, replicas across nodes and shards inside one, as torchtitan lays out
    HSDP x TP: the mesh is ``("pp", "replicate", "shard", "tp")`` (the same rank order, pool position ``i = r shard
    + k``) and the two pool dims are flattened into ``"pool"`` too, so ``mesh["pool"]`` is the whole pool (the
    gradient and loss sums) and ``mesh["replicate", "shard"]`` FSDP's 2-D mesh, both slices of one root mesh as
    FSDP2 needs beside the TP mesh. ``DeviceMesh._flatten`` is private torch API (what torchtitan itself calls; no
    public way to name a flattened dim of a mesh yet): it names the flattened dim on the root mesh.

    Raises:
        ConfigError: ``shard`` does not divide ``pool`` (hsdp needs whole nodes).
    """
    if shard is None:
        return init_device_mesh(device_type, (stages, pool, tensor), mesh_dim_names=MESH_DIMS)
    if shard < 1 or pool % shard:
        raise ConfigError(f"hsdp needs whole nodes: {pool} pool positions with {shard} positions per node")
    shape = (stages, pool // shard, shard, tensor)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "replicate", "shard", "tp"))
    mesh["replicate", "shard"]._flatten("pool")
    return mesh


BLOCK_LAYOUTS = (
    (("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate", "mlp.up"), ("attn.o_proj", "mlp.down")),
    (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        ("self_attn.o_proj", "mlp.down_proj"),
    ),
)
"""``(colwise, rowwise)`` module paths of the blocks tensor parallelism knows: the reference decoder's, and Hugging
Face Llama-family decoder layers' (whose attention views its projections with ``-1`` heads, so it runs on the
``H / T`` local heads unchanged)."""


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """The TP plan of one transformer block (paths relative to the block): the first of :data:`BLOCK_LAYOUTS` whose
    modules the block has; ``TypeError`` when none fits."""
    names = {name for name, _ in block.named_modules()}
    for colwise, rowwise in BLOCK_LAYOUTS:
        if names.issuperset(colwise + rowwise):
            return {**{n: ColwiseParallel() for n in colwise}, **{n: RowwiseParallel() for n in rowwise}}
    raise TypeError(
        f"tensor parallelism knows the reference decoder's blocks and Hugging Face Llama-family decoder layers, "
        f"not {type(block).__name__}"
    )


def parallelize(model: nn.Module, mesh: DeviceMesh) -> int:
    """Split every transformer block of ``model`` over the 1-D TP ``mesh``, in place; returns the blocks split.

    Each block's projections become DTensor shards (:func:`block_plan`); its attention then holds ``H / T`` query
    and ``Hkv / T`` KV heads, which the CP engine splits further by Ulysses. The model's ``output_head()``
    (:meth:`~lightning_hydra.HydraModule.output_head`: the reference decoder's ``lm_head``, a Hugging Face
    CausalLM's) is split by vocabulary rows when it is untied and ``T`` divides them: its loss is
    :func:`~lightning_hydra.models.vocab_parallel.vocab_parallel_cross_entropy`; a tied head stays whole.

    Args:
        model: A :class:`~lightning_hydra.HydraModule` whose ``transformer_blocks()`` fit :data:`BLOCK_LAYOUTS`.
        mesh: The ``"tp"`` dimension of :func:`tensor_mesh`.
    """
    tensor = mesh.size()
    blocks: list[Any] = model.transformer_blocks()  # type: ignore[operator]
    for block in blocks:
        attention = getattr(block, "attn", None)  # the reference decoder's CPAttention counts its heads
        if attention is not None and (attention.heads % tensor or attention.kv_heads % tensor):
            raise ConfigError(
                f"tensor_parallel={tensor} must divide {attention.heads} heads and {attention.kv_heads} KV heads"
            )
        parallelize_module(block, mesh, block_plan(block))
        if attention is not None:
            attention.heads //= tensor
            attention.kv_heads //= tensor
    find = getattr(model, "output_head", None)
    head = find() if callable(find) else getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and head.out_features % tensor == 0 and not _tied(model, head.weight):
        # vocabulary-parallel: the chunked loss reads the row shards (never full logits); logits, when asked
        # for (no labels), are gathered
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Replicate()))
    return len(blocks)


def _tied(model: nn.Module, weight: nn.Parameter) -> bool:
    """Whether ``weight`` is also another parameter of ``model`` (an LM head tied to the embedding)."""
    return sum(p is weight for _, p in model.named_parameters(remove_duplicate=False)) > 1
