"""Token shards on disk, the per-dataset meta.json, and reading a prepared split as one token stream.

A prepared dataset is a folder holding ``meta.json`` plus ``train_000000.bin, ...`` and ``val_000000.bin, ...``.
Each ``.bin`` shard is a fixed 32-byte header followed by the raw token ids, so it can be memory-mapped and
sliced without ever loading a corpus into RAM:

    offset  size  field
    0       8     magic b"GPTTOKS\\0"  (catches pointing the loader at some unrelated file)
    8       4     format version, uint32 (currently 1)
    12      4     dtype code, uint32: 2 = uint16, 4 = uint32 (the item size in bytes)
    16      8     token count, uint64 (lets us detect truncated or padded files)
    24      8     reserved, zero

All integers are little-endian. uint16 is used whenever every id fits (vocab_size <= 65536, e.g. GPT-2's 50257),
halving disk and page-cache use; larger vocabularies get uint32.

This module deliberately does not import torch: the prepare scripts only need numpy (and tiktoken).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.cli import one_line
from gptkit.errors import DataError
from gptkit.files import atomic_write

MAGIC = b"GPTTOKS\0"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, dtype code, token count, 8 reserved zero bytes
HEADER_SIZE = HEADER.size  # 32
DTYPE_CODES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
META_NAME = "meta.json"
SPLITS = ("train", "val")
# Token shards, the loss-mask shards of a chat dataset (train_mask_000000.bin: 1 where the token is trained), and
# the label shards of unpaired preference rows (train_labels_000000.bin: one 0/1 per sequence).
SHARD_RE = re.compile(r"^(train|val)(_mask|_labels)?_\d{6}\.bin$")

# Datasets that have their own prepare script: used to tell the user the exact command to run.
PREPARE_COMMANDS = {
    "shakespeare_char": "python prepare/shakespeare_char.py",
    "shakespeare": "python prepare/shakespeare.py",
    "openwebtext": "python prepare/openwebtext.py",
    "fineweb": "python prepare/fineweb.py",
    "fineweb_edu": "python prepare/fineweb.py --edu",
}


# ----------------------------------------------------------------------------------------------------------
# Shard files


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest on-disk dtype able to hold every id of a vocabulary of this size."""
    if vocab_size < 1:
        raise DataError(f"vocab_size must be at least 1, got {vocab_size}")
    if vocab_size <= 2**16:
        return DTYPE_CODES[2]
    if vocab_size <= 2**32:
        return DTYPE_CODES[4]
    raise DataError(f"vocab_size {vocab_size} does not fit in uint32 token shards (max {2**32})")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def write_shard(path: str | os.PathLike, tokens: np.ndarray | Sequence[int], vocab_size: int) -> Path:
    """Write one shard atomically. Every id must lie in [0, vocab_size)."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"tokens for {path} must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"tokens for {path} must be integers, got dtype {arr.dtype}")
    dtype = dtype_for_vocab(vocab_size)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise DataError(
                f"token id {bad} is outside the vocabulary [0, {vocab_size}) while writing {path}; "
                "the tokenizer and vocab_size disagree"
            )
    data = np.ascontiguousarray(arr, dtype=dtype)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, dtype.itemsize, data.size)
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        f.write(header)
        f.write(memoryview(data).cast("B"))
    return path


def read_header(path: str | os.PathLike) -> tuple[np.dtype, int]:
    """Validate a shard's header and size; return (dtype, token count)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token shard {path} does not exist; re-run the prepare script for this dataset")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise DataError(f"{path} is not a token shard (bad magic); re-run the prepare script for this dataset")
    _, version, code, count = HEADER.unpack(raw)
    if version != FORMAT_VERSION:
        raise DataError(
            f"{path} has shard format version {version} but this code supports version {FORMAT_VERSION}; "
            "re-run the prepare script with this version of the code"
        )
    if code not in DTYPE_CODES:
        raise DataError(f"{path} has unknown dtype code {code} (expected 2 or 4); the file is corrupt, re-run prepare")
    dtype = DTYPE_CODES[code]
    expected = HEADER_SIZE + count * dtype.itemsize
    if size != expected:
        raise DataError(
            f"{path} should be {expected} bytes for {count} tokens but is {size} bytes (truncated or corrupt); "
            "re-run the prepare script for this dataset"
        )
    return dtype, count


