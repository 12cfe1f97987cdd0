"""Corpora from the Hugging Face Hub, larger than memory: rows tokenised by the workers, streamed into shards.

    meta = prepare_hub_corpus(out_dir, "Skylion007/openwebtext", streaming=True)   # openwebtext.py, fineweb.py
    meta = write_hf_corpus(out_dir, ds, tokenizer, source=..., val_fraction=0.1)    # text.py --hf_dataset

A downloaded Dataset (memory-mapped Arrow files) is sent to each worker once and read by them, ``ROWS_PER_TASK``
rows per task; a streaming IterableDataset is read here and its texts sent to the workers. Each document is
followed by the end-of-text token. Splits: the first ``val_tokens`` tokens of the corpus are val and the rest
train; or, with ``val_fraction``, whole documents picked by ``ValRule``. Interrupted runs resume: at a row
range for a Dataset, and for an IterableDataset from the position its ``state_dict()`` saved (datasets
resumes at that data file and row); any other iterable of rows is read again from the start, without
tokenising, up to the row.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gptkit.cli import one_line
from gptkit.data.prepare import pipeline
from gptkit.data.prepare.local import distinct_chars
from gptkit.data.prepare.pipeline import Result, ValRule
from gptkit.data.prepare.pool import ordered_map
from gptkit.data.prepare.writer import (
    DEFAULT_SHARD_TOKENS,
    already_prepared,
    check_positive,
    make_fingerprint,
)
from gptkit.errors import DataError
from gptkit.network import hub_unreachable
from gptkit.tokenizer import Tokenizer, resolve_tokenizer

ROWS_PER_TASK = 256  # ~1 MB of web text
PARALLEL_MIN_BYTES = 16 << 20  # a smaller downloaded dataset is tokenised in this process (see local.py)


def prepare_hub_corpus(
    out_dir: Path,
    hf_path: str,
    config: str | None = None,
    *,
    tokenizer: str = "gpt2",
    streaming: bool = False,
    revision: str | None = None,
    num_proc: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_tokens: int | None = None,
    overwrite: bool = False,
    data_root: str = "data",
    started: float | None = None,
) -> dict[str, Any]:
    """The "train" split of a Hub dataset (and config), tokenised with the --tokenizer value, written to out_dir."""
    if tokenizer == "char" and streaming:
        raise DataError("--tokenizer char needs the whole corpus's characters before tokenising, which a stream "
                        "gives only by reading it twice; drop --streaming (the corpus is downloaded, then read "
                        "twice locally) or use another tokenizer")
    # A bad --tokenizer (or missing BPE files) fails here, before any download.
    tok = None if tokenizer == "char" else resolve_tokenizer(tokenizer, data_root=data_root)
    check_positive(shard_tokens, "--shard_tokens")
    source = f"https://huggingface.co/datasets/{hf_path}" + (f" ({config})" if config else "")
    fp = make_fingerprint(hub=[hf_path, config, revision, "train", "text"],
                          tokenizer=tok.to_meta() if tok else "char", shard_tokens=shard_tokens,
                          val_tokens=val_tokens, rows_per_task=ROWS_PER_TASK)
    meta = already_prepared(out_dir, fp, overwrite, source)
    if meta is not None:
        return meta
    ds = load_hf_dataset(hf_path, config, split="train", streaming=streaming, revision=revision)
    if tok is None:
        tok = resolve_tokenizer("char", data_root=data_root, chars=dataset_chars(ds, "text", num_proc))
    return write_hf_corpus(out_dir, ds, tok, source=source, num_proc=num_proc, shard_tokens=shard_tokens,
                           val_tokens=val_tokens, fingerprint=fp, started=started)


def load_hf_dataset(path: str, name: str | None = None, *, split: str = "train", streaming: bool = False,
                    revision: str | None = None) -> Any:
    """datasets.load_dataset with every failure (no network, unknown name, ...) turned into one line."""
    import datasets  # lazy: slow to import, and only these scripts need it

    label = path + (f" (config {name})" if name else "")
    offline = None if Path(path).exists() else hub_unreachable()  # a local folder needs no network
    try:
        if offline is not None:  # the local cache only, so that a miss fails at once, not after a minute of retries
            return _cached_dataset(path, name, split, streaming)
        return datasets.load_dataset(path, name, split=split, streaming=streaming, revision=revision)
    except Exception as e:
        msg = one_line(e)
        if offline is not None:
            raise DataError(f"cannot reach the Hugging Face Hub ({offline}) and dataset {label} is not in the local "
                            f"cache; connect to the network and run the same command again, or download the "
                            f"dataset's files (https://huggingface.co/datasets/{path}) into a folder on this machine "
                            f"and give that folder instead of the name") from None
        hint = "check your network connection (and HF_HUB_OFFLINE), the dataset name and --hf_split"
        if "scripts are no longer supported" in msg:
            hint = "this dataset still uses a loading script; try --revision refs/convert/parquet"
        raise DataError(f"could not load Hugging Face dataset {label} ({type(e).__name__}: {msg}); {hint}") from None


def _cached_dataset(path: str, name: str | None, split: str, streaming: bool) -> Any:
    """A Hub dataset from datasets' local cache alone, read by the library's own cache reader (what
    load_dataset falls back to offline), without changing any of the process' settings; an error if absent."""
    from datasets.packaged_modules.cache.cache import Cache

    builder = Cache(repo_id=path, dataset_name=path.split("/")[-1], config_name=name, version="auto", hash="auto")
    return builder.as_streaming_dataset(split=split) if streaming else builder.as_dataset(split=split)


