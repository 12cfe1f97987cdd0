"""Trained byte-level BPE tokenizers: training one on any text, and the folder it lives in.

    bpe = train(texts, vocab_size=8192, special=CHAT_SPECIALS, name="mytok")    # texts: any iterator of str
    folder, created = save(bpe, "data/tokenizers")      # data/tokenizers/mytok-1a2b3c4d5e6f/
    bpe = load(folder)                                   # checked against its hash

A folder, named NAME-HASH12 (the first 12 hex digits of the content hash), holds:

    ranks.tiktoken        the BPE, in tiktoken's format: one line per token, "base64(bytes) id", by id
    tokenizer_info.json   name, hash, split pattern, special tokens with their ids, vocab_size, what it was
                          trained on
    tokenizer.json        the same tokenizer for Hugging Face tokenizers/transformers (derived, not hashed)

The hash (sha256) covers everything that defines the encoding: the ranks, the split pattern and the special
tokens. A folder is written once, atomically (a staging folder renamed into place), and never rewritten.

Byte-level: the 256 single bytes are the first 256 ids, so every string is encoded (nothing is unknown) and
decodes back exactly. The text is first split into pieces by GPT-4's pattern (tiktoken's cl100k_base: letters,
1-3 digit numbers, punctuation runs, whitespace runs), and BPE merges never cross a piece boundary; llama.cpp
knows this pattern, so such a model exported to GGUF is pre-tokenised identically there.
"""

from __future__ import annotations

import base64
import binascii
import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gptkit.cli import one_line
from gptkit.errors import DataError
from gptkit.hf_tokenizer import byte_bpe_tokenizer_json

# GPT-4's pre-tokenisation split, exactly tiktoken's cl100k_base pat_str (a test checks it against tiktoken).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]"""
    r"""|\s+(?!\S)|\s"""
)
RANKS_FILE = "ranks.tiktoken"
INFO_FILE = "tokenizer_info.json"
HF_FILE = "tokenizer.json"
DEFINING_FILES = (RANKS_FILE, INFO_FILE)  # what the hash covers (tokenizer.json is derived from them)
FORMAT = 1
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
FOLDER_RE = re.compile(r"(?P<name>.+)-(?P<short>[0-9a-f]{12})")
TRAIN_HINT = "train one with: python prepare/tokenizer.py --input TEXT --vocab_size 8192 --name NAME"


@dataclass(frozen=True)
class BPE:
    """A byte-level BPE: token bytes -> id (ids 0..len-1, merges in id order), the split regex and the special
    tokens (name -> id, after the ordinary ids)."""

    name: str
    ranks: dict[bytes, int]
    pattern: str
    special: dict[str, int]
    trained_on: str = ""  # a line saying what text it was trained on (not hashed)

    @property
    def vocab_size(self) -> int:
        return len(self.ranks) + len(self.special)

    @property
    def hash(self) -> str:
        return content_hash(ranks_text(self.ranks), self.pattern, self.special)

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.hash[:12]}"

    def files(self) -> dict[str, str]:
        """The folder's files, name -> text."""
        info = {
            "format": FORMAT,
            "name": self.name,
            "hash": self.hash,
            "pattern": self.pattern,
            "special": self.special,
            "vocab_size": self.vocab_size,
            "merges": len(self.ranks) - 256,
            "trained_on": self.trained_on,
        }
        return {
            RANKS_FILE: ranks_text(self.ranks),
            INFO_FILE: json.dumps(info, indent=2, ensure_ascii=False) + "\n",
            HF_FILE: json.dumps(byte_bpe_tokenizer_json(self.ranks, self.pattern, self.special),
                                ensure_ascii=False) + "\n",
        }


# ----------------------------------------------------------------------------- training


def train(texts: Iterable[str], vocab_size: int, special: Sequence[str], name: str, *,
          trained_on: str = "") -> BPE:
    """Train a byte-level BPE of `vocab_size` ids in all (256 bytes + merges + the `special` names) on the
    texts, read once as a stream (memory holds the counts of distinct pieces, not the text).

    Deterministic: the same texts and settings give the same BPE (ties between equally frequent pairs are
    broken by the pair itself, not by hash-map order), whatever the batching of the input.
    """
    check_name(name)
    special = list(dict.fromkeys(special))
    n_merges = merges_for(vocab_size, len(special))
    # rustbpe (Rust, the trainer of Karpathy's nanochat) rather than Hugging Face tokenizers' BpeTrainer: it
    # trains exactly this kind of BPE (a GPT-4-style split regex, byte-level, ranks in tiktoken's form) and
    # was ~1.8x faster on the same 90 MB of text (12.1 vs 6.8 MB/s, 2 cores; BENCHMARKS.md, "Tokenizers").
    # It consumes the iterator in batches, counting the split pieces in parallel while the next batch is read.
    import rustbpe

    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(_strings(texts), 256 + n_merges, pattern=SPLIT_PATTERN)
    ranks = {bytes(token): int(rank) for token, rank in trainer.get_mergeable_ranks()}
    if sorted(ranks.values()) != list(range(len(ranks))):  # never expected: a guard on the library's output
        raise DataError("the BPE trainer returned ranks that are not 0..n-1; report this as a bug")
    special_ids = {s: len(ranks) + i for i, s in enumerate(special)}
    return BPE(name, ranks, SPLIT_PATTERN, special_ids, trained_on)


def merges_for(vocab_size: int, n_special: int) -> int:
    """How many merges make `vocab_size` ids with `n_special` special tokens; a DataError if none can."""
    if vocab_size < 256 + n_special:
        raise DataError(f"--vocab_size {vocab_size} is too small: it counts the 256 byte tokens and the "
                        f"{n_special} special tokens too; use at least {256 + n_special}")
    return vocab_size - 256 - n_special


