"""Data at scale (issue 57): vectorised global batches equal to the loop's, Megatron indexed token files (read and
written byte for byte as megatron-core does), Arrow and parquet data, documents split at ``max_seq_len``, blends by
weight, the ``prepare`` command, bad input in one line, and one multi-rank run that trains a blend of a prepared
corpus, a megatron-core-written one and a ``datasets`` directory on 4 ranks (zero2), resumes on 2, and trains every
unit exactly once."""

from __future__ import annotations

import functools
import json
import operator
import struct
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

import lightning_hydra.data.batching as batching
from lightning_hydra import HydraDataModule
from lightning_hydra.data.batching import EpochBatches, epoch_permutation, reference_global_batches
from lightning_hydra.data.corpus import stdlib_files
from lightning_hydra.data.indexed import IndexedTokens, IndexedWriter, read_index
from lightning_hydra.data.mixture import Mixture, parse_sources
from lightning_hydra.errors import ConfigError

# ---------------------------------------------------------------------------------------------- helpers


def small_texts(count: int, skip: int = 0, low: int = 200, high: int = 1200) -> list[str]:
    """Texts of ``count`` standard-library files of ``low..high`` bytes (the embedded corpus, nothing fetched)."""
    files = [p for p in stdlib_files() if low <= p.stat().st_size <= high]
    return [p.read_text(errors="replace") for p in files[skip : skip + count]]


def train_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on the spot on the embedded corpus, BOS added to every text, saved as a
    Hugging Face tokenizer directory (``tokenizer.json`` and ``tokenizer_config.json``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(small_texts(60), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


def write_prefix(prefix: Path, docs: list[np.ndarray], dtype=np.uint16) -> IndexedTokens:
    with IndexedWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    return IndexedTokens(prefix)


# ---------------------------------------------------------------------------------------------- batches


@pytest.mark.timeout(120)
def test_vectorised_batches_are_the_loops_batches(monkeypatch) -> None:
    """Same seed, same batches as the sequence-by-sequence loop, whatever the block size of the running sums (a
    batch spanning blocks, a sequence over the budget, an empty dataset); each group's tokens before each batch."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        monkeypatch.setattr(batching, "CHUNK", int(rng.choice([1, 2, 3, 7, 50, 1 << 22])))
        n = int(rng.integers(0, 200))
        lengths = rng.integers(1, 300, n).astype(rng.choice([np.int32, np.int64]))
        budget = int(rng.integers(1, 900))
        groups = rng.integers(0, 3, n)
        for shuffle in (True, False):
            want = reference_global_batches(lengths, budget, seed=trial, epoch=2, shuffle=shuffle)
            got = EpochBatches(lengths, budget, seed=trial, epoch=2, shuffle=shuffle, groups=groups, num_groups=3)
            assert len(got) == len(want), trial
            for a, b in zip(want, got, strict=True):
                np.testing.assert_array_equal(a, b)
            seen = np.zeros(3, dtype=np.int64)
            for k, batch in enumerate(got):
                np.testing.assert_array_equal(got.tokens_before(k), seen)
                seen += np.bincount(groups[batch], weights=lengths[batch], minlength=3).astype(np.int64)
            np.testing.assert_array_equal(got.tokens_before(len(got)), seen)
    big = 1_000_003
    assert epoch_permutation(big, 7, 1).dtype == np.int32
    np.testing.assert_array_equal(epoch_permutation(big, 7, 1), np.random.default_rng([7, 1]).permutation(big))


# ---------------------------------------------------------------------------------------------- indexed files


_MEGATRON = r"""
import json, sys
import numpy as np, torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

task = json.loads(sys.argv[1])
for job in task["write"]:
    docs = np.load(job["docs"])
    docs = [docs[k] for k in sorted(docs.files, key=int)]
    builder = IndexedDatasetBuilder(job["prefix"] + ".bin", dtype=getattr(np, job["dtype"]))
    whole = len(docs) - 2 if job["multi"] else len(docs)
    for doc in docs[:whole]:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    if job["multi"]:  # a document of two sequences
        builder.add_document(np.concatenate(docs[whole:]), [len(d) for d in docs[whole:]])
    builder.finalize(job["prefix"] + ".idx")
read = {}
for prefix in task["read"]:
    data = IndexedDataset(prefix)
    read[prefix] = {"docs": [data[i].tolist() for i in range(len(data))],
                    "document_indices": data.document_indices.tolist()}
print(json.dumps(read))
"""
"""What megatron-core does, in a process of its own (its import takes seconds and sets things up that the other
tests' processes should not inherit): write with its builder, read with its ``IndexedDataset``."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, tokenizer) -> dict | None:
    """In one run of megatron-core (``None`` where it is not installed, the ``megatron`` extra): its builder writes
    random documents (``uint16`` and ``int32``, the last document of two sequences) and a corpus of the embedded
    texts tokenized on the spot; its reader reads the files :class:`IndexedWriter` wrote from the same documents."""
    import subprocess
    import sys

    from tokenizers import Tokenizer

    tmp = tmp_path_factory.mktemp("megatron")
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 60000, int(n)) for n in rng.integers(1, 40, 25)]
    np.savez(tmp / "docs.npz", **{str(i): d for i, d in enumerate(docs)})
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    corpus = [np.asarray([*tok.encode(t).ids, 2]) for t in small_texts(5, skip=5, low=150, high=700)]
    np.savez(tmp / "corpus.npz", **{str(i): d for i, d in enumerate(corpus)})
    task: dict = {"write": [], "read": []}
    for dtype in ("uint16", "int32"):
        ours = tmp / f"ours_{dtype}"
        with IndexedWriter(ours, np.dtype(dtype)) as writer:
            for doc in docs[:-2]:
                writer.add_document(doc)
            writer.add_document(np.concatenate(docs[-2:]), [len(docs[-2]), len(docs[-1])])
        task["write"].append({"prefix": str(tmp / f"theirs_{dtype}"), "dtype": dtype, "docs": str(tmp / "docs.npz"),
                              "multi": True})  # fmt: skip
        task["read"].append(str(ours))
    task["write"].append({"prefix": str(tmp / "corpus"), "dtype": "uint16", "docs": str(tmp / "corpus.npz"),
                          "multi": False})  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _MEGATRON, json.dumps(task)], capture_output=True, text=True)
    if "No module named 'megatron'" in done.stderr:
        return None
    assert done.returncode == 0, done.stderr[-3000:]
    return {"dir": tmp, "docs": docs, "corpus": tmp / "corpus", "read": json.loads(done.stdout.splitlines()[-1])}


