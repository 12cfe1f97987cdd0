"""Writing a prepared dataset folder: the shards of both splits and, last, meta.json (format: ``gptkit/data/shards.py``).

Every prepare script ends here, and the rules they share live here:

* Size: a dataset must hold at least ``MIN_TOKENS`` tokens (4096 = four 1024-token GPT-2 contexts) and both
  splits must be non-empty; the streaming writer only knows the size at the end, so a refused input's shards
  are deleted then.
* Staging: shards are written into ``out_dir/.partial`` and moved into place only by ``finish()``, after every
  check has passed, so a run that fails or is killed half-way leaves an already prepared dataset in
  ``out_dir`` exactly as it was.
* Resume: ``checkpoint(cursor)`` makes the shards written so far durable and records, in
  ``.partial/progress.json``, how far into the input they reach (the caller's cursor) and the run's
  fingerprint (a hash of its input, tokenizer and options). A run that is killed (even with kill -9) or fails
  after a checkpoint keeps ``.partial``; the next run with the same fingerprint continues from the last
  checkpoint, dropping anything written after it, and so ends with the same bytes as an uninterrupted run.
  Any other run starts afresh.
* Never rewritten unless asked: meta.json records the fingerprint, so ``check_prepared`` recognises a folder
  already prepared from the same input (nothing to do), and refuses to replace a different one without
  ``overwrite``.
* Idempotence: the same input gives the same bytes, meta.json included (it keeps its "created" date).
* Consistency: meta.json is removed first and written last, so a folder with a meta.json is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.data import shards
from gptkit.errors import DataError
from gptkit.files import OutDirLock, write_text_atomic
from gptkit.tokenizer import Tokenizer

MIN_TOKENS = 4096
DEFAULT_SHARD_TOKENS = 100_000_000
PIPELINE_VERSION = 2  # part of every fingerprint: a change to how tokens are produced invalidates old runs


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


def make_fingerprint(**parts: Any) -> str:
    """A short hash of everything that determines a dataset's bytes (JSON-able values)."""
    text = json.dumps({"pipeline": PIPELINE_VERSION, **parts}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def check_prepared(out_dir: Path, fingerprint: str, overwrite: bool = False) -> dict[str, Any] | None:
    """The meta.json of out_dir when it was prepared by a run with this fingerprint (nothing to do), None when
    there is nothing complete there (or overwrite), and a DataError when it holds a different dataset."""
    try:
        meta = shards.read_meta(out_dir)
    except DataError:
        return None
    if overwrite:
        return None
    if meta.get("fingerprint") == fingerprint:
        return meta
    raise DataError(
        f"{out_dir} already holds a dataset prepared from {meta.get('source', 'another input')} with other "
        "input, tokenizer or options; pass --overwrite to replace it, or choose another --out_dir"
    )


def already_prepared(out_dir: Path, fingerprint: str, overwrite: bool, source: str | Path = "this input"
                     ) -> dict[str, Any] | None:
    """Every prepare pipeline's first question: check_prepared, saying so when there is nothing to do (the
    folder's meta.json, returned as the pipeline's own result), None when the pipeline is to run."""
    meta = check_prepared(out_dir, fingerprint, overwrite)
    if meta is not None:
        total = sum(e["tokens"] for e in meta["splits"].values())
        print(f"{out_dir} is already prepared from {source} with this tokenizer and these options ({total:,} "
              "tokens); nothing to do (--overwrite prepares it again)")
    return meta


class DatasetWriter:
    """Writes the shards of both splits into the staging folder, resumably, then moves them into place.

    Use as a context manager. ``resumed`` is the cursor dict of the last checkpoint when this run continues
    an interrupted one (the writers already hold what was written up to it), else None. If anything fails
    before ``finish()``, the staging folder is kept when a checkpoint exists (to resume) and removed otherwise
    (with ``out_dir`` itself if this run created it and it is empty). A lock on ``out_dir`` keeps a second
    prepare out of it meanwhile.
    """

    STAGING = ".partial"
    PROGRESS = "progress.json"

    def __init__(self, out_dir: Path, tokenizer: Tokenizer, shard_tokens: int = DEFAULT_SHARD_TOKENS, *,
                 fingerprint: str = "", masks: bool = False, labels: bool = False):
        check_positive(shard_tokens, "--shard_tokens")
        # With masks (a chat dataset), each split also gets a loss mask: one 0/1 per token, in its own shards;
        # with labels (unpaired preference rows), one 0/1 per sequence, in its own shards too.
        self.streams = [*shards.SPLITS, *(f"{s}_mask" for s in shards.SPLITS if masks),
                        *(f"{s}_labels" for s in shards.SPLITS if labels)]
        self.out_dir = Path(out_dir)
        self.tokenizer = tokenizer
        self.shard_tokens = shard_tokens
        self.fingerprint = fingerprint
        self._created_dir = not self.out_dir.exists()
        self._lock = OutDirLock(self.out_dir).acquire()
        if self._lock.notice:
            print(self._lock.notice)
        self.stage = self.out_dir / self.STAGING
        self._finished = False
        try:
            # Remember the old creation date, for byte-identical re-runs.
            self._old_meta: dict[str, Any] | None = shards.read_meta(self.out_dir)
        except DataError:
            self._old_meta = None
        try:
            self.resumed, self.writers = self._resume()
        except BaseException:
            self._lock.release()
            raise
        self._checkpointed = self.resumed is not None

    def _resume(self) -> tuple[dict[str, Any] | None, dict[str, shards.ShardWriter]]:
        progress = self._read_progress()
        if progress is not None:
            try:
                writers = {s: self._shard_writer(s, progress["splits"][s]) for s in self.streams}
                return progress["cursor"], writers
            except (DataError, KeyError, TypeError, ValueError, OSError) as e:
                print(f"cannot continue the interrupted run in {self.stage} ({e}); starting again")
        elif self.stage.exists():
            print(f"discarding {self.stage}: left by an interrupted run with other input, tokenizer or options")
        shutil.rmtree(self.stage, ignore_errors=True)
        self.stage.mkdir(parents=True)
        return None, {s: self._shard_writer(s, None) for s in self.streams}

    def _read_progress(self) -> dict[str, Any] | None:
        try:
            progress = json.loads((self.stage / self.PROGRESS).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        ok = isinstance(progress, dict) and self.fingerprint and progress.get("fingerprint") == self.fingerprint
        return progress if ok else None

    def _shard_writer(self, stream: str, state: dict[str, int] | None) -> shards.ShardWriter:
        vocab = 2 if stream.endswith(("_mask", "_labels")) else self.tokenizer.vocab_size
        return shards.ShardWriter(self.stage, stream, vocab, self.shard_tokens, state=state)

    def write(self, split: str, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append tokens to a split; with masks, `mask` says which of them are trained (1) or context (0)."""
        if (mask is None) != (f"{split}_mask" not in self.writers) or (mask is not None and len(mask) != len(tokens)):
            raise ValueError("a dataset with loss masks needs one mask value per token (and one without, none)")
        self.writers[split].write(tokens)
        if mask is not None:
            self.writers[f"{split}_mask"].write(np.asarray(mask, dtype=np.uint16))

    def write_label(self, split: str, label: int) -> None:
        """Append one sequence's label (0 or 1) to a split (a dataset made with labels=True)."""
        self.writers[f"{split}_labels"].write(np.array([label], dtype=np.uint16))

    def close_split(self, split: str) -> None:
        """Complete a split's last shard early (the streaming corpora's val split is written first)."""
        self.writers[split].close()

    def tokens(self, split: str) -> int:
        return self.writers[split].tokens

    def shards_done(self) -> int:
        return sum(len(w.names) for w in self.writers.values())

    def checkpoint(self, cursor: dict[str, Any]) -> None:
        """Make everything written so far durable and record that it covers the input up to `cursor`."""
        states = {s: w.sync() for s, w in self.writers.items()}
        progress = {"fingerprint": self.fingerprint, "splits": states, "cursor": cursor}
        write_text_atomic(self.stage / self.PROGRESS, json.dumps(progress))
        self._checkpointed = True

    def finish(self, source: str, what: str = "the input", extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Complete all shards, check sizes, move the shards into place, write meta.json (with `extra` keys and
        the fingerprint), and delete shards left over from older runs."""
        names = {s: w.close() for s, w in self.writers.items()}
        try:
            check_sizes({s: self.writers[s].tokens for s in shards.SPLITS}, what)
        except DataError:
            self.abort()
            raise
        splits = {s: {"shards": names[s], "tokens": self.writers[s].tokens} for s in shards.SPLITS}
        for s in shards.SPLITS:
            if f"{s}_mask" in names:
                splits[s]["masks"] = names[f"{s}_mask"]
            if f"{s}_labels" in names:
                splits[s]["labels"] = names[f"{s}_labels"]
        meta = shards.make_meta(self.tokenizer, splits, source)
        meta.update(extra or {})
        meta["fingerprint"] = self.fingerprint
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
        self._lock.release()
        return meta

    def abort(self) -> None:
        """Remove the staging folder (and out_dir if this run created it and it is empty)."""
        shutil.rmtree(self.stage, ignore_errors=True)
        self._lock.release()
        if self._created_dir and self.out_dir.is_dir() and not any(self.out_dir.iterdir()):
            self.out_dir.rmdir()
        self._finished = True

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if self._finished:
            return
        if exc_type is not None and self._checkpointed:
            self._lock.release()  # keep the staging folder: the next run continues from the checkpoint
            print(f"kept {self.stage}: run the same command again to continue from its last checkpoint")
        else:
            self.abort()
