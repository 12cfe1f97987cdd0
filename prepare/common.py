"""Shared pieces of the prepare scripts: getting the input, tokenising in parallel, writing shards + meta.json.

Every script turns raw text into the format of ``shards.py``. The rules they share live here:

* Input: ``--input PATH`` uses a local file; otherwise the source URL is downloaded once into the output folder.
* Size: an input must give at least ``MIN_TOKENS`` tokens (4096 = four 1024-token GPT-2 contexts) and both
  splits must be non-empty. Anything smaller cannot give a meaningful train/val split, so it is refused
  *before* any shard is written (the streaming writers, which only know the size at the end, delete what
  they wrote instead).
* Idempotence: the same input gives the same bytes. Shards are deterministic, and meta.json keeps its
  "created" date when nothing else changed, so a re-run rewrites identical files.
* Consistency: meta.json is removed first and written last, so a folder with a meta.json is always complete.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import shards
from cli import one_line
from shards import DataError
from tokenizer import Tokenizer

MIN_TOKENS = 4096
DEFAULT_SHARD_TOKENS = 100_000_000
CHUNK_CHARS = 1 << 18  # a long text is tokenised in ~256K-character pieces, spread over the workers

# ----------------------------------------------------------------------------------------------------------
# Command line helpers


def default_num_proc() -> int:
    return os.cpu_count() or 1


def add_common_args(parser: argparse.ArgumentParser, name: str) -> None:
    """--out_dir and --num_proc, which every script has."""
    parser.add_argument("--out_dir", default=None, help=f"output folder (default: data/{name})")
    parser.add_argument(
        "--num_proc", type=int, default=default_num_proc(), help="tokeniser workers (default: all CPU cores)"
    )


def check_positive(value: int, flag: str) -> None:
    if value < 1:
        raise DataError(f"{flag} must be at least 1, got {value}")


def check_fraction(value: float, flag: str = "--val_fraction") -> None:
    if not 0.0 < value < 1.0:
        raise DataError(f"{flag} must be between 0 and 1 (exclusive), got {value}")


def run(main_fn: Callable[[], None]) -> None:
    """Run a script body, turning DataError (and OS errors) into the one-line ``error: ...`` exit every script
    promises."""
    try:
        main_fn()
    except DataError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # disk full, permission denied, ...: still one line, naming the file
        sys.exit(f"error: {one_line(e)}")


# ----------------------------------------------------------------------------------------------------------
# Input


def download(url: str, dest: Path) -> Path:
    """Fetch url into dest (atomically, with a progress bar) unless dest already exists."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        # urllib.request.urlopen is looked up at call time so tests can replace it.
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as f:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {dest.name}") as bar:
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError) as e:  # URLError/HTTPError/timeouts are all OSErrors
        reason = getattr(e, "reason", None) or e
        raise DataError(
            f"could not download {url} ({one_line(reason)}); check your network connection, "
            "or pass --input PATH to use a local copy of the file"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def obtain_input(input_path: str | None, url: str, out_dir: Path, filename: str = "input.txt") -> Path:
    """The local --input file when given, else the downloaded source (cached in out_dir)."""
    if input_path is not None:
        path = Path(input_path)
        if not path.is_file():
            raise DataError(f"--input {input_path} does not exist or is not a file; give the path of a text file")
        return path
    return download(url, out_dir / filename)


def read_text(path: Path) -> str:
    """Read a UTF-8 text file exactly (newline="" keeps "\\r\\n" as is, so decoding gives the file back)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({one_line(e)}); convert it to UTF-8 first") from None
    except OSError as e:
        raise DataError(f"cannot read {path} ({one_line(e)})") from None


def require_text(text: str, what: str) -> None:
    if not text:
        raise DataError(f"{what} is empty; give a text with at least {MIN_TOKENS} tokens")


def make_tokenizer(kind: str, text_for_chars: str | None = None) -> Tokenizer:
    """'gpt2' -> tiktoken's GPT-2 BPE; 'char' -> the sorted characters of the given text."""
    if kind == "gpt2":
        return Tokenizer.tiktoken("gpt2")
    if kind == "char":
        return Tokenizer.char_from_text(text_for_chars or "")
    raise DataError(f"unknown tokenizer {kind!r}; use gpt2 or char")


# ----------------------------------------------------------------------------------------------------------
# Tokenising


# A whitespace run that contains a newline and is followed by a non-space character. Cutting just before the
# run's last character gives exactly the pieces GPT-2's pre-tokeniser would produce on the whole text (it
# always ends a piece there: trailing whitespace stays on its own, and the last space/newline either starts
# the next word or stands alone), so chunked encoding equals whole-text encoding token for token.
_SAFE_BREAK = re.compile(r"\n\s*(?=\S)")


def split_points(text: str, chunk_chars: int = CHUNK_CHARS) -> list[int]:
    """Cut positions 0 = c0 < c1 < ... < cn = len(text), about chunk_chars apart, only at safe line breaks."""
    cuts = [0]
    while cuts[-1] + chunk_chars < len(text):
        m = _SAFE_BREAK.search(text, cuts[-1] + chunk_chars)
        if m is None:  # no line break left: the rest is one piece (correct, just not parallel)
            break
        cuts.append(m.end() - 1)
    cuts.append(len(text))
    return cuts


_WORKER_TOKENIZER: Tokenizer | None = None  # set in each process of the "process" pool


def _init_worker(spec: dict[str, Any]) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = Tokenizer.from_meta(spec)


def _encode_in_worker(text: str) -> np.ndarray:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.encode_array(text)


def encode_texts(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    num_proc: int,
    *,
    parallel: str = "thread",
    desc: str = "tokenizing",
    executor: ThreadPoolExecutor | None = None,
) -> list[np.ndarray]:
    """Encode texts in order, in parallel, each to the compact on-disk dtype.

    "thread" (the default) runs tiktoken in a thread pool: its Rust core releases the GIL, so threads scale
    across cores without pickling texts and token arrays between processes. On an idle 2-core machine it
    measured faster than "process" (a multiprocessing pool), which is kept for comparison (BENCHMARKS.md).
    """
    check_positive(num_proc, "--num_proc")
    if parallel not in ("thread", "process"):
        raise DataError(f"unknown --parallel {parallel!r}; use thread or process")
    dtype = shards.dtype_for_vocab(tokenizer.vocab_size)

    def collect(results: Iterable[np.ndarray]) -> list[np.ndarray]:
        with tqdm(total=len(texts), desc=desc, unit="text", disable=len(texts) < 16) as bar:
            out = []
            for ids in results:
                out.append(ids.astype(dtype, copy=False))
                bar.update(1)
            return out

    if num_proc == 1 or len(texts) < 2:
        return collect(map(tokenizer.encode_array, texts))
    if parallel == "thread":
        if executor is not None:
            return collect(executor.map(tokenizer.encode_array, texts))
        with ThreadPoolExecutor(num_proc) as pool:
            return collect(pool.map(tokenizer.encode_array, texts))
    import multiprocessing

    with multiprocessing.Pool(num_proc, initializer=_init_worker, initargs=(tokenizer.to_meta(),)) as pool:
        chunksize = max(1, len(texts) // (num_proc * 8))
        return collect(pool.imap(_encode_in_worker, texts, chunksize=chunksize))


def encode_long_text(tokenizer: Tokenizer, text: str, num_proc: int, *, parallel: str = "thread") -> np.ndarray:
    """Encode one long text in parallel by cutting it at safe line breaks (same tokens as one encode call)."""
    cuts = split_points(text)
    pieces = [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    parts = encode_texts(tokenizer, pieces, num_proc, parallel=parallel)
    if not parts:
        return np.zeros(0, dtype=shards.dtype_for_vocab(tokenizer.vocab_size))
    return np.concatenate(parts)


def with_eot(ids: np.ndarray, eot_id: int | None) -> np.ndarray:
    """A document's tokens followed by the end-of-text token (when the tokenizer has one)."""
    if eot_id is None:
        return ids
    return np.concatenate([ids, np.array([eot_id], dtype=ids.dtype)])


def check_sizes(counts: dict[str, int], what: str) -> None:
    """Refuse inputs too small to train on, with the numbers and what to do."""
    total = sum(counts.values())
    if total < MIN_TOKENS:
        raise DataError(
            f"{what} has only {total} tokens; at least {MIN_TOKENS} are needed for a train and a val split, "
            "so use a longer text"
        )
    for split, n in counts.items():
        if n == 0:
            raise DataError(f"{what} gives an empty {split} split; adjust --val_fraction / --val_tokens")


def choose_val_docs(lengths: Sequence[int], val_fraction: float, seed: int = 0) -> np.ndarray:
    """Pick whole documents for val: about val_fraction of all tokens, chosen at random (seeded, so re-runs
    agree). A document is skipped if it would push val past twice its target, so one huge document cannot
    swallow the split; at least one document goes to val and at least one stays in train."""
    lengths = np.asarray(lengths, dtype=np.int64)
    target = val_fraction * lengths.sum()
    is_val = np.zeros(len(lengths), dtype=bool)
    total, n_val = 0, 0
    for i in np.random.default_rng(seed).permutation(len(lengths)):
        if total >= target:
            break
        if total + lengths[i] <= 2 * target and n_val < len(lengths) - 1:
            is_val[i] = True
            total += int(lengths[i])
            n_val += 1
    if not is_val.any():
        is_val[int(np.argmin(lengths))] = True
    return is_val


# ----------------------------------------------------------------------------------------------------------
# Writing a dataset folder


class DatasetWriter:
    """Writes the shards of both splits and, last, meta.json.

    Shards are written into a staging folder (``out_dir/.partial``) and moved into place only by ``finish()``,
    after every check has passed: a run that fails half-way (a network drop during a 10B-token corpus, a
    refused input) leaves an already prepared dataset in ``out_dir`` exactly as it was. Use as a context
    manager: if anything fails before ``finish()``, the staging folder is removed (and ``out_dir`` too if this
    run created it and it is empty).
    """

    STAGING = ".partial"

    def __init__(self, out_dir: Path, tokenizer: Tokenizer, shard_tokens: int = DEFAULT_SHARD_TOKENS):
        check_positive(shard_tokens, "--shard_tokens")
        self.out_dir = Path(out_dir)
        self.tokenizer = tokenizer
        self.shard_tokens = shard_tokens
        self._created_dir = not self.out_dir.exists()
        self.stage = self.out_dir / self.STAGING
        shutil.rmtree(self.stage, ignore_errors=True)  # left over from a run that was killed
        self.stage.mkdir(parents=True)
        # Remember the old creation date, for byte-identical re-runs.
        try:
            self._old_meta: dict[str, Any] | None = shards.read_meta(self.out_dir)
        except DataError:
            self._old_meta = None
        self.writers = {s: shards.ShardWriter(self.stage, s, tokenizer.vocab_size, shard_tokens) for s in shards.SPLITS}
        self._finished = False

    def write(self, split: str, tokens: np.ndarray) -> None:
        self.writers[split].write(tokens)

    def close_split(self, split: str) -> None:
        """Flush a split early (frees its buffer: the streaming writer only ever holds one shard)."""
        self.writers[split].close()

    def finish(self, source: str, what: str = "the input") -> dict[str, Any]:
        """Close all shards, check sizes, move the shards into place, write meta.json, and delete shards left
        over from older runs."""
        names = {s: w.close() for s, w in self.writers.items()}
        check_sizes({s: w.tokens for s, w in self.writers.items()}, what)
        splits = {s: {"shards": names[s], "tokens": self.writers[s].tokens} for s in shards.SPLITS}
        meta = shards.make_meta(self.tokenizer, splits, source)
        old = self._old_meta
        if old is not None and {**old, "created": None} == {**meta, "created": None}:
            meta["created"] = old["created"]  # nothing changed: keep the file byte-identical
        # From here on only renames: meta.json goes first (the folder no longer claims to be complete), the
        # new shards replace the old ones, and the new meta.json marks the folder complete again.
        (self.out_dir / shards.META_NAME).unlink(missing_ok=True)
        keep = {n for ns in names.values() for n in ns}
        for name in keep:
            os.replace(self.stage / name, self.out_dir / name)
        shutil.rmtree(self.stage, ignore_errors=True)
        shards.write_meta(self.out_dir, meta)
        for path in self.out_dir.iterdir():
            if (shards.SHARD_RE.match(path.name) and path.name not in keep) or path.name.endswith(".bin.tmp"):
                path.unlink()
        self._finished = True
        return meta

    def abort(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)
        if self._created_dir and self.out_dir.is_dir() and not any(self.out_dir.iterdir()):
            self.out_dir.rmdir()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None and not self._finished:
            self.abort()


def write_splits(
    out_dir: Path,
    tokenizer: Tokenizer,
    splits: dict[str, Sequence[np.ndarray]],
    source: str,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    what: str = "the input",
) -> dict[str, Any]:
    """Write in-memory token arrays per split. Sizes are checked first, so a refused input writes nothing."""
    check_sizes({s: sum(len(a) for a in arrays) for s, arrays in splits.items()}, what)
    with DatasetWriter(out_dir, tokenizer, shard_tokens) as writer:
        for split, arrays in splits.items():
            for arr in arrays:
                writer.write(split, arr)
        return writer.finish(source, what)


def prepare_single_text(
    out_dir: Path,
    text: str,
    tokenizer: Tokenizer,
    *,
    val_fraction: float,
    source: str,
    num_proc: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    parallel: str = "thread",
) -> dict[str, Any]:
    """One text: the first (1 - val_fraction) of its characters become train, the rest val.

    Splitting the text (not the tokens) keeps decode(train) + decode(val) == text for every tokenizer.
    No end-of-text token is added: it is a single document.
    """
    check_fraction(val_fraction)
    require_text(text, "the input text")
    cut = round(len(text) * (1.0 - val_fraction))
    t0 = time.perf_counter()
    train = encode_long_text(tokenizer, text[:cut], num_proc, parallel=parallel)
    val = encode_long_text(tokenizer, text[cut:], num_proc, parallel=parallel)
    report_speed(len(train) + len(val), time.perf_counter() - t0)
    return write_splits(out_dir, tokenizer, {"train": [train], "val": [val]}, source, shard_tokens=shard_tokens)


def prepare_documents(
    out_dir: Path,
    docs: Sequence[str],
    tokenizer: Tokenizer,
    *,
    val_fraction: float,
    source: str,
    num_proc: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    parallel: str = "thread",
) -> dict[str, Any]:
    """Many documents: each is followed by the end-of-text token (gpt2); whole documents go to val."""
    check_fraction(val_fraction)
    docs = [d for d in docs if d]
    if not docs:
        raise DataError(f"the input has no text; give documents with at least {MIN_TOKENS} tokens in total")
    if len(docs) == 1:
        return prepare_single_text(
            out_dir, docs[0], tokenizer, val_fraction=val_fraction, source=source, num_proc=num_proc,
            shard_tokens=shard_tokens, parallel=parallel,
        )
    t0 = time.perf_counter()
    ids = [with_eot(a, tokenizer.eot_id) for a in encode_texts(tokenizer, docs, num_proc, parallel=parallel)]
    report_speed(sum(len(a) for a in ids), time.perf_counter() - t0)
    is_val = choose_val_docs([len(a) for a in ids], val_fraction)
    splits = {
        "train": [a for a, v in zip(ids, is_val) if not v],
        "val": [a for a, v in zip(ids, is_val) if v],
    }
    return write_splits(out_dir, tokenizer, splits, source, shard_tokens=shard_tokens)


def report_speed(tokens: int, seconds: float) -> None:
    rate = tokens / seconds if seconds > 0 else float("inf")
    print(f"tokenized {tokens:,} tokens in {seconds:.2f} s ({rate / 1e6:.2f} M tokens/s)")


TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def tiny_shakespeare_main(argv: Sequence[str] | None, name: str, tokenizer: str, description: str) -> None:
    """The two Shakespeare scripts: the same text and 90/10 split, a char or GPT-2 BPE tokenizer."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default=None, help="local copy of the text (default: download it)")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of characters for val")
    add_common_args(parser, name)
    args = parser.parse_args(argv)

    def prepare() -> None:
        t0 = time.perf_counter()
        out_dir = Path(args.out_dir or f"data/{name}")
        path = obtain_input(args.input, TINY_SHAKESPEARE_URL, out_dir)
        text = read_text(path)
        require_text(text, str(path))
        tok = Tokenizer.char_from_text(text) if tokenizer == "char" else Tokenizer.tiktoken(tokenizer)
        meta = prepare_single_text(out_dir, text, tok, val_fraction=args.val_fraction,
                                   source=args.input or TINY_SHAKESPEARE_URL, num_proc=args.num_proc)
        summarize(out_dir, meta)
        print(f"done in {time.perf_counter() - t0:.2f} s")

    run(prepare)


def summarize(out_dir: Path, meta: dict[str, Any]) -> None:
    parts = [f"{s}: {e['tokens']:,} tokens in {len(e['shards'])} shard(s)" for s, e in meta["splits"].items()]
    print(f"wrote {out_dir} (vocab_size {meta['vocab_size']}; {'; '.join(parts)})")


# ----------------------------------------------------------------------------------------------------------
# Big corpora through Hugging Face datasets


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


def add_corpus_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by openwebtext.py and fineweb.py."""
    parser.add_argument("--streaming", action="store_true", help="stream from the Hub instead of downloading first")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    parser.add_argument("--val_tokens", type=int, default=None, help="val split size (default: one shard)")
    parser.add_argument("--revision", default=None, help="dataset revision on the Hub (branch, tag or commit)")
