"""The formation-family benchmark (issue 58): every recipe is a valid plan, and its figures order as they must."""

from __future__ import annotations

import json

from lightning_hydra.bench import reach
from lightning_hydra.bench.robust import cell_batches, plan_request
from lightning_hydra.bench.schedule import llama8b_cost


def test_every_recipe_is_a_valid_plan_of_the_whole_batch():
    lengths = cell_batches("lognormal", 16, "32K", range(1000, 1001))[0]
    req = plan_request(lengths, llama8b_cost(), 16, "32K")
    plans = reach.family(req)
    recipes = 3 * (1 + len(reach.FAMILY_LIFTS)) * 3 * 2  # degree sets x degrees x microbatch counts x balance
    assert len(plans) >= recipes and {"pow2/memory/x1/m8", "fine/load/x1.1/m7/bal", "node/load/x2/m6"} <= set(plans)
    for plan in plans.values():
        plan.check(req.lengths.tolist(), req.capacity)


def test_hydra_is_within_the_best_within_zero_waiting_within_the_ceiling(capsys):
    args = ["--world-sizes", "16", "--distributions", "lognormal", "--truths", "base", "--batches", "1"]
    assert reach.main(args) == 0
    cell, summary = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (cell["world_size"], cell["distribution"], summary["summary"]["cells"]) == (16, "lognormal", 1)
    # hydra's choice and Megatron's plan are in the family; a plan without waiting is no slower; the ceiling bounds all
    assert 0 < cell["hydra"] <= cell["best"] <= cell["zero_waiting"] <= 1
    assert cell["mcore"] <= cell["best"] and cell["best_over_mcore"] >= 1
    assert cell["plans_per_batch"][0] >= 3 * 8 * 3 * 2 and len(cell["best_plans"]) == 1
    assert summary["summary"]["hydra_of_best_min"] == round(cell["hydra"] / cell["best"], 4)
    assert summary["summary"]["zero_waiting_below_target"] == int(cell["zero_waiting"] < 0.96)
