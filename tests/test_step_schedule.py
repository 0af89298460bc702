"""The step as data, checked before it runs: every rank's operation list of random plans (the ``hydra``, ``mcore`` and
``static`` policies, and plans drawn directly, idle patterns the policies rarely make) on every layout family issues
the same collectives in the same order on every member of every communicator and runs to its end; the lists of the
orders the runtime used before (a per-position 1F1B, FSDP gathers at a rank's first forward) fail the same checks,
on the smallest plans that break them (Hypothesis' shrunk counterexamples, kept below)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_hydra.planner import CostModel, PlanError, schedule
from lightning_hydra.schedule import (
    Comm,
    Op,
    ScheduleError,
    StepLayout,
    StepOptions,
    Work,
    check_programs,
    concat,
    per_position_order,
    plan_work,
    projection,
    save_program,
    step_programs,
)

COST = CostModel.for_transformer(
    32, 4, 4, 2, 96, 258, flops_per_second=20e9, bytes_per_element=4, intra_node_bandwidth=2e9
).replace(min_chunk_tokens=16, inter_node_bandwidth=2e9)
"""The tiny test decoder's analytic model (communication charged)."""

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
"""A few hundred plans per layout family, the same ones every run (a failure reproduces)."""


# ---------------------------------------------------------------------- plans and layouts
@st.composite
def planned(draw, pool: int) -> list[list[Work]]:
    """A plan of one of the three policies over a random batch, as every position's work."""
    policy = draw(st.sampled_from(["hydra", "mcore", "static"]))
    capacity = draw(st.sampled_from([48, 64, 96, 128, 256]))
    lengths = draw(st.lists(st.integers(1, 3 * capacity), min_size=1, max_size=6 * pool))
    try:
        plan = schedule(
            lengths,
            world_size=pool,
            num_microbatches=draw(st.integers(1, 6)),
            max_tokens_per_rank=capacity,
            cost=COST,
            policy=policy,
            ranks_per_node=draw(st.sampled_from([n for n in (1, 2, 4, 8) if pool % n == 0 or n % pool == 0])),
            num_heads=4,
            num_kv_heads=2,
            seed=draw(st.integers(0, 3)),
        )
    except PlanError:
        assume(False)
    return plan_work(plan)


@st.composite
def drawn(draw, pool: int) -> list[list[Work]]:
    """A plan drawn directly: each microbatch cuts the pool into contiguous groups, each busy or idle (ranks idle in
    the first microbatch and busy later in groups of several, which the policies seldom make at small pools)."""
    count = draw(st.integers(1, 6))
    work: list[list[Work]] = [[] for _ in range(pool)]
    for _ in range(count):
        start = 0
        while start < pool:
            size = draw(st.integers(1, pool - start))
            group = tuple(range(start, start + size))
            tokens = draw(st.sampled_from([0, 0, 4, 10, 24]))
            for p in group:
                work[p].append(Work(group, tokens))
            start += size
    return work


@st.composite
def layouts(draw, *, stages: tuple[int, int], shardings: list[str]) -> StepLayout:
    """A layout: stages, a pool of 2-16 positions, TP 1-2, a sharding (hsdp's nodes divide the pool)."""
    pool = draw(st.sampled_from([2, 3, 4, 6, 8, 16]))
    sharding = draw(st.sampled_from(shardings))
    nodes = [n for n in (1, 2, 4, 8) if pool % n == 0] if sharding == "hsdp" else [pool]
    return StepLayout(
        stages=draw(st.integers(*stages)),
        pool=pool,
        tensor=draw(st.integers(1, 2)),
        sharding=sharding,
        node=draw(st.sampled_from(nodes)),
    )


