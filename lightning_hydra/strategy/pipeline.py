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
- 1`` warm-up forwards, one forward / one backward alternating, the remaining backwards). Every transfer's shape
comes from the plan every stage holds (no header travels, nothing is read back to the host) and its dtype from the
model (:func:`wire_dtype`). Each exchange with a neighbour is one ``batch_isend_irecv`` that pairs a send with the
receive the next operation needs, the same pairs in the same order on both ends of every link
(:func:`p2p_schedule`), so NCCL cannot deadlock on sends and receives posted in opposite orders. Receives are waited
for when needed, sends at the end of the step. A pool position idle in a microbatch is idle at every stage (same
plan), so both sides skip it without a message. The loss lives on the last stage, normalised by the global batch's
trained tokens, so the run stays exact.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_hydra.metrics.bubbles import one_f_one_b_order
from lightning_hydra.metrics.timing import OpTimer
from lightning_hydra.models.stages import stage_layers

__all__ = [
    "PipelineLayout",
    "PipelineStep",
    "StageTimeline",
    "Transfer",
    "link_exchanges",
    "p2p_schedule",
    "run_pipeline",
    "stage_layers",
    "stage_order",
    "wire_dtype",
]


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


@dataclass(frozen=True)
class Transfer:
    """One point-to-point transfer of a pipelined step, as one end of the link sees it."""

    send: bool
    """This rank sends (``False``: receives)."""
    peer: int
    """-1: the previous stage; +1: the next stage."""
    kind: str
    """``"act"`` (activations, forward) or ``"grad"`` (their gradients, backward)."""
    microbatch: int
    """The microbatch the tensor belongs to."""


Exchange = tuple[Transfer, ...]
"""Transfers posted together, as one ``batch_isend_irecv``."""


def stage_order(stage: int, stages: int, active: list[int], *, train: bool) -> list[tuple[str, int]]:
    """The operations of ``stage``: the 1F1B order (forwards only when not ``train``) of the microbatches ``active``
    (those its pool position runs: the same on every stage, the plan is)."""
    order = one_f_one_b_order(stage, stages, len(active)) if train else [("F", i) for i in range(len(active))]
    return [(kind, active[i]) for kind, i in order]


def _paired(upper: list[tuple[str, int]], lower: list[tuple[str, int]]) -> set[tuple[int, int]]:
    """``(m, k)`` where the earlier stage runs ``F(m)`` right before ``B(k)`` and the later one ``B(k)`` right
    before ``F(m)``: activations ``m`` and gradients ``k`` then cross the link in one exchange."""
    ahead = {(a[1], b[1]) for a, b in itertools.pairwise(upper) if a[0] == "F" and b[0] == "B"}
    behind = {(b[1], a[1]) for a, b in itertools.pairwise(lower) if a[0] == "B" and b[0] == "F"}
    return ahead & behind


def p2p_schedule(stage: int, stages: int, active: list[int], *, train: bool) -> list[tuple[Exchange, Exchange]]:
    """The transfers of ``stage`` around every operation of its :func:`stage_order`: for each operation, the
    exchange posted before it (its input, unless already posted) and the one posted after it (its output).

    Activations ``m`` sent down after ``F(m)`` and gradients ``k`` sent up after ``B(k)`` travel in one exchange
    (one ``batch_isend_irecv`` on each end) when the earlier stage runs ``F(m)`` right before ``B(k)`` and the later
    stage ``B(k)`` right before ``F(m)`` (the steady 1F1B phase); every other transfer is an exchange of its own.
    Both ends derive the same pairs from the same orders and post the transfers of a link in the same order
    (:func:`link_exchanges`; the tests check every link of up to 8 stages), so NCCL cannot deadlock on a send and a
    receive of the same two ranks posted in opposite orders.

    Args:
        stage: This stage.
        stages: Pipeline stages.
        active: The microbatches this pool position runs, ascending.
        train: Forwards and backwards (``False``: forwards only).
    """
    orders = {s: stage_order(s, stages, active, train=train) for s in (stage - 1, stage, stage + 1) if 0 <= s < stages}
    down = _paired(orders[stage], orders[stage + 1]) if stage + 1 < stages else set()
    up = _paired(orders[stage - 1], orders[stage]) if stage > 0 else set()
    recv_act_with = {k: m for m, k in up}  # after B(k), the activations m arrive in the same exchange
    recv_grad_with = dict(down)  # after F(m), the gradients k arrive in the same exchange
    first, last = stage == 0, stage == stages - 1
    out: list[tuple[Exchange, Exchange]] = []
    posted: set[tuple[str, int]] = set()
    for kind, m in orders[stage]:
        before: list[Transfer] = []
        after: list[Transfer] = []
        if kind == "F":
            if not first and ("act", m) not in posted:
                before.append(Transfer(False, -1, "act", m))
            if not last:
                after.append(Transfer(True, 1, "act", m))
                if m in recv_grad_with:
                    after.append(Transfer(False, 1, "grad", recv_grad_with[m]))
                    posted.add(("grad", recv_grad_with[m]))
        else:
            if not last and ("grad", m) not in posted:
                before.append(Transfer(False, 1, "grad", m))
            if not first:
                after.append(Transfer(True, -1, "grad", m))
                if m in recv_act_with:
                    after.append(Transfer(False, -1, "act", recv_act_with[m]))
                    posted.add(("act", recv_act_with[m]))
        out.append((tuple(before), tuple(after)))
    return out


