"""Build every rank's operation list of a step from the plan and the layout (pure: no ``torch.distributed``).

**Layout.** A world of ``stages x pool x tensor`` ranks: global rank ``(stage * pool + position) * tensor + t``
(TP ranks consecutive inside a node; with ``tensor=1`` stage ``s`` is ranks ``[s * pool, (s + 1) * pool)``). Every
stage plans the same global batch onto its pool, so a pool position holds the same work on every stage, and its TP
ranks hold the same work as each other.

**Order.** Each stage runs *one* 1F1B order over all the step's microbatches
(:func:`~lightning_hydra.metrics.bubbles.one_f_one_b_order`; forwards only in a forward-only step), and every rank
drops from it the operations of the microbatches it sits out. Two ranks of one CP group therefore meet their shared
microbatches in the same order whatever else each of them runs (each list is a subsequence of the same order);
deriving each rank's 1F1B order from only the microbatches it runs did not (two pool positions sharing groups in
microbatches 4 and 6 ran ``B4 F6`` and ``F6 B4``).

**Sharded state.** zero2 and hsdp gather every FSDP unit at the start of the step, on every rank, in the unit order
(:attr:`StepOptions.units`), and keep it gathered until the step's last backward, which every rank runs (a
zero-token pass where it sits the microbatch out) and in which FSDP reduce-scatters. Gathering at a rank's first
forward instead put a rank idle in microbatch 0 out of step with its peers: it gathered inside its first active
microbatch, between that microbatch's CP collectives, while the others gathered during microbatch 0. zero3 gathers
and reduce-scatters in every forward and backward, so every rank runs every microbatch.

**Transfers.** A pipeline stage exchanges activations and their gradients with the same pool position of its
neighbours: each operation's input is received before it (unless an earlier exchange brought it) and its output
sent after it; an activation sent after ``F(m)`` and a gradient received for ``B(k)`` travel in one exchange when
the earlier stage runs ``F(m)`` right before ``B(k)`` and the later one ``B(k)`` right before ``F(m)`` (the steady
1F1B phase), as Megatron's ``send_forward_recv_backward`` does. Both ends derive the same exchanges from the same
orders.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from lightning_hydra.metrics.bubbles import one_f_one_b_order
from lightning_hydra.planner import Plan, shard_tokens
from lightning_hydra.schedule.ops import Call, Comm, CommKind, Op, Transfer

__all__ = [
    "SHARDINGS",
    "StepLayout",
    "StepOptions",
    "Work",
    "ZERO_TOKEN_TOKENS",
    "OrderRule",
    "control_words",
    "exchanges",
    "per_position_order",
    "plan_work",
    "rank_program",
    "save_program",
    "stage_order",
    "step_programs",
]

SHARDINGS = ("none", "zero2", "zero3", "hsdp")
"""The sharding modes a layout takes."""

ZERO_TOKEN_TOKENS = 2
"""Tokens of a zero-token pass (one ignored token and its zigzag padding)."""


@dataclass(frozen=True, kw_only=True)
class StepLayout:
    """Stages x pool x TP, and how the training state is held."""

    stages: int = 1
    """Pipeline stages."""
    pool: int
    """Pool positions per stage (what plans are made for)."""
    tensor: int = 1
    """TP degree."""
    sharding: str = "none"
    """``"none"``, ``"zero2"``, ``"zero3"`` or ``"hsdp"``."""
    node: int = 1
    """Pool positions of one node (hsdp shards inside it and replicates across nodes)."""

    def __post_init__(self) -> None:
        if min(self.stages, self.pool, self.tensor, self.node) < 1:
            raise ValueError(f"a step layout needs positive sizes, got {self}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"unknown sharding {self.sharding!r}; one of {SHARDINGS}")
        if self.sharding == "hsdp" and self.pool % min(self.node, self.pool):
            raise ValueError(f"hsdp needs whole nodes: a pool of {self.pool} in nodes of {self.node}")

    @property
    def world_size(self) -> int:
        """``stages * pool * tensor``."""
        return self.stages * self.pool * self.tensor

    def rank(self, stage: int, position: int, tp: int = 0) -> int:
        """The global rank of TP index ``tp`` of ``position`` on ``stage``."""
        return (stage * self.pool + position) * self.tensor + tp

    def locate(self, rank: int) -> tuple[int, int, int]:
        """``(stage, position, tp)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        slot, tp = divmod(rank, self.tensor)
        stage, position = divmod(slot, self.pool)
        return stage, position, tp

    @property
    def explicit_gathers(self) -> bool:
        """zero2 and hsdp: every unit gathered once, at the start of the step."""
        return self.sharding in ("zero2", "hsdp")

    # ------------------------------------------------------------------ communicators
    def _comm(self, kind: CommKind, ranks: Iterable[int]) -> Comm | None:
        members = tuple(sorted(ranks))
        return Comm(kind, members) if len(members) > 1 else None  # a communicator of one issues nothing

    def world(self) -> Comm | None:
        """Every rank."""
        return self._comm("world", range(self.world_size))

    def loss(self, rank: int) -> Comm | None:
        """Where the loss is summed: the world, or under TP the ranks of ``rank``'s TP index in every stage."""
        if self.tensor == 1:
            return self.world()
        return self._comm("loss", range(self.locate(rank)[2], self.world_size, self.tensor))

    def grad(self, rank: int) -> Comm | None:
        """The gradient sum's communicator: ``rank``'s stage pool (its TP index)."""
        stage, _, tp = self.locate(rank)
        return self._comm("grad", (self.rank(stage, p, tp) for p in range(self.pool)))

    def shard(self, rank: int) -> Comm | None:
        """FSDP's gathers and reduce-scatters: the stage pool (zero2, zero3), ``rank``'s node (hsdp)."""
        if self.sharding == "none":
            return None
        stage, position, tp = self.locate(rank)
        if self.sharding != "hsdp":
            return self._comm("shard", (self.rank(stage, p, tp) for p in range(self.pool)))
        node = min(self.node, self.pool)
        first = position - position % node
        return self._comm("shard", (self.rank(stage, p, tp) for p in range(first, first + node)))

    def replicate(self, rank: int) -> Comm | None:
        """hsdp's all-reduce across nodes: ``rank``'s place in every node."""
        if self.sharding != "hsdp":
            return None
        stage, position, tp = self.locate(rank)
        node = min(self.node, self.pool)
        return self._comm("replicate", (self.rank(stage, p, tp) for p in range(position % node, self.pool, node)))

    def cp(self, rank: int, group: Sequence[int]) -> Comm | None:
        """The communicator of a CP group of pool positions, on ``rank``'s stage and TP index."""
        stage, _, tp = self.locate(rank)
        return self._comm("cp", (self.rank(stage, p, tp) for p in group))

    def tp(self, rank: int) -> Comm | None:
        """``rank``'s TP group."""
        stage, position, _ = self.locate(rank)
        return self._comm("tp", (self.rank(stage, position, t) for t in range(self.tensor)))

    def link(self, rank: int, peer: int) -> Comm:
        """The point-to-point link of two ranks."""
        return Comm("link", (min(rank, peer), max(rank, peer)))