def open_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard's tokens (read-only, 1-D). Nothing is read into memory until it is sliced."""
    dtype, count = read_header(path)
    if count == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(count,))


class ShardWriter:
    """Streams tokens of one split into consecutive shards of ``shard_tokens`` tokens each, straight to disk.

    The shard being filled is ``NAME.part``: a placeholder header, then the tokens as they come. Once full (or
    at ``close``) its header gets the count, and it is synced and renamed to NAME. Memory holds nothing but the
    caller's array, whatever the shard size, which is what lets the big-corpus scripts run on machines with
    far less RAM than the corpus. ``sync()`` makes everything written so far durable and returns the writer's
    state; ``ShardWriter(..., state=that)`` continues from exactly there after a crash, dropping whatever was
    written after that sync (how an interrupted prepare resumes).
    """

    def __init__(self, out_dir: str | os.PathLike, split: str, vocab_size: int, shard_tokens: int = 100_000_000,
                 state: dict[str, int] | None = None):
        if shard_tokens < 1:
            raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
        self.out_dir = Path(out_dir)
        self.split = split
        self.vocab_size = vocab_size
        self.shard_tokens = shard_tokens
        self.dtype = dtype_for_vocab(vocab_size)
        self.names: list[str] = []
        self.tokens = 0  # total written (in complete shards or the .part file)
        self._fill = 0  # tokens in the shard being filled (its .part file)
        if state is not None:
            self._restore(state)

    def write(self, tokens: np.ndarray | Sequence[int]) -> None:
        arr = np.asarray(tokens)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size):
            raise DataError(f"a token id is outside the vocabulary [0, {self.vocab_size}) in the {self.split} split")
        data = np.ascontiguousarray(arr, dtype=self.dtype)
        pos = 0
        while pos < data.size:
            take = min(data.size - pos, self.shard_tokens - self._fill)
            part = self._part_path(len(self.names))
            with open(part, "ab") as f:  # opened per call: no handle outlives a write, whatever happens next
                if self._fill == 0:
                    f.truncate(0)
                    f.write(HEADER.pack(MAGIC, FORMAT_VERSION, self.dtype.itemsize, 0))  # the count comes last
                f.write(memoryview(data[pos : pos + take]).cast("B"))
            self._fill += take
            pos += take
            if self._fill == self.shard_tokens:
                self._complete()
        self.tokens += int(data.size)

    def sync(self) -> dict[str, int]:
        """Make everything written so far durable; return the state to resume from."""
        if self._fill:
            with open(self._part_path(len(self.names)), "ab") as f:
                os.fsync(f.fileno())
        return {"shards": len(self.names), "part_tokens": self._fill, "tokens": self.tokens}

    def close(self) -> list[str]:
        """Complete the last partial shard; return the shard file names in order."""
        if self._fill:
            self._complete()
        return list(self.names)

    def _part_path(self, index: int) -> Path:
        return self.out_dir / f"{shard_name(self.split, index)}.part"

    def _complete(self) -> None:
        part = self._part_path(len(self.names))
        with open(part, "r+b") as f:
            f.write(HEADER.pack(MAGIC, FORMAT_VERSION, self.dtype.itemsize, self._fill))
            f.flush()
            os.fsync(f.fileno())
        name = shard_name(self.split, len(self.names))
        os.replace(part, self.out_dir / name)
        self.names.append(name)
        self._fill = 0

    def _restore(self, state: dict[str, int]) -> None:
        done, fill = int(state["shards"]), int(state["part_tokens"])
        self.names = [shard_name(self.split, i) for i in range(done)]
        for name in self.names:
            read_header(self.out_dir / name)  # each complete shard is there, whole
        part = self._part_path(done)
        completed_since = self.out_dir / shard_name(self.split, done)
        if completed_since.exists() and not part.exists():
            os.replace(completed_since, part)  # filled and renamed after the sync: reopen it, cut back below
        pattern = re.compile(rf"^{self.split}_(\d{{6}})\.bin(\.part)?$")
        for path in self.out_dir.iterdir():
            m = pattern.match(path.name)
            if m and (int(m.group(1)) > done or (int(m.group(1)) < done and m.group(2))):
                path.unlink()  # written after the sync, or a leftover
        size = HEADER_SIZE + fill * self.dtype.itemsize
        if fill == 0:
            part.unlink(missing_ok=True)
        elif not part.is_file() or part.stat().st_size < size:
            raise DataError(f"{part} is missing or shorter than its saved state")
        else:
            os.truncate(part, size)
        self._fill = fill
        self.tokens = int(state["tokens"])


