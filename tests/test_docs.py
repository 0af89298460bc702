"""The docs site builds strictly, its configuration reference is complete, and its code blocks run.

- ``mkdocs build --strict`` with ``validation:`` settings (``mkdocs.yml``) fails on a broken link, a missing
  anchor or an unresolved API reference: a copy of the docs with each broken in turn must fail to build.
- The configuration reference (``lightning_hydra.docs_reference``, put into ``docs/configuration.md`` at build
  time) lists every argument of the configured classes, each with a description.
- Every ``python``, ``bash`` and ``yaml`` block of ``docs/*.md`` is claimed by a test here (or by
  ``tests/test_readme.py`` when it is the README's block), or carries a visible ``<!-- needs: gpu -->`` /
  ``cluster`` / ``sketch`` mark; training examples run on 4 CPU ranks for 2 steps. ``text`` and unlabelled blocks
  are output samples and diagrams.
"""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from lightning_hydra.cli import RECIPES, main
from lightning_hydra.docs_reference import CLASSES, arguments, reference_markdown
from tests.test_readme import BLOCKS as README_BLOCKS
from tests.test_readme import ROOT, commands, env, make_dry_run, shrink, train

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"^(?:<!-- needs: (\w+) -->\n)?```(\w*)\n(.*?)^```", re.S | re.M)
README_BODIES = {body for _, body in README_BLOCKS}


def _blocks() -> list[tuple[str, str | None, str, str]]:
    """Every fenced block of the docs: (page name, needs-mark, language, body)."""
    return [(page.name, *found.groups()) for page in PAGES for found in BLOCK.finditer(page.read_text())]


def _page_blocks(name: str, language: str) -> list[str]:
    return [body for page, mark, lang, body in _blocks() if page == name and lang == language and not mark]


def _claim(page: str, mark: str | None, language: str, body: str) -> str | None:
    """The test that runs a block (or why none needs to); ``None``: no test runs it."""
    if mark:
        return f"marked: needs {mark}"
    if language in ("", "text"):
        return "output or diagram"
    if body in README_BODIES:
        return "tests/test_readme.py"
    if page == "your-data.md":
        return "test_the_own_data_page_trains_on_4_ranks"
    if language == "python" and "pipeline_stages=2" in body:
        return "test_the_pipeline_example_trains_as_written_and_its_measured_bubble_is_not_below_its_minimum"
    if language == "python" and "rank_zero_info(" in body:
        return "test_the_rank_zero_example_prints_once"
    if language == "python" and "HFCausalLM(" in body:
        return "test_the_hugging_face_example_builds"
    if language == "python" and "HFCausalLM.from_pretrained(" in body:
        return "test_the_pretrained_example_builds_with_its_overrides"
    if language == "yaml":
        return "test_the_recipe_fragments_parse"
    if language == "bash":
        return "test_the_shell_commands_run_or_parse"
    return None


def test_every_block_is_run_or_marked():
    blocks = _blocks()
    assert len(blocks) > 20, len(blocks)
    unclaimed = [(page, lang, body[:80]) for page, mark, lang, body in blocks if _claim(page, mark, lang, body) is None]
    assert not unclaimed, unclaimed
    marks = [mark for _, mark, _, _ in blocks if mark]
    assert set(marks) <= {"gpu", "cluster", "sketch"} and len(marks) <= 6, marks  # the few that cannot run here


def test_the_marks_are_visible_on_the_page():
    sys.path.insert(0, str(DOCS))
    try:
        from hooks import on_page_markdown
    finally:
        sys.path.remove(str(DOCS))
    for page in PAGES:
        text = page.read_text()
        shown = on_page_markdown(text, None, None, None)
        assert "<!-- needs:" not in shown, page.name
        for kind, title in (("gpu", "Needs a GPU"), ("cluster", "Needs a cluster"), ("sketch", "A sketch")):
            assert shown.count(title) >= text.count(f"<!-- needs: {kind} -->"), page.name


# --- the build