@dataclass(frozen=True)
class Work:
    """A pool position's share of one microbatch."""

    group: tuple[int, ...]
    """The pool positions of its CP group (itself alone: degree 1)."""
    tokens: int
    """Tokens it holds (0: its group sits the microbatch out)."""


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """What a rank does around its microbatches (from the runtime, which knows its model and its syncs)."""

    train: bool = True
    """Forwards and backwards (``False``: forwards only)."""
    units: int = 0
    """FSDP units of the rank's stage (sharded state), in the order they are gathered."""
    grad_calls: tuple[tuple[CommKind, str, int, str], ...] = ()
    """The gradient sum's collectives in order, as ``(communicator kind, function, numel, dtype)`` with the kind
    ``"grad"`` or ``"tp"`` (replicas, and TP without sharding; none for a pool of one; FSDP reduces inside the
    backwards, and a sharded step has no gradient sum operation)."""
    partial_sum: bool = False
    """Partial gradients (sequence-parallel norms under TP) are summed over the TP group before the pool's sum."""
    calibrate: bool = False
    """The cost model is refitted after the step (rank 0's refit is broadcast)."""
    refit_fields: int = 0
    """Values of that broadcast."""
    clip: bool = False
    """The gradient norm is reduced after the gradient sum."""
    digest_words: int = 1
    """int64 words of the plan digest in the step's control all-reduce (:func:`control_words`)."""
    measure: bool = True
    """Every rank's measurements are gathered after a training step."""


