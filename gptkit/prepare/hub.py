"""Corpora from the Hugging Face Hub, larger than memory: streamed through the tokenizer into shards.

    meta = prepare_gpt2_corpus(out_dir, "Skylion007/openwebtext", streaming=True)   # openwebtext.py, fineweb.py

A downloaded dataset is tokenised with ``Dataset.map(num_proc=...)`` (cached by datasets, so an interrupted
run resumes quickly); a streaming one batch by batch in a thread pool as it arrives. Each document is
followed by the end-of-text token. The first ``val_tokens`` tokens of the stream are val, the rest train,
and the writer holds at most one shard of tokens in memory, whatever the corpus size.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptkit import shards
from gptkit.cli import one_line
from gptkit.prepare.local import encode_texts, with_eot
from gptkit.prepare.writer import DEFAULT_SHARD_TOKENS, DatasetWriter, check_positive
from gptkit.shards import DataError
from gptkit.tokenizer import Tokenizer


def add_corpus_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by openwebtext.py and fineweb.py."""
    parser.add_argument("--streaming", action="store_true", help="stream from the Hub instead of downloading first")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    parser.add_argument("--val_tokens", type=int, default=None, help="val split size (default: one shard)")
    parser.add_argument("--revision", default=None, help="dataset revision on the Hub (branch, tag or commit)")


def prepare_gpt2_corpus(
    out_dir: Path,
    hf_path: str,
    config: str | None = None,
    *,
    streaming: bool = False,
    revision: str | None = None,
    num_proc: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_tokens: int | None = None,
) -> dict[str, Any]:
    """The "train" split of a Hub dataset (and config), GPT-2-tokenised, written to out_dir."""
    tokenizer = Tokenizer.tiktoken("gpt2")  # fail fast (before any download) if the BPE files are missing
    ds = load_hf_dataset(hf_path, config, split="train", streaming=streaming, revision=revision)
    source = f"https://huggingface.co/datasets/{hf_path}" + (f" ({config})" if config else "")
    return write_hf_corpus(
        out_dir, ds, tokenizer, source=source, num_proc=num_proc, shard_tokens=shard_tokens, val_tokens=val_tokens
    )


def load_hf_dataset(path: str, name: str | None = None, *, split: str = "train", streaming: bool = False,
                    revision: str | None = None) -> Any:
    """datasets.load_dataset with every failure (no network, unknown name, ...) turned into one line."""
    import datasets  # lazy: slow to import, and only these scripts need it

    label = path + (f" (config {name})" if name else "")
    try:
        return datasets.load_dataset(path, name, split=split, streaming=streaming, revision=revision)
    except Exception as e:
        msg = one_line(e)
        hint = "check your network connection (and HF_HUB_OFFLINE), the dataset name and --hf_split"
        if "scripts are no longer supported" in msg:
            hint = "this dataset still uses a loading script; try --revision refs/convert/parquet"
        raise DataError(f"could not load Hugging Face dataset {label} ({type(e).__name__}: {msg}); {hint}") from None


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
) -> dict[str, Any]:
    """The whole big-corpus pipeline for any Dataset/IterableDataset (or iterable of {"text": ...} rows)."""
    chunks = tokenize_hf_dataset(ds, tokenizer, text_column=text_column, num_proc=num_proc)
    return write_token_stream(
        out_dir, chunks, tokenizer, source=source, shard_tokens=shard_tokens, val_tokens=val_tokens, what=source
    )


def write_token_stream(
    out_dir: Path,
    chunks: Iterable[np.ndarray],
    tokenizer: Tokenizer,
    *,
    source: str,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_tokens: int | None = None,
    what: str = "the corpus",
) -> dict[str, Any]:
    """Write a stream of token arrays (documents already followed by EOT): the first ``val_tokens`` tokens
    (default: one shard's worth) are the val split, everything after is train.

    Only one shard's buffer is held at a time (the val writer is closed before train starts filling), so
    memory does not grow with the corpus. The size check happens at the end; a refused corpus is deleted.
    """
    val_target = shard_tokens if val_tokens is None else val_tokens
    check_positive(val_target, "--val_tokens")
    with DatasetWriter(out_dir, tokenizer, shard_tokens) as writer, tqdm(unit="tok", unit_scale=True, desc="writing") as bar:
        n_val = 0
        for arr in chunks:
            bar.update(len(arr))
            if n_val < val_target:
                take = min(len(arr), val_target - n_val)
                writer.write("val", arr[:take])
                n_val += take
                arr = arr[take:]
                if n_val == val_target:
                    writer.close_split("val")
            if len(arr):
                writer.write("train", arr)
        return writer.finish(source, what)