def _copy(tmp_path):
    """A copy of the docs site (pages, mkdocs.yml; the package linked) to break."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "lightning_hydra").symlink_to(ROOT / "lightning_hydra")
    return tmp_path


def _build(root) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", "site"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env(), "NO_MKDOCS_2_WARNING": "1"},
    )


BREAKAGES = {
    "a link to a missing page": ("index.md", "\n[gone](no-such-page.md)\n", "no-such-page.md"),
    "a missing anchor": ("index.md", "\n[gone](concepts.md#no-such-anchor)\n", "no-such-anchor"),
    "an unresolved API reference": ("api.md", "\n::: lightning_hydra.no_such_module\n", "no_such_module"),
    "an unresolved cross-reference": ("data.md", "\n[gone][lightning_hydra.data.NoSuchClass]\n", "NoSuchClass"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("breakage", [None, *BREAKAGES])
def test_the_docs_build_strictly_and_a_broken_reference_fails_it(tmp_path, breakage):
    pytest.importorskip("mkdocs")
    root = _copy(tmp_path)
    if breakage is None:
        done = _build(root)
        assert done.returncode == 0, done.stderr[-3000:]
        page = (root / "site" / "configuration" / "index.html").read_text()
        for _, source_file, class_name in CLASSES:
            for arg in arguments(source_file, class_name):
                assert f"<code>{arg.name}</code>" in page, arg.name  # the generated reference is on the page
        return
    name, added, named = BREAKAGES[breakage]
    with open(root / "docs" / name, "a") as page:
        page.write(added)
    done = _build(root)
    assert done.returncode != 0, f"the build passed with {breakage}"
    assert named in done.stderr, done.stderr[-3000:]


# --- the configuration reference


def test_the_configuration_reference_lists_and_describes_every_argument():
    import lightning_hydra

    for shown, source_file, class_name in CLASSES:
        cls = getattr(lightning_hydra, shown.rsplit(".", 1)[1])
        args = arguments(source_file, class_name)
        signature = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
        assert [arg.name for arg in args] == signature, class_name
        undescribed = [arg.name for arg in args if not arg.description]
        assert not undescribed, f"{class_name}: no description in the docstring's Args: for {undescribed}"
    table = reference_markdown()
    assert "| `max_tokens_per_rank` | `int \\| Literal['auto']` | `4096` |" in table
    assert "| `global_batch_tokens` | `int` | required |" in table
    assert "<!-- generated: configuration reference -->" in (DOCS / "configuration.md").read_text()


def test_an_undescribed_argument_is_found(tmp_path, monkeypatch):
    import lightning_hydra.docs_reference as reference

    (tmp_path / "thing.py").write_text(
        'class Thing:\n    def __init__(self, a: int = 1, b: str = "x") -> None:\n'
        '        """Make it.\n\n        Args:\n            a: The a.\n        """\n'
    )
    monkeypatch.setattr(reference, "_PACKAGE", tmp_path)
    args = reference.arguments("thing.py", "Thing")
    assert [(arg.name, arg.default, bool(arg.description)) for arg in args] == [("a", "1", True), ("b", "'x'", False)]


# --- the pages' code blocks


@pytest.mark.timeout(600)
def test_the_own_data_page_trains_on_4_ranks(tmp_path):
    """docs/your-data.md as a newcomer follows it: write token files, save the recipe, run the command."""
    page = (DOCS / "your-data.md").read_text()
    (write,) = _page_blocks("your-data.md", "python")
    (recipe,) = _page_blocks("your-data.md", "yaml")
    (command,) = _page_blocks("your-data.md", "bash")
    assert "Save this as `my-data.yaml`" in page
    (tmp_path / "recipes").symlink_to(RECIPES)
    done = subprocess.run([sys.executable, "-c", write], cwd=tmp_path, capture_output=True, text=True, env=env())
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "my-data.yaml").write_text(recipe)
    ((words),) = commands(command)
    assert words[:2] == ["lightning-hydra", "fit"], words
    done = subprocess.run(
        [sys.executable, "-m", "lightning_hydra", *words[1:], "--trainer.max_steps", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=560,
        env=env(),
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-3000:]
    assert "lightning-hydra: 2 steps" in printed, printed[-3000:]


@pytest.mark.timeout(600)
def test_the_pipeline_example_trains_as_written_and_its_measured_bubble_is_not_below_its_minimum(tmp_path):
    (example,) = [b for b in _page_blocks("pipelines.md", "python") if "pipeline_stages=2" in b]
    printed = train(tmp_path, example)
    found = re.search(r"bubble/pp \(P=2, measured\) ([\d.]+) \(minimum ([\d.]+) for these microbatch times\)", printed)
    assert found, printed[-3000:]
    assert float(found.group(1)) >= float(found.group(2)) > 0


def test_the_rank_zero_example_prints_once():
    (example,) = [b for b in _page_blocks("getting-started.md", "python") if "rank_zero_info(" in b]
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300, env=env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("training the demo on 4 ranks") == 1


def test_the_hugging_face_example_builds():
    pytest.importorskip("transformers")

    (example,) = [b for b in _page_blocks("your-model.md", "python") if "HFCausalLM(" in b]
    code = shrink(
        example,
        {
            '"hidden_size": 4096': '"hidden_size": 64',
            '"num_attention_heads": 32': '"num_attention_heads": 4',
            '"num_key_value_heads": 8': '"num_key_value_heads": 2',
            '"num_hidden_layers": 32': '"num_hidden_layers": 1',
            '"intermediate_size": 14336': '"intermediate_size": 128',
            '"vocab_size": 128256': '"vocab_size": 512',
        },
    )
    namespace: dict = {}
    exec(compile(code, "docs/your-model.md", "exec"), namespace)
    assert namespace["model"].attention_heads() == (4, 2)
    assert namespace["data"].global_batch_tokens == 262_144


def test_the_pretrained_example_builds_with_its_overrides(tmp_path):
    """``docs/pretrained.md``'s example on a tiny Llama saved here in place of Llama-3.1-8B: built on the meta device
    with the constructor's arguments and the config overrides the page names (YaRN to 128K positions)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_hydra.models.init import is_meta

    shape = dict(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=8192)  # fmt: skip
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(tmp_path / "llama")
    (example,) = [b for b in _page_blocks("pretrained.md", "python") if "HFCausalLM.from_pretrained(" in b]
    namespace: dict = {}
    code = shrink(example, {'"/models/Llama-3.1-8B"': repr(str(tmp_path / "llama"))})
    exec(compile(code, "docs/pretrained.md", "exec"), namespace)
    module = namespace["module"]
    assert is_meta(module) and module.lr == 2e-5 and module.pretrained == str(tmp_path / "llama")
    config = module.model.config
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling  # transformers 5 renamed it
    assert config.max_position_embeddings == 131072 and rope["rope_type"] == "yarn" and rope["factor"] == 16.0