# ----------------------------------------------------------------------------------------------------------
# meta.json


def write_meta(data_dir: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Write meta.json atomically (JSON, never pickle: safe to read from untrusted folders)."""
    path = Path(data_dir) / META_NAME
    text = json.dumps(meta, indent=2, ensure_ascii=False) + "\n"
    with atomic_write(path) as tmp:
        tmp.write_bytes(text.encode("utf-8"))
    return path


def read_meta(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and sanity-check meta.json. Missing or malformed files raise DataError."""
    path = Path(data_dir) / META_NAME
    if not path.is_file():
        raise DataError(f"{path} not found; prepare the dataset first (see the scripts in prepare/)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({one_line(e)}); re-run the prepare script") from None
    problem = _meta_problem(meta)
    if problem:
        raise DataError(f"{path} is invalid: {problem}; re-run the prepare script")
    return meta


def _meta_problem(meta: Any) -> str | None:
    """Describe the first structural problem of a meta dict, or None when it looks right."""
    if not isinstance(meta, dict):
        return "top level is not a JSON object"
    for key in ("format_version", "tokenizer", "vocab_size", "splits"):
        if key not in meta:
            return f"missing key {key!r}"
    if meta["format_version"] != FORMAT_VERSION:
        return f"format_version is {meta['format_version']!r}, this code supports {FORMAT_VERSION}"
    if not isinstance(meta["vocab_size"], int) or meta["vocab_size"] < 1:
        return "vocab_size must be a positive integer"
    if not isinstance(meta["tokenizer"], dict) or meta["tokenizer"].get("kind") not in ("char", "tiktoken", "bpe"):
        return "tokenizer.kind must be 'char', 'tiktoken' or 'bpe' (a trained BPE)"
    if not isinstance(meta["splits"], dict):
        return "splits must be an object"
    for split, entry in meta["splits"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            return f"splits.{split}.shards must be a list of file names"
        if not isinstance(entry.get("tokens"), int):
            return f"splits.{split}.tokens must be an integer"
        for extra in ("masks", "labels"):
            if extra in entry and not isinstance(entry[extra], list):
                return f"splits.{split}.{extra} must be a list of file names"
        for name in entry["shards"] + entry.get("masks", []) + entry.get("labels", []):
            # Names only, never paths: a meta.json must not be able to point outside its folder.
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".bin"):
                return f"splits.{split} names {name!r}, which is not a plain .bin file name"
    return None


def make_meta(
    tokenizer: Any, splits: dict[str, dict[str, Any]], source: str, created: str | None = None
) -> dict[str, Any]:
    """Assemble a meta dict in the canonical key order (`tokenizer`: a tokenizer.Tokenizer)."""
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.to_meta(),
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "splits": splits,
        "source": source,
        "created": created or datetime.date.today().isoformat(),
    }


# ----------------------------------------------------------------------------------------------------------
# Reading a prepared split as one token stream