# ----------------------------------------------------------------------------------------------------------
# Tokenising a Dataset or a stream


_WORKER_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenize_batch(batch: dict[str, list], *, spec: dict[str, Any], text_column: str) -> dict[str, list]:
    """datasets.map function (runs in worker processes): each text -> its ids followed by EOT."""
    key = repr(spec)
    if key not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[key] = Tokenizer.from_meta(spec)
    tok = _WORKER_TOKENIZERS[key]
    dtype = shards.dtype_for_vocab(tok.vocab_size)
    return {"ids": [with_eot(tok.encode_array(t or "").astype(dtype), tok.eot_id) for t in batch[text_column]]}


def tokenize_hf_dataset(ds: Any, tokenizer: Tokenizer, *, text_column: str = "text", num_proc: int = 1,
                        batch_docs: int = 1024) -> Iterator[np.ndarray]:
    """Yield token chunks (several documents each, each followed by EOT) of a datasets Dataset or
    IterableDataset, in order.

    A downloaded Dataset is tokenised with ``Dataset.map(num_proc=...)`` (cached by datasets, so a re-run
    skips it); a streaming IterableDataset is tokenised batch by batch in a thread pool as it arrives.
    """
    import datasets

    check_positive(num_proc, "--num_proc")
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_column not in columns:
        raise DataError(f"the dataset has no column {text_column!r} (columns: {', '.join(columns)}); pass --text_column")
    if isinstance(ds, datasets.Dataset):
        value = "uint16" if shards.dtype_for_vocab(tokenizer.vocab_size).itemsize == 2 else "uint32"
        mapped = ds.map(
            _tokenize_batch,
            batched=True,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=ds.column_names,
            fn_kwargs={"spec": tokenizer.to_meta(), "text_column": text_column},
            features=datasets.Features({"ids": datasets.List(datasets.Value(value))}),
            desc="tokenizing",
        )
        # Arrow batches: the flattened ids of a batch are one zero-copy numpy array.
        for table in mapped.with_format("arrow").iter(batch_size=batch_docs):
            for chunk in table.column("ids").chunks:
                yield chunk.flatten().to_numpy(zero_copy_only=False)
        return
    yield from _tokenize_stream(ds, tokenizer, text_column, num_proc, batch_docs)


def _tokenize_stream(ds: Iterable[dict], tokenizer: Tokenizer, text_column: str, num_proc: int,
                     batch_docs: int) -> Iterator[np.ndarray]:
    with ThreadPoolExecutor(num_proc) as pool:
        batch: list[str] = []
        for row in _rows(ds, text_column):
            batch.append(row)
            if len(batch) == batch_docs:
                yield _encode_docs(tokenizer, batch, num_proc, pool)
                batch = []
        if batch:
            yield _encode_docs(tokenizer, batch, num_proc, pool)


def _encode_docs(tokenizer: Tokenizer, docs: list[str], num_proc: int, pool: ThreadPoolExecutor) -> np.ndarray:
    arrays = encode_texts(tokenizer, docs, num_proc, executor=pool, desc="batch")
    return np.concatenate([with_eot(a, tokenizer.eot_id) for a in arrays])


def _rows(ds: Iterable[dict], text_column: str) -> Iterator[str]:
    """Texts of a streaming dataset; network failures mid-stream become one-line errors."""
    it = iter(ds)
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise DataError(
                f"reading the dataset stream failed ({type(e).__name__}: {one_line(e)}); check your network "
                "connection and re-run"
            ) from None
        if text_column not in row:
            raise DataError(f"the dataset has no column {text_column!r} (columns: {', '.join(row)}); pass --text_column")
        yield row[text_column] or ""
