"""The README runs as written: every code block is executed (at small sizes, a few steps) or checked to parse.

Each fenced block is handled by its language: ``python`` blocks run (the API example as a script on 4 CPU ranks,
with ``max_steps`` lowered to 2), ``yaml`` recipe fragments are merged into a recipe and parsed by the CLI,
``bash`` blocks' commands run (``make -n``, ``lightning-hydra plan``) or, where they need GPUs or a cluster, are
parsed with ``--print_config``; the sample output block must match what the code prints. A block of another kind
fails the test until it is handled here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from lightning_hydra.cli import RECIPES, main
from tests.test_cli import assert_readable

ROOT = RECIPES.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCKS if lang == language]


def _shrink(code: str, replacements: dict[str, str]) -> str:
    """``code`` with each key replaced by its value, every key present exactly once (the README changed otherwise)."""
    for old, new in replacements.items():
        assert code.count(old) == 1, f"{old!r} is not in the README block once:\n{code}"
        code = code.replace(old, new)
    return code


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_every_block_is_handled():
    assert {lang for lang, _ in BLOCKS} <= {"python", "yaml", "bash", ""}, [lang for lang, _ in BLOCKS]
    assert len(_blocks("python")) == 4 and len(_blocks("yaml")) == 1 and len(_blocks("bash")) == 3


def _train(tmp_path, code: str) -> str:
    """Run a README training example as a script with ``max_steps=2``; what it printed."""
    assert "from lightning.pytorch import Trainer" in code and "max_steps=" in code
    script = tmp_path / "train.py"
    script.write_text(_shrink(code, {"max_steps=20": "max_steps=2"}))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=560, cwd=tmp_path, env=_env()
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-3000:]
    assert "lightning-hydra: 2 steps" in printed
    assert_readable(printed)  # the API path prints no warning, no Epoch 0/-2, no v_num, no FLOPs either
    return printed


@pytest.mark.timeout(600)
def test_the_api_example_trains_as_written(tmp_path):
    (api,) = [b for b in _blocks("python") if "Trainer(" in b and "pipeline_stages" not in b]
    assert "bubble/pp (projected for P=4; no pipeline stages in this run)" in _train(tmp_path, api)


@pytest.mark.timeout(600)
def test_the_pipeline_example_trains_as_written_and_its_measured_bubble_is_not_below_its_minimum(tmp_path):
    (example,) = [b for b in _blocks("python") if "pipeline_stages=2" in b]
    printed = _train(tmp_path, example)
    found = re.search(r"bubble/pp \(P=2, measured\) ([\d.]+) \(minimum ([\d.]+) for these microbatch times\)", printed)
    assert found, printed[-3000:]
    assert float(found.group(1)) >= float(found.group(2)) > 0


def test_the_rank_zero_example_prints_once():
    (example,) = [b for b in _blocks("python") if "rank_zero_info(" in b]
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("training the demo on 4 ranks") == 1


def test_the_bring_your_own_example_builds(tmp_path):
    pytest.importorskip("transformers")
    import torch

    (byo,) = [b for b in _blocks("python") if "HFCausalLM(" in b]
    code = _shrink(
        byo,
        {
            '"hidden_size": 4096': '"hidden_size": 64',
            '"num_attention_heads": 32': '"num_attention_heads": 4',
            '"num_key_value_heads": 8': '"num_key_value_heads": 2',
            '"num_hidden_layers": 32': '"num_hidden_layers": 1',
            '"intermediate_size": 14336': '"intermediate_size": 128',
            '"vocab_size": 128256': '"vocab_size": 512',
        },
    )
    namespace = {"my_token_id_dataset": [torch.randint(0, 500, (n,)) for n in (100, 2000, 30)]}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["model"].attention_heads() == (4, 2)
    assert namespace["data"].global_batch_tokens == 262_144


def test_the_recipe_fragment_parses(tmp_path, capsys):
    (fragment,) = _blocks("yaml")
    data = yaml.safe_load(fragment)["data"]
    assert data["train_dataset"]["class_path"] == "my_project.data.TokenizedShards"  # the placeholder
    data["train_dataset"] = {"class_path": "lightning_hydra.data.corpus.StdlibCorpus", "init_args": {"split": "val"}}
    path = tmp_path / "data.yaml"
    path.write_text(yaml.safe_dump({"data": data}))
    assert main(["fit", "--config", str(RECIPES / "cpu-demo.yaml"), "--config", str(path), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["data"]
    assert printed["global_batch_tokens"] == 393216 and printed["max_seq_len"] == 32768


def _commands(block: str) -> list[list[str]]:
    """The commands of a bash block (continuation lines joined, comments and shell syntax dropped)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "if ")):
            out.append(shlex.split(line))
    return out


def test_the_shell_commands_run_or_parse(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name recipes relative to the repository
    checked = 0
    for block in _blocks("bash"):
        for words in _commands(block):
            if words[0] == "make":
                if shutil.which("make") is None:
                    pytest.skip("make is not installed")
                done = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True)
                assert done.returncode == 0, done.stderr
                assert "lightning_hydra" in done.stdout or "pytest" in done.stdout
            else:  # torchrun / srun launching the training command on GPUs: the command must parse
                at = words.index("lightning_hydra")
                assert main([*words[at + 1 :], "--print_config"]) == 0, words
                capsys.readouterr()
            checked += 1
    assert checked == 5


def test_the_plan_commands_of_the_readme_run(capsys):
    commands = re.findall(r"`lightning-hydra (plan [^`.]*)`", README) + re.findall(
        r"\$ lightning-hydra (plan .*)", README
    )
    assert len(commands) >= 2, commands  # the CLI table's and the memory section's
    for command in commands:
        assert main([*command.split(), "--json"]) == 0, command
        assert '"policy": "hydra"' in capsys.readouterr().out


def test_the_sample_output_matches_the_code():
    from lightning_hydra.metrics.monitor import BubbleMonitor

    (sample,) = [b for lang, b in BLOCKS if lang == "" and "lightning-hydra: 20 steps" in b]
    monitor = BubbleMonitor()
    step = {"throughput/tokens_per_s": 1.0, "time/step_s": 1.0, "bubble/dp": 0.0, "bubble/pp": 0.6}
    monitor.history = [{**step, "bubble/pp_min": 0.583, "balance/max_over_mean": 1.0}]
    line = monitor.summary()
    said = "(minimum 0.583 for these microbatch times)"
    assert said in line and said in sample
    shape = (
        r"lightning-hydra: \d+ steps, [\d,]+ tokens trained; median bubble/dp [\d.]+, "
        r"bubble/pp \(projected for P=4; no pipeline stages in this run\) [\d.]+"
    )
    assert re.match(shape, line) and re.match(shape, sample)
