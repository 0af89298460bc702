"""The ``lightning-hydra`` command (also ``python -m lightning_hydra``).

Training goes through Lightning's ``LightningCLI`` (``fit``, ``validate``); the package adds its own subcommands::

    lightning-hydra fit --config recipes/cpu-demo.yaml      # LightningCLI: any HydraModule + HydraDataModule
    lightning-hydra demo                                     # fit with recipes/cpu-demo.yaml
    lightning-hydra compare                                  # static, mcore and hydra on the same data + dashboard
    lightning-hydra report runs/compare                      # render the dashboard of logged runs
    lightning-hydra plan --world-size 64 --context 32768     # print the plan of one global batch
    lightning-hydra simulate --config recipes/sim-512-32k.yaml --json
    lightning-hydra export runs/ckpt/last.ckpt out/model --dtype bf16   # a checkpoint as a Hugging Face directory

An error is printed as one line naming the problem, once (from global rank 0 when every rank found it, from the
rank that found it otherwise); ``--traceback`` prints every rank's full traceback instead, under a line naming the
rank (:func:`lightning_hydra.cli_errors.report_error`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_hydra.cli_errors import argument_reason, current_rank, report_error
from lightning_hydra.recipes import RECIPES, recipe_path

__all__ = ["COMMANDS", "RECIPES", "main", "recipe_path", "run"]

COMMANDS = {
    "fit": "train a HydraModule on a HydraDataModule (LightningCLI: --config, --trainer.*, --model.*, --data.*)",
    "validate": "run the validation loop of a configured model and data (LightningCLI)",
    "demo": "train the CPU demo: fit with recipes/cpu-demo.yaml (what `make demo` runs)",
    "compare": "run one recipe under the static, mcore and hydra policies on the same batches, then one dashboard",
    "report": "render the dashboard (HTML with inlined PNGs) of logged runs",
    "plan": "plan one long-tailed global batch and print groups, degrees, predicted balance and efficiency",
    "simulate": "the cluster-scale simulator: real planner, simulated hardware (recipes/sim-*.yaml)",
    "prepare": "tokenize text (jsonl, parquet, plain files) into Megatron indexed token files (.bin/.idx)",
    "export": "write a checkpoint (any layout, any world size) as a Hugging Face model directory (safetensors)",
}
"""The subcommands and what each does."""

_TRAINING = ("fit", "validate")

USAGE = f"""usage: lightning-hydra [--traceback] COMMAND [ARGS ...]

Load-driven dynamic context parallelism (HyDra) for PyTorch Lightning.

commands:
{chr(10).join(f"  {name:<10} {text}" for name, text in COMMANDS.items())}

options:
  -h, --help   show this message
  --traceback  print the full traceback of an error (default: one line naming the problem)

`lightning-hydra COMMAND --help` shows a command's options (for fit: every --trainer.*, --model.*, --data.* option
with its description; `lightning-hydra fit --trainer.strategy.help lightning_hydra.HydraStrategy` the strategy's)."""


