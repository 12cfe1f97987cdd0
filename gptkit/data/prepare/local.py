"""Local text -> tokens -> a dataset folder, streamed: a file (Shakespeare, a book, a 50 GB dump) or a folder.

    meta = prepare_local("data/mine", "my_texts/", "gpt2", num_proc=8)

* Input: ``--input PATH``, a UTF-8 file or a folder whose ``.txt`` files below it (sorted by path) are the
  documents; or a source URL downloaded once into the output folder (``obtain_input``). A folder is walked
  twice (sizes and fingerprint, then the work) instead of being listed, so millions of files cost no memory.
* Work: tasks of about ``BLOCK_BYTES`` of input each, a byte range of a file or a group of small files, read
  by the workers themselves, so the main process only writes. A document larger than a block is cut inside
  it only at safe points (``gptkit/data/prepare/cuts.py``): its tokens equal those of one encode call.
* Splits: one document (a file): the first (1 - val_fraction) of its characters are train, the rest val,
  as always (so decode(train) + decode(val) is the file); that needs the character count first, from a
  streaming scan. Many documents: each is followed by the end-of-text token and goes whole to the split
  ``ValRule`` picks (a seeded hash of its position: about val_fraction of the documents).
* ``--tokenizer char``: the vocabulary is the input's characters, collected by the same scan.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptkit.cli import one_line
from gptkit.data import shards
from gptkit.data.prepare import cuts
from gptkit.data.prepare.pipeline import Job, Result, ValRule, run, worker_tokenizer
from gptkit.data.prepare.pool import ordered_map
from gptkit.data.prepare.writer import (
    DEFAULT_SHARD_TOKENS,
    MIN_TOKENS,
    already_prepared,
    check_positive,
    make_fingerprint,
)
from gptkit.errors import DataError
from gptkit.files import atomic_write
from gptkit.tokenizer import resolve_tokenizer

BLOCK_BYTES = 1 << 20  # input per task: large enough that a task's overhead is noise, small enough to stream
# Smaller inputs are tokenised in this process: starting the workers (~1 s: Python, numpy, the tokenizer) costs
# more than they save (9 MB, loaded machine: 1.6 s in one process, 2.8 s with two workers).
PARALLEL_MIN_BLOCKS = 16
MAX_FILES_PER_TASK = 1024

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
        raise DownloadError(url, one_line(getattr(e, "reason", None) or e)) from None
    return dest


class DownloadError(DataError):
    """A source that could not be downloaded (no network, say): `url`, and `reason` in a few words. The message
    is for the prepare scripts, which take --input; another caller (train.py) can say what works there."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"could not download {url} ({reason}); check your network connection, or pass --input "
                         f"PATH to use a local copy of the file")
        self.url, self.reason = url, reason


def obtain_input(input_path: str | None, url: str, out_dir: Path, filename: str = "input.txt") -> Path:
    """The local --input file when given, else the downloaded source (cached in out_dir)."""
    if input_path is not None:
        path = Path(input_path)
        if not path.is_file():
            raise DataError(f"--input {input_path} does not exist or is not a file; give the path of a text file")
        return path
    return download(url, out_dir / filename)


def check_fraction(value: float, flag: str = "--val_fraction") -> None:
    if not 0.0 < value < 1.0:
        raise DataError(f"{flag} must be between 0 and 1 (exclusive), got {value}")


