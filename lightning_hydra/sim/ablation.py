"""Ablation in the simulator: {scheduler: mcore, hydra} x {engine: ring only, Ulysses in ring}, beside the paper.

    python -m lightning_hydra.sim.ablation [--steps N] [--markdown FILE]

Megatron-Core's Dynamic-CP hands each microbatch's CP group to Transformer Engine's ``DotProductAttention``
(``TEDotProductAttention.forward`` calls ``set_context_parallel_group`` with the group from ``PackedSeqParams`` and
its ``cp_comm_type``, ``"p2p"`` by default), and for packed THD input Transformer Engine supports only the P2P
ring (its tests skip ``all_gather`` and every ``a2a`` type for THD: "does not support THD format yet"). So the
paper's baseline engine is a ring over the whole group with no Ulysses level (``engine: te-p2p`` in the
simulator, plans made with ``max_ulysses=1``); ours nests Ulysses inside a shallow ring (``engine: hydra``).

For each scenario recipe (``sim-512-32k``, ``sim-512-256k``, ``sim-2048-256k-pp``) every combination is simulated
on the same batches with the closed loop on, and throughput is reported relative to (mcore, te-p2p): the published
comparison is HyDra (hydra scheduler, Ulysses-in-ring engine) against Mcore DCP (mcore scheduler, TE ring).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from lightning_hydra.recipes import recipe_path
from lightning_hydra.sim.scenario import load_scenario
from lightning_hydra.sim.simulate import simulate

__all__ = ["PUBLISHED", "SCENARIOS", "main", "run"]

SCENARIOS = ("sim-512-32k", "sim-512-256k", "sim-2048-256k-pp")
"""Scenario recipes of the ablation (the published testbeds)."""
PUBLISHED = {
    "sim-512-32k": "1.18x over Mcore DCP (512 GPUs, 32K, average)",
    "sim-512-256k": "2.48x over Mcore DCP (512 GPUs, 256K, average)",
    "sim-2048-256k-pp": "1.10-1.43x (avg 1.25x) over Mcore DCP; pipeline bubble 36% -> 14% (2,048 GPUs)",
}
"""The paper's figures (abstract), for the table."""
ENGINES = ("te-p2p", "hydra")
POLICIES = ("mcore", "hydra")


def run(recipe: str, steps: int | None) -> dict[str, Any]:
    """Every (scheduler, engine) of one scenario on the same batches."""
    base = load_scenario(recipe_path(recipe), steps=steps)
    out: dict[str, Any] = {"scenario": recipe, "name": base.name, "published": PUBLISHED[recipe], "runs": {}}
    for engine in ENGINES:
        scenario = dataclasses.replace(base, engine=engine, policies=list(POLICIES))
        result = simulate(scenario)
        for policy, summary in result["policies"].items():
            out["runs"][f"{policy}/{engine}"] = {
                k: summary[k] for k in ("tokens_per_s", "tokens_per_s_uncalibrated", "bubble_pp", "bubble_dp")
                if k in summary
            }  # fmt: skip
    baseline = out["runs"]["mcore/te-p2p"]["tokens_per_s"]
    for run_ in out["runs"].values():
        run_["over_mcore_te_p2p"] = round(run_["tokens_per_s"] / baseline, 3)
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    """The docs' table (docs/benchmarks.md): throughput relative to (mcore, te-p2p), pipeline bubble, and the
    paper's figure."""
    lines = [
        "| scenario | mcore + TE ring | mcore + Ulysses-in-ring | hydra + TE ring | hydra + Ulysses-in-ring "
        "| bubble_pp mcore+ring -> hydra+nested | published |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        runs = r["runs"]
        cells = [
            f"{runs[k]['over_mcore_te_p2p']:.2f}x"
            for k in ("mcore/te-p2p", "mcore/hydra", "hydra/te-p2p", "hydra/hydra")
        ]
        bubble = f"{runs['mcore/te-p2p']['bubble_pp']:.1%} -> {runs['hydra/hydra']['bubble_pp']:.1%}"
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {bubble} | {r['published']} |")
    return "\n".join(lines) + "\n"  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--steps", type=int, default=None, help="override the recipes' number of global batches")
    parser.add_argument("--markdown", default=None, help="write the docs' table (markdown) to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = []
    for recipe in args.scenarios:
        results.append(run(recipe, args.steps))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"seconds": round(time.perf_counter() - start, 1)}))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
