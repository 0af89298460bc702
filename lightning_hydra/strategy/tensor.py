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
gradient sum treats them as a replica's. With sequence parallelism (``HydraStrategy(sequence_parallel=...)``, on by
default under TP) the residual stream between blocks and the norms are split by tokens instead (see
:func:`parallelize`): o and down reduce-scatter, each norm's output is all-gathered, and the norms' weights get
partial gradients that are summed over the TP group before the pool's sum. An untied LM head
(``HydraModule.output_head()``: the reference decoder's, a Hugging Face CausalLM's) is split by vocabulary rows
(:mod:`lightning_hydra.models.vocab_parallel`: its loss never gathers logits); a tied one stays whole. A rank idle in
a microbatch is idle with its whole TP group (same pool position), so TP's collectives stay aligned.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_hydra.errors import ConfigError
from lightning_hydra.strategy.layout import tensor_fits

__all__ = [
    "BLOCK_LAYOUTS",
    "MESH_DIMS",
    "BlockLayout",
    "block_layout",
    "block_plan",
    "check_sequence_parallel",
    "check_tensor_block",
    "check_tensor_parallel",
    "known_blocks",
    "parallelize",
    "resolve_sequence_parallel",
    "tensor_mesh",
]

MESH_DIMS = ("pp", "pool", "tp")
"""Names of the device mesh's dimensions, outermost first."""