class LocalInput:
    """A text file, or a folder whose .txt files below it are the documents, in sorted path order.

    Attributes from one walk: ``documents`` (non-empty files), ``total_bytes``, ``fingerprint`` (paths, sizes
    and modification times), ``single`` (the path when there is exactly one document, else None).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise DataError(f"--input {path} does not exist; give a text file or a folder of .txt files")
        self.is_dir = self.path.is_dir()
        digest = hashlib.sha256(str(self.path.resolve()).encode())
        self.files_found = self.documents = self.total_bytes = 0
        self.single: Path | None = None
        for file, size, mtime in self.files():
            digest.update(f"\0{file.relative_to(self.path) if self.is_dir else ''}\0{size}\0{mtime}".encode())
            self.files_found += 1
            if size:
                self.documents += 1
                self.total_bytes += size
                self.single = file if self.documents == 1 else None
        if self.is_dir and not self.files_found:
            raise DataError(f"--input folder {path} contains no .txt files; add some or point at a text file")
        self.fingerprint = digest.hexdigest()

    def files(self) -> Iterator[tuple[Path, int, int]]:
        """(path, size, mtime_ns) of every file, in order."""
        if not self.is_dir:
            st = self.path.stat()
            yield self.path, st.st_size, st.st_mtime_ns
            return
        yield from _walk(self.path)


def _walk(folder: Path) -> Iterator[tuple[Path, int, int]]:
    """The .txt files below folder in the order of sorted(folder.rglob("*.txt")), one directory listed at a
    time (symlinked folders are not entered, as rglob does)."""
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path))
        elif entry.name.endswith(".txt") and entry.is_file():
            st = entry.stat()
            yield Path(entry.path), st.st_size, st.st_mtime_ns


def _decode(data: bytes, path: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {offset + e.start}: {one_line(e.reason)}); "
                        "convert it to UTF-8 first") from None


def _char_start(f: Any, pos: int, size: int) -> int:
    """The first character boundary at or after byte pos (UTF-8 continuation bytes are 10xxxxxx)."""
    f.seek(pos)
    head = f.read(4)
    skip = 0
    while skip < len(head) and head[skip] & 0xC0 == 0x80:
        skip += 1
    return min(pos + skip, size)


# ----------------------------------------------------------------------------------------------------------
# The scan: character counts (one document's split) and the character set (--tokenizer char)


@dataclass(frozen=True)
class Block:
    path: str
    lo: int
    hi: int
    size: int  # the file's
    want_chars: bool


def scan_block(block: Block) -> tuple[int, str]:
    """(characters in the block, the distinct characters if asked). Blocks start and end on the first
    character boundary at or after their byte offsets, so every character is counted once."""
    with open(block.path, "rb") as f:
        lo = _char_start(f, block.lo, block.size)
        hi = _char_start(f, block.hi, block.size)
        f.seek(lo)
        text = _decode(f.read(hi - lo), block.path, lo)
    return len(text), (distinct_chars(text) if block.want_chars else "")


def distinct_chars(text: str) -> str:
    """The distinct characters of text, as a string (a count table over code points: ~100x set(text))."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    common = np.flatnonzero(np.bincount(cps[cps < 0x10000], minlength=0x10000))
    rare = np.unique(cps[cps >= 0x10000])
    return "".join(map(chr, np.concatenate([common, rare]).tolist()))


def _blocks(inp: LocalInput, block_bytes: int, want_chars: bool) -> Iterator[Block]:
    for path, size, _ in inp.files():
        for lo in range(0, size, block_bytes):
            yield Block(str(path), lo, min(lo + block_bytes, size), size, want_chars)


def scan(inp: LocalInput, block_bytes: int, want_chars: bool, workers: int) -> tuple[list[tuple[Block, int]], str]:
    """([(block, its character count)], the input's distinct characters if asked)."""
    counts: list[tuple[Block, int]] = []
    chars: set[str] = set()
    bar = tqdm(total=inp.total_bytes, unit="B", unit_scale=True, desc="scanning")
    with bar:
        for block, (n, found) in ordered_map(scan_block, _blocks(inp, block_bytes, want_chars), workers):
            counts.append((block, n))
            chars.update(found)
            bar.update(block.hi - block.lo)
    return counts, "".join(sorted(chars))


def char_to_byte(counts: list[tuple[Block, int]], cut: int) -> int:
    """The byte offset of character `cut` of a file, from its scan."""
    before = 0
    for block, n in counts:
        if cut < before + n:
            with open(block.path, "rb") as f:
                lo, hi = _char_start(f, block.lo, block.size), _char_start(f, block.hi, block.size)
                f.seek(lo)
                text = _decode(f.read(hi - lo), block.path, lo)
            return lo + len(text[: cut - before].encode("utf-8"))
        before += n
    return counts[-1][0].size


# ----------------------------------------------------------------------------------------------------------
# The work: pieces of files, tokenised in the workers


@dataclass(frozen=True)
class Piece:
    """Bytes [lo, hi) of a document that spans [doc_lo, doc_hi) of a file. An end that is not the document's
    own moves to the first safe cut at or after it: the piece before and the piece after agree on it."""

    path: str
    lo: int
    hi: int
    doc_lo: int
    doc_hi: int
    split: str
    last: bool  # the document ends with this piece