@pytest.mark.timeout(120)
def test_indexed_files_are_megatron_cores_byte_for_byte(megatron) -> None:
    """Files megatron-core's builder writes read here; files written here are byte-identical to its and read by its
    ``IndexedDataset`` (one sequence per document, and a document of several sequences)."""
    if megatron is None:
        pytest.skip("megatron-core is not installed (the megatron extra)")
    docs, tmp = megatron["docs"], megatron["dir"]
    for dtype in ("uint16", "int32"):
        theirs, ours = tmp / f"theirs_{dtype}", tmp / f"ours_{dtype}"
        for suffix in (".bin", ".idx"):
            assert Path(f"{ours}{suffix}").read_bytes() == Path(f"{theirs}{suffix}").read_bytes(), suffix
        read_here = IndexedTokens(theirs)
        assert read_here.files[0].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(read_here.lengths(), [len(d) for d in docs])
        for i, doc in enumerate(docs):
            np.testing.assert_array_equal(read_here.read(i), doc)
        np.testing.assert_array_equal(read_here.read(3, 2, 5), docs[3][2:7])
        read_there = megatron["read"][str(ours)]
        assert read_there["docs"] == [d.tolist() for d in docs]
        assert read_index(theirs).document_index.tolist() == read_there["document_indices"] == [*range(24), 25]


def _corrupt(prefix: Path, kind: str) -> None:
    idx, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    raw = bytearray(idx.read_bytes())
    if kind == "no idx":
        idx.unlink()
    elif kind == "no bin":
        data.unlink()
    elif kind == "header":
        raw[:4] = b"XXXX"
    elif kind == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif kind == "float":
        raw[17] = 7
    elif kind == "code":
        raw[17] = 42
    elif kind == "truncated":
        raw = raw[:-5]
    elif kind == "bin size":
        data.write_bytes(data.read_bytes()[:-2])
    if kind not in ("no idx", "no bin", "bin size"):
        idx.write_bytes(bytes(raw))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("no idx", r"\.idx not found"),
        ("no bin", r"\.bin not found"),
        ("header", "is not a Megatron index"),
        ("version", "index of version 2; this reader reads version 1"),
        ("float", "holds float32 values; token files hold integer ids"),
        ("code", "token type code 42"),
        ("truncated", "the file is truncated"),
        ("bin size", "do not belong together"),
    ],
)
def test_bad_indexed_files_are_one_line_before_any_rank_starts(tmp_path: Path, kind: str, match: str) -> None:
    prefix = tmp_path / "corpus"
    write_prefix(prefix, [np.arange(5), np.arange(7)])
    _corrupt(prefix, kind)
    with pytest.raises(ConfigError, match=match):
        HydraDataModule(sources=str(prefix), global_batch_tokens=64).lengths_before_setup()