def _strings(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if not isinstance(text, str):
            raise DataError(f"training text must be strings, got a {type(text).__name__}")
        yield text


def check_name(name: str) -> None:
    if not NAME_RE.fullmatch(name) or name in ("gpt2", "char"):
        raise DataError(f"tokenizer name {name!r} must be letters, digits, '.', '_' or '-' (not starting with "
                        f"'.' or '-'), and not 'gpt2' or 'char'")


# ----------------------------------------------------------------------------- the files and the hash


def ranks_text(ranks: dict[bytes, int]) -> str:
    return "".join(f"{base64.b64encode(token).decode()} {rank}\n"
                   for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]))


def content_hash(ranks_txt: str, pattern: str, special: dict[str, int]) -> str:
    """sha256 of what defines the encoding: the split pattern, the special tokens and their ids, the ranks."""
    header = json.dumps({"pattern": pattern, "special": sorted(special.items(), key=lambda kv: kv[1])},
                        ensure_ascii=False, sort_keys=True)
    return hashlib.sha256((header + "\n" + ranks_txt).encode("utf-8")).hexdigest()


def from_files(files: dict[str, str], where: str, expected_hash: str | None = None) -> BPE:
    """The BPE in a folder's defining files (name -> text), `where` naming them in errors; a DataError if they
    are malformed, disagree with their recorded hash, or with `expected_hash`."""
    try:
        info = json.loads(files[INFO_FILE])
        ranks_txt = files[RANKS_FILE]
    except KeyError as e:
        raise DataError(f"{where} has no {e.args[0]}; {TRAIN_HINT}") from None
    except ValueError as e:
        raise DataError(f"{where}/{INFO_FILE} is not valid JSON ({one_line(e)}); restore it or retrain") from None
    if not (isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("pattern"), str)
            and isinstance(info.get("special"), dict) and isinstance(info.get("hash"), str)):
        raise DataError(f"{where}/{INFO_FILE} lacks name, hash, pattern or special; restore it or retrain")
    ranks = _parse_ranks(ranks_txt, f"{where}/{RANKS_FILE}")
    special = info["special"]
    found = content_hash(ranks_txt, info["pattern"], special)
    if found != info["hash"] or (expected_hash is not None and found != expected_hash):
        wanted = expected_hash if expected_hash is not None else info["hash"]
        raise DataError(f"tokenizer {where} was changed: its content hash is {found[:12]}, not the {wanted[:12]} "
                        f"it was saved with; restore the original files or train and prepare again")
    return BPE(info["name"], ranks, info["pattern"], special, str(info.get("trained_on", "")))


def _parse_ranks(text: str, where: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        try:
            token, rank = line.split(" ")
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise DataError(f"{where} line {n} is not 'base64 id'; restore the file or retrain") from None
    if sorted(ranks.values()) != list(range(len(ranks))) or any(ranks.get(bytes([b])) != b for b in range(256)):
        raise DataError(f"{where} is not a byte-level BPE (ids 0..n-1, the 256 bytes first); restore it or retrain")
    return ranks


# ----------------------------------------------------------------------------- the folder


def read_files(folder: str | Path) -> dict[str, str]:
    """The defining files of a tokenizer folder (name -> text); a DataError if the folder or a file is
    missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"tokenizer folder {folder} does not exist: restore it, or train a tokenizer (python "
                        f"prepare/tokenizer.py) and prepare the data with it again")
    files = {}
    for name in DEFINING_FILES:
        try:
            files[name] = (folder / name).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"tokenizer folder {folder} has no {name}: restore it, or train a tokenizer (python "
                            f"prepare/tokenizer.py) and prepare the data with it again") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read {folder / name} ({one_line(e)}); restore it") from None
    return files


def load(folder: str | Path, expected_hash: str | None = None) -> BPE:
    return from_files(read_files(folder), str(folder), expected_hash)


def save(bpe: BPE, root: str | Path) -> tuple[Path, bool]:
    """Write `bpe` as root/NAME-HASH12/ unless that folder exists already (same name, same content): returns
    the folder and whether it was written now. All files appear at once (a staging folder renamed into
    place): a failed or killed run leaves no folder that looks finished."""
    root = Path(root)
    folder = root / bpe.folder_name
    if folder.is_dir():
        load(folder, bpe.hash)  # the same content (a DataError if someone changed it)
        return folder, False
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{bpe.folder_name}.tmp-{os.getpid()}"
    for stale in root.glob(f".{bpe.folder_name}.tmp-*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    try:
        staging.mkdir()
        for name, text in bpe.files().items():
            with open(staging / name, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder, True


def find(name: str, root: str | Path) -> Path:
    """The one folder root/NAME-HASH12; a DataError listing what there is when there is none or several."""
    root = Path(root)
    candidates = sorted(p for p in root.glob(f"{glob.escape(name)}-*") if _folder_name(p) == name)
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        listed = ", ".join(str(p) for p in candidates)
        raise DataError(f"several tokenizers are named {name!r} ({listed}); pass the PATH of the one you mean")
    there = sorted(p.name for p in root.iterdir() if _folder_name(p)) if root.is_dir() else []
    have = f"{root}/ holds {', '.join(there)}" if there else f"{root}/ holds none"
    raise DataError(f"no tokenizer named {name!r} ({have}); {TRAIN_HINT}, or pass a tokenizer folder's PATH")


def _folder_name(path: Path) -> str | None:
    match = FOLDER_RE.fullmatch(path.name)
    return match["name"] if match and path.is_dir() and not path.name.startswith(".") else None