@dataclass(frozen=True)
class PieceTask:
    cursor: int  # tasks done once this one is written
    pieces: tuple[Piece, ...]
    rule: str  # the cut rule (cuts.py)
    eot: bool  # end each document with the end-of-text token


def read_piece(piece: Piece, rule: str) -> str:
    with open(piece.path, "rb") as f:
        lo, hi = piece.lo, piece.hi
        if lo != piece.doc_lo:
            lo = cuts.find_cut(f, lo, piece.doc_hi, rule, piece.path)
        if hi != piece.doc_hi:
            hi = cuts.find_cut(f, hi, piece.doc_hi, rule, piece.path)
        f.seek(lo)
        return _decode(f.read(max(hi - lo, 0)), piece.path, lo)


def encode_pieces(task: PieceTask) -> Result:
    """A worker's job: read, tokenise and sort a task's pieces into their splits."""
    tok = worker_tokenizer()
    dtype = shards.dtype_for_vocab(tok.vocab_size)
    eot = np.array([] if tok.eot_id is None or not task.eot else [tok.eot_id], dtype=dtype)
    out: dict[str, list[np.ndarray]] = {}
    documents = 0
    for piece in task.pieces:
        parts = out.setdefault(piece.split, [])
        parts.append(tok.encode_array(read_piece(piece, task.rule)).astype(dtype, copy=False))
        if piece.last:
            parts.append(eot)
            documents += 1
    tokens = {split: np.concatenate(parts) for split, parts in out.items()}
    return Result(tokens, documents, sum(p.hi - p.lo for p in task.pieces))


def _numbered(groups: Iterable[tuple[Piece, ...]], cursor: int | None, rule: str, eot: bool) -> Iterator[PieceTask]:
    """The tasks after the first `cursor` (planning is cheap: skipping reads no text)."""
    for i, pieces in enumerate(groups):
        if i >= (cursor or 0):
            yield PieceTask(i + 1, pieces, rule, eot)


def _ranges(path: str, doc_lo: int, doc_hi: int, split: str, last: bool, block_bytes: int) -> Iterator[Piece]:
    for lo in range(doc_lo, doc_hi, block_bytes):
        hi = min(lo + block_bytes, doc_hi)
        yield Piece(path, lo, hi, doc_lo, doc_hi, split, last and hi == doc_hi)


def text_groups(path: str, size: int, cut: int, block_bytes: int) -> Iterator[tuple[Piece, ...]]:
    """One document: bytes [0, cut) are train and [cut, size) val, one block per task."""
    for piece in _ranges(path, 0, cut, "train", False, block_bytes):
        yield (piece,)
    for piece in _ranges(path, cut, size, "val", True, block_bytes):
        yield (piece,)


def document_groups(inp: LocalInput, val_rule: ValRule, block_bytes: int) -> Iterator[tuple[Piece, ...]]:
    """Many documents: small files grouped up to a block, a large one cut into blocks."""
    group: list[Piece] = []
    group_bytes = 0
    doc = 0
    for path, size, _ in inp.files():
        if not size:
            continue
        split = val_rule.split(doc)
        doc += 1
        if size > block_bytes:
            if group:
                yield tuple(group)
                group, group_bytes = [], 0
            for piece in _ranges(str(path), 0, size, split, True, block_bytes):
                yield (piece,)
            continue
        group.append(Piece(str(path), 0, size, 0, size, split, True))
        group_bytes += size
        if group_bytes >= block_bytes or len(group) >= MAX_FILES_PER_TASK:
            yield tuple(group)
            group, group_bytes = [], 0
    if group:
        yield tuple(group)


# ----------------------------------------------------------------------------------------------------------
# The whole preparation


