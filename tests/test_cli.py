"""The ``lightning-hydra`` command and the recipes: every recipe parses, the CPU ones train a few steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_hydra.cli import RECIPES, main, recipe_path

TRAINING = sorted(p for p in RECIPES.glob("*.yaml") if not p.name.startswith("sim-"))
CPU = [p for p in TRAINING if "accelerator: cpu" in p.read_text()]


def test_recipes_exist():
    names = {p.stem for p in TRAINING}
    assert {"cpu-demo", "compare-policies", "gpu-llama3-8b-32k", "gpu-llama3-8b-256k"} <= names


@pytest.mark.parametrize("recipe", TRAINING, ids=lambda p: p.stem)
def test_recipe_round_trips_through_print_config(recipe: Path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert done.value.code in (0, None)
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
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(recipe_path("cpu-demo")), "--trainer.strategy.init_args.max_ring=x"])
    assert done.value.code != 0


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
    assert "lightning-hydra: 2 steps" in done.stdout + done.stderr
    if "dashboard: true" in recipe.read_text():
        assert (records[0].parent / "dashboard" / "index.html").exists()


def test_plan_command_prints_the_plan(capsys):
    assert main(["plan", "--world-size", "16", "--context", "8192", "--microbatches", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["policy"] == "hydra" and summary["sequences"] > 0
    assert 0 < summary["efficiency"] <= 1 and summary["predicted_max_over_mean"] >= 1
    assert main(["plan", "--world-size", "16", "--context", "8192", "--policy", "mcore"]) == 0
    assert "microbatch 0" in capsys.readouterr().out


def test_report_command_needs_records(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"hydra_steps\.jsonl"):
        main(["report", str(tmp_path)])


def test_unknown_recipe_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no recipe"):
        recipe_path("no-such-recipe")


@pytest.mark.timeout(600)
def test_compare_runs_each_policy_and_renders_one_dashboard(tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["compare", "--policies", "static", "hydra", "--out", str(out), "--trainer.max_steps=1"]
    assert main([*args, "--trainer.limit_val_batches=0"]) == 0
    printed = capsys.readouterr().out
    assert "static |" in printed and "hydra |" in printed
    page = out / "dashboard" / "index.html"
    assert page.exists()
    html = page.read_text()
    assert html.count("data:image/png") == 6 + 2  # six series, one timeline per run
    assert 'alt="timeline_0_step0"' in html and 'alt="timeline_1_step0"' in html
