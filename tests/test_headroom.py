"""The placement-headroom benchmark's search (issue 58): it keeps a plan valid and never makes it slower."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from lightning_hydra.bench import headroom
from lightning_hydra.bench.robust import LLAMA_8B, cell_batches, efficiency, plan_batch
from lightning_hydra.bench.schedule import analytic_cost
from lightning_hydra.planner.plan import Group, Plan
from lightning_hydra.sim.family import truth


def _shape(plan: Plan) -> list[list[tuple[tuple[int, ...], int, int]]]:
    return [[(g.ranks, g.ulysses, g.ring) for g in mb] for mb in plan.microbatches]


def _sequences(plan: Plan) -> Counter:
    return Counter(i for mb in plan.microbatches for g in mb for i in g.seq_ids)


def test_a_sequence_piled_on_one_rank_moves_to_the_idle_one():
    plan = Plan(
        lengths=(2000, 2000), world_size=2, ranks_per_node=2,
        microbatches=[[Group((0,), 1, 1, (0, 1)), Group((1,), 1, 1, ())]],
    )  # fmt: skip
    hw = truth("base", 32)
    better, kept = headroom.improve(plan, hw, 4096)
    assert kept == 1
    assert sorted(len(g.seq_ids) for g in better.microbatches[0]) == [1, 1]
    (before, _), (after, times) = efficiency(plan, hw), efficiency(better, hw)
    assert times[0, 0] == times[0, 1] and after > 1.5 * before  # the two ranks even (a rank's fixed cost stays)


def test_the_search_keeps_groups_and_every_sequence_once_and_is_never_slower():
    world, context = 16, "32K"
    hw = truth("base", 32)
    lengths = cell_batches("lognormal", world, context, range(1000, 1001))[0]
    for policy in ("mcore", "static"):
        plan, _ = plan_batch(lengths, policy, analytic_cost(LLAMA_8B), world, context)
        better, kept = headroom.improve(plan, hw, 4096, moves=30)
        better.check(list(lengths), 4096)
        assert _shape(better) == _shape(plan)  # ranks and degrees kept
        assert _sequences(better) == Counter(range(len(lengths)))  # every sequence once
        assert efficiency(better, hw)[0] >= efficiency(plan, hw)[0]
        again, kept_again = headroom.improve(plan, hw, 4096, moves=30)
        assert (again.digest(), kept_again) == (better.digest(), kept)  # deterministic


def test_the_command_prints_a_cell_and_a_summary(capsys):
    assert headroom.main(["--world-sizes", "16", "--contexts", "32K", "--distributions", "lognormal",
                          "--truths", "base", "--moves", "5"]) == 0  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cell, summary = lines
    assert cell["world_size"] == 16 and 0 < cell["ceiling"] <= 1
    for policy in ("hydra", "mcore"):
        row = cell[policy]
        assert 0 < row["of_ceiling"] <= row["searched_of_ceiling"] <= 1 and row["gain"] >= 1
    assert summary["summary"]["plans"] == 2 and np.isfinite(summary["summary"]["largest_gain"])