def options(draw, layout: StepLayout, *, train: bool) -> list[StepOptions]:
    """Per stage: FSDP units (stages hold different layers), the gradient sum's calls, calibration, clipping."""
    out = []
    calibrate = draw(st.booleans())
    clip = draw(st.booleans())
    for _ in range(layout.stages):
        if layout.sharding != "none":
            calls: tuple = ()
        elif layout.tensor > 1:
            calls = (("grad", "all_reduce", draw(st.integers(1, 999)), "float32"),) if layout.pool > 1 else ()
        else:
            buckets = draw(st.lists(st.integers(1, 999), min_size=1, max_size=3)) if layout.pool > 1 else []
            first = draw(st.booleans())
            calls = tuple(("grad", "all_reduce", n, "float32") for n in buckets)
            calls += (("grad", "all_gather", 9, "int64"),) if first and buckets else ()
        out.append(
            StepOptions(
                train=train,
                units=draw(st.integers(1, 4)) if layout.sharding != "none" else 0,
                grad_calls=calls,
                partial_sum=layout.tensor > 1 and layout.sharding == "none",
                calibrate=calibrate,
                refit_fields=12,
                clip=clip,
            )
        )
    return out


def run_of(draw, layout: StepLayout, plans) -> dict[int, list[Op]]:
    """A run: a training step, a checkpoint save (sometimes), a validation step, another training step."""
    parts = [step_programs(layout, draw(plans), options(draw, layout, train=True))]
    if draw(st.booleans()):
        parts.append({r: ops for r, ops in enumerate([save_program(layout)] * layout.world_size)})
    parts.append(step_programs(layout, draw(plans), options(draw, layout, train=False)))
    parts.append(step_programs(layout, draw(plans), options(draw, layout, train=True)))
    return concat(*parts)


def check_every_microbatch_once(layout: StepLayout, work: list[list[Work]], programs: dict[int, list[Op]]) -> None:
    """Every rank runs the forward (and backward) of each microbatch it holds tokens of exactly once, a zero-token
    pass only where it holds none, and nothing it may skip: the step loses no token."""
    for rank, ops in programs.items():
        _, position, _ = layout.locate(rank)
        for kind in ("forward", "backward"):
            ran = [op for op in ops if op.kind == kind]
            if kind == "backward" and not any(op.kind == "measure" for op in ops):
                assert not ran
                continue
            busy = [m for m, w in enumerate(work[position]) if w.tokens]
            assert sorted(op.microbatch for op in ran if not op.zero_token) == busy
            assert all(not work[position][op.microbatch].tokens for op in ran if op.zero_token)
            assert len({op.microbatch for op in ran}) == len(ran)


def family(draw, layout: StepLayout) -> dict[int, list[Op]]:
    plans = st.one_of(planned(layout.pool), drawn(layout.pool))
    return run_of(draw, layout, plans)


# ---------------------------------------------------------------------- the property, per layout family
@SETTINGS
@given(st.data())
def test_replica_steps_are_live(data) -> None:
    layout = data.draw(layouts(stages=(1, 1), shardings=["none"]))
    check_programs(family(data.draw, layout))


@SETTINGS
@given(st.data())
def test_sharded_steps_are_live(data) -> None:
    layout = data.draw(layouts(stages=(1, 1), shardings=["zero2", "zero3", "hsdp"]))
    check_programs(family(data.draw, layout))


@SETTINGS
@given(st.data())
def test_pipelined_steps_are_live(data) -> None:
    layout = data.draw(layouts(stages=(2, 4), shardings=["none", "zero2", "zero3", "hsdp"]))
    check_programs(family(data.draw, layout))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.data())
def test_no_microbatch_is_lost_or_run_twice(data) -> None:
    layout = data.draw(layouts(stages=(1, 3), shardings=["none", "zero2", "zero3", "hsdp"]))
    work = data.draw(st.one_of(planned(layout.pool), drawn(layout.pool)))
    train = data.draw(st.booleans())
    programs = step_programs(layout, work, options(data.draw, layout, train=train))
    check_every_microbatch_once(layout, work, programs)


# ---------------------------------------------------------------------- the old orders fail
def _work(rows: list[list[tuple[tuple[int, ...], int]]]) -> list[list[Work]]:
    return [[Work(g, t) for g, t in row] for row in rows]


PIPELINE_COUNTEREXAMPLE = _work(
    [
        [((0, 1), 8), ((0,), 0), ((0, 1), 8)],
        [((0, 1), 8), ((1,), 8), ((0, 1), 8)],
    ]
)
"""Two stages x a pool of 2: position 1 runs microbatch 1, position 0 sits it out. A per-position 1F1B orders
position 0 ``F0 F2 B0 B2`` on stage 0 and position 1 ``F0 F1 B0 F2 B1 B2``: on their one group's communicator one
issues ``F2`` where the other issues ``B0``."""