def control_words(digest_words: int = 1) -> int:
    """Values of a step's control all-reduce (the ``check`` operation, int64, ``MAX`` over the world): the data error
    flag, the SIGTERM flag, then the digest words and their negations (equal digests: ``max == -max(-x)``)."""
    return 2 + 2 * digest_words


@dataclass
class _Builder:
    layout: StepLayout
    rank: int
    ops: list[Op] = field(default_factory=list)

    def add(self, kind: str, comms: Iterable[Comm | None] = (), calls: Iterable[Call] | None = (), **kw) -> None:
        self.ops.append(
            Op(
                kind=kind,
                comms=tuple(c for c in comms if c is not None),
                calls=None if calls is None else tuple(calls),
                **kw,
            )  # type: ignore[arg-type]
        )


def stage_order(
    stage: int, stages: int, runs: Sequence[int], microbatches: int, *, train: bool
) -> list[tuple[str, int]]:
    """The operations of ``stage`` in a step of ``microbatches``: the stage's one 1F1B order (forwards only when not
    ``train``), without the microbatches not in ``runs``."""
    keep = set(runs)
    order = one_f_one_b_order(stage, stages, microbatches) if train else [("F", m) for m in range(microbatches)]
    return [(kind, m) for kind, m in order if m in keep]


def per_position_order(
    stage: int, stages: int, runs: Sequence[int], microbatches: int, *, train: bool
) -> list[tuple[str, int]]:
    """The order each rank derived before the step was data: its pool position's own 1F1B over only the microbatches
    it runs. Two members of a CP group then meet shared microbatches in different orders (it deadlocked 8 gloo ranks
    at 2 stages x a pool of 4); kept as the counterexample that the tests and the GPU check scripts show the checker
    catching (pass it as ``order``), never used to run a step."""
    runs = list(runs)
    order = one_f_one_b_order(stage, stages, len(runs)) if train else [("F", i) for i in range(len(runs))]
    return [(kind, runs[i]) for kind, i in order]


OrderRule = Callable[..., list[tuple[str, int]]]
"""A stage's operation order: ``rule(stage, stages, runs, microbatches, train=...)`` (:func:`stage_order`)."""


def _paired(upper: list[tuple[str, int]], lower: list[tuple[str, int]]) -> set[tuple[int, int]]:
    """``(m, k)`` where the earlier stage runs ``F(m)`` right before ``B(k)`` and the later one ``B(k)`` right
    before ``F(m)``: activations ``m`` and gradients ``k`` then cross the link in one exchange."""
    ahead = {(a[1], b[1]) for a, b in itertools.pairwise(upper) if a[0] == "F" and b[0] == "B"}
    behind = {(b[1], a[1]) for a, b in itertools.pairwise(lower) if a[0] == "B" and b[0] == "F"}
    return ahead & behind