# ---------------------------------------------------------------------------------------------- arrow and parquet


@pytest.mark.timeout(120)
def test_datasets_directories_parquet_and_dataset_objects_read_by_offsets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_hydra.data.arrow import ArrowTokens

    rng = np.random.default_rng(2)
    rows = [rng.integers(0, 250, int(n)).tolist() for n in rng.integers(0, 30, 40)]  # some empty rows
    data = datasets.Dataset.from_dict({"input_ids": rows, "text": ["x"] * len(rows)})
    data.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    datasets.DatasetDict({"train": data, "validation": data.select(range(5))}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "parquet" / "part").mkdir(parents=True)
    table = pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int64()))})
    pq.write_table(table.slice(0, 25), tmp_path / "parquet" / "a.parquet", row_group_size=7)
    pq.write_table(table.slice(25), tmp_path / "parquet" / "part" / "b.parquet", row_group_size=4)
    shuffled = data.shuffle(seed=0)  # an indices mapping over the table
    cases = {
        "saved": (ArrowTokens(tmp_path / "saved"), rows),
        "dict": (ArrowTokens(tmp_path / "dict", split="validation"), rows[:5]),
        "parquet": (ArrowTokens(tmp_path / "parquet"), rows),
        "object": (ArrowTokens(shuffled), shuffled["input_ids"]),
    }
    for name, (tokens, want) in cases.items():
        assert tokens.lengths().tolist() == [len(r) for r in want], name
        for i in (0, len(want) // 2, len(want) - 1):
            assert tokens.read(i).tolist() == list(want[i]), (name, i)
        assert tokens[3].dtype == torch.long
    assert ArrowTokens(tmp_path / "parquet").read(30, 1, 3).tolist() == rows[30][1:4]
    with pytest.raises(ConfigError, match=r"column 'text' of .* is string, not a list of integer token ids.*prepare"):
        ArrowTokens(tmp_path / "saved", column="text")
    with pytest.raises(ConfigError, match=r"has no column 'ids' \(columns: input_ids, text\)"):
        ArrowTokens(tmp_path / "saved", column="ids")
    with pytest.raises(ConfigError, match=r"holds the splits \['train', 'validation'\], not 'test'"):
        ArrowTokens(tmp_path / "dict", split="test")
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"input_ids": [[1.5, 2.0]]}), floats)
    with pytest.raises(ConfigError, match="list<element: double>, not a list of integer"):
        HydraDataModule(sources=str(floats), global_batch_tokens=64).lengths_before_setup()
    # through the data module: empty rows are left out, the rest trained as units; a datasets.Dataset given as the
    # training data is read through its Arrow table (its lengths from the offsets, no item read at set-up)
    data_module = HydraDataModule(sources=str(tmp_path / "saved"), global_batch_tokens=64)
    np.testing.assert_array_equal(data_module.lengths_before_setup()["train"], [len(r) for r in rows if r])
    data_module = HydraDataModule(shuffled, global_batch_tokens=64)
    data_module.setup("fit")
    assert isinstance(data_module._sources["train"].sources[0], ArrowTokens)
    assert data_module._sources["train"].lengths.tolist() == [len(r) for r in shuffled["input_ids"] if len(r)]


# ---------------------------------------------------------------------------------------------- units and blends


class _Lengths:
    """A token source of given lengths whose tokens are ``(document * 1000 + position) % 997``."""

    def __init__(self, lengths, name: str = "s") -> None:
        self._lengths = np.asarray(lengths)
        self.name = name

    def __len__(self) -> int:
        return len(self._lengths)

    def lengths(self) -> np.ndarray:
        return self._lengths

    def describe(self, index: int) -> str:
        return f"document {index} of {self.name}"

    def read(self, index: int, offset: int = 0, count: int | None = None) -> np.ndarray:
        full = (index * 1000 + np.arange(int(self._lengths[index]))) % 997
        return full[offset : None if count is None else offset + count]


