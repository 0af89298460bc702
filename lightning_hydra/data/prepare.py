"""``lightning-hydra prepare``: text to Megatron indexed token files, with a local Hugging Face tokenizer.

Each input is a JSON-lines file (one document per line, its text under ``--text-field``), a parquet file (the text
column), a plain file (one document), or a directory of them (every file below it, in sorted order). Documents are
tokenized in ``--workers`` processes, a batch at a time, with the tokenizer in ``--tokenizer`` (a directory holding
``tokenizer.json``, as ``save_pretrained`` writes it; its special tokens as the tokenizer adds them, so a
tokenizer that starts every text with BOS does so here) and the end-of-document token appended. The output is
``<output>.bin`` and ``<output>.idx`` in megatron-core's format (one sequence per document, ``uint16`` ids below
65,500 tokens of vocabulary, else ``int32``), which Megatron-LM, NeMo and MaxText read, and
:class:`~lightning_hydra.data.indexed.IndexedTokens` too; a summary of what was written goes to
``<output>.summary.json`` and the screen: documents, tokens, length percentiles, and the histogram of the lengths
the planner will see (with ``--max-seq-len``, of the pieces :class:`~lightning_hydra.HydraDataModule` splits longer
documents into with ``split_long``). Empty documents are left out.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_hydra.data.indexed import IndexedWriter, optimal_dtype
from lightning_hydra.errors import ConfigError

__all__ = ["encode_batch", "length_summary", "load_tokenizer", "prepare", "read_documents"]

BATCH_DOCS = 256
"""Documents per batch a worker tokenizes at once."""


# ---------------------------------------------------------------------------------------------- the tokenizer
def _special(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(directory: str | os.PathLike, eos_token: str | None = None) -> tuple[Any, int | None, int]:
    """The tokenizer of a local Hugging Face tokenizer directory (``tokenizer.json``, or the file itself), the id of
    its end-of-document token (``eos_token`` if given, else the directory's ``tokenizer_config.json`` or
    ``special_tokens_map.json`` ``eos_token``; ``None`` where it has none), and its vocabulary size."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - the data extra
        raise ConfigError("prepare needs tokenizers: pip install 'lightning-hydra[data]'") from exc
    path = Path(directory)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"{path} holds no tokenizer.json: name a local Hugging Face tokenizer directory (save_pretrained's)"
        )
    tokenizer = Tokenizer.from_file(str(file))
    if eos_token is None and path.is_dir():
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (path / name).is_file():
                eos_token = _special(json.loads((path / name).read_text()), "eos_token")
                if eos_token:
                    break
    eos = None
    if eos_token is not None:
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise ConfigError(f"the tokenizer in {path} has no token {eos_token!r} (the end-of-document token)")
    return tokenizer, eos, tokenizer.get_vocab_size(with_added_tokens=True)