def prepare_local(
    out_dir: Path,
    input_path: str | os.PathLike,
    tokenizer: str = "gpt2",
    *,
    source: str | None = None,
    val_fraction: float = 0.1,
    num_proc: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    data_root: str | os.PathLike = "data",
    started: float | None = None,
) -> dict[str, Any]:
    """Prepare a local file or folder with the tokenizer a --tokenizer value names; return meta.json.

    A folder already prepared from the same input, tokenizer and options is left alone (and its meta.json
    returned); an interrupted run of the same is continued. Every user mistake is a one-line DataError.
    """
    check_fraction(val_fraction)
    check_positive(num_proc, "--num_proc")
    check_positive(shard_tokens, "--shard_tokens")
    out_dir = Path(out_dir)
    inp = LocalInput(input_path)
    if not inp.documents:
        raise DataError(f"the input ({inp.path}) is empty; give text with at least {MIN_TOKENS} tokens")
    tok = None if tokenizer == "char" else resolve_tokenizer(tokenizer, data_root=data_root)
    block_bytes = BLOCK_BYTES
    fp = make_fingerprint(input=inp.fingerprint, tokenizer=tok.to_meta() if tok else "char",
                          val_fraction=val_fraction, shard_tokens=shard_tokens, block_bytes=block_bytes)
    meta = already_prepared(out_dir, fp, overwrite, inp.path)
    if meta is not None:
        return meta
    workers = num_proc if inp.total_bytes > PARALLEL_MIN_BLOCKS * block_bytes else 1
    counts: list[tuple[Block, int]] = []
    if inp.single is not None or tok is None:
        single_only = LocalInput(inp.single) if inp.single is not None else inp
        counts, chars = scan(single_only, block_bytes, tok is None, workers)
        if tok is None:
            tok = resolve_tokenizer("char", data_root=data_root, chars=chars)
    rule = cuts.choose_rule(tok)
    if inp.single is not None:
        # One text: the split is by characters (round() as it always was, so existing datasets keep their bytes).
        total_chars = sum(n for _, n in counts)
        cut = char_to_byte(counts, round(total_chars * (1.0 - val_fraction)))
        path, size = str(inp.single), inp.total_bytes

        def tasks(cursor: int | None) -> Iterator[PieceTask]:
            return _numbered(text_groups(path, size, cut, block_bytes), cursor, rule, eot=False)
    else:
        val_rule = ValRule.for_documents(val_fraction, inp.documents)

        def tasks(cursor: int | None) -> Iterator[PieceTask]:
            return _numbered(document_groups(inp, val_rule, block_bytes), cursor, rule, eot=True)

    meta = run(Job(out_dir, tok, fp, source or str(input_path), tasks=tasks, work=encode_pieces, workers=workers,
                   shard_tokens=shard_tokens, total=inp.total_bytes, started=started))
    if inp.single is None:
        for line in describe_val(inp, val_rule, meta, val_fraction):
            print(line)
    return meta


# ----------------------------------------------------------------------------------------------------------
# Which documents went to val, said after the summary

VAL_NAMES_SHOWN = 3  # documents named; the rest are counted
# Fewer documents than this: val is one or two whole documents, which may be nothing like the others (another
# language, another kind of text), so its loss says little about the model.
FEW_DOCUMENTS = 10


def describe_val(inp: LocalInput, val_rule: ValRule, meta: dict[str, Any], fraction: float) -> list[str]:
    """The line naming the documents that went to val (a few, then how many more) with val's share of the
    tokens, and a warning, saying what to do, when val is a large share or one of very few documents."""
    names: list[str] = []
    n_val = doc = 0
    for path, size, _ in inp.files():
        if not size:
            continue
        if val_rule.split(doc) == "val":
            n_val += 1
            if len(names) < VAL_NAMES_SHOWN:
                names.append(str(path.relative_to(inp.path)))
        doc += 1
    tokens = {split: entry["tokens"] for split, entry in meta["splits"].items()}
    share = tokens.get("val", 0) / max(1, sum(tokens.values()))
    more = f" and {n_val - len(names):,} more" if n_val > len(names) else ""
    lines = [f"val: {n_val:,} of the {inp.documents:,} documents ({', '.join(names)}{more}), {share:.0%} of the "
             f"tokens (--val_fraction {fraction:g} picks whole documents)"]
    few = inp.documents < FEW_DOCUMENTS
    if few or share >= min(2 * fraction, (1 + fraction) / 2):  # twice the share asked, or most of the rest
        what = (f"val is {n_val} of only {inp.documents} documents" if few else
                f"val holds {share:.0%} of the tokens, not {fraction:.0%}")
        them = ("that text", "it is") if n_val == 1 else ("those texts", "they are")
        lines.append(f"warning: {what}: the val loss measures how well the model knows {them[0]}, which may be "
                     f"unlike the rest, and {them[1]} never trained on; cut the text into more documents (files), "
                     f"or join them into one file, whose last {fraction:.0%} is then val")
    return lines
