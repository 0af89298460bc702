"""Pretrained Hugging Face weights in (issue 54, item 1): ``HFCausalLM.from_pretrained(path, **overrides)`` builds
on the meta device, the strategy lays the model out and each rank reads only its slices of the safetensors files.
A tiny Llama saved with ``save_pretrained`` trains under TP 2 x zero3 and PP 2 x pool 2 on 4 gloo ranks exactly as
transformers' own ``from_pretrained`` model in one process; bad input is one line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from lightning_hydra.errors import ConfigError
from lightning_hydra.models.hf import HFCausalLM
from lightning_hydra.models.init import is_meta
from lightning_hydra.models.pretrained import check_buffers, generation_config, weight_files
from tests.test_tensor import _fit, _strategy, assert_held_params

SHAPE = dict(
    vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


def _save(path: Path, model: torch.nn.Module) -> Path:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny untied Llama saved by transformers (float32 safetensors)."""
    torch.manual_seed(5)
    return _save(tmp_path_factory.mktemp("llama"), LlamaForCausalLM(LlamaConfig(**SHAPE)))


def _transformers(path: Path, **overrides) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **overrides)


def test_loads_transformers_weights_in_one_process(llama: Path, tmp_path: Path) -> None:
    """Built on the meta device, materialised whole: every tensor (rotary tables included) is what transformers'
    ``from_pretrained`` gives; a tied head is the embedding itself, as transformers ties it."""
    module = HFCausalLM.from_pretrained(str(llama), lr=0.5, optimizer="sgd")
    assert module.lr == 0.5 and is_meta(module)
    module.materialize("cpu")
    assert not is_meta(module)
    assert module.loaded_bytes == sum(p.numel() * 4 for p in module.parameters())  # every tensor read once, whole
    expected = _transformers(llama).state_dict() | dict(_transformers(llama).named_buffers())
    got = module.model.state_dict() | dict(module.model.named_buffers())
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert generation_config(llama) == json.loads((llama / "generation_config.json").read_text())
    assert generation_config(tmp_path) is None
    torch.manual_seed(6)
    tied = _save(tmp_path / "tied", LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True)))
    module = HFCausalLM(pretrained=str(tied))
    module.materialize("cpu")
    reference = _transformers(tied)
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    assert torch.equal(module.model.lm_head.weight, reference.lm_head.weight)
    # weights in several files (an index names each tensor's file), as large checkpoints are saved
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(tmp_path / "split", max_shard_size="20KB")
    assert (tmp_path / "split" / "model.safetensors.index.json").is_file()
    assert len(set(weight_files(tmp_path / "split").values())) > 2
    module = HFCausalLM(pretrained=str(tmp_path / "split"))
    module.materialize("cpu")
    expected = _transformers(tmp_path / "split").state_dict()
    for name, value in module.model.state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_theta": 20000.0},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "max_position_embeddings": 2048},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 512}, "max_position_embeddings": 4096},
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
         "max_position_embeddings": 2048, "rope_theta": 50000.0},
    ],
    ids=["theta", "linear", "llama3", "yarn"],
)  # fmt: skip
def test_config_overrides_change_the_rotary_tables(llama: Path, overrides: dict) -> None:
    """A context extension's overrides reach the rotary embedding: its tables and scaling equal those of
    transformers' model built from the same config written out by hand (``rope_parameters`` with the theta)."""
    module = HFCausalLM.from_pretrained(str(llama), **overrides)
    module.materialize("cpu")
    scaling = dict(overrides.get("rope_scaling") or {"rope_type": "default"})
    scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type"))
    rope = {**scaling, "rope_theta": overrides.get("rope_theta", 10000.0)}
    shape = {**SHAPE, "max_position_embeddings": overrides.get("max_position_embeddings", 512)}
    expected = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters=rope)).model.rotary_emb
    rotary = module.model.model.rotary_emb
    assert module.model.config.max_position_embeddings == shape["max_position_embeddings"]
    assert rotary.rope_type == rope["rope_type"]
    torch.testing.assert_close(rotary.inv_freq, expected.inv_freq, rtol=0, atol=0)
    assert rotary.attention_scaling == pytest.approx(expected.attention_scaling)
    assert not torch.equal(rotary.inv_freq, _transformers(llama).model.rotary_emb.inv_freq)


