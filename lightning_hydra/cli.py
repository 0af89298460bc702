"""The ``lightning-hydra`` command (also ``python -m lightning_hydra``).

Training goes through Lightning's ``LightningCLI`` (``fit``, ``validate``, ``--config``, ``--print_config``); the
package adds its own subcommands::

    lightning-hydra fit --config recipes/cpu-demo.yaml      # LightningCLI: any HydraModule + HydraDataModule
    lightning-hydra demo                                     # fit with recipes/cpu-demo.yaml
    lightning-hydra compare                                  # static, mcore and hydra on the same data + dashboard
    lightning-hydra report runs/compare                      # render the dashboard of logged runs
    lightning-hydra plan --world-size 64 --context 32768     # print the plan of one global batch
    lightning-hydra simulate --config recipes/sim-512-32k.yaml --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from pathlib import Path

__all__ = ["main", "recipe_path"]

OWN_COMMANDS = ("demo", "compare", "report", "plan", "simulate")
RECIPES = Path(__file__).resolve().parent.parent / "recipes"
"""The repository's ``recipes/`` directory (an editable install, as the README's set-up makes)."""


def recipe_path(name: str) -> Path:
    """Path of a recipe given by file path or by name (``cpu-demo`` -> ``recipes/cpu-demo.yaml``)."""
    path = Path(name)
    if path.exists():
        return path
    candidate = RECIPES / (name if name.endswith(".yaml") else f"{name}.yaml")
    if candidate.exists():
        return candidate
    raise FileNotFoundError(f"no recipe {name!r} (looked for {path} and {candidate})")


def _lightning_cli(args: list[str]) -> int:
    from lightning.pytorch.cli import LightningCLI

    from lightning_hydra.data.datamodule import HydraDataModule
    from lightning_hydra.models.module import HydraModule

    with warnings.catch_warnings():
        # the arguments are sys.argv's own (or built from them): Lightning's "args and sys.argv" warning is noise
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        LightningCLI(
            HydraModule,
            HydraDataModule,
            subclass_mode_model=True,
            args=args,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
        )
    return 0


# ---------------------------------------------------------------------------------------------- own subcommands
def _demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-hydra demo",
        description="Train the CPU demo (recipes/cpu-demo.yaml); extra arguments go "
        "to LightningCLI, e.g. --trainer.max_steps=5",
    )
    parser.add_argument("--config", default="cpu-demo", help="recipe name or path (default cpu-demo)")
    args, rest = parser.parse_known_args(argv)
    return _lightning_cli(["fit", "--config", str(recipe_path(args.config)), *rest])


def _compare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-hydra compare",
        description="Run one recipe under several policies (same data and seed), then render one dashboard.",
    )
    parser.add_argument("--config", default="compare-policies", help="recipe name or path")
    parser.add_argument("--policies", nargs="+", default=["static", "mcore", "hydra"])
    parser.add_argument("--out", default="runs/compare", help="log directory of the runs and the dashboard")
    args, rest = parser.parse_known_args(argv)
    config = recipe_path(args.config)
    out = Path(args.out)
    for policy in args.policies:
        cmd = [
            sys.executable, "-m", "lightning_hydra", "fit", "--config", str(config),
            f"--trainer.strategy.init_args.policy={policy}",
            f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name={policy}",
            *rest,
        ]  # fmt: skip
        print(f"lightning-hydra compare: {' '.join(cmd[2:])}", flush=True)
        done = subprocess.run(cmd, check=False)
        if done.returncode:
            print(f"lightning-hydra compare: the {policy} run failed ({done.returncode})", file=sys.stderr)
            return done.returncode
    from lightning_hydra.report import render_report, summary_table

    latest = [max((out / p).glob("version_*"), key=lambda d: int(d.name.split("_")[1])) for p in args.policies]
    page = render_report(latest, out / "dashboard")
    for row in summary_table({p: _rows(d) for p, d in zip(args.policies, latest, strict=True)}):
        print(" | ".join(row))
    print(f"lightning-hydra compare: dashboard {page}")
    return 0


def _rows(run_dir: Path) -> list[dict]:
    from lightning_hydra.report import find_runs, load_run

    return load_run(find_runs([run_dir])[0])[1]


def _report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-hydra report", description="Render the dashboard of runs.")
    parser.add_argument("runs", nargs="+", help="run directories or hydra_steps.jsonl files (overlaid)")
    parser.add_argument("--out", default=None, help="output directory (default: <first run>/dashboard)")
    parser.add_argument("--steps", type=int, nargs="*", default=None, help="steps whose timeline to draw")
    args = parser.parse_args(argv)
    from lightning_hydra.report import render_report

    out = Path(args.out) if args.out else Path(args.runs[0]) / "dashboard"
    print(render_report(args.runs, out, steps=args.steps))
    return 0


def _plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-hydra plan", description="Plan one long-tailed global batch and print the plan."
    )
    parser.add_argument("--policy", default="hydra", choices=["hydra", "mcore", "static"])
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768, help="longest sequence")
    parser.add_argument("--capacity", type=int, default=None, help="tokens per rank per microbatch (default context/8)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--fill", type=float, default=0.75, help="share of the pool's tokens the batch fills")
    parser.add_argument("--lengths", default="lognormal", choices=["lognormal", "stdlib"])
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the plan's summary as JSON")
    args = parser.parse_args(argv)
    from lightning_hydra.bench.batches import make_batch
    from lightning_hydra.planner import CostModel, PlannerConfig

    capacity = args.capacity or max(1024, args.context // 8)
    lengths = make_batch(
        args.lengths, world_size=args.world_size, capacity=capacity, num_microbatches=args.microbatches,
        fill=args.fill, context=args.context, seed=args.seed,
    )  # fmt: skip
    cost = CostModel.for_transformer(args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads)
    config = PlannerConfig(
        policy=args.policy, max_tokens_per_rank=capacity, num_microbatches=args.microbatches,
        ranks_per_node=args.ranks_per_node,
    )  # fmt: skip
    plan = config.schedule(
        lengths, world_size=args.world_size, cost=cost, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        seed=args.seed,
    )  # fmt: skip
    loads = plan.loads(cost)
    per_rank = loads.sum(axis=0)
    summary = {
        "policy": args.policy,
        "sequences": int(lengths.size),
        "tokens": int(lengths.sum()),
        "longest": int(lengths.max()),
        "microbatches": plan.num_microbatches,
        "efficiency": plan.efficiency(cost),
        "predicted_max_over_mean": float(per_rank.max() / per_rank.mean()),
        "predicted_step_s": float(loads.max(axis=1).sum()),
        "degrees": {str(k): v for k, v in plan.degree_histogram().items()},
        "digest": plan.digest(),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for key, value in summary.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")
    for m, groups in enumerate(plan.microbatches):
        busy = [g for g in groups if g.seq_ids]
        print(
            f"microbatch {m}: {len(busy)} working groups, max load {loads[m].max():.3f} s, mean {loads[m].mean():.3f} s"
        )
        for g in sorted(busy, key=lambda g: -g.degree)[:6]:
            lens = sorted((int(lengths[i]) for i in g.seq_ids), reverse=True)
            print(f"    ranks {g.ranks[0]}..{g.ranks[-1]} u={g.ulysses} r={g.ring}: {len(lens)} seqs {lens[:5]}")
        if len(busy) > 6:
            print(f"    ... {len(busy) - 6} more groups")
    return 0


def _simulate(argv: list[str]) -> int:
    from lightning_hydra.sim.cli import main as simulate

    return simulate(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-hydra``: the package's subcommands, else ``LightningCLI``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Lightning 2.6 on torch 2.13 warns once per process about a deprecated pytree class; it is not actionable here
    warnings.filterwarnings("ignore", message=".*treespec, LeafSpec.*")
    if argv and argv[0] in OWN_COMMANDS:
        command = {"demo": _demo, "compare": _compare, "report": _report, "plan": _plan, "simulate": _simulate}
        return command[argv[0]](argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
    return _lightning_cli(argv)
