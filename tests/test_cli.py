"""The ``lightning-hydra`` command and the recipes: every recipe parses, the CPU ones train a few steps."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_hydra.cli import RECIPES, main, recipe_path

NOISE = ("Warning", "warn(", "Epoch 0/-2", "v_num", "FLOPs", "Tip:", "Traceback", "deprecated")
"""What a run must not print (issue 13): warnings not about the user's configuration, meaningless fields."""


def assert_readable(printed: str) -> None:
    """No warning or meaningless field in what a run printed."""
    lines = [line for line in printed.splitlines() if any(n in line for n in NOISE)]
    assert not lines, lines


TRAINING = sorted(p for p in RECIPES.glob("*.yaml") if not p.name.startswith("sim-"))
CPU = [p for p in TRAINING if "accelerator: cpu" in p.read_text() and p.stem != "compare-policies"]
"""CPU recipes trained with ``fit``. ``compare-policies`` is the default recipe of ``compare``, which trains it
once per policy in :func:`test_compare_runs_each_policy_and_renders_one_dashboard`."""


def test_recipes_exist():
    names = {p.stem for p in TRAINING}
    assert {"cpu-demo", "compare-policies", "gpu-llama3-8b-32k", "gpu-llama3-8b-256k"} <= names


@pytest.mark.parametrize("recipe", TRAINING, ids=lambda p: p.stem)
def test_recipe_round_trips_through_print_config(recipe: Path, capsys):
    assert main(["fit", "--config", str(recipe), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    given = yaml.safe_load(recipe.read_text())
    assert printed["model"]["class_path"] == given["model"]["class_path"]
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_hydra.HydraStrategy"
    for key, value in given["trainer"]["strategy"]["init_args"].items():
        assert strategy["init_args"][key] == value, key
    for key, value in given["data"].items():
        assert printed["data"][key] == value, key


def test_bad_recipe_values_are_rejected(capsys):
    assert main(["fit", "--config", str(recipe_path("cpu-demo")), "--trainer.strategy.init_args.max_ring=x"]) != 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", CPU, ids=lambda p: p.stem)
def test_cpu_recipe_trains_a_few_steps(recipe: Path, tmp_path):
    cmd = [
        sys.executable, "-m", "lightning_hydra", "fit", "--config", str(recipe),
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = list(tmp_path.rglob("hydra_steps.jsonl"))
    assert len(records) == 1
    rows = [json.loads(line) for line in records[0].read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    printed = done.stdout + done.stderr
    assert "lightning-hydra: 2 steps" in printed
    assert_readable(printed)
    if "dashboard: true" in recipe.read_text():
        assert (records[0].parent / "dashboard" / "index.html").exists()


def test_plan_command_prints_the_plan(capsys):
    assert main(["plan", "--world-size", "16", "--context", "8192", "--microbatches", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["policy"] == "hydra" and summary["sequences"] > 0
    assert 0 < summary["efficiency"] <= 1 and summary["predicted_max_over_mean"] >= 1
    assert main(["plan", "--world-size", "16", "--context", "8192", "--policy", "mcore"]) == 0
    assert "microbatch 0" in capsys.readouterr().out


def test_report_command_needs_records(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-hydra: error: no hydra_steps.jsonl"), err


def test_unknown_recipe_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no recipe"):
        recipe_path("no-such-recipe")


@pytest.mark.timeout(600)
def test_compare_runs_each_policy_and_renders_one_dashboard(tmp_path, capfd):
    out = tmp_path / "cmp"
    args = ["compare", "--policies", "static", "hydra", "--out", str(out), "--trainer.max_steps=1"]
    assert main([*args, "--trainer.limit_val_batches=0"]) == 0
    captured = capfd.readouterr()  # the runs' output too (subprocesses)
    printed = captured.out
    assert_readable(captured.out + captured.err)
    assert "run 1/2, policy static" in printed and "run 2/2, policy hydra" in printed  # progress
    assert "PP bubble minimum: the fill and drain idle time of the step's own microbatch times" in printed  # legend
    for policy in ("static", "hydra"):  # run, layout (DP 4 on the 4 ranks), steps
        assert re.search(rf"^{policy} +\| +DP 4 +\| +1 \|", printed, re.M), printed
    page = out / "dashboard" / "index.html"
    assert page.exists()
    html = page.read_text()
    assert html.count("data:image/png") == 6 + 2  # six series, one timeline per run
    assert 'alt="timeline_0_step0"' in html and 'alt="timeline_1_step0"' in html


# ---------------------------------------------------------------------------------------------- issue 13
def test_usage_lists_the_package_commands_and_offers_no_broken_ones(capsys):
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    for name in ("fit", "validate", "demo", "compare", "report", "plan", "simulate", "--traceback"):
        assert re.search(rf"^\s+{re.escape(name)}\s", usage, re.M), name
    assert "test" not in usage.split() and "predict" not in usage.split()
    for command in ("test", "predict", "tarin"):
        assert main([command]) == 2
        assert f"unknown command {command!r}" in capsys.readouterr().err
    assert main(["fit", "--help"]) == 0
    fit_usage = capsys.readouterr().out
    assert fit_usage.startswith("usage: lightning-hydra") and "{fit,validate}" not in fit_usage
    # LightningCLI itself (reached with options before the command) offers fit and validate only
    assert main(["--config", str(recipe_path("cpu-demo")), "predict"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "lightning-hydra: error: argument subcommand: invalid choice: 'predict' (choose from 'fit', 'validate')"
    ]


def test_a_bad_option_or_recipe_value_is_one_line_naming_the_option(tmp_path, capsys):
    """LightningCLI's parser printed its whole usage and jsonargparse's nested union report (70-77 lines) for a
    value of the wrong type (found by fuzzing the command line); now one line names the option and the problem, and
    the exit code stays argparse's 2."""
    demo = recipe_path("cpu-demo")
    cases = {
        "--trainer.strategy.init_args.max_tokens_per_rank=abc": (
            "--trainer.strategy.init_args.max_tokens_per_rank: expected int or Literal['auto'], got 'abc'"
        ),
        "--trainer.strategy.init_args.foo=1": "--trainer.strategy: Option 'foo' is not accepted",
        "--model.init_args.lr=abc": "--model.init_args.lr: expected float, got 'abc'",
        "--trainer.max_stepz=3": "unrecognized arguments: --trainer.max_stepz=3",
    }
    for option, said in cases.items():
        assert main(["fit", "--config", str(demo), option, "--print_config"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"lightning-hydra: error: {said}"]
    recipe = tmp_path / "walll.yaml"
    recipe.write_text(demo.read_text().replace("dashboard: true", "dashboard: true\n        step_time: walll", 1))
    assert main(["fit", "--config", str(recipe), "--print_config"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "lightning-hydra: error: --trainer.callbacks.init_args.step_time: expected Literal['auto', 'wall', 'replay'], "
        "got 'walll'"
    ]
    assert main(["fit", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"lightning-hydra: error: --config: File does not exist: '{tmp_path / 'missing.yaml'}'"
    ]


def _described(help_text: str, prefix: str, names: list[str]) -> dict[str, str]:
    """The description argparse printed for each ``prefix + name`` option (text before its type note)."""
    out = {}
    for name in names:
        found = re.search(rf"^  {re.escape(prefix + name)}(?: \S+)?\n?(.*?)(?=^  -|\Z)", help_text, re.M | re.S)
        assert found, f"{prefix}{name} is not in the help"
        out[name] = " ".join(found.group(1).split()).split("(type:")[0].split("(required")[0].strip()
    return out


_HELP = {  # class: (what to ask for, option prefix)
    "lightning_hydra.HydraDataModule": (["--help"], "--data."),
    "lightning_hydra.DecoderLM": (["--model.help", "lightning_hydra.DecoderLM"], "--model."),
    "lightning_hydra.models.hf.HFCausalLM": (["--model.help", "lightning_hydra.models.hf.HFCausalLM"], "--model."),
    "lightning_hydra.HydraStrategy": (
        ["--trainer.strategy.help", "lightning_hydra.HydraStrategy"],
        "--trainer.strategy.",
    ),
    "lightning_hydra.BubbleMonitor": (
        ["--trainer.callbacks.help", "lightning_hydra.BubbleMonitor"],
        "--trainer.callbacks.",
    ),
}


@pytest.mark.parametrize("which", sorted(_HELP))
def test_every_option_has_its_description_in_help(capsys, which):
    args, prefix = _HELP[which]
    cls = which
    import importlib
    import inspect

    module, _, name = cls.rpartition(".")
    target = getattr(importlib.import_module(module), name)
    params = [p for p in inspect.signature(target.__init__).parameters.values() if p.name != "self"]
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert main(["fit", *args]) == 0
    text = capsys.readouterr().out
    undescribed = [n for n, d in _described(text, prefix, names).items() if not d]
    assert not undescribed, undescribed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--context", "0"], "argument --context: 0 is out of range: allowed >= 16"),
        (["--context", "-5"], "argument --context: -5 is out of range"),
        (["--world-size", "0"], "argument --world-size: 0 is out of range"),
        (["--microbatches", "0"], "argument --microbatches: 0 is out of range"),
        (["--fill", "0"], "argument --fill: 0.0 is out of range: allowed > 0"),
        (["--capacity", "0"], "argument --capacity: 0 is out of range"),
        (["--world-size", "65536"], "sequences (limit 500,000)"),
        (["--policy", "mcore", "--world-size", "16384"], "mcore scans the whole pool for every sequence"),
        (["--num-heads", "12"], "--num-heads 12 is not a multiple of --num-kv-heads 8"),
    ],
)
def test_plan_refuses_runaway_sizes_before_allocating(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_reports_a_bad_pool_in_one_line(capsys):
    assert main(["plan", "--world-size", "12"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lightning-hydra: error: world size 12 is not a multiple of ranks_per_node=8: set "
        "HydraStrategy(ranks_per_node=...) to the ranks (GPUs) of one node, and run whole nodes"
    ]


def test_plan_prints_its_settings_a_legend_and_progress(capsys):
    assert main(["plan", "--world-size", "16", "--policy", "mcore"]) == 0
    out, err = capsys.readouterr()
    assert "planning 155 sequences" in err and "done in" in err  # progress on stderr
    assert "settings (defaults unless marked" in out and "16 ranks (given), 8 per node" in out
    assert "policy         mcore (given): Megatron-Core Dynamic-CP" in out
    assert "3 (4 asked: mcore, like Megatron's scheduler, packs ranks to capacity" in out  # explained
    assert re.search(r"ranks \d+-\d+: degree 8 = 8 Ulysses x 1 ring", out)
    assert "legend:" in out and "efficiency  (useful compute / ranks)" in out
    assert not re.search(r"\bu=\d|\br=\d|'\d+':", out)  # no u=2 r=7, no string-keyed degree dicts
    assert "sequences per CP degree: d=1: " in out
    assert_readable(out + err)


def test_plan_memory_sizes_the_capacity_from_the_memory_model(capsys):
    base = ["plan", "--world-size", "64", "--context", "262144", "--memory", "80GB"]
    assert main([*base, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["memory"]
    table = summary["capacities"]
    # Llama-3-8B with AdamW under bf16-mixed: a replica does not fit 80 GB; sharding and checkpointing each add room
    assert table["none"] == {"none": 0, "selective": 0}
    assert 16384 <= summary["capacity"] == table["zero3"]["selective"]
    assert table["zero2"]["none"] < table["zero2"]["selective"] < table["zero3"]["selective"]
    assert table["hsdp"]["selective"] < table["zero2"]["selective"]  # hsdp shards over one node of 8 only
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "8.03B parameters" in out and "capacity (tokens per rank) of every mode at 80GB" in out
    assert f"{summary['capacity']:,} tokens per rank per microbatch (the memory model at 80GB)" in out
    assert main([*base, "--sharding", "none"]) == 2
    assert "leaves no room for activations under sharding none" in capsys.readouterr().err
    assert main([*base, "--memory", "lots"]) == 2
    assert "cannot read 'lots' as a memory size" in capsys.readouterr().err


def test_plan_help_shows_defaults(capsys):
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 64)", "(default: 32768)", "(default: 0.75)", "(default: hydra)", "(default: 4)"):
        assert default in text, default


def test_simulate_explains_its_columns_and_shows_progress(capsys):
    assert main(["simulate", "--config", "sim-cpu-demo", "--steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert "simulate: static (1/3)" in err and "simulate: hydra (3/3)" in err and "done in" in err
    assert "uncalib.      the same with the planner's analytic cost model kept" in out
    assert "mem headroom  share of a GPU's memory left" in out
    assert main(["simulate", "--config", "sim-cpu-demo", "--steps", "0"]) == 2
    assert "argument --steps: 0 is out of range" in capsys.readouterr().err


def test_errors_are_said_once(capsys):
    from lightning_hydra.cli_errors import report_error
    from lightning_hydra.errors import ConfigError

    same_everywhere = ConfigError("global_batch_tokens=9 exceeds ...")
    one_rank = ValueError("train item 3 holds token id 300 ...")
    gone = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]")
    for rank in (0, 1, 2, 3):
        report_error(same_everywhere, rank=rank)
    assert capsys.readouterr().err.splitlines() == ["lightning-hydra: error: global_batch_tokens=9 exceeds ..."]
    report_error(one_rank, rank=2)
    for rank in (1, 3):
        report_error(gone, rank=rank)
    report_error(gone, rank=0)
    assert capsys.readouterr().err.splitlines() == [
        "lightning-hydra: error on rank 2: train item 3 holds token id 300 ...",
        "lightning-hydra: stopped: another rank failed (its error is printed by that rank; --traceback for details)",
    ]


def _raise_on_rank_two() -> None:
    raise ValueError("train item 3 holds token id 300 ...")


def test_traceback_prints_the_rank_and_the_frames_down_to_the_raise(capsys):
    """``--traceback``: on every rank (the secondary ones too), a line naming the rank, then Python's traceback:
    the frames from where the command caught the error down to where it was raised, the message last."""
    from lightning_hydra.cli_errors import report_error

    try:
        _raise_on_rank_two()
    except ValueError as exc:
        report_error(exc, rank=2, show_traceback=True)
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["lightning-hydra: traceback of the error on rank 2:", "Traceback (most recent call last):"]
    frames = [line.strip() for line in err if line.lstrip().startswith("File ")]
    assert len(frames) == 2 and __file__ in frames[0] and frames[1].endswith(", in _raise_on_rank_two"), err
    assert err[-1] == "ValueError: train item 3 holds token id 300 ...", err
    gone = RuntimeError("Connection closed by peer")  # said by nobody but rank 0 without --traceback
    report_error(gone, rank=3, show_traceback=True)
    assert capsys.readouterr().err.splitlines() == [
        "lightning-hydra: traceback of the error on rank 3:",
        "RuntimeError: Connection closed by peer",  # never raised: no frames
    ]
    # the command: a ConfigError from deep inside `plan`, and a bad option LightningCLI's parser raised
    assert main(["--traceback", "plan", "--world-size", "12"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-hydra: traceback of the error on rank 0:\nTraceback (most recent call last):\n")
    assert err.count('  File "') > 2 and "lightning_hydra/cli.py" in err, err
    assert err.rstrip().endswith(
        "world size 12 is not a multiple of ranks_per_node=8: set "
        "HydraStrategy(ranks_per_node=...) to the ranks (GPUs) of one node, and run whole nodes"
    )
    assert main(["plan", "--world-size", "12"]) == 1 and "Traceback" not in capsys.readouterr().err
    bad = ["fit", "--config", str(recipe_path("cpu-demo")), "--model.init_args.lr=abc", "--print_config"]
    assert main(["--traceback", *bad]) == 2  # argparse's code, as without --traceback
    err = capsys.readouterr().err
    assert err.startswith("lightning-hydra: traceback of the error on rank 0:\nTraceback (most recent call last):\n")
    assert err.count('  File "') > 2 and "ArgumentError" in err and "lr" in err, err


@pytest.mark.timeout(300)
def test_a_bad_setting_is_one_line_before_any_rank_starts(tmp_path):
    cmd = [
        sys.executable, "-m", "lightning_hydra", "fit", "--config", str(recipe_path("cpu-demo")),
        "--trainer.strategy.init_args.policy=hydar", f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["lightning-hydra: error: unknown policy 'hydar'; choose one of ['hydra', 'mcore', 'static']"], (
        done.stderr[-3000:]
    )
    assert "Traceback" not in done.stderr and "Initializing distributed" not in done.stderr
    assert not list(tmp_path.rglob("version_*"))
