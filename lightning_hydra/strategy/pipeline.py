"""Pipeline parallelism under dynamic CP: stages of the model and our own 1F1B schedule.

**Layout.** With ``HydraStrategy(pipeline_stages=P)`` the world is ``P`` stages of a pool of ``N = world / P``
ranks: stage ``s`` holds global ranks ``[s * N, (s + 1) * N)`` and pool position ``i`` of stage ``s`` is global rank
``s * N + i``. Every stage plans the same global batch onto its pool (the same plan: the digest check covers the
whole world), so stage ``s`` position ``i`` and stage ``s + 1`` position ``i`` hold the same zigzag layout in every
microbatch: activations ``[tokens_on_rank, hidden]`` go from one to the other (stage-to-stage traffic between
matching pool positions, across nodes when a stage fills whole nodes), gradients come back the same way.

**Stages of a model.** A :class:`~lightning_hydra.HydraModule` splits through two methods:
``pipeline_stage(stage, stages)`` keeps only that stage's parameters (embedding with the first blocks, ..., the
last blocks with the final norm and head) and ``stage_forward(mb, hidden)`` runs them (the first stage from token
ids, the others from the previous stage's activations; the last returns the microbatch's loss sum).
:func:`stage_layers` balances contiguous blocks by per-token FLOPs (embedding lookups cost nothing, the head ``2 V
h``), the reference decoder and Hugging Face Llama-family models use it.

**Schedule.** Each stage runs the 1F1B order (:func:`~lightning_hydra.metrics.bubbles.one_f_one_b_order`: ``P - s
- 1`` warm-up forwards, one forward / one backward alternating, the remaining backwards). Every activation or
gradient is preceded by its shape (an int64 pair), checked against what the plan says it must be; sends are
asynchronous and waited at the end of the step, receives block. A pool position idle in a microbatch is idle at
every stage (same plan), so both sides skip it without a message. The loss lives on the last stage, normalised by
the global batch's trained tokens, so the run stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_hydra.metrics.bubbles import one_f_one_b_order
from lightning_hydra.metrics.timing import OpTimer
from lightning_hydra.models.stages import stage_layers

__all__ = ["PipelineLayout", "PipelineStep", "StageTimeline", "run_pipeline", "stage_layers"]


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Stages x pool: stage ``s`` is global ranks ``[s * pool, (s + 1) * pool)``."""

    stages: int
    """Pipeline stages ``P``."""
    pool: int
    """Ranks per stage (the dynamic-CP pool every plan is made for)."""

    def __post_init__(self) -> None:
        if self.stages < 1 or self.pool < 1:
            raise ValueError(f"pipeline stages ({self.stages}) and pool ({self.pool}) must be positive")

    @classmethod
    def of_world(cls, world_size: int, stages: int) -> PipelineLayout:
        """The layout of ``world_size`` ranks in ``stages`` stages (``ValueError`` unless it divides)."""
        if stages < 1:
            raise ValueError(f"pipeline_stages must be positive, got {stages}")
        if world_size % stages:
            raise ValueError(f"a world of {world_size} ranks cannot form {stages} pipeline stages of equal pools")
        return cls(stages=stages, pool=world_size // stages)

    @property
    def world_size(self) -> int:
        """``stages * pool``."""
        return self.stages * self.pool

    def stage(self, global_rank: int) -> int:
        """The stage of a global rank."""
        return global_rank // self.pool

    def position(self, global_rank: int) -> int:
        """The pool position of a global rank (its rank in every plan)."""
        return global_rank % self.pool

    def global_rank(self, stage: int, position: int) -> int:
        """The global rank at ``position`` of ``stage``."""
        return stage * self.pool + position

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks of a stage's pool."""
        return tuple(range(stage * self.pool, (stage + 1) * self.pool))


@dataclass
class StageTimeline:
    """One rank's operations in a pipelined step: busy seconds and wall spans per microbatch."""

    fwd_busy: list[float] = field(default_factory=list)
    """Busy seconds of every microbatch's forward (0: skipped)."""
    bwd_busy: list[float] = field(default_factory=list)
    """Busy seconds of every microbatch's backward (0: skipped)."""
    spans: list[list[float]] = field(default_factory=list)
    """Per microbatch ``[forward start, forward end, backward start, backward end]`` wall seconds since the step
    began (-1: not run)."""


@dataclass
class PipelineStep:
    """What :func:`run_pipeline` returns."""

    loss_sum: torch.Tensor
    """This rank's loss sum (non-zero on the last stage only)."""
    timeline: StageTimeline
    """This rank's operations."""
    comm: list[float]
    """Seconds in CP collectives per microbatch."""


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _Link:
    """Shape-checked point-to-point transfers with one neighbouring stage: a header ``[tokens, width, dtype]``
    (int64) before every tensor."""

    def __init__(self, peer: int, device: torch.device) -> None:
        self.peer = peer
        self.device = device
        self.pending: list = []

    def send(self, tensor: torch.Tensor) -> None:
        if tensor.dim() != 2 or tensor.dtype not in _DTYPES:
            raise TypeError(f"pipeline stages exchange [tokens, hidden] float tensors, got {tuple(tensor.shape)}")
        header = torch.tensor([*tensor.shape, _DTYPES.index(tensor.dtype)], dtype=torch.int64, device=self.device)
        self.pending.append((header, dist.isend(header, self.peer)))
        if tensor.numel():
            payload = tensor.detach().contiguous()
            self.pending.append((payload, dist.isend(payload, self.peer)))

    def recv(self, expected: tuple[int, int]) -> torch.Tensor:
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        dist.recv(header, self.peer)
        tokens, width, code = (int(x) for x in header.tolist())
        if (tokens, width) != expected:
            raise RuntimeError(
                f"pipeline: rank {self.peer} sent a {(tokens, width)} tensor where the plan expects {expected}: "
                "the stages disagree on the plan"
            )
        out = torch.empty(expected, dtype=_DTYPES[code], device=self.device)
        if out.numel():
            dist.recv(out, self.peer)
        return out

    def wait(self) -> None:
        for _, work in self.pending:
            work.wait()
        self.pending.clear()


def run_pipeline(module: torch.nn.Module, batch, runtime, *, train: bool, hidden_size: int) -> PipelineStep:
    """One step of this rank's stage under 1F1B (forward only when not ``train``).

    Args:
        module: The stage's :class:`~lightning_hydra.HydraModule` (after ``pipeline_stage``).
        batch: The step's :class:`~lightning_hydra.data.packing.StepBatch` (this pool position's microbatches).
        runtime: The :class:`~lightning_hydra.strategy.pool.PoolRuntime` (layout, groups, gradient sync).
        train: Run backwards (and the gradient sync).
        hidden_size: Width of the activations passed between stages.
    """
    layout: PipelineLayout = runtime.layout
    stage, stages = runtime.stage, layout.stages
    first, last = stage == 0, stage == stages - 1
    device = runtime.device
    prev = _Link(runtime.world_rank - layout.pool, device) if not first else None
    nxt = _Link(runtime.world_rank + layout.pool, device) if not last else None
    microbatches = batch.microbatches
    count = len(microbatches)
    order = one_f_one_b_order(stage, stages, count) if train else [("F", m) for m in range(count)]
    sync = runtime.gradient_sync(module) if train else None
    if sync is not None:
        sync.begin()
    context = module._context()
    timer = OpTimer(device)
    clock = runtime.comm_clock
    clock.discard()
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    backwards = [m for kind, m in order if kind == "B"]
    for kind, m in order:
        mb = microbatches[m]
        if mb.num_tokens == 0:
            if not runtime.must_run(m, count - 1, train=train):
                continue
            mb = module._zero_token_microbatch(runtime.global_rank)
        shape = (mb.num_tokens, hidden_size)
        group = runtime.group(mb.group)
        if kind == "F":
            hidden = prev.recv(shape) if prev is not None else None
            if hidden is not None and train:
                hidden.requires_grad_(True)
            clock.tag(m)
            timer.begin(("F", m))
            with context.use(group, mb.cu_seqlens), torch.set_grad_enabled(train):
                out = module.stage_forward(mb, hidden)
            timer.end(("F", m))
            if last:
                loss_sum += out.detach().double()
                out = out / batch.trained_tokens
            elif nxt is not None:
                nxt.send(out)
            if train:
                saved[m] = (hidden, out)
        else:
            hidden, out = saved.pop(m)
            grad = nxt.recv(shape) if nxt is not None else None
            if sync is not None and m == backwards[-1]:
                sync.arm()
            clock.tag(m)
            timer.begin(("B", m))
            if out.requires_grad:
                torch.autograd.backward(out, grad.to(out.dtype) if grad is not None else None)
            timer.end(("B", m))
            if prev is not None:
                assert hidden is not None
                prev.send(hidden.grad if hidden.grad is not None else torch.zeros_like(hidden))
    for link in (prev, nxt):
        if link is not None:
            link.wait()
    if sync is not None:
        sync.finish()
    else:
        runtime.end_forward_only()
    ops = timer.read()  # after the step's last synchronisation: then the clock, once
    spent = clock.read()
    comm = [spent.get(m, 0.0) for m in range(count)]
    timeline = StageTimeline([0.0] * count, [0.0] * count, [[-1.0] * 4 for _ in range(count)])
    for (kind, m), (busy, begin, end) in ops.items():
        if kind == "F":
            timeline.fwd_busy[m], timeline.spans[m][0], timeline.spans[m][1] = busy, begin, end
        else:
            timeline.bwd_busy[m], timeline.spans[m][2], timeline.spans[m][3] = busy, begin, end
    return PipelineStep(loss_sum, timeline, comm)
