"""Writing a prepared dataset folder: the shards of both splits and, last, meta.json (format: ``gptkit/shards.py``).

Every prepare script ends here, and the rules they share live here:

* Size: a dataset must hold at least ``MIN_TOKENS`` tokens (4096 = four 1024-token GPT-2 contexts) and both
  splits must be non-empty. Anything smaller cannot give a meaningful train/val split, so it is refused
  *before* any shard is written (the streaming writers, which only know the size at the end, delete what
  they wrote instead).
* Idempotence: the same input gives the same bytes. Shards are deterministic, and meta.json keeps its
  "created" date when nothing else changed, so a re-run rewrites identical files.
* Consistency: meta.json is removed first and written last, so a folder with a meta.json is always complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptkit import shards
from gptkit.shards import DataError
from gptkit.tokenizer import Tokenizer

MIN_TOKENS = 4096
DEFAULT_SHARD_TOKENS = 100_000_000


def check_positive(value: int, flag: str) -> None:
    if value < 1:
        raise DataError(f"{flag} must be at least 1, got {value}")


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


class DatasetWriter:
    """Writes the shards of both splits and, last, meta.json.

    Shards are written into a staging folder (``out_dir/.partial``) and moved into place only by ``finish()``,
    after every check has passed: a run that fails half-way (a network drop during a 10B-token corpus, a
    refused input) leaves an already prepared dataset in ``out_dir`` exactly as it was. Use as a context
    manager: if anything fails before ``finish()``, the staging folder is removed (and ``out_dir`` too if this
    run created it and it is empty). Each shard and meta.json is itself written atomically (``gptkit/shards.py``).
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