@pytest.mark.timeout(60)
def test_long_documents_split_into_consecutive_pieces_and_empty_ones_are_left_out(tmp_path: Path) -> None:
    docs = [np.arange(5), np.arange(100, 123), np.arange(200, 210), np.zeros(0, int), np.arange(300, 341)]
    tokens = write_prefix(tmp_path / "c", docs)
    split = Mixture([tokens], "train", max_seq_len=10, long="split")
    # first pieces in document order (the empty document left out), then the further pieces
    assert split.lengths.tolist() == [5, 10, 10, 10, 10, 3, 10, 10, 10, 1]
    assert [split.locate(u)[1:3] for u in range(len(split))] == [
        (0, 0), (1, 0), (2, 0), (4, 0), (1, 10), (1, 20), (4, 10), (4, 20), (4, 30), (4, 40)
    ]  # fmt: skip
    pieces = {}
    for unit in range(len(split)):
        _, doc, offset, _ = split.locate(unit)
        pieces.setdefault(doc, {})[offset] = split.item(unit).tolist()
    for doc, parts in pieces.items():
        assert functools.reduce(operator.iadd, (parts[k] for k in sorted(parts)), []) == docs[doc].tolist()
    assert split.describe(5) == f"tokens 20..22 of sequence 1 of {tmp_path / 'c.bin'}"
    cut = Mixture([tokens], "train", max_seq_len=10, long="truncate")
    assert cut.lengths.tolist() == [5, 10, 10, 10] and cut.item(3).tolist() == docs[4][:10].tolist()
    with pytest.raises(ConfigError, match=r"the train source e holds no documents \(all 1 are empty\)"):
        Mixture([write_prefix(tmp_path / "e", [np.zeros(0, int)])], "train").lengths  # noqa: B018
    # every read is checked against the vocabulary; set-up checks a sample (the first and last documents always)
    split.vocab_size = 300
    with pytest.raises(ValueError, match=r"sequence 4 of .*c\.bin holds token id 310 \(at token 10\), outside"):
        split.item(6)
    with pytest.raises(ConfigError, match=r"sequence 4 of .*c\.bin holds token id 300 \(at token 0\)"):
        split.check_sample(300)