def check_tensor_parallel(
    tensor: int,
    *,
    world: int | None,
    ranks_per_node: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    max_ulysses: int | None = None,
) -> None:
    """Raise a one-line :class:`~lightning_hydra.errors.ConfigError` when ``tensor_parallel`` cannot lay out the run.

    The degrees it suggests fit the node and the world (:func:`~lightning_hydra.strategy.layout.tensor_fits`).

    Args:
        tensor: The TP degree ``T``.
        world: Ranks (devices) of the whole run (``None``: not known yet, only the node is checked).
        ranks_per_node: Ranks (GPUs) of one node.
        heads: The model's query heads (``None``: not checked).
        kv_heads: The model's key/value heads (``None``: not checked).
        max_ulysses: The Ulysses cap (``None``: ``"auto"``, not checked).
    """
    if tensor == 1:
        return
    fits = tensor_fits(world, ranks_per_node) if world is not None else _divisors(ranks_per_node)
    on = f" on {world} devices" if world is not None else ""
    if ranks_per_node % tensor:
        raise ConfigError(
            f"tensor_parallel={tensor} does not divide ranks_per_node={ranks_per_node}: a TP group must lie inside "
            f"one node; use one of {fits}{on}"
        )
    if world is not None and world % tensor:
        raise ConfigError(
            f"tensor_parallel={tensor} does not divide the {world} devices (they must be whole TP groups); use one "
            f"of {fits} with ranks_per_node={ranks_per_node}"
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


@dataclass(frozen=True)
class BlockLayout:
    """Module paths (relative to a block) of one family of transformer blocks that tensor parallelism splits.

    Args:
        colwise: Projections whose rows split over the TP group (q/k/v, gate/up).
        rowwise: Projections whose columns split (o, down): their outputs are summed over the group.
        norms: The block's two pre-norms (before attention, before the MLP), which sequence parallelism runs on
            the local token shard.
        sequence_dim: The token dimension of the block's hidden states (0: ``[t, h]``; 1: ``[1, t, h]``).
    """

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    norms: tuple[str, str]
    sequence_dim: int


BLOCK_LAYOUTS = (
    BlockLayout(
        ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate", "mlp.up"),
        ("attn.o_proj", "mlp.down"),
        ("attn_norm", "mlp_norm"),
        0,
    ),
    BlockLayout(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        ("self_attn.o_proj", "mlp.down_proj"),
        ("input_layernorm", "post_attention_layernorm"),
        1,
    ),
)
"""The block families tensor parallelism knows: the reference decoder's, and Hugging Face Llama-family decoder
layers' (whose attention views its projections with ``-1`` heads, so it runs on the ``H / T`` local heads
unchanged)."""


def block_layout(block: nn.Module) -> BlockLayout:
    """The first of :data:`BLOCK_LAYOUTS` whose projections ``block`` has; ``TypeError`` when none fits."""
    names = {name for name, _ in block.named_modules()}
    for layout in BLOCK_LAYOUTS:
        if names.issuperset(layout.colwise + layout.rowwise):
            return layout
    raise TypeError(
        f"tensor parallelism knows the reference decoder's blocks and Hugging Face Llama-family decoder layers, "
        f"not {type(block).__name__}"
    )


def known_blocks(blocks: Iterable[nn.Module]) -> Iterator[nn.Module]:
    """The blocks of ``blocks`` that fit one of :data:`BLOCK_LAYOUTS` (the others are for set-up to name)."""
    for block in blocks:
        try:
            block_layout(block)
        except TypeError:
            continue
        yield block


def check_sequence_parallel(block: nn.Module) -> BlockLayout:
    """The block's layout when sequence parallelism can split it: its norms (direct children named ``*norm*``) are
    exactly the layout's two pre-norms; otherwise a one-line :class:`~lightning_hydra.errors.ConfigError` (Gemma's
    sandwich norms, OLMo-2's post-norms: a norm on the attention's or MLP's output would need its own plan)."""
    layout = block_layout(block)
    norms = {name for name, _ in block.named_children() if "norm" in name.lower()}
    if norms != set(layout.norms):
        other = ", ".join(sorted(norms.symmetric_difference(layout.norms)))
        raise ConfigError(
            f"sequence_parallel knows blocks whose norms are {' and '.join(layout.norms)}; "
            f"{type(block).__name__} differs in {other}: pass sequence_parallel=False"
        )
    return layout


def check_tensor_block(block: nn.Module, tensor: int) -> BlockLayout:
    """The block's layout when TP can split it: no parameter outside its projections spans the whole output width
    of a projection TP splits (OLMo-2's ``q_norm``/``k_norm`` normalise all heads together, where Qwen3's are one
    head wide and run on the local heads unchanged); otherwise a one-line
    :class:`~lightning_hydra.errors.ConfigError`. ``TypeError`` when the block is not one of :data:`BLOCK_LAYOUTS`.

    Args:
        block: A transformer block.
        tensor: The TP degree ``T``.
    """
    layout = block_layout(block)
    widths = {
        getattr(block.get_submodule(name), "out_features", None): name for name in layout.colwise
    }  # a split projection's whole output width
    planned = tuple(f"{name}." for name in layout.colwise + layout.rowwise)
    inside = tuple({name.rpartition(".")[0] + "." for name in layout.colwise})  # the attention and the MLP
    for name, param in block.named_parameters():
        if name.startswith(inside) and not name.startswith(planned) and param.numel() in widths:
            raise ConfigError(
                f"tensor_parallel={tensor} cannot split {type(block).__name__}: {name} ({param.numel()} values) "
                f"spans the whole output of {widths[param.numel()]}, which TP splits; use tensor_parallel=1"
            )
    return layout


def resolve_sequence_parallel(asked: bool | None, tensor: int, blocks: list[nn.Module]) -> bool:
    """Whether the blocks run sequence-parallel: ``asked`` (``HydraStrategy(sequence_parallel=...)``) against ``T``
    and the model's blocks.

    ``None`` turns it on when ``tensor > 1`` and every block TP knows has only the two pre-norms, and off otherwise
    (Gemma's sandwich norms: TP without SP); ``True`` with such a block raises
    :func:`check_sequence_parallel`'s one-line :class:`~lightning_hydra.errors.ConfigError`.

    Args:
        asked: The user's setting (``None``: as the model allows).
        tensor: The TP degree ``T`` (``1``: no sequence parallelism).
        blocks: The model's ``transformer_blocks()``.
    """
    if tensor == 1 or asked is False:
        return False
    for block in known_blocks(blocks):
        try:
            check_sequence_parallel(block)
        except ConfigError:
            if asked:
                raise
            return False
    return True


def block_plan(block: nn.Module, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The TP plan of one transformer block (paths relative to the block).

    Without sequence parallelism: ``ColwiseParallel`` q/k/v and gate/up (replicated input), ``RowwiseParallel`` o
    and down (output all-reduced to replicated); norms untouched. With it, the block's input and output are
    DTensors sharded on the token dimension: each norm is ``SequenceParallel`` (replicated weight, the local token
    shard in and out), then gathered to replicated for the projections (see :func:`parallelize`); o and down
    reduce-scatter their outputs onto the token shards.

    Args:
        block: A block of one of :data:`BLOCK_LAYOUTS`.
        sequence_parallel: Shard the residual stream and the norms over the TP group by tokens.
    """
    layout = check_sequence_parallel(block) if sequence_parallel else block_layout(block)
    plan: dict[str, ParallelStyle] = {n: ColwiseParallel() for n in layout.colwise}
    if not sequence_parallel:
        return {**plan, **{n: RowwiseParallel() for n in layout.rowwise}}
    tokens = Shard(layout.sequence_dim)
    plan.update({n: RowwiseParallel(output_layouts=tokens, use_local_output=False) for n in layout.rowwise})
    plan.update({n: SequenceParallel(sequence_dim=layout.sequence_dim) for n in layout.norms})
    return plan


def parallelize(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> int:
    """Split every transformer block of ``model`` over the 1-D TP ``mesh``, in place; returns the blocks split.

    Each block's projections become DTensor shards (:func:`block_plan`); its attention then holds ``H / T`` query
    and ``Hkv / T`` KV heads, which the CP engine splits further by Ulysses. The model's ``output_head()``
    (:meth:`~lightning_hydra.HydraModule.output_head`: the reference decoder's ``lm_head``, a Hugging Face
    CausalLM's) is split by vocabulary rows when it is untied and ``T`` divides them: its loss is
    :func:`~lightning_hydra.models.vocab_parallel.vocab_parallel_cross_entropy`; a tied head stays whole.

    With ``sequence_parallel`` the residual stream between blocks is a DTensor sharded over the TP group by
    tokens (``torch.chunk``'s split: uneven and empty shards allowed, the global length travels with the DTensor):
    the first block's input is split (no communication; its backward all-gathers the gradient), each norm runs on
    the local shard and its output is all-gathered for the projections (backward: one reduce-scatter of q/k/v's,
    or gate/up's, summed input gradient), o and down reduce-scatter, and the last block's output is all-gathered
    (a pipeline stage splits and gathers its own blocks: stages exchange whole activations). The attention sees
    the whole local chunk, so CP needs no change. The norms' weights are replicated DTensors whose gradients are
    partial sums over the group (each rank saw ``1 / T`` of the tokens):
    :func:`~lightning_hydra.strategy.tensor_pool.sum_partial_gradients` (or FSDP2) sums them.

    Args:
        model: A :class:`~lightning_hydra.HydraModule` whose ``transformer_blocks()`` fit :data:`BLOCK_LAYOUTS`.
        mesh: The ``"tp"`` dimension of :func:`tensor_mesh`.
        sequence_parallel: Shard the norms and the residual stream by tokens (see above).
    """
    tensor = mesh.size()
    blocks: list[Any] = model.transformer_blocks()  # type: ignore[operator]
    for block in blocks:
        attention = getattr(block, "attn", None)  # the reference decoder's CPAttention counts its heads
        if attention is not None and (attention.heads % tensor or attention.kv_heads % tensor):
            raise ConfigError(
                f"tensor_parallel={tensor} must divide {attention.heads} heads and {attention.kv_heads} KV heads"
            )
        layout = check_tensor_block(block, tensor)
        parallelize_module(block, mesh, block_plan(block, sequence_parallel=sequence_parallel))
        if sequence_parallel:
            gather = PrepareModuleOutput(
                output_layouts=Shard(layout.sequence_dim), desired_output_layouts=Replicate(), use_local_output=False
            )
            for norm in layout.norms:  # after SequenceParallel's own output hook
                parallelize_module(block.get_submodule(norm), mesh, gather)
        if attention is not None:
            attention.heads //= tensor
            attention.kv_heads //= tensor
    if sequence_parallel and blocks:
        dim = block_layout(blocks[0]).sequence_dim
        blocks[0].register_forward_pre_hook(partial(_split_tokens, mesh, dim), with_kwargs=True)
        blocks[-1].register_forward_hook(_gather_tokens)
    find = getattr(model, "output_head", None)
    head = find() if callable(find) else getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and head.out_features % tensor == 0 and not _tied(model, head.weight):
        # vocabulary-parallel: the chunked loss reads the row shards (never full logits); logits, when asked
        # for (no labels), are gathered
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Replicate()))
    return len(blocks)


def _split_tokens(
    mesh: DeviceMesh, dim: int, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the first block: its (replicated) hidden states become this rank's token shard."""

    def split(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            return x
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(dim)])

    if args:
        return (split(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}


def _gather_tokens(module: nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook of the last block: its token-sharded output gathered to the whole (plain) hidden states, a new
    tensor (:class:`_GatherTokens`), never a view: FSDP2 hooks a block's output for its backward."""

    def gather(x: Any) -> Any:
        return _GatherTokens.apply(x) if isinstance(x, DTensor) else x

    if isinstance(output, tuple):
        return (gather(output[0]), *output[1:])
    return gather(output)


class _GatherTokens(torch.autograd.Function):
    """A token-sharded DTensor all-gathered to the plain tensor every TP rank holds whole, returned as a tensor of
    its own.

    ``redistribute(...).to_local()`` would return a view (``to_local`` is ``view_as`` under autograd): FSDP2 warns
    of a view returned by a ``fully_shard``-ed block ("returned a view tensor ... wrong gradients"), since an
    in-place op on it would drop the hook that gathers the block's parameters for backward. Here the all-gather's
    own output is returned (an uneven split, which DTensor trims by a view, is copied). The backward is
    redistribute's: the gradient, the same on every TP rank (the head's and the final norm's backward sum theirs
    over the group), is cut to this rank's token shard.
    """

    @staticmethod
    def forward(ctx: Any, shard: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.layout = (shard.device_mesh, shard.placements, shard.shape, shard.stride())
        whole = shard.redistribute(shard.device_mesh, [Replicate()]).to_local()  # no autograd here: no view_as
        return whole.clone() if whole._base is not None else whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        mesh, placements, shape, stride = ctx.layout
        whole = DTensor.from_local(grad, mesh, [Replicate()], shape=shape, stride=stride, run_check=False)
        return whole.redistribute(mesh, placements)


def _tied(model: nn.Module, weight: nn.Parameter) -> bool:
    """Whether ``weight`` is also another parameter of ``model`` (an LM head tied to the embedding)."""
    return sum(p is weight for _, p in model.named_parameters(remove_duplicate=False)) > 1