def test_the_recipe_fragments_parse(tmp_path, capsys):
    checked = 0
    for page, mark, lang, body in _blocks():
        if lang != "yaml" or mark or _claim(page, mark, lang, body) != "test_the_recipe_fragments_parse":
            continue
        data = yaml.safe_load(body)
        assert set(data) <= {"trainer", "model", "data", "seed_everything"}, (page, set(data))
        if "train_dataset" in data.get("data", {}):  # a placeholder class of the user's: one of ours instead
            assert data["data"]["train_dataset"]["class_path"].startswith("my_project."), page
            data["data"]["train_dataset"] = {"class_path": "lightning_hydra.data.corpus.StdlibCorpus"}
        path = tmp_path / f"{checked}.yaml"
        path.write_text(yaml.safe_dump(data))
        assert main(["fit", "--config", str(RECIPES / "cpu-demo.yaml"), "--config", str(path), "--print_config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)["data"]
        for key, value in data.get("data", {}).items():
            if key != "train_dataset":
                assert printed[key] == value, (page, key)
        checked += 1
    assert checked >= 2


def test_the_shell_commands_run_or_parse(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^(\w+) = \[", section, re.M))
    assert {"dev", "data", "hf"} <= extras, extras
    checked = 0
    for page, mark, lang, body in _blocks():
        if lang != "bash" or _claim(page, mark, lang, body) != "test_the_shell_commands_run_or_parse":
            continue
        for words in commands(body):
            if words[0] == "make":
                make_dry_run(words)
            elif words[:2] == ["pip", "install"]:  # the extras it names exist
                named = re.findall(r"\[([\w,]+)\]", " ".join(words))
                assert named and set(",".join(named).split(",")) <= extras, words
            elif words[0] == "lightning-hydra":  # a subcommand's arguments: its --help parses (no tokenizer here)
                try:
                    code = main([words[1], "--help"])
                except SystemExit as exited:
                    code = exited.code
                assert code in (0, None), words
                capsys.readouterr()
            else:
                raise AssertionError(f"{page}: no rule runs {words}")
            checked += 1
    assert checked >= 2


def test_the_plan_commands_of_the_docs_run(capsys):
    text = "\n".join(page.read_text() for page in PAGES)
    found = re.findall(r"`lightning-hydra (plan [^`.]*)`", text) + re.findall(r"\$ lightning-hydra (plan .*)", text)
    assert len(found) >= 2, found  # the command line's and the memory page's
    for command in found:
        assert main([*command.split(), "--json"]) == 0, command
        assert '"policy": "hydra"' in capsys.readouterr().out