@pytest.mark.timeout(120)
def test_a_blend_draws_its_weights_and_each_source_epoch_exactly_once() -> None:
    rng = np.random.default_rng(3)
    sizes = (4000, 700, 150)  # the small source is drawn over several of its epochs per blend epoch
    sources = [_Lengths(rng.integers(1, 200 * (s + 1), n), f"s{s}") for s, n in enumerate(sizes)]
    weights = [0.5, 0.3, 0.2]
    mix = Mixture(sources, "train", weights=weights, blend=True)
    budget = 4096
    streams: list[list[int]] = [[], [], []]
    for epoch in range(3):
        batches = mix.epoch_batches(budget, seed=11, epoch=epoch, shuffle=True)
        order = np.concatenate(list(batches))
        np.testing.assert_array_equal(np.sort(order), np.sort(mix.blend_order(11, epoch)))
        source = mix.unit_source[order]
        tokens = np.bincount(source, weights=mix.lengths[order], minlength=3)
        np.testing.assert_array_equal(batches.tokens_before(len(batches)), tokens)
        share = tokens / tokens.sum()
        # sampling error of the drawn units' lengths (a source drawn in whole source epochs has none)
        spread = [mix.lengths[mix.offsets[s] : mix.offsets[s + 1]].std() for s in range(3)]
        for s in range(3):
            draws = int(mix.draws[s])
            error = 4 * spread[s] * np.sqrt(draws) / tokens.sum() + 2e-3
            assert abs(share[s] - weights[s]) < error, (epoch, s, share, weights)
            streams[s] += (order[source == s] - mix.offsets[s]).tolist()
    for s, n in enumerate(sizes):  # each source's units in consecutive source epochs, each a whole permutation
        stream = np.asarray(streams[s])
        for start in range(0, len(stream) - n + 1, n):
            assert sorted(stream[start : start + n].tolist()) == list(range(n)), s
    assert mix.draws[2] > sizes[2]  # the small source was repeated whole epochs at a time
    again = Mixture(sources, "train", weights=weights, blend=True).blend_order(11, 1)
    np.testing.assert_array_equal(again, mix.blend_order(11, 1))
    assert not np.array_equal(mix.blend_order(12, 1), again)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([{"path": "PREFIX", "weight": -0.5}], r"sources\[0\] \(.*\) has weight -0.5: weights must be >= 0"),
        ([{"path": "PREFIX", "weight": 0}, {"path": "PREFIX", "weight": 0.0}], "the weights of sources are all zero"),
        ([{"path": "PREFIX", "weights": 1}], r"unknown key\(s\) \['weights'\]"),
        (["MISSING"], "is neither a file, a directory nor the prefix of indexed token files"),
        ([{"path": "PREFIX", "name": "a"}, {"path": "PREFIX", "name": "a"}], "two sources of sources are named 'a'"),
        ([], "sources is empty"),
    ],
)
def test_bad_sources_are_one_line_at_construction(tmp_path: Path, value, match: str) -> None:
    write_prefix(tmp_path / "c", [np.arange(3)])

    def fill(v):
        if isinstance(v, list):
            return [fill(x) for x in v]
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        return str(tmp_path / "c") if v == "PREFIX" else str(tmp_path / "missing") if v == "MISSING" else v

    with pytest.raises(ConfigError, match=match):
        HydraDataModule(sources=fill(value), global_batch_tokens=64)
    assert [s.name for s in parse_sources([str(tmp_path / "c"), str(tmp_path / "c")])] == ["c", "c_1"]
    with pytest.raises(ValueError, match="give the training data once"):
        HydraDataModule([[1, 2]], sources=str(tmp_path / "c"), global_batch_tokens=64)
    with pytest.raises(ValueError, match="split_long=True needs max_seq_len"):
        HydraDataModule(sources=str(tmp_path / "c"), global_batch_tokens=64, split_long=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("vocabulary", r"^sequence 2 of .*c\.bin holds token id 999 \(at token 2\), outside the model's vocabulary"),
        ("long", r"^train sequence 1 \(sequence 1 of .*c\.bin\) has 90 tokens, over max_seq_len=64.*split_long=True"),
        ("weights", r"^the weights of sources are all zero"),
    ],
)
def test_bad_data_by_path_stops_the_run_before_any_rank_starts(tmp_path: Path, bad: str, match: str) -> None:
    from lightning_hydra import DecoderLM, HydraStrategy

    # the last document is always sampled
    docs = [np.arange(5), np.arange(90), np.array([1, 2, 999 if bad == "vocabulary" else 3, 4])]
    write_prefix(tmp_path / "c", docs)
    strategy = HydraStrategy(ranks_per_node=4, max_tokens_per_rank=1024)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, default_root_dir=tmp_path / "r")
    sources = [{"path": str(tmp_path / "c"), "weight": 0.0 if bad == "weights" else 1.0}]
    model = DecoderLM(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    with pytest.raises(ConfigError, match=match) as raised:
        data = HydraDataModule(
            sources=sources, global_batch_tokens=1000, pad_id=0, max_seq_len=64, split_long=bad != "long"
        )
        trainer.fit(model, data)
    assert "\n" not in str(raised.value)  # one line
    assert strategy.launcher.procs == []  # found in the launching process: no rank was started


# ---------------------------------------------------------------------------------------------- prepare


@pytest.mark.timeout(120)
def test_prepare_tokenizes_jsonl_parquet_and_plain_files(tmp_path: Path, tokenizer: Path, capsys) -> None:
    """Text in, megatron-core's format out (:class:`IndexedWriter`, byte-identical to its builder's), BOS as the
    tokenizer adds it, EOS appended, several processes, and the summary of what the planner will see."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from lightning_hydra.cli import main

    texts = small_texts(12, skip=70)
    (tmp_path / "in" / "plain").mkdir(parents=True)
    with open(tmp_path / "in" / "a.jsonl", "w") as f:
        for text in texts[:5]:
            f.write(json.dumps({"text": text, "id": 1}) + "\n")
        f.write(json.dumps({"text": ""}) + "\n")  # an empty document: left out
    pq.write_table(pa.table({"text": texts[5:9]}), tmp_path / "in" / "b.parquet")
    for k, text in enumerate(texts[9:]):
        (tmp_path / "in" / "plain" / f"{k}.py").write_text(text)
    out = tmp_path / "out" / "corpus"
    args = ["prepare", str(tmp_path / "in"), "--tokenizer", str(tokenizer), "--output", str(out), "--workers", "2"]
    assert main([*args, "--max-seq-len", "64", "--json", "--no-progress"]) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out.strip().splitlines()[-1])
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    want = [[*tok.encode(t).ids, eos] for t in texts]  # BOS as the tokenizer adds it, EOS appended
    assert all(w[0] == tok.token_to_id("<s>") for w in want)
    read = IndexedTokens(out)
    assert [read.read(i).tolist() for i in range(len(read))] == want
    assert read.files[0].dtype == np.uint16
    assert summary["documents"] == len(texts) and summary["tokens"] == sum(map(len, want))
    assert summary["units"] == sum((len(w) + 63) // 64 for w in want)
    assert sum(summary["histogram"].values()) == summary["units"]
    assert "the planner will see" in printed.err and json.loads(Path(f"{out}.summary.json").read_text()) == summary
    assert main(["prepare", str(tmp_path / "in" / "b.parquet"), "--tokenizer", str(tokenizer), "--output",
                 str(out), "--text-field", "body"]) == 1  # fmt: skip
    assert "has no column 'body' (it has: text)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- recipes and ranks


class TrainedTokens(pl.Callback):
    """Each rank writes, per step, the (unit, position in the unit, token id) of every real token it trained and
    the step's per-source metrics, to ``<out>.rank<r>``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        from lightning_hydra.cp.layout import ZigzagMeta, zigzag_source_index

        tokens = []
        for mb in batch.microbatches:
            if not mb.num_tokens:
                continue
            meta = ZigzagMeta.from_cu_seqlens(mb.cu_seqlens, len(mb.ranks))
            source = zigzag_source_index(meta, mb.ranks.index(trainer.global_rank))[1]
            real = source >= 0
            cu = np.asarray(mb.cu_seqlens)
            for s, token in zip(source[real].tolist(), mb.input_ids[real].tolist(), strict=True):
                doc = int(np.searchsorted(cu, s, side="right")) - 1
                tokens.append([mb.seq_ids[doc], s - int(cu[doc]), token])
        self.steps.append({"epoch": batch.epoch, "step": batch.step, "tokens": tokens, **batch.source_metrics()})

    def on_train_end(self, trainer, module) -> None:
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(self.steps))