PIPELINE_ACROSS_GROUPS = _work(
    [
        [((0, 1, 2, 3), 4), ((0, 1, 2), 0), ((0, 1), 0)],
        [((0, 1, 2, 3), 4), ((0, 1, 2), 0), ((0, 1), 0)],
        [((0, 1, 2, 3), 4), ((0, 1, 2), 0), ((2, 3), 4)],
        [((0, 1, 2, 3), 4), ((3,), 4), ((2, 3), 4)],
    ]
)
"""Two stages x a pool of 4, Hypothesis' shrunk counterexample of the per-position 1F1B (what the issue measured):
positions 2 and 3 share microbatch 0 in one group and microbatch 2 in another; position 2 (``F0 F2 B0 B2``) waits in
``F2`` on the second while position 3 (``F0 F1 B0 F2 B1 B2``) waits in ``B0`` on the first. Each communicator alone
sees one order; the deadlock is across them."""

ZERO2_COUNTEREXAMPLE = _work(
    [
        [((0, 1), 8), ((0, 1), 8)],
        [((0, 1), 8), ((0, 1), 8)],
        [((2,), 0), ((2, 3), 8)],
        [((3,), 0), ((2, 3), 8)],
    ]
)
"""zero2 on a pool of 4: positions 2 and 3 sit microbatch 0 out and share a group in microbatch 1."""


def _gather_at_first_forward(layout: StepLayout, programs: dict[int, list[Op]]) -> dict[int, list[Op]]:
    """The lists as FSDP ran them before: no gather at the step's start, every unit gathered in the rank's first
    forward instead."""
    out = {}
    for rank, ops in programs.items():
        kept = [op for op in ops if op.kind != "gather"]
        first = next(i for i, op in enumerate(kept) if op.kind == "forward")
        kept[first] = dataclasses.replace(kept[first], comms=(*kept[first].comms, layout.shard(rank)))
        out[rank] = kept
    return out


@pytest.mark.parametrize(
    ("work", "found"),
    [
        (PIPELINE_COUNTEREXAMPLE, r"on cp\(0, 1\), operation 1 differs"),
        (PIPELINE_ACROSS_GROUPS, r"rank 2 waits in forward of microbatch 2 [^|]* on cp\(2, 3\) for rank 3 \(backward"),
    ],
)
def test_a_per_position_1f1b_deadlocks_where_one_order_does_not(work, found: str) -> None:
    layout = StepLayout(stages=2, pool=len(work))
    check_programs(step_programs(layout, work, StepOptions()))
    with pytest.raises(ScheduleError, match=found):
        check_programs(step_programs(layout, work, StepOptions(), order=per_position_order))


def test_gathers_at_a_ranks_first_forward_deadlock_where_gathers_at_the_start_do_not() -> None:
    layout = StepLayout(pool=4, sharding="zero2")
    programs = step_programs(layout, ZERO2_COUNTEREXAMPLE, StepOptions(units=3))
    check_programs(programs)
    assert [op.kind for op in programs[2][:5]] == ["check", "gather", "gather", "gather", "forward"]
    with pytest.raises(ScheduleError, match=r"shard\(0, 1, 2, 3\)"):
        check_programs(_gather_at_first_forward(layout, programs))


def test_the_checker_names_the_communicator_and_both_ranks() -> None:
    layout = StepLayout(pool=2)
    comm = Comm("cp", (0, 1))
    mine = [Op(kind="forward", comms=(comm,), calls=None, microbatch=0, tokens=4)]
    theirs = [Op(kind="forward", comms=(comm,), calls=None, microbatch=1, tokens=4)]
    with pytest.raises(ScheduleError, match=r"on cp\(0, 1\), operation 0 differs: rank 0 issues forward of "):
        check_programs({0: mine, 1: theirs})
    assert projection(mine, comm) == [(0, mine[0].signature(comm))]
    assert layout.world() == Comm("world", (0, 1))
