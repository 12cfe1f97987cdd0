"""Text that fits in memory -> tokens -> a dataset folder: one file (Shakespeare, a book) or many documents.

* Input: a local file (``--input PATH``), or a source URL downloaded once into the output folder.
* Tokenising: a thread pool (tiktoken's Rust core releases the GIL); one long text is cut at line breaks
  where GPT-2's pre-tokeniser always splits, so the tokens equal those of a single encode call.
* Splits: one text is cut by characters (the first 1 - val_fraction are train); many documents are kept
  whole, each followed by the end-of-text token, and a seeded random choice of them forms val.

The folder itself is written by ``prepare.writer``; corpora larger than memory go through ``prepare.hub``.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptkit import shards
from gptkit.cli import one_line
from gptkit.files import atomic_write
from gptkit.prepare.writer import DEFAULT_SHARD_TOKENS, MIN_TOKENS, check_positive, write_splits
from gptkit.shards import DataError
from gptkit.tokenizer import Tokenizer

CHUNK_CHARS = 1 << 18  # a long text is tokenised in ~256K-character pieces, spread over the workers

# ----------------------------------------------------------------------------------------------------------
# Input


def download(url: str, dest: Path) -> Path:
    """Fetch url into dest (atomically, with a progress bar) unless dest already exists."""
    if dest.is_file():
        return dest
    try:
        # urllib.request.urlopen is looked up at call time so tests can replace it.
        with atomic_write(dest) as tmp, urllib.request.urlopen(url, timeout=60) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or None
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {dest.name}")
            with open(tmp, "wb") as f, bar:
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, OSError) as e:  # URLError/HTTPError/timeouts are all OSErrors
        reason = getattr(e, "reason", None) or e
        raise DataError(
            f"could not download {url} ({one_line(reason)}); check your network connection, "
            "or pass --input PATH to use a local copy of the file"
        ) from None
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


def check_fraction(value: float, flag: str = "--val_fraction") -> None:
    if not 0.0 < value < 1.0:
        raise DataError(f"{flag} must be between 0 and 1 (exclusive), got {value}")


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


def encode_texts(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    num_proc: int,
    *,
    desc: str = "tokenizing",
    executor: ThreadPoolExecutor | None = None,
) -> list[np.ndarray]:
    """Encode texts in order, on num_proc threads (or the given pool), each to the compact on-disk dtype.

    tiktoken's Rust core releases the GIL, so threads scale across cores without pickling texts and token
    arrays between processes (on an idle 2-core machine they beat a process pool: BENCHMARKS.md).
    """
    check_positive(num_proc, "--num_proc")
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
    if executor is not None:
        return collect(executor.map(tokenizer.encode_array, texts))
    with ThreadPoolExecutor(num_proc) as pool:
        return collect(pool.map(tokenizer.encode_array, texts))


def encode_long_text(tokenizer: Tokenizer, text: str, num_proc: int) -> np.ndarray:
    """Encode one long text in parallel by cutting it at safe line breaks (same tokens as one encode call)."""
    cuts = split_points(text)
    pieces = [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]  # at least one piece, "" for an empty text
    return np.concatenate(encode_texts(tokenizer, pieces, num_proc))


def with_eot(ids: np.ndarray, eot_id: int | None) -> np.ndarray:
    """A document's tokens followed by the end-of-text token (when the tokenizer has one)."""
    if eot_id is None:
        return ids
    return np.concatenate([ids, np.array([eot_id], dtype=ids.dtype)])


def report_speed(tokens: int, seconds: float) -> None:
    rate = tokens / seconds if seconds > 0 else float("inf")
    print(f"tokenized {tokens:,} tokens in {seconds:.2f} s ({rate / 1e6:.2f} M tokens/s)")


# ----------------------------------------------------------------------------------------------------------
# Splitting and writing


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


def prepare_single_text(
    out_dir: Path,
    text: str,
    tokenizer: Tokenizer,
    *,
    val_fraction: float,
    source: str,
    num_proc: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> dict[str, Any]:
    """One text: the first (1 - val_fraction) of its characters become train, the rest val.

    Splitting the text (not the tokens) keeps decode(train) + decode(val) == text for every tokenizer.
    No end-of-text token is added: it is a single document.
    """
    check_fraction(val_fraction)
    require_text(text, "the input text")
    cut = round(len(text) * (1.0 - val_fraction))
    t0 = time.perf_counter()
    train = encode_long_text(tokenizer, text[:cut], num_proc)
    val = encode_long_text(tokenizer, text[cut:], num_proc)
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
) -> dict[str, Any]:
    """Many documents: each is followed by the end-of-text token (gpt2); whole documents go to val."""
    check_fraction(val_fraction)
    docs = [d for d in docs if d]
    if not docs:
        raise DataError(f"the input has no text; give documents with at least {MIN_TOKENS} tokens in total")
    if len(docs) == 1:
        return prepare_single_text(
            out_dir, docs[0], tokenizer, val_fraction=val_fraction, source=source, num_proc=num_proc,
            shard_tokens=shard_tokens,
        )
    t0 = time.perf_counter()
    ids = [with_eot(a, tokenizer.eot_id) for a in encode_texts(tokenizer, docs, num_proc)]
    report_speed(sum(len(a) for a in ids), time.perf_counter() - t0)
    is_val = choose_val_docs([len(a) for a in ids], val_fraction)
    splits = {
        "train": [a for a, v in zip(ids, is_val) if not v],
        "val": [a for a, v in zip(ids, is_val) if v],
    }
    return write_splits(out_dir, tokenizer, splits, source, shard_tokens=shard_tokens)