def exchanges(
    stage: int, stages: int, runs: Sequence[int], microbatches: int, *, train: bool, order: OrderRule = stage_order
) -> list[tuple[tuple[tuple[int, Transfer], ...], tuple[tuple[int, Transfer], ...]]]:
    """For each operation of :func:`stage_order`, the transfers posted before it and after it, each as ``(peer
    side, transfer)`` with side -1 (the previous stage) or +1 (the next); a transfer's ``tokens`` is left 0 (the
    caller knows the shapes).

    Args:
        stage: This stage.
        stages: Pipeline stages.
        runs: The microbatches the pool position runs (the same on every stage).
        microbatches: The step's microbatches.
        train: Forwards and backwards (``False``: forwards only).
        order: The stages' order rule.
    """
    orders = {
        s: order(s, stages, runs, microbatches, train=train) for s in (stage - 1, stage, stage + 1) if 0 <= s < stages
    }
    down = _paired(orders[stage], orders[stage + 1]) if stage + 1 < stages else set()
    up = _paired(orders[stage - 1], orders[stage]) if stage > 0 else set()
    recv_act_with = {k: m for m, k in up}  # after B(k), the activations m arrive in the same exchange
    recv_grad_with = dict(down)  # after F(m), the gradients k arrive in the same exchange
    first, last = stage == 0, stage == stages - 1
    out = []
    posted: set[tuple[str, int]] = set()
    for kind, m in orders[stage]:
        before: list[tuple[int, Transfer]] = []
        after: list[tuple[int, Transfer]] = []
        if kind == "F":
            if not first and ("act", m) not in posted:
                before.append((-1, Transfer("down", m, 0)))
            if not last:
                after.append((1, Transfer("down", m, 0)))
                if m in recv_grad_with:
                    after.append((1, Transfer("up", recv_grad_with[m], 0)))
                    posted.add(("grad", recv_grad_with[m]))
        else:
            if not last and ("grad", m) not in posted:
                before.append((1, Transfer("up", m, 0)))
            if not first:
                after.append((-1, Transfer("up", m, 0)))
                if m in recv_act_with:
                    after.append((-1, Transfer("down", recv_act_with[m], 0)))
                    posted.add(("act", recv_act_with[m]))
        out.append((tuple(before), tuple(after)))
    return out


def _must_run(layout: StepLayout, m: int, count: int, train: bool) -> bool:
    """Whether a rank idle in microbatch ``m`` runs a zero-token pass: every microbatch under zero3 (FSDP
    collectives in every forward and backward), the last one of a training step under zero2 and hsdp (FSDP
    reduce-scatters in its backward)."""
    if layout.sharding == "zero3":
        return True
    return layout.explicit_gathers and train and m == count - 1


def rank_program(
    layout: StepLayout, work: Sequence[Work], rank: int, options: StepOptions, *, order: OrderRule = stage_order
) -> list[Op]:
    """One rank's operations in one step, in the order it runs them.

    Args:
        layout: Stages x pool x TP and the sharding.
        work: The rank's pool position's share of every microbatch of the step.
        rank: The global rank.
        options: What the rank does around its microbatches.
        order: The stages' order rule (:func:`stage_order`; :func:`per_position_order` only to show a deadlock).
    """
    stage, _, _ = layout.locate(rank)
    train = options.train
    count = len(work)
    b = _Builder(layout, rank)
    world = layout.world()
    control = [Call("all_reduce", world, control_words(options.digest_words), "int64")] if world else []
    b.add("check", [world], control)
    shard = layout.shard(rank)
    if layout.explicit_gathers:
        for unit in range(options.units):
            b.add("gather", [shard], None, unit=unit)
    runs = [m for m in range(count) if work[m].tokens or _must_run(layout, m, count, train)]
    ops = order(stage, layout.stages, runs, count, train=train)
    posts = exchanges(stage, layout.stages, runs, count, train=train, order=order) if layout.stages > 1 else None
    posts = posts or [((), ())] * len(ops)
    tokens = {m: work[m].tokens or ZERO_TOKEN_TOKENS for m in runs}
    backwards = [m for kind, m in ops if kind == "B"]
    tp = layout.tp(rank)
    for (kind, m), (before, after) in zip(ops, posts, strict=True):
        _post(b, stage, before, tokens)
        zero = work[m].tokens == 0
        comms = [None if zero else layout.cp(rank, work[m].group), tp]
        last = kind == "B" and m == count - 1
        if layout.sharding == "zero3" or (last and layout.explicit_gathers):
            comms += [shard, layout.replicate(rank) if kind == "B" else None]
        arms = kind == "B" and m == backwards[-1]
        b.add(
            "forward" if kind == "F" else "backward",
            comms,
            None,
            stage=stage,
            microbatch=m,
            tokens=tokens[m],
            zero_token=zero,
            arms=arms,
        )
        _post(b, stage, after, tokens)
    if train and options.partial_sum and tp is not None and backwards:  # no backward, no partial gradient
        b.add("partial_sum", [tp], None)
    if train and layout.sharding == "none":  # FSDP reduces inside the backwards; replicas and TP sum here
        calls = [_grad_call(layout, rank, *c) for c in options.grad_calls]
        b.add("grad_sum", dict.fromkeys(c.comm for c in calls), calls)
    if not train and layout.explicit_gathers:
        b.add("reshard")
    loss = layout.loss(rank)
    b.add("loss_sum", [loss], [Call("all_reduce", loss, 1, "float64")] if loss else [])
    if train and options.measure:
        b.add("measure", [world], None)
        if options.calibrate:
            b.add("refit", [world], [Call("broadcast", world, options.refit_fields, "float64")] if world else [])
    if train and options.clip:
        b.add("clip", [shard, tp, world if layout.stages > 1 else None], None)
    return b.ops