def test_bad_pretrained_input_is_one_line(llama: Path, tmp_path: Path) -> None:
    """Not a checkpoint directory, weights whose shapes disagree with the (overridden) config, a rotary type or an
    architecture the CP engine refuses: one ``ConfigError`` line each, raised where the module is built; the
    refusals are word for word those of the same model built from its config."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((llama / "config.json").read_text())
    cases = [
        (tmp_path / "missing", {}, "is not a directory"),
        (tmp_path / "empty", {}, "is not a Hugging Face checkpoint directory: it has no config.json"),
        (tmp_path / "bare", {}, r"has no \*.safetensors weights"),
        (llama, {"intermediate_size": 96}, r"gate_proj.weight has shape \[64, 32\] in the weights, \[96, 32\] by"),
        (llama, {"num_hidden_layers": 3}, r"the weights have no model.layers.2.self_attn.q_proj.weight \(of shape"),
        (llama, {"rope_scaling": {"rope_type": "yarn"}}, r"is refused: .*Missing required keys .*'factor'"),
        (llama, {"rope_scaling": {"rope_type": "nonsense"}}, r"unknown rope_type nonsense \(transformers knows defa"),
    ]
    for path, overrides, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            HFCausalLM.from_pretrained(str(path), **overrides)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="takes a model or pretrained=, not both"):
        HFCausalLM(LlamaForCausalLM(LlamaConfig(**SHAPE)), pretrained=str(llama))
    with pytest.raises(ConfigError, match="with pretrained=, config is a dict of overrides"):
        HFCausalLM(pretrained=str(llama), config=LlamaConfig(**SHAPE))
    dynamic = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError) as built:
        HFCausalLM(config={"model_type": "llama", **SHAPE, "rope_parameters": {**dynamic["rope_scaling"],
                                                                               "rope_theta": 10000.0}})  # fmt: skip
    with pytest.raises(ConfigError) as loaded:
        HFCausalLM.from_pretrained(str(llama), **dynamic)
    assert str(loaded.value) == str(built.value) and "picks its frequencies" in str(loaded.value)
    model = _transformers(llama)
    check_buffers(model, llama)  # the rotary tables are computed again
    model.model.layers[0].register_buffer("table", torch.ones(3), persistent=False)
    with pytest.raises(ConfigError, match=r"a buffer model.layers.0.table that is not in the weights and that load"):
        check_buffers(model, llama)
    mistral = MistralConfig(**SHAPE, sliding_window=16)
    with pytest.raises(ValueError) as built:
        HFCausalLM(model=MistralForCausalLM(mistral))
    with pytest.raises(ConfigError) as loaded:
        HFCausalLM(pretrained=str(_save(tmp_path / "mistral", MistralForCausalLM(mistral))))
    assert str(loaded.value) == str(built.value) and "sliding window of 16 tokens" in str(loaded.value)
    assert "\n" not in str(loaded.value)


def test_pretrained_trains_in_one_process_without_hydra_strategy(llama: Path, tmp_path: Path) -> None:
    """Under Lightning's own single-device strategy, ``configure_model`` loads the weights: the losses and
    parameters of transformers' ``from_pretrained`` model."""
    hparams = dict(lr=1.0, optimizer="sgd", max_grad_norm=0.2)
    reference = HFCausalLM(model=_transformers(llama), **hparams)
    module = HFCausalLM.from_pretrained(str(llama), **hparams)
    ref = _fit(tmp_path, "ref", reference, 1, 2)[0]
    got = _fit(tmp_path, "pretrained", module, 1, 2)[0]
    assert got["losses"] == ref["losses"]
    torch.testing.assert_close(module.state_dict(), reference.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(("tensor", "sharding", "stages"), [(2, "zero3", 1), (1, "none", 2)], ids=["tp2-zero3", "pp2"])
def test_pretrained_trains_like_transformers_model(
    llama: Path, tmp_path: Path, tensor: int, sharding: str, stages: int
) -> None:
    """TP 2 x zero3 over a pool of 2, and PP 2 x pool 2, on 4 gloo ranks, each rank reading its own slices: the
    losses (the first one: the pretrained weights' loss) and the parameters after 2 SGD steps are those of
    transformers' ``from_pretrained`` model trained in one process; the run's checkpoint exports as a Hugging Face
    directory that transformers loads to the trained model's logits."""
    hparams = dict(lr=1.0, optimizer="sgd", max_grad_norm=0.2)
    reference = HFCausalLM(model=_transformers(llama), **hparams)
    ref = _fit(tmp_path, "ref", reference, 1, 2)[0]
    strategy = _strategy(
        tensor_parallel=tensor, sharding=sharding, pipeline_stages=stages, num_microbatches=4, capacity=160 * stages
    )
    module = HFCausalLM.from_pretrained(str(llama), **hparams)
    saves = [ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)]
    ranks = _fit(tmp_path, "pretrained", module, 4, 2, strategy, saves=saves)
    _assert_exports(tmp_path / "ckpt" / "last.ckpt", tmp_path / "hf", llama, reference)
    # the main process, which never allocated the model, took the trained weights and computed its rotary tables
    assert not is_meta(module)
    torch.testing.assert_close(module.state_dict(), reference.state_dict(), rtol=1e-5, atol=1e-6)
    assert torch.equal(module.model.model.rotary_emb.inv_freq, reference.model.model.rotary_emb.inv_freq)
    for rank in ranks:
        assert rank["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-6)
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_held_params(ranks, reference, 4 // stages)
    if tensor > 1:
        assert ranks[0]["types"]["model.model.layers.0.self_attn.q_proj.weight"] == "DTensor"


def _assert_exports(checkpoint: Path, out: Path, source: Path, trained: HFCausalLM) -> None:
    """``lightning-hydra export`` of ``checkpoint`` (float32): the source's config (a Llama), its generation config,
    and weights whose logits on held-out tokens are those of ``trained``'s model under transformers' own attention
    (1e-5)."""
    from lightning_hydra.cli import main

    assert main(["export", str(checkpoint), str(out), "--dtype", "fp32"]) == 0
    assert (out / "generation_config.json").is_file() and (out / "config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(exported).__name__ == "LlamaForCausalLM" and exported.dtype == torch.float32
    plain = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    plain.load_state_dict(trained.model.state_dict())
    ids = torch.randint(0, 258, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_load_bench_reports_each_rank_reading_its_shards() -> None:
    """``python -m lightning_hydra.bench.startup --pretrained`` at a tiny size: on TP 2 x zero3 each rank read
    exactly the bytes of the shards it holds (a quarter of the layers' weights), not the model."""
    from lightning_hydra.bench.startup import measure_pretrained

    result = measure_pretrained(hidden=128, layers=2, vocab=4096)
    assert result["layout"] == "TP 2 x zero3 over 2, 4 gloo ranks"
    for rank in result["per_rank"]:
        assert rank["read_mib"] == rank["shards_mib"] < 0.5 * result["model_mib"]
        assert rank["peak_rise_mib"] > 0


def _recipe(tmp_path: Path, pretrained: Path) -> Path:
    """The CPU demo recipe (4 ranks, the embedded corpus: byte tokens below 258) with a pretrained tiny Llama."""
    import yaml

    from lightning_hydra.cli import recipe_path

    recipe = yaml.safe_load(recipe_path("cpu-demo").read_text())
    recipe["model"] = {
        "class_path": "lightning_hydra.models.hf.HFCausalLM",
        "init_args": {"pretrained": str(pretrained), "config": {"rope_theta": 20000.0}, "lr": 0.002},
    }
    recipe["trainer"]["callbacks"] = []
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.timeout(300)
def test_a_recipe_trains_from_pretrained_weights_and_bad_ones_stop_before_launch(
    llama: Path, tmp_path: Path, capfd
) -> None:
    """``pretrained:`` with config overrides in a recipe: the command trains from the weights on 4 ranks; a
    directory that is not a checkpoint is one line from the command, before any rank starts."""
    import subprocess
    import sys

    from lightning_hydra.cli import main

    assert main(["fit", "--config", str(_recipe(tmp_path, tmp_path / "missing"))]) == 1
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors == [f"lightning-hydra: error: pretrained='{tmp_path / 'missing'}' is not a directory (a local "
                      "Hugging Face checkpoint is needed)"], err[-3000:]  # fmt: skip
    assert "Traceback" not in err and "Initializing distributed" not in err
    cmd = [
        sys.executable, "-m", "lightning_hydra", "fit", "--config", str(_recipe(tmp_path, llama)),
        "--trainer.max_steps=1", "--trainer.limit_val_batches=0", f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout + done.stderr
    assert "materialised each rank's shards on its device" in printed
    assert "lightning-hydra: 1 steps" in printed, printed[-3000:]


def test_a_recipe_s_config_dict_reaches_the_module_as_a_dict() -> None:
    """A recipe's ``config:`` mapping is parsed as the dict it is (``dict`` comes first in the annotation): parsed
    as a base ``PretrainedConfig``, transformers found no model class for it (the GPU recipes' HF models failed to
    build) and ``pretrained=`` took it for a config object."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(HFCausalLM, "model")
    built = parser.instantiate(parser.parse_object({"model": {"config": {"model_type": "llama", **SHAPE}}}))
    assert isinstance(built.model.model, LlamaForCausalLM)