class TokenDataset:
    """All shards of one split, memory-mapped and addressed as a single concatenated stream of tokens."""

    def __init__(self, data_dir: str | os.PathLike, split: str, stream: str = "shards"):
        self.data_dir = require_dataset(data_dir)
        self.split = split
        self.meta = read_meta(self.data_dir)
        splits = self.meta["splits"]
        if split not in splits:
            raise DataError(
                f"{self.data_dir} has no {split!r} split (it has: {', '.join(sorted(splits)) or 'none'}); "
                "re-run the prepare script"
            )
        self.vocab_size: int = self.meta["vocab_size"] if stream == "shards" else 2
        self.shards = [open_shard(self.data_dir / name) for name in splits[split][stream]]
        for name, shard in zip(splits[split][stream], self.shards):
            if shard.dtype.itemsize < dtype_for_vocab(self.vocab_size).itemsize:
                raise DataError(f"{self.data_dir / name} is {shard.dtype} but vocab_size is {self.vocab_size}")
        # offsets[i] is the stream position of shard i's first token; offsets[-1] is the total length.
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards], dtype=np.int64)
        if int(self.offsets[-1]) != splits[split]["tokens"]:
            raise DataError(
                f"{self.data_dir}/meta.json says the {split} split has {splits[split]['tokens']} tokens but its "
                f"{stream} hold {int(self.offsets[-1])}; re-run the prepare script"
            )
        # A chat dataset's loss mask (prepare/chat.py): for every token, 1 when it is trained (a target that
        # carries loss: the assistant's replies), 0 when it is context only. The same stream layout.
        self.masks = TokenDataset(data_dir, split, "masks") if stream == "shards" and "masks" in splits[split] \
            else None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the stream as a new array, reading across shard boundaries."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) is outside the {self.split} split of {len(self)} tokens")
        out = np.empty(length, dtype=self.shards[0].dtype if self.shards else np.uint16)
        pos = 0
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while pos < length:
            lo = start + pos - int(self.offsets[shard])
            take = min(length - pos, len(self.shards[shard]) - lo)
            out[pos : pos + take] = self.shards[shard][lo : lo + take]
            pos += take
            shard += 1
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Stack of windows, shape (len(starts), length), int64. Vectorised when a window stays in one shard."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), dtype=np.int64)
        shard_of = np.searchsorted(self.offsets, starts, side="right") - 1
        inside = starts + length <= self.offsets[np.minimum(shard_of + 1, len(self.shards))]
        for s in np.unique(shard_of[inside]):
            rows = np.nonzero(inside & (shard_of == s))[0]
            local = starts[rows] - self.offsets[s]
            out[rows] = self.shards[s][local[:, None] + np.arange(length)]  # one fancy-index gather per shard
        for row in np.nonzero(~inside)[0]:  # rare: the window straddles a shard boundary
            out[row] = self.window(int(starts[row]), length)
        return out

    def max_token(self, chunk: int = 1 << 24) -> int:
        """Largest id in the split (-1 if empty), scanned in chunks so memory stays flat on huge corpora.

        Used before training to refuse data whose ids exceed the model's vocabulary (which would otherwise
        surface as an opaque CUDA index error deep in the embedding).
        """
        best = -1
        for shard in self.shards:
            for lo in range(0, len(shard), chunk):
                best = max(best, int(shard[lo : lo + chunk].max()))
        return best


# ----------------------------------------------------------------------------------------------------------
# Finding datasets


def dataset_dir(name_or_path: str | os.PathLike, data_root: str | os.PathLike = "data") -> Path:
    """A dataset argument is a folder path (existing, or containing a separator) or a name under data_root."""
    text = os.fspath(name_or_path)
    path = Path(text)
    if path.is_dir() or os.sep in text or (os.altsep and os.altsep in text):
        return path
    return Path(data_root) / text


# What a run's data is prepared from, by the script that prepares it: the placeholder of its --input.
PREPARE_INPUTS = {"text": "YOUR_TEXT", "chat": "YOUR_CONVERSATIONS.jsonl", "preference": "YOUR_PAIRS.jsonl"}


def prepare_command(name_or_path: str | os.PathLike, data_root: str | os.PathLike = "data", kind: str = "text",
                    tokenizer: str | None = None) -> str:
    """The command that creates this dataset, for error messages. `kind`: the prepare script, text, chat
    (conversations) or preference (pairs); `tokenizer`: its --tokenizer (a fine-tune's base), when not GPT-2's."""
    path = dataset_dir(name_or_path, data_root)
    name = path.name
    default_location = path == Path(data_root) / name
    if name in PREPARE_COMMANDS and kind == "text":
        cmd = PREPARE_COMMANDS[name]
        return cmd if default_location else f"{cmd} --out_dir {path}"
    tok = f" --tokenizer {tokenizer}" if tokenizer and tokenizer != "gpt2" else ""
    where = f"--name {name}" if default_location else f"--out_dir {path}"
    return f"python prepare/{kind}.py --input {PREPARE_INPUTS[kind]}{tok} {where}"


def require_dataset(name_or_path: str | os.PathLike, data_root: str | os.PathLike = "data",
                    how: str | None = None) -> Path:
    """Resolve a dataset folder and insist that it has been prepared; the error says how to prepare it (`how`:
    the command, when the caller knows better than prepare_command's default)."""
    path = dataset_dir(name_or_path, data_root)
    label = os.fspath(name_or_path)
    how = how or prepare_command(name_or_path, data_root)
    if not path.is_dir():
        raise DataError(f"dataset {label!r} not found at {path}; prepare it with: {how}")
    if not (path / META_NAME).is_file():
        raise DataError(
            f"dataset {label!r} at {path} has no {META_NAME} (never prepared, or preparation was interrupted); "
            f"prepare it with: {how}"
        )
    return path