def encode_batch(tokenizer: Any, texts: Sequence[str], eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the non-empty ``texts`` one after the other (``int64``, ``eos`` appended to each where given)
    and each document's count."""
    encodings = tokenizer.encode_batch([t for t in texts if t], add_special_tokens=True)
    ids = [[*e.ids, eos] if eos is not None else e.ids for e in encodings]
    ids = [doc for doc in ids if doc]
    lengths = np.fromiter((len(doc) for doc in ids), dtype=np.int64, count=len(ids))
    flat = np.concatenate([np.asarray(doc, dtype=np.int64) for doc in ids]) if ids else np.zeros(0, np.int64)
    return flat, lengths


_WORKER: dict[str, Any] = {}
"""A tokenizing process's tokenizer and end-of-document id."""


def _worker_start(directory: str, eos_token: str | None, append_eos: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    tokenizer, eos, _ = load_tokenizer(directory, eos_token)
    _WORKER.update(tokenizer=tokenizer, eos=eos if append_eos else None)


def _worker_encode(task: tuple[int, list[str]]) -> tuple[int, np.ndarray, np.ndarray]:
    k, texts = task
    return (k, *encode_batch(_WORKER["tokenizer"], texts, _WORKER["eos"]))


# ---------------------------------------------------------------------------------------------- the inputs
def _files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"input {path} does not exist")
    if not files:
        raise ConfigError(f"no input file in {', '.join(str(i) for i in inputs)}")
    return files


def read_documents(files: Sequence[Path], text_field: str = "text") -> Iterator[tuple[int, str]]:
    """``(file number, text)`` of every document of the input files, in order."""
    for k, path in enumerate(files):
        if path.suffix in (".jsonl", ".json", ".ndjson"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConfigError(f"{path} line {n} is not JSON ({exc.msg})") from None
                    if not isinstance(row, dict) or text_field not in row:
                        keys = ", ".join(list(row)[:8]) if isinstance(row, dict) else type(row).__name__
                        raise ConfigError(f"{path} line {n} has no {text_field!r} field (it has: {keys}); "
                                          "name the field with --text-field")  # fmt: skip
                    yield k, str(row[text_field] or "")
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            handle = pq.ParquetFile(str(path))
            if text_field not in handle.schema_arrow.names:
                names = ", ".join(handle.schema_arrow.names)
                raise ConfigError(f"{path} has no column {text_field!r} (it has: {names}); name it with --text-field")
            for batch in handle.iter_batches(columns=[text_field], batch_size=BATCH_DOCS):
                for text in batch.column(0).to_pylist():
                    yield k, text or ""
        else:
            yield k, path.read_text(encoding="utf-8", errors="replace")


def _batches(documents: Iterator[tuple[int, str]]) -> Iterator[tuple[int, list[str]]]:
    """Batches of :data:`BATCH_DOCS` texts, each with the number of the last file it read from."""
    batch: list[str] = []
    last = 0
    for k, text in documents:
        batch.append(text)
        last = k
        if len(batch) == BATCH_DOCS:
            yield last, batch
            batch = []
    if batch:
        yield last, batch


# ---------------------------------------------------------------------------------------------- the summary
def length_summary(lengths: np.ndarray, max_seq_len: int | None = None) -> dict[str, Any]:
    """Documents, tokens, length percentiles and the power-of-two length histogram of the units the planner will
    see (each document, or with ``max_seq_len`` its pieces of at most that many tokens)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    units = lengths
    if max_seq_len:
        pieces = (lengths + max_seq_len - 1) // max_seq_len
        last = lengths - (pieces - 1) * max_seq_len
        units = np.concatenate([np.full(int((pieces - 1).sum()), max_seq_len, dtype=np.int64), last])
    out: dict[str, Any] = {"documents": len(lengths), "tokens": int(lengths.sum())}
    if len(lengths):
        q = np.percentile(lengths, [50, 90, 99])
        out.update(p50=int(q[0]), p90=int(q[1]), p99=int(q[2]), max=int(lengths.max()), mean=float(lengths.mean()))
    out["max_seq_len"] = max_seq_len
    out["units"] = len(units)
    histogram: dict[str, int] = {}
    if len(units):
        top = int(np.ceil(np.log2(max(2, int(units.max())))))
        counts, _ = np.histogram(units, bins=[0] + [2**k for k in range(1, top + 1)])
        for k, count in enumerate(counts):
            low, high = (1 if k == 0 else 2**k + 1), 2 ** (k + 1)
            if count:
                histogram[f"{low}-{high}"] = int(count)
    out["histogram"] = histogram
    return out


def _print_summary(summary: dict[str, Any], console: Any) -> None:
    console.print(
        f"{summary['documents']:,} documents, {summary['tokens']:,} tokens -> {summary['output']}.bin/.idx "
        f"({summary['dtype']}, vocabulary {summary['vocab_size']:,})"
    )
    if summary["documents"]:
        console.print(
            f"tokens per document: p50 {summary['p50']:,}  p90 {summary['p90']:,}  p99 {summary['p99']:,}  "
            f"max {summary['max']:,}  mean {summary['mean']:,.1f}"
        )
    what = f"pieces of at most {summary['max_seq_len']:,} tokens" if summary["max_seq_len"] else "documents"
    console.print(f"the planner will see {summary['units']:,} {what}; lengths in tokens:")
    largest = max(summary["histogram"].values(), default=1)
    for bucket, count in summary["histogram"].items():
        console.print(f"  {bucket:>15}  {count:>10,}  {'#' * max(1, round(40 * count / largest))}")


# ---------------------------------------------------------------------------------------------- the command
def prepare(
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    tokenizer: str | os.PathLike,
    *,
    text_field: str = "text",
    workers: int = 1,
    eos_token: str | None = None,
    append_eos: bool = True,
    max_seq_len: int | None = None,
    progress: bool = True,
    console: Any = None,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into ``<output>.bin`` / ``<output>.idx`` and return (and write) the summary.

    Args:
        inputs: Files or directories (see the module's docstring).
        output: The output prefix.
        tokenizer: A local Hugging Face tokenizer directory (or its ``tokenizer.json``).
        text_field: The JSON field or parquet column of the text.
        workers: Tokenizing processes (1: in this process, the tokenizer's own threads).
        eos_token: The end-of-document token (default: the tokenizer's ``eos_token``).
        append_eos: Append it to every document.
        max_seq_len: Summarise the pieces of at most this many tokens the planner will see.
        progress: Show a progress bar.
        console: A ``rich`` console to print to (default: a new one on standard error).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    tok, eos, vocab = load_tokenizer(tokenizer, eos_token)
    if append_eos and eos is None:
        raise ConfigError(
            f"the tokenizer in {tokenizer} names no eos_token: give the end-of-document token with --eos-token "
            "(or --no-eos)"
        )
    files = _files(inputs)
    dtype = optimal_dtype(vocab)
    lengths: list[np.ndarray] = []
    read = 0
    bars = Progress(
        TextColumn("[bold]prepare"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
        TextColumn("{task.fields[documents]:,} documents, {task.fields[tokens]:,} tokens"), TimeElapsedColumn(),
        console=console, disable=not progress, transient=False,
    )  # fmt: skip
    batches = _batches(read_documents(files, text_field))
    eos_id = eos if append_eos else None
    pool = None
    if workers > 1:  # forked where the platform can: nothing to import again (the tokenizer ran no thread here)
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        pool = multiprocessing.get_context(method).Pool(
            workers, initializer=_worker_start, initargs=(str(tokenizer), eos_token, append_eos)
        )
        results: Iterator[tuple[int, np.ndarray, np.ndarray]] = pool.imap(_worker_encode, batches, chunksize=1)
    else:
        results = ((k, *encode_batch(tok, texts, eos_id)) for k, texts in batches)
    tokens = 0
    try:
        with bars, IndexedWriter(output, dtype) as writer:
            task = bars.add_task("prepare", total=len(files), documents=0, tokens=0)
            for k, flat, counts in results:
                writer.add_documents(flat, counts)
                lengths.append(counts)
                read += len(counts)
                tokens += int(flat.size)
                bars.update(task, completed=k, documents=read, tokens=tokens)
            bars.update(task, completed=len(files))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    summary = length_summary(all_lengths, max_seq_len)
    summary.update(output=str(output), dtype=np.dtype(dtype).name, vocab_size=vocab, eos_id=eos if append_eos else None,
                   inputs=[str(f) for f in files])  # fmt: skip
    Path(f"{output}.summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(summary, console)
    return summary