def link_exchanges(schedule: list[tuple[Exchange, Exchange]], peer: int) -> list[frozenset[tuple[str, str, int]]]:
    """The exchanges of ``schedule`` with one neighbour (``peer`` -1 or +1), in posting order, as sets of ``(flow,
    kind, microbatch)`` with ``flow`` ``"down"`` (towards the later stage) or ``"up"``: the same list on both ends
    of a link means they post the same batches in the same order."""
    out = []
    for exchange in (x for pair in schedule for x in pair):
        mine = [t for t in exchange if t.peer == peer]
        if mine:
            out.append(frozenset(("down" if t.send == (t.peer > 0) else "up", t.kind, t.microbatch) for t in mine))
    return out


class _Links:
    """Posts a stage's exchanges (:func:`p2p_schedule`) as one ``batch_isend_irecv`` each. Shapes come from the
    plan (every stage holds the same) and the dtype from the model, so no header travels and nothing is read back
    to the host; a receive is waited for when its tensor is needed, every transfer at the end of the step."""

    def __init__(self, world_rank: int, pool: int, device: torch.device, dtype: torch.dtype) -> None:
        self.peers = {-1: world_rank - pool, 1: world_rank + pool}
        self.device = device
        self.dtype = dtype
        self.received: dict[tuple[str, int], tuple[torch.Tensor, list]] = {}
        self.works: list = []
        self.done: set[int] = set()  # ids of the works already waited for (the works stay alive in ``works``)
        self.kept: list[torch.Tensor] = []  # sent tensors stay alive until their sends complete

    def post(self, exchange: Exchange, shape: dict[int, tuple[int, int]], sending: torch.Tensor | None = None) -> None:
        """Post ``exchange`` (at most one send: ``sending``); ``shape[m]`` is microbatch ``m``'s ``[tokens,
        width]``."""
        ops = []
        waiting = []
        for t in exchange:
            expected = shape[t.microbatch]
            if t.send:
                assert sending is not None
                if tuple(sending.shape) != expected:
                    raise RuntimeError(f"pipeline: a {tuple(sending.shape)} tensor where the plan says {expected}")
                tensor = sending.detach().to(self.dtype).contiguous()
                self.kept.append(tensor)
            else:
                tensor = torch.empty(expected, dtype=self.dtype, device=self.device)
                waiting.append((t.kind, t.microbatch, tensor))
            if tensor.numel():  # a zero-token pass sends nothing: both ends know it from the plan
                ops.append(dist.P2POp(dist.isend if t.send else dist.irecv, tensor, self.peers[t.peer]))
        works = dist.batch_isend_irecv(ops) if ops else []
        self.works.extend(works)
        for kind, m, tensor in waiting:
            self.received[(kind, m)] = (tensor, works)

    def take(self, kind: str, m: int) -> torch.Tensor:
        """The received tensor of ``(kind, m)``, once its exchange has completed."""
        tensor, works = self.received.pop((kind, m))
        self._complete(works)
        return tensor

    def _complete(self, works: list) -> None:
        for work in works:
            if id(work) not in self.done:  # a gloo work waited for twice never returns
                work.wait()
                self.done.add(id(work))

    def wait(self) -> None:
        """Complete every transfer posted."""
        self._complete(self.works)
        self.works.clear()
        self.done.clear()
        self.kept.clear()


def wire_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype activations and their gradients travel in between stages: the model's (first floating-point
    parameter's; float32 without one). Every stage derives the same one; a stage output of another dtype (autocast)
    is cast to it."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


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
    links = _Links(runtime.world_rank, layout.pool, device, wire_dtype(module))
    microbatches = batch.microbatches
    count = len(microbatches)
    # the microbatches this pool position runs (the same on every stage: the plan is), in 1F1B order among them
    active = [m for m, mb in enumerate(microbatches) if mb.num_tokens or runtime.must_run(m, count - 1, train=train)]
    order = stage_order(stage, stages, active, train=train)
    schedule = p2p_schedule(stage, stages, active, train=train)
    # an idle position that must run (sharded state) runs the zero-token microbatch on every stage: its activations
    # are that microbatch's length, not the plan's 0 tokens
    idle = module._zero_token_microbatch(runtime.global_rank)
    shape = {m: (mb.num_tokens or idle.input_ids.shape[0], hidden_size) for m, mb in enumerate(microbatches)}
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
    for (kind, m), (before, after) in zip(order, schedule, strict=True):
        mb = microbatches[m]
        if mb.num_tokens == 0:
            mb = idle
        group = runtime.group(mb.group)
        links.post(before, shape)
        clock.tag(m)
        if kind == "F":
            hidden = None if first else links.take("act", m)
            if hidden is not None and train:
                hidden.requires_grad_(True)
            timer.begin(("F", m))
            with context.use(group, mb.cu_seqlens), torch.set_grad_enabled(train):
                out = module.stage_forward(mb, hidden)
            timer.end(("F", m))
            if last:
                loss_sum += out.detach().double()
                out = out / batch.trained_tokens
            links.post(after, shape, None if last else out)
            if train:
                saved[m] = (hidden, out)
        else:
            hidden, out = saved.pop(m)
            grad = None if last else links.take("grad", m)
            if sync is not None and m == backwards[-1]:
                sync.arm()
            timer.begin(("B", m))
            if out.requires_grad:
                torch.autograd.backward(out, grad.to(out.dtype) if grad is not None else None)
            timer.end(("B", m))
            sending = None
            if not first:
                assert hidden is not None
                sending = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
            links.post(after, shape, sending)
    links.wait()
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
