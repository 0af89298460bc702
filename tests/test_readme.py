"""The README runs as written: every code block is executed (at small sizes, a few steps) or checked to parse.

Each fenced block is handled by its language: the ``python`` block (the smallest example) runs as a script on 4
CPU ranks with ``max_steps`` lowered to 2, the ``yaml`` recipe is parsed by the CLI, the ``bash`` block's ``make``
commands are checked with ``make -n``; the sample output block must match what the code prints. A block of another
kind fails the test until it is handled here. The docs pages' blocks are run by ``tests/test_docs.py`` with the
helpers below.
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
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
BLOCKS = FENCE.findall(README)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCKS if lang == language]


def shrink(code: str, replacements: dict[str, str]) -> str:
    """``code`` with each key replaced by its value, every key present exactly once (the page changed otherwise)."""
    for old, new in replacements.items():
        assert code.count(old) == 1, f"{old!r} is not in the block once:\n{code}"
        code = code.replace(old, new)
    return code


def env() -> dict[str, str]:
    """The environment of a subprocess that imports this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def train(tmp_path, code: str) -> str:
    """Run a training example as a script with ``max_steps=2``; what it printed."""
    assert "from lightning.pytorch import Trainer" in code and "max_steps=" in code
    script = tmp_path / "train.py"
    script.write_text(shrink(code, {"max_steps=20": "max_steps=2"}))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=560, cwd=tmp_path, env=env()
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-3000:]
    assert "lightning-hydra: 2 steps" in printed
    assert_readable(printed)  # the API path prints no warning, no Epoch 0/-2, no v_num, no FLOPs either
    return printed


def commands(block: str) -> list[list[str]]:
    """The commands of a bash block (continuation lines joined, comments and shell syntax dropped)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "if ")):
            out.append(shlex.split(line))
    return out


def make_dry_run(words: list[str]) -> None:
    """``make -n`` of a ``make`` command: the target exists and runs the package, the tests or the docs build."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert any(word in done.stdout for word in ("lightning_hydra", "pytest", "mkdocs build")), done.stdout


def test_every_block_is_handled():
    assert {lang for lang, _ in BLOCKS} <= {"python", "yaml", "bash", ""}, [lang for lang, _ in BLOCKS]
    assert len(_blocks("python")) == 1 and len(_blocks("yaml")) == 1 and len(_blocks("bash")) == 1
    assert len(README.splitlines()) <= 300  # a few screens; the rest is in docs/


@pytest.mark.timeout(600)
def test_the_api_example_trains_as_written(tmp_path):
    (api,) = _blocks("python")
    assert "bubble/pp (projected for P=4; no pipeline stages in this run)" in train(tmp_path, api)


def test_the_recipe_parses_and_is_the_api_example(capsys, tmp_path):
    (recipe,) = _blocks("yaml")
    path = tmp_path / "my-run.yaml"
    path.write_text(recipe)
    assert main(["fit", "--config", str(path), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["devices"] == 4 and printed["data"]["global_batch_tokens"] == 12288
    assert printed["trainer"]["strategy"]["init_args"]["max_tokens_per_rank"] == 2048


def test_the_shell_commands_run():
    checked = 0
    for block in _blocks("bash"):
        for words in commands(block):
            assert words[0] == "make", words
            make_dry_run(words)
            checked += 1
    assert checked == 2


def test_the_sample_output_matches_the_code():
    from lightning_hydra.metrics.monitor import BubbleMonitor

    (sample,) = [b for lang, b in BLOCKS if lang == "" and "lightning-hydra: 20 steps" in b]
    monitor = BubbleMonitor()
    step = {"throughput/tokens_per_s": 1.0, "time/step_s": 1.0, "bubble/dp": 0.0, "bubble/pp": 0.6}
    monitor.history = [{**step, "bubble/pp_min": 0.581, "balance/max_over_mean": 1.0}]
    monitor.losses = [5.0] * 10 + [3.0] * 9 + [4.285]  # the demo's last step jumps (docs/tensor-parallel.md)
    line = monitor.summary()
    said = "(minimum 0.581 for these microbatch times)"
    assert said in line and said in sample
    shape = (
        r"lightning-hydra: \d+ steps, [\d,]+ tokens trained; median bubble/dp [\d.]+, "
        r"bubble/pp \(projected for P=4; no pipeline stages in this run\) [\d.]+ \(minimum [\d.]+ for these "
        r"microbatch times\), balance [\d.]+; train loss [\d.]+ \(mean of the last 10 steps; last 4.285\)"
    )
    assert re.match(shape, line) and re.match(shape, sample), (line, sample)


def _anchors(page: str) -> set[str]:
    """The anchors of a docs page: explicit ``{ #id }`` ones and the headings' slugs (as Markdown's toc makes them)."""
    out = set(re.findall(r"\{ #([\w-]+) \}", page))
    for heading in re.findall(r"^#+ (.*?)(?: \{ #[\w-]+ \})?$", page, re.M):
        out.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower()))
    return out


def test_the_readme_links_and_anchors_exist():
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#([\w-]+))?\)", README)
    links += re.findall(r"^\[[\w-]+\]: ((?:docs/)?[\w./-]+\.md)(?:#([\w-]+))?$", README, re.M)
    assert len(links) >= 20, links
    for target, anchor in links:
        assert (ROOT / target).exists(), target
        if anchor:
            assert anchor in _anchors((ROOT / target).read_text()), f"{target}#{anchor}"