def write_hf_corpus(
    out_dir: Path,
    ds: Any,
    tokenizer: Tokenizer,
    *,
    source: str,
    text_column: str = "text",
    num_proc: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_tokens: int | None = None,
    val_fraction: float | None = None,
    fingerprint: str | None = None,
    overwrite: bool = False,
    started: float | None = None,
) -> dict[str, Any]:
    """The whole pipeline for a Dataset, an IterableDataset or any iterable of {text_column: ...} rows.

    Splits: the first val_tokens tokens (default one shard) are val; or, given val_fraction, whole documents
    picked by ValRule (a Dataset only: it needs the number of rows). `fingerprint` identifies the input for
    resuming and for "already prepared" (default: the source, column, tokenizer and options).
    """
    check_positive(num_proc, "--num_proc")
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_column not in columns:
        raise DataError(f"the dataset has no column {text_column!r} (columns: {', '.join(columns)}); pass --text_column")
    rows = _num_rows(ds)
    if val_fraction is not None and rows is None:
        raise DataError("--val_fraction needs a dataset whose size is known; download it instead of streaming")
    val_rule = None if val_fraction is None else ValRule.for_documents(val_fraction, rows)
    fp = fingerprint or make_fingerprint(source=source, column=text_column, tokenizer=tokenizer.to_meta(),
                                         shard_tokens=shard_tokens, val_tokens=val_tokens,
                                         val_fraction=val_fraction, rows_per_task=ROWS_PER_TASK)
    meta = already_prepared(out_dir, fp, overwrite, source)
    if meta is not None:
        return meta
    workers = num_proc
    if _is_dataset(ds):
        extra = _text_only(ds, text_column)
        workers = _workers(extra, num_proc)

        def tasks(cursor: int | None) -> Iterator[RowTask]:
            for start in range((cursor or 0) * ROWS_PER_TASK, len(ds), ROWS_PER_TASK):
                yield RowTask(start // ROWS_PER_TASK + 1, start, min(start + ROWS_PER_TASK, len(ds)), None,
                              text_column, val_rule)
    else:
        extra = None

        def tasks(cursor: dict | None) -> Iterator[RowTask]:
            return _stream_tasks(ds, text_column, val_rule, cursor)

    job = pipeline.Job(out_dir, tokenizer, fp, source, tasks=tasks, work=encode_rows, workers=workers, extra=extra,
                       shard_tokens=shard_tokens, val_tokens=None if val_rule else val_tokens, total=rows,
                       unit="doc", what=source, started=started)
    return pipeline.run(job)