# ---------------------------------------------------------------------------------------------- argument types
def _bounded(kind: Callable[[str], Any], low: float | None, high: float | None, *, low_open: bool = False) -> Any:
    """An argparse type: ``kind(text)`` within ``[low, high]`` (``low`` excluded when ``low_open``)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high) or value != value:
            bounds = [f"> {low:,}" if low_open else f">= {low:,}"] if low is not None else []
            bounds += [f"<= {high:,}"] if high is not None else []
            raise argparse.ArgumentTypeError(f"{value} is out of range: allowed {' and '.join(bounds)}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"lightning-hydra {name}", description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


# ---------------------------------------------------------------------------------------------- training commands
def _lightning_cli(args: list[str]) -> int:
    from lightning.pytorch.cli import LightningCLI

    from lightning_hydra.data.datamodule import HydraDataModule
    from lightning_hydra.models.module import HydraModule

    class HydraCLI(LightningCLI):
        """``LightningCLI`` offering only what a ``HydraModule`` implements (``fit`` and ``validate``)."""

        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            """``fit`` and ``validate`` (``test`` and ``predict`` need steps a HydraModule does not define)."""
            return {name: spec for name, spec in LightningCLI.subcommands().items() if name in _TRAINING}

    with warnings.catch_warnings():
        # the arguments are sys.argv's own (or built from them): Lightning's "args and sys.argv" warning is noise
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        HydraCLI(
            HydraModule,
            HydraDataModule,
            subclass_mode_model=True,
            args=args,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            parser_kwargs={
                "prog": "lightning-hydra",
                "description": "train with dynamic context parallelism (HyDra)",
                "exit_on_error": False,
            },
        )
    return 0


def _demo(argv: list[str]) -> int:
    parser = _parser(
        "demo", "Train the CPU demo (recipes/cpu-demo.yaml); other arguments go to `fit`, e.g. --trainer.max_steps=5"
    )
    parser.add_argument("--config", default="cpu-demo", help="recipe name or path")
    args, rest = parser.parse_known_args(argv)
    return _lightning_cli(["fit", "--config", str(recipe_path(args.config)), *rest])


def _compare(argv: list[str]) -> int:
    from lightning_hydra.planner import POLICIES

    parser = _parser(
        "compare",
        "Run one recipe under several policies (same data and seed), one after the other, then render one "
        "dashboard of all runs. Other arguments go to every `fit`, e.g. --trainer.max_steps=5.",
    )
    parser.add_argument("--config", default="compare-policies", help="recipe name or path")
    parser.add_argument("--policies", nargs="+", default=["static", "mcore", "hydra"], choices=sorted(POLICIES))
    parser.add_argument("--out", default="runs/compare", help="log directory of the runs and the dashboard")
    args, rest = parser.parse_known_args(argv)
    config = recipe_path(args.config)
    out = Path(args.out)
    for k, policy in enumerate(args.policies, 1):
        cmd = [
            sys.executable, "-m", "lightning_hydra", "fit", "--config", str(config),
            f"--trainer.strategy.init_args.policy={policy}",
            f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name={policy}",
            *rest,
        ]  # fmt: skip
        print(
            f"lightning-hydra compare: run {k}/{len(args.policies)}, policy {policy}: {' '.join(cmd[2:])}", flush=True
        )
        done = subprocess.run(cmd, check=False)
        if done.returncode:  # the run printed its own error
            print(f"lightning-hydra compare: the {policy} run failed (exit status {done.returncode})", file=sys.stderr)
            return done.returncode
    from lightning_hydra.report import SUMMARY_LEGEND, render_report, summary_table

    latest = [max((out / p).glob("version_*"), key=lambda d: int(d.name.split("_")[1])) for p in args.policies]
    page = render_report(latest, out / "dashboard")
    _print_table(summary_table({p: _rows(d) for p, d in zip(args.policies, latest, strict=True)}))
    print("medians over each run's steps:")
    for column, meaning in SUMMARY_LEGEND:
        print(f"  {column}: {meaning}")
    print(f"lightning-hydra compare: dashboard {page}")
    return 0


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print(
            " | ".join(
                cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def _rows(run_dir: Path) -> list[dict]:
    from lightning_hydra.report import find_runs, load_run

    return load_run(find_runs([run_dir])[0])[1]


def _report(argv: list[str]) -> int:
    parser = _parser("report", "Render the dashboard of runs (one HTML page with inlined PNGs).")
    parser.add_argument("runs", nargs="+", help="run directories or hydra_steps.jsonl files (overlaid)")
    parser.add_argument("--out", default=None, help="output directory (default: <first run>/dashboard)")
    parser.add_argument(
        "--steps", type=_bounded(int, 0, None), nargs="*", default=None, help="steps whose timeline to draw"
    )
    args = parser.parse_args(argv)
    from lightning_hydra.report import render_report

    out = Path(args.out) if args.out else Path(args.runs[0]) / "dashboard"
    print(render_report(args.runs, out, steps=args.steps))
    return 0


# ---------------------------------------------------------------------------------------------- plan
MAX_PLAN_SEQUENCES = 500_000
"""Largest global batch (in sequences) ``plan`` draws and plans without ``--no-limit``."""
MAX_MCORE_SCANS = 150_000_000
"""Largest ``sequences x ranks`` ``plan --policy mcore`` runs without ``--no-limit`` (its whole-pool scans: about
2 minutes here; 2,048 ranks x 18,000 sequences took 28 s)."""

_POLICY_TEXT = {
    "hydra": "load-driven: every sequence's CP degree balances predicted time against one target per microbatch",
    "mcore": "Megatron-Core Dynamic-CP: memory-sized power-of-two degrees, packed until ranks are full",
    "static": "one CP degree for every sequence, sized for the longest allowed one",
}

PLAN_LEGEND = """legend:
  group       ranks that process some sequences together in one microbatch; every sequence of the group is split
              over all its ranks (context parallelism). "ranks 8-15" is a group of 8 ranks.
  degree d    the number of ranks of a group: d = u x r, with u Ulysses ranks (all-to-all over attention heads,
              inside one node) and r ring ranks (key/value blocks passed around, across nodes)
  load        the cost model's predicted time of one rank in one microbatch (compute + exposed communication)
  efficiency  (useful compute / ranks) / sum over microbatches of the slowest rank's load; 1.0 means no rank
              ever waits and no communication is exposed
  max/mean    the busiest rank's total predicted time over the mean rank's (1.0 is perfect balance)"""


def _plan_parser() -> argparse.ArgumentParser:
    from lightning_hydra.bench.batches import DISTRIBUTIONS
    from lightning_hydra.models.checkpointing import CHECKPOINTING_MODES
    from lightning_hydra.planner import POLICIES
    from lightning_hydra.planner.memory import MEMORY_PRECISIONS, SHARDING_MODES

    parser = _parser(
        "plan",
        "Draw one long-tailed global batch sized to fill the pool, plan it with a policy and print the plan: "
        "groups, CP degrees, predicted loads, balance and efficiency. Times are predictions of an analytic cost "
        "model of the given transformer shape (default: Llama-3-8B) at 400 TFLOP/s, not measurements.",
    )
    pos = _bounded(int, 1, None)
    parser.add_argument("--policy", default="hydra", choices=sorted(POLICIES), help="planning policy")
    parser.add_argument("--world-size", type=_bounded(int, 1, 65536), default=64, help="ranks in the pool")
    parser.add_argument("--ranks-per-node", type=_bounded(int, 1, 1024), default=8, help="ranks (GPUs) per node")
    parser.add_argument("--context", type=_bounded(int, 16, 1 << 24), default=32768, help="longest sequence")
    parser.add_argument(
        "--capacity", type=_bounded(int, 16, 1 << 24), default=None,
        help="tokens per rank per microbatch (max_tokens_per_rank; default: max(1024, context / 8))",
    )  # fmt: skip
    parser.add_argument("--microbatches", type=_bounded(int, 1, 1024), default=4, help="microbatches per step")
    parser.add_argument(
        "--fill", type=_bounded(float, 0.0, 1.0, low_open=True), default=0.75,
        help="share of the pool's tokens (ranks x capacity x microbatches) the batch fills",
    )  # fmt: skip
    parser.add_argument("--lengths", default="lognormal", choices=sorted(DISTRIBUTIONS), help="length distribution")
    parser.add_argument("--hidden-size", type=pos, default=4096, help="model width")
    parser.add_argument("--num-layers", type=pos, default=32, help="transformer blocks")
    parser.add_argument("--num-heads", type=pos, default=32, help="attention heads")
    parser.add_argument("--num-kv-heads", type=pos, default=8, help="key/value heads (GQA)")
    parser.add_argument("--ffn-size", type=pos, default=14336, help="MLP width (with --memory)")
    parser.add_argument("--vocab-size", type=pos, default=128256, help="vocabulary (with --memory)")
    parser.add_argument(
        "--pipeline-stages", type=_bounded(int, 1, 1024), default=1,
        help="pipeline stages the microbatches flow through (the pool is one stage's ranks)",
    )  # fmt: skip
    parser.add_argument(
        "--tensor-parallel", type=_bounded(int, 1, 1024), default=1,
        help="TP degree inside a node: each pool rank (--world-size) is a TP group of this many GPUs, which splits "
        "the heads, the projections and most activations (HydraStrategy(tensor_parallel=...))",
    )  # fmt: skip
    parser.add_argument(
        "--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
        help="under --tensor-parallel, the norms and the residual stream split by tokens over the TP group (their "
        "activations 1/T per rank; HydraStrategy(sequence_parallel=...)); default on when --tensor-parallel > 1",
    )  # fmt: skip
    memory = parser.add_argument_group(
        "memory", "with --memory, the memory model sizes the capacity (max_tokens_per_rank='auto' does the same)"
    )
    memory.add_argument(
        "--memory", default=None, metavar="BYTES",
        help="per-rank memory budget, e.g. 80GB or 141GB: print what model state, communicators, margin and "
        "activations take, a capacity table of every sharding and checkpointing mode, and plan at the capacity "
        "left (unless --capacity is given)",
    )  # fmt: skip
    memory.add_argument("--sharding", default="zero3", choices=SHARDING_MODES, help="sharded training state")
    memory.add_argument(
        "--checkpointing", default="selective", choices=CHECKPOINTING_MODES, help="activation checkpointing"
    )
    memory.add_argument("--precision", default="bf16-mixed", choices=MEMORY_PRECISIONS, help="Trainer precision")
    memory.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"), help="optimizer state kept")
    parser.add_argument("--seed", type=_bounded(int, 0, None), default=0, help="seed of the batch and the planner")
    parser.add_argument("--json", action="store_true", help="print the plan's summary as JSON")
    parser.add_argument(
        "--no-limit", action="store_true",
        help=f"plan batches over {MAX_PLAN_SEQUENCES:,} sequences (or mcore over {MAX_MCORE_SCANS:.1e} "
        "sequence x rank scans), which take minutes to hours",
    )  # fmt: skip
    return parser


def _plan(argv: list[str]) -> int:
    parser = _plan_parser()
    args = parser.parse_args(argv)
    import numpy as np

    from lightning_hydra.bench.batches import DISTRIBUTIONS, make_batch
    from lightning_hydra.console import progress
    from lightning_hydra.planner import CostModel, PlannerConfig
    from lightning_hydra.strategy.layout import check_pool

    if args.num_heads % args.num_kv_heads:
        parser.error(f"--num-heads {args.num_heads} is not a multiple of --num-kv-heads {args.num_kv_heads}")
    if args.hidden_size % args.num_heads:
        parser.error(f"--hidden-size {args.hidden_size} is not a multiple of --num-heads {args.num_heads}")
    node = _tensor_node(parser, args)  # pool ranks (TP groups) per node
    check_pool(args.world_size, node)
    sized, table = _memory(parser, args) if args.memory is not None else (None, None)
    if args.capacity:
        capacity = args.capacity
    elif sized is not None:
        capacity = sized.capacity
    else:
        capacity = max(1024, args.context // 8)
    budget = args.fill * args.world_size * capacity * args.microbatches
    sample = DISTRIBUTIONS[args.lengths](np.random.default_rng(args.seed), 4096, args.context)
    expected = budget / float(sample.mean())
    if not args.no_limit and expected > MAX_PLAN_SEQUENCES:
        parser.error(
            f"this batch would hold about {expected:,.0f} sequences (limit {MAX_PLAN_SEQUENCES:,}): lower "
            "--world-size, --microbatches, --capacity or --fill, raise --context, or pass --no-limit"
        )
    if not args.no_limit and args.policy == "mcore" and expected * args.world_size > MAX_MCORE_SCANS:
        parser.error(
            f"mcore scans the whole pool for every sequence: about {expected:,.0f} sequences x {args.world_size:,} "
            f"ranks, over the limit of {MAX_MCORE_SCANS:.1e} (minutes of planning); lower --world-size or --fill, "
            "or pass --no-limit"
        )
    lengths = make_batch(
        args.lengths, world_size=args.world_size, capacity=capacity, num_microbatches=args.microbatches,
        fill=args.fill, context=args.context, seed=args.seed,
    )  # fmt: skip
    if lengths.size == 0:
        parser.error(f"--fill {args.fill} of the pool holds no sequence: raise --fill or --capacity")
    tp = args.tensor_parallel
    cost = CostModel.for_transformer(
        args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, ranks_per_node=node, tensor_parallel=tp,
        sequence_parallel=_sequence_parallel(args),
    )  # fmt: skip
    config = PlannerConfig(
        policy=args.policy, max_tokens_per_rank=capacity, num_microbatches=args.microbatches,
        ranks_per_node=node, pipeline_stages=args.pipeline_stages,
    )  # fmt: skip
    label = (
        f"lightning-hydra plan: planning {lengths.size:,} sequences ({int(lengths.sum()):,} tokens) on "
        f"{args.world_size:,} {_unit(args)} with {args.policy}"
    )
    with progress(label, every=10.0):
        plan = config.schedule(
            lengths, world_size=args.world_size, cost=cost, num_heads=args.num_heads // tp,
            num_kv_heads=args.num_kv_heads // tp, seed=args.seed,
        )  # fmt: skip
    loads = plan.loads(cost)
    per_rank = loads.sum(axis=0)
    summary = {
        "policy": args.policy,
        "sequences": int(lengths.size),
        "tokens": int(lengths.sum()),
        "longest": int(lengths.max()),
        "microbatches_asked": args.microbatches,
        "microbatches": plan.num_microbatches,
        "efficiency": plan.efficiency(cost),
        "predicted_max_over_mean": float(per_rank.max() / per_rank.mean()),
        "predicted_step_s": float(loads.max(axis=1).sum()),
        "degrees": {str(k): v for k, v in plan.degree_histogram().items()},
        "digest": plan.digest(),
    }
    if sized is not None:
        summary["memory"] = {
            "budget_bytes": sized.budget,
            "state_bytes": sized.state,
            "communicator_bytes": sized.communicators,
            "margin_bytes": sized.margin,
            "activation_bytes_per_token": sized.per_token["total"],
            "capacity": sized.capacity,
            "capacities": table,
        }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_plan(args, capacity, lengths, plan, loads, summary)
    return 0


def _tensor_node(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Pool ranks per node under ``--tensor-parallel`` (a parser error, one line, when TP cannot lay it out)."""
    from lightning_hydra.strategy.tensor import check_tensor_parallel

    tp = args.tensor_parallel
    try:
        check_tensor_parallel(
            tp, world=args.world_size * tp, ranks_per_node=args.ranks_per_node, heads=args.num_heads,
            kv_heads=args.num_kv_heads,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(f"--tensor-parallel: {exc}")
    return args.ranks_per_node // tp


def _memory_shape(args: argparse.Namespace) -> Any:
    from lightning_hydra.planner.memory import ModelMemoryShape

    return ModelMemoryShape.for_decoder(
        args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.ffn_size, args.vocab_size
    )


def _sized(args: argparse.Namespace, sharding: str, checkpointing: str) -> Any:
    from lightning_hydra.planner.memory import memory_capacity, parse_bytes

    return memory_capacity(
        _memory_shape(args), budget=float(parse_bytes(args.memory)), sharding=sharding, precision=args.precision,
        checkpointing=checkpointing, world_size=args.world_size,
        ranks_per_node=min(args.ranks_per_node // args.tensor_parallel, args.world_size),
        num_microbatches=args.microbatches, optimizer=args.optimizer,
        pipeline_stages=args.pipeline_stages, tensor_parallel=args.tensor_parallel,
        sequence_parallel=_sequence_parallel(args),
    )  # fmt: skip


def _sequence_parallel(args: argparse.Namespace) -> bool:
    """``--sequence-parallel`` resolved as ``HydraStrategy`` does: on when ``--tensor-parallel > 1`` unless
    ``--no-sequence-parallel``."""
    return args.tensor_parallel > 1 and args.sequence_parallel is not False


def _capacity_table(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Capacity of every sharding x checkpointing mode at the given budget (tokens per rank; 0: does not fit)."""
    from lightning_hydra.models.checkpointing import CHECKPOINTING_MODES
    from lightning_hydra.planner.memory import SHARDING_MODES

    return {
        sharding: {mode: _sized(args, sharding, mode).capacity for mode in CHECKPOINTING_MODES}
        for sharding in SHARDING_MODES
    }


def _memory(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Any, dict[str, dict[str, int]]]:
    """The memory model's breakdown for ``--memory`` and the capacity table of every mode; printed unless
    ``--json``; an error when nothing fits."""
    try:
        sized = _sized(args, args.sharding, args.checkpointing)
    except ValueError as exc:
        parser.error(f"--memory: {exc}")
    table = _capacity_table(args)
    shape = _memory_shape(args)
    if not args.json:
        from lightning_hydra.models.checkpointing import CHECKPOINTING_MODES

        print(
            f"memory per rank ({shape.num_params / 1e9:.2f}B parameters, {args.precision}, {args.optimizer}, "
            f"sharding {args.sharding} over the pool's {args.world_size:,} {_unit(args)}, {args.checkpointing} "
            f"activation checkpointing, {args.pipeline_stages} pipeline stage{'s' * (args.pipeline_stages > 1)}"
            + (f", tensor parallel {args.tensor_parallel} (a position: a TP group)" if args.tensor_parallel > 1 else "")
            + (", sequence-parallel norms" if _sequence_parallel(args) else "")
            + "; "
            "lightning_hydra.planner.memory, an estimate not yet checked on a GPU):"
        )
        print("\n".join(f"  {line}" for line in sized.lines()))
        print(f"  (unsharded: {_UNSHARDED[args.sharding]})")
        print(f"capacity (tokens per rank) of every mode at {args.memory}:")
        print(f"  {'sharding':<10}" + "".join(f"{'ckpt ' + mode:>18}" for mode in CHECKPOINTING_MODES))
        for sharding, row in table.items():
            print(f"  {sharding:<10}" + "".join(f"{row[mode]:>18,}" for mode in CHECKPOINTING_MODES))
        print()
    if sized.capacity < 16 and not args.capacity:
        parser.error(
            f"with {args.memory} per rank the model state leaves no room for activations under sharding "
            f"{args.sharding} ({sized.capacity} tokens): shard it (--sharding zero3), checkpoint activations, "
            "use more ranks or pipeline stages"
        )
    return sized, table


def _print_plan(args: argparse.Namespace, capacity: int, lengths: Any, plan: Any, loads: Any, summary: dict) -> None:
    from lightning_hydra.strategy.layout import RunLayout

    defaults = vars(_plan_parser().parse_args([]))

    def given(*names: str) -> str:
        return " (given)" if any(defaults.get(n) != getattr(args, n) for n in names) else ""

    print("settings (defaults unless marked; `lightning-hydra plan --help` describes each option):")
    layout = RunLayout(
        args.world_size * args.tensor_parallel * args.pipeline_stages, args.tensor_parallel, args.pipeline_stages,
        args.ranks_per_node,
    )  # fmt: skip
    tp = args.tensor_parallel
    print(f"  layout         {layout.describe('GPUs')}{given('tensor_parallel', 'pipeline_stages', 'ranks_per_node')}")
    per_node = max(1, min(args.ranks_per_node // tp, args.world_size))
    groups = f": each a TP group of {tp} GPUs" if tp > 1 else ""
    stage = " (one stage's)" if args.pipeline_stages > 1 else ""
    print(f"  pool{stage:<11}{args.world_size:,} {_unit(args)}{given('world_size')}, {per_node} per node{groups}: "
          "what context parallelism is planned over (DP x CP; --world-size)")  # fmt: skip
    if args.capacity:
        capacity_note = " (given)"
    elif args.memory is not None:
        capacity_note = f" (the memory model at {args.memory})"
    else:
        capacity_note = " (max(1024, context / 8))"
    print(f"  capacity       {capacity:,} tokens per rank per microbatch{capacity_note}")
    print(f"  batch          {args.lengths} lengths{given('lengths')} up to {args.context:,} tokens{given('context')}, "
          f"filling {args.fill:g} of the pool{given('fill')} over {args.microbatches} microbatches"
          f"{given('microbatches')}, seed {args.seed}{given('seed')}")  # fmt: skip
    print(f"  model          hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads} heads, "
          f"{args.num_kv_heads} KV heads{given('hidden_size', 'num_layers', 'num_heads', 'num_kv_heads')}; "
          "cost model at 400 TFLOP/s (assumed)")  # fmt: skip
    print(f"  policy         {args.policy}{given('policy')}: {_POLICY_TEXT[args.policy]}")
    print()
    asked, made = args.microbatches, plan.num_microbatches
    if made == asked:
        micro = f"{made}"
    elif args.policy == "mcore":
        micro = f"{made} ({asked} asked: mcore, like Megatron's scheduler, packs ranks to capacity and makes as many "
        micro += "microbatches as its packing needs)"
    elif made < asked:
        micro = f"{made} ({asked} asked: hydra kept a candidate with fewer, fuller microbatches, predicted faster)"
    else:
        micro = f"{made} ({asked} asked: what did not fit spilled into more)"
    degrees = ", ".join(f"d={d}: {n:,}" for d, n in plan.degree_histogram().items())
    rows = (
        ("sequences", f"{summary['sequences']:,} ({summary['tokens']:,} tokens, longest {summary['longest']:,})"),
        ("microbatches", micro),
        ("efficiency", f"{summary['efficiency']:.3f} (predicted; 1.0 is perfect)"),
        ("max/mean", f"{summary['predicted_max_over_mean']:.3f} (predicted busy time, busiest rank / mean rank)"),
        ("step time", f"{summary['predicted_step_s']:.3f} s (predicted: sum over microbatches of the slowest rank)"),
        ("degrees", f"sequences per CP degree: {degrees}"),
        ("digest", summary["digest"]),
    )
    for key, value in rows:
        print(f"{key:>14}  {value}")
    for m, groups in enumerate(plan.microbatches):
        busy = [g for g in groups if g.seq_ids]
        print(
            f"microbatch {m}: {len(busy)} working groups; predicted load per rank: slowest {loads[m].max():.3f} s, "
            f"mean {loads[m].mean():.3f} s"
        )
        for g in sorted(busy, key=lambda g: -g.degree)[:6]:
            lens = sorted((int(lengths[i]) for i in g.seq_ids), reverse=True)
            unit = "position" if args.tensor_parallel > 1 else "rank"  # a position is a TP group
            ranks = f"{unit} {g.ranks[0]}" if len(g.ranks) == 1 else f"{unit}s {g.ranks[0]}-{g.ranks[-1]}"
            shown = ", ".join(f"{x:,}" for x in lens[:5]) + (", ..." if len(lens) > 5 else "")
            print(
                f"    {ranks}: degree {g.degree} = {g.ulysses} Ulysses x {g.ring} ring, {len(lens)} "
                f"sequence{'s' * (len(lens) > 1)} ({shown} tokens)"
            )
        if len(busy) > 6:
            print(f"    ... {len(busy) - 6} more groups")
    print(PLAN_LEGEND)
    if args.tensor_parallel > 1:
        print(
            f"  position    under --tensor-parallel {args.tensor_parallel}, what a group's members and the loads "
            f"are counted in: a TP group of {args.tensor_parallel} GPUs\n"
            "              holding the same tokens (position i is GPUs i x T to i x T + T - 1 of its stage)"
        )


def _unit(args: argparse.Namespace) -> str:
    """What the pool counts: ranks, or under ``--tensor-parallel`` positions (TP groups)."""
    return "positions" if args.tensor_parallel > 1 else "ranks"


_UNSHARDED = {
    "none": "a replica's parameters are whole anyway; under bf16-mixed, autocast's bf16 copies of them",
    "zero2": "what a step holds whole beside the shards: the stage's parameters gathered in compute precision and "
    "their whole gradients, accumulated over the microbatches before the one reduce-scatter",
    "zero3": "what a step holds whole beside the shards: the root's parameters (embedding, head) and two blocks at "
    "a time (the current one and the prefetched one), in compute precision, with their gradients",
    "hsdp": "what a step holds whole beside the shards: the stage's parameters gathered in compute precision and "
    "their whole gradients, accumulated over the microbatches before the one reduce-scatter",
}
"""What the memory breakdown's ``unsharded`` line holds, by sharding mode (:mod:`lightning_hydra.planner.memory`)."""


def _simulate(argv: list[str]) -> int:
    from lightning_hydra.sim.cli import main as simulate

    return simulate(argv)


def _prepare(argv: list[str]) -> int:
    parser = _parser(
        "prepare",
        "Tokenize text into Megatron indexed token files (<output>.bin and <output>.idx, megatron-core's format) "
        "that HydraDataModule(sources=...) trains on, and print what the planner will see. Inputs: JSON-lines files "
        "(the text under --text-field), parquet files (the --text-field column), plain files (one document each), "
        "or directories of them.",
    )
    parser.add_argument("inputs", nargs="+", help="files or directories of text")
    parser.add_argument("--tokenizer", required=True, help="a local Hugging Face tokenizer directory (tokenizer.json)")
    parser.add_argument("--output", required=True, help="prefix of OUTPUT.bin, OUTPUT.idx and OUTPUT.summary.json")
    parser.add_argument("--text-field", default="text", help="JSON field or parquet column of the text")
    parser.add_argument("--workers", type=_bounded(int, 1, 1024), default=max(1, min(8, os.cpu_count() or 1)),
                        help="tokenizing processes")  # fmt: skip
    parser.add_argument("--eos-token", default=None, help="end-of-document token (default: the tokenizer's eos_token)")
    parser.add_argument("--no-eos", action="store_true", help="append no end-of-document token")
    parser.add_argument("--max-seq-len", type=_bounded(int, 1, None), default=None,
                        help="summarise the pieces HydraDataModule(split_long=True) cuts documents into")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on standard output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    from lightning_hydra.data.prepare import prepare

    summary = prepare(
        args.inputs, args.output, args.tokenizer, text_field=args.text_field, workers=args.workers,
        eos_token=args.eos_token, append_eos=not args.no_eos, max_seq_len=args.max_seq_len,
        progress=not args.no_progress,
    )  # fmt: skip
    if args.json:
        print(json.dumps(summary))
    return 0


def _export(argv: list[str]) -> int:
    from lightning_hydra.export import DTYPES

    parser = _parser(
        "export",
        "Write a checkpoint this package saved (a replica's file or a sharded directory: any FSDP2, tensor-parallel "
        "and pipeline layout, any world size) as a Hugging Face directory that AutoModelForCausalLM.from_pretrained "
        "loads: config.json, safetensors shards and their index, generation_config.json and tokenizer files where "
        "the run had them.",
    )
    parser.add_argument("checkpoint", help="the checkpoint (e.g. runs/x/checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the directory to write")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="dtype of the written weights")
    parser.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file (transformers' default)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory to copy (default: the run's, if any)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    args = parser.parse_args(argv)
    from lightning_hydra.export import export_checkpoint

    out = export_checkpoint(
        args.checkpoint, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
        max_shard_size=args.max_shard_size, tokenizer=args.tokenizer,
    )  # fmt: skip
    print(f"lightning-hydra export: {out}")
    return 0


# ---------------------------------------------------------------------------------------------- entry point
_OWN: dict[str, Callable[[list[str]], int]] = {
    "demo": _demo,
    "compare": _compare,
    "report": _report,
    "plan": _plan,
    "simulate": _simulate,
    "prepare": _prepare,
    "export": _export,
}


def run(argv: list[str]) -> int:
    """Run one command (errors are raised, not printed: :func:`main` prints them)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = argv[0]
    if command in _OWN:
        return _OWN[command](argv[1:])
    if command in _TRAINING or command.startswith("-"):
        return _lightning_cli(argv)
    print(USAGE, file=sys.stderr)
    hint = " (LightningCLI's test and predict need steps a HydraModule does not define)" * (
        command in ("test", "predict")
    )
    print(f"lightning-hydra: error: unknown command {command!r}{hint}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-hydra``: the package's subcommands, else ``LightningCLI``; errors as one line."""
    from lightning_hydra.console import quiet_known_noise

    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in argv or os.environ.get("LIGHTNING_HYDRA_TRACEBACK") == "1"
    argv = [a for a in argv if a != "--traceback"]
    quiet_known_noise()
    rank = current_rank()
    if rank != 0:  # ranks started by the launcher: their per-rank start-up lines repeat rank 0's
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return run(argv)
    except KeyboardInterrupt:
        return 130
    except argparse.ArgumentError as exc:  # a bad option or recipe value (LightningCLI's parser raises, not exits)
        if show_traceback:
            report_error(exc, rank=rank, show_traceback=True)
        else:
            print(f"lightning-hydra: error: {argument_reason(str(exc))}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as done:  # argparse's usage errors, --help, a run stopped by SIGTERM
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except Exception as exc:
        report_error(exc, rank=current_rank(), show_traceback=show_traceback)
        return 1