def _recipe(tmp: Path, name: str, sources: list[dict], devices: int, max_steps: int, save: bool) -> Path:
    """A recipe training the blend by path on ``devices`` CPU ranks (zero2), recording what each rank trained."""
    callbacks = [
        {"class_path": "tests.test_data.TrainedTokens", "init_args": {"out": str(tmp / name)}},
        {"class_path": "lightning_hydra.BubbleMonitor"},
    ]
    if save:
        callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                          "init_args": {"dirpath": str(tmp / "ckpt"), "every_n_train_steps": max_steps,
                                        "filename": "stop"}})  # fmt: skip
    recipe = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": devices, "max_steps": max_steps, "max_epochs": 1,
            "enable_checkpointing": save, "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp / "logs"), "name": name}},
            "callbacks": callbacks,
            "strategy": {"class_path": "lightning_hydra.HydraStrategy",
                         "init_args": {"max_tokens_per_rank": 192, "num_microbatches": 2, "ranks_per_node": 2,
                                       "start_method": "forkserver", "kernel": "cpu", "sharding": "zero2"}},
        },
        "model": {"class_path": "lightning_hydra.DecoderLM",
                  "init_args": {"vocab_size": 300, "hidden_size": 32, "num_layers": 1, "num_heads": 4,
                                "num_kv_heads": 2}},
        "data": {"sources": sources, "global_batch_tokens": 480, "max_seq_len": 96, "split_long": True,
                 "pad_id": 0, "seed": 3, "planning_process": False},
    }  # fmt: skip
    import yaml

    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _fit_recipe(recipe: Path, ckpt: Path | None = None) -> None:
    """``lightning-hydra fit --config recipe [--ckpt_path ckpt]``, parsed by LightningCLI as the command parses it,
    the fit run here (the command's own CLI object does not pickle to the ranks of an in-process launch)."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_hydra.models.module import HydraModule

    cli = LightningCLI(
        HydraModule, HydraDataModule, subclass_mode_model=True, run=False, save_config_callback=None,
        auto_configure_optimizers=False, args=["--config", str(recipe)],
    )  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=None if ckpt is None else str(ckpt))


@pytest.mark.timeout(300)
def test_a_blend_by_path_trains_on_4_ranks_resumes_on_2_and_trains_every_unit_once(
    tmp_path: Path, tokenizer: Path, megatron: dict | None, isolated_process
) -> None:
    """A recipe blends, by path and weight, a corpus written by ``prepare``, one written by megatron-core's builder,
    a ``datasets`` directory (``save_to_disk``) and a parquet directory, documents split at ``max_seq_len``. 4 ranks
    (zero2) train the first steps of the epoch and save; 2 ranks resume from the checkpoint and train the rest, the
    same batches. Every unit of the epoch's order was trained exactly once, every token as its file holds it, and
    each step's tokens per source are in the metrics (the dashboard's records)."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from lightning_hydra.data.prepare import prepare

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in small_texts(3, skip=10, low=150, high=700))
    prepare([tmp_path / "a.jsonl"], tmp_path / "prepared", tokenizer, progress=False)
    if megatron is not None:  # written by megatron-core's own builder
        written = megatron["corpus"]
    else:  # without megatron-core: ours, byte-identical (test_indexed_files_are_megatron_cores_byte_for_byte)
        written = tmp_path / "megatron"
        write_prefix(written, [np.asarray([*tok.encode(t).ids, 2]) for t in small_texts(5, skip=5, low=150, high=700)])
    ids = [[*tok.encode(t).ids, 2] for t in small_texts(5, skip=15, low=150, high=700)]
    datasets.Dataset.from_dict({"input_ids": ids[:3]}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"input_ids": ids[3:]}), tmp_path / "pq" / "part-0.parquet")
    sources = [
        {"path": str(tmp_path / "prepared"), "weight": 0.4},
        {"path": str(written), "weight": 0.3, "name": "megatron"},
        {"path": str(tmp_path / "hf"), "weight": 0.2},
        {"path": str(tmp_path / "pq"), "weight": 0.1},
    ]
    mixture = HydraDataModule(sources=sources, global_batch_tokens=480, max_seq_len=96, split_long=True)._by_path(
        "train"
    )
    batches = mixture.epoch_batches(480, seed=3, epoch=0, shuffle=True)
    assert len(mixture) > 3 + 5 + 3 + 2 and (mixture.lengths == 96).any()  # documents split into pieces
    first = 2
    assert len(batches) > first + 1, len(batches)
    _fit_recipe(_recipe(tmp_path, "first", sources, 4, first, save=True))
    _fit_recipe(_recipe(tmp_path, "rest", sources, 2, len(batches), save=False), tmp_path / "ckpt" / "stop.ckpt")
    runs = [json.loads(Path(f"{tmp_path / 'first'}.rank{r}").read_text()) for r in range(4)]
    rest = [json.loads(Path(f"{tmp_path / 'rest'}.rank{r}").read_text()) for r in range(2)]
    assert [[s["step"] for s in rank] for rank in runs] == [list(range(first))] * 4
    assert [[s["step"] for s in rank] for rank in rest] == [list(range(first, len(batches)))] * 2
    for k in range(len(batches)):
        ranks = runs if k < first else rest
        trained = Counter((u, p) for rank in ranks for s in rank if s["step"] == k for u, p, _ in s["tokens"])
        want = Counter((int(u), p) for u in batches[k] for p in range(int(mixture.lengths[u])))
        assert trained == want, k  # the step's units, each token once (a unit drawn twice: twice)
        for rank in ranks:
            step = next(s for s in rank if s["step"] == k)
            mix = [step[f"data/tokens/{n}"] for n in mixture.metric_names()]
            assert mix == mixture.source_tokens(batches[k]).tolist()
    for rank in runs + rest:  # every token as its file holds it (pieces of split documents included)
        for step in rank:
            for unit, position, token in step["tokens"]:
                assert token == int(mixture.item(unit)[position])
    records = (tmp_path / "logs" / "rest").rglob("hydra_steps.jsonl")
    last = json.loads(next(records).read_text().splitlines()[-1])["metrics"]
    seen = batches.tokens_before(len(batches))
    for name, tokens, weight in zip(mixture.metric_names(), seen, mixture.weights, strict=True):
        assert last[f"data/share/{name}"] == pytest.approx(tokens / seen.sum())
        assert last[f"data/weight/{name}"] == pytest.approx(weight)