def dataset_chars(ds: Any, text_column: str, num_proc: int) -> str:
    """Every character of a downloaded dataset's texts (--tokenizer char), read by the workers."""
    if not _is_dataset(ds):
        raise DataError("--tokenizer char needs a downloaded dataset (its characters are collected first)")
    ranges = ((start, min(start + ROWS_PER_TASK, len(ds))) for start in range(0, len(ds), ROWS_PER_TASK))
    texts = _text_only(ds, text_column)
    chars: set[str] = set()
    with tqdm(total=len(ds), unit="doc", unit_scale=True, desc="scanning") as bar:
        for (start, end), found in ordered_map(_scan_rows, ranges, _workers(texts, num_proc),
                                               initializer=pipeline.init_worker, initargs=(None, (texts, text_column))):
            chars.update(found)
            bar.update(end - start)
    return "".join(sorted(chars))


def _scan_rows(rows: tuple[int, int]) -> str:
    ds, column = pipeline.worker_extra()
    return distinct_chars("".join(t or "" for t in ds[rows[0]:rows[1]][column]))


# ----------------------------------------------------------------------------------------------------------
# Tasks


@dataclass(frozen=True)
class RowTask:
    """Rows [start, end) of the corpus: read from the workers' Dataset, or given as `texts` (a stream)."""

    cursor: Any  # tasks done (a Dataset), or the stream's position after these rows
    start: int
    end: int
    texts: list[str] | None
    column: str
    val_rule: ValRule | None  # None: the tokens are one "stream" (val is its first tokens)


def encode_rows(task: RowTask) -> Result:
    """A worker's job: tokenise a task's rows, each followed by the end-of-text token."""
    tok = pipeline.worker_tokenizer()
    texts = task.texts if task.texts is not None else pipeline.worker_extra()[task.start : task.end][task.column]
    texts = [t or "" for t in texts]
    if task.val_rule is None:
        return Result({"stream": pipeline.encode_documents(tok, texts)}, len(texts), len(texts))
    by_split: dict[str, list[str]] = {}
    for i, text in enumerate(texts):
        by_split.setdefault(task.val_rule.split(task.start + i), []).append(text)
    return Result({s: pipeline.encode_documents(tok, ts) for s, ts in by_split.items()}, len(texts), len(texts))


def _stream_tasks(ds: Iterable[dict], column: str, val_rule: ValRule | None,
                  cursor: dict | None) -> Iterator[RowTask]:
    """Batches of rows of a stream, each with the position to resume after it."""
    done = 0 if cursor is None else cursor["rows"]
    resumable = hasattr(ds, "state_dict") and hasattr(ds, "load_state_dict")
    if cursor is not None and resumable and cursor.get("state") is not None:
        ds.load_state_dict(cursor["state"])
        it = iter(ds)
    else:
        it = itertools.islice(iter(ds), done, None)
    while True:
        texts = [_text(row, column) for row in _read(it, ROWS_PER_TASK)]
        if not texts:
            return
        state = ds.state_dict() if resumable else None
        yield RowTask({"rows": done + len(texts), "state": state}, done, done + len(texts), texts, column, val_rule)
        done += len(texts)


def _read(it: Iterator[dict], n: int) -> list[dict]:
    """Up to n rows; network failures mid-stream become one-line errors."""
    try:
        return list(itertools.islice(it, n))
    except Exception as e:
        raise DataError(f"reading the dataset stream failed ({type(e).__name__}: {one_line(e)}); check your network "
                        "connection and run the same command again: it continues where it stopped") from None


def _text(row: dict, column: str) -> str:
    if column not in row:
        raise DataError(f"the dataset has no column {column!r} (columns: {', '.join(row)}); pass --text_column")
    return row[column] or ""


def _text_only(ds: Any, column: str) -> Any:
    """The Dataset with just its text column: what the workers read (and are sent: a memory-mapped Dataset
    pickles as the paths of its files)."""
    return ds.select_columns([column]) if len(ds.column_names) > 1 else ds


def _workers(texts: Any, num_proc: int) -> int:
    return num_proc if texts.data.nbytes >= PARALLEL_MIN_BYTES else 1


def _is_dataset(ds: Any) -> bool:
    import datasets

    return isinstance(ds, datasets.Dataset)


def _num_rows(ds: Any) -> int | None:
    """The number of rows, when known (a Dataset, or a stream whose card says it)."""
    if _is_dataset(ds):
        return len(ds)
    try:
        return int(ds.info.splits[ds.split].num_examples) or None
    except Exception:  # no info, no split sizes: the progress bar has no ETA
        return None