def _post(b: _Builder, stage: int, transfers: tuple[tuple[int, Transfer], ...], tokens: dict[int, int]) -> None:
    """Add the exchange(s) of ``transfers``: one per neighbour, in the order they are listed."""
    layout, rank = b.layout, b.rank
    _, position, tp = layout.locate(rank)
    for side in dict.fromkeys(s for s, _ in transfers):
        peer = layout.rank(stage + side, position, tp)
        mine = tuple(Transfer(t.flow, t.microbatch, tokens[t.microbatch]) for s, t in transfers if s == side)
        b.add("exchange", [layout.link(rank, peer)], (), stage=stage, peer=peer, transfers=mine)


def _grad_call(layout: StepLayout, rank: int, kind: CommKind, name: str, numel: int, dtype: str) -> Call:
    comm = layout.grad(rank) if kind == "grad" else layout.tp(rank)
    if comm is None:
        raise ValueError(f"a gradient {name} on a {kind} communicator of one rank")
    return Call(name, comm, numel, dtype)


def save_program(layout: StepLayout) -> list[Op]:
    """A rank's operations of a sharded checkpoint save between two steps (the same on every rank: the path's
    broadcast and ``torch.distributed.checkpoint``'s collectives, over the world)."""
    return [Op(kind="save", comms=tuple(c for c in (layout.world(),) if c is not None), calls=None)]


def step_programs(
    layout: StepLayout,
    work: Sequence[Sequence[Work]],
    options: StepOptions | Sequence[StepOptions],
    *,
    order: OrderRule = stage_order,
) -> dict[int, list[Op]]:
    """Every rank's :func:`rank_program` of one step.

    Args:
        layout: Stages x pool x TP and the sharding.
        work: ``work[position][m]``: every pool position's share of every microbatch (every stage plans the same).
        options: The options of every rank, or one per stage (stages hold different layers).
        order: The stages' order rule (see :func:`rank_program`).
    """
    if len(work) != layout.pool:
        raise ValueError(f"work for {len(work)} positions, the layout has a pool of {layout.pool}")
    if len({len(row) for row in work}) > 1:
        raise ValueError("every pool position must hold the same number of microbatches")
    per_stage = [options] * layout.stages if isinstance(options, StepOptions) else list(options)
    if len(per_stage) != layout.stages:
        raise ValueError(f"options for {len(per_stage)} stages, the layout has {layout.stages}")
    out = {}
    for rank in range(layout.world_size):
        stage, position, _ = layout.locate(rank)
        out[rank] = rank_program(layout, work[position], rank, per_stage[stage], order=order)
    return out


def plan_work(plan: Plan) -> list[list[Work]]:
    """``work[position][m]`` of a plan: each pool position's CP group and tokens (zigzag shards) per microbatch."""
    out: list[list[Work]] = [[] for _ in range(plan.world_size)]
    for groups in plan.microbatches:
        for g in groups:
            tokens = sum(shard_tokens(plan.lengths[i], g.degree) for i in g.seq_ids)
            for p in g.ranks:
                out[p].append(Work(g.ranks, int(tokens)))
    return out
