"""The engine every prepare script runs: a stream of tasks -> worker processes -> shards, resumable, with progress.

    meta = run(Job(out_dir, tokenizer, fingerprint, source, tasks=make_tasks, work=encode_task, workers=8))

A task is a small, picklable description of a bounded piece of input (byte ranges of files, a range of dataset
rows, or a batch of streamed texts) with a ``cursor``: where the input stands once it is written. ``work``
runs in the workers (``gptkit/data/prepare/pool.py``), reads and tokenises its task and returns a ``Result``;
results are written in task order, so the shards are the same whatever the number of workers. After a task
that completed a shard (or a minute after the last one) the writer checkpoints with that task's cursor; a
resumed run asks ``tasks(cursor)`` for the tasks after it (``gptkit/data/prepare/writer.py`` has the rules).

Splits: a result's tokens are either already split ("train"/"val": whole documents, chosen by ``ValRule``)
or one "stream" whose first ``val_tokens`` tokens are val and the rest train (the Hub corpora).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptkit.data import shards
from gptkit.data.prepare.pool import ordered_map
from gptkit.data.prepare.writer import DEFAULT_SHARD_TOKENS, DatasetWriter, check_positive
from gptkit.tokenizer import Tokenizer

CHECKPOINT_SECONDS = 60.0  # also checkpoint this often when shards complete slowly (a slow stream)


@dataclass
class Result:
    """What a task gave: token arrays (on-disk dtype) by split, or "stream"; documents finished; progress made
    (in the job's unit: bytes of input, or rows)."""

    tokens: dict[str, np.ndarray]
    documents: int
    size: int


@dataclass
class Job:
    out_dir: Path
    tokenizer: Tokenizer
    fingerprint: str
    source: str
    tasks: Callable[[Any], Iterable[Any]]  # cursor of the last checkpoint (None: the start) -> the tasks after it
    work: Callable[[Any], Result]  # a module-level function: it runs in the worker processes
    workers: int = 1
    extra: Any = None  # worker state besides the tokenizer (e.g. a Dataset), sent to each worker once
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    val_tokens: int | None = None  # for "stream" results: how many tokens of the stream are val
    total: int | None = None  # the input's size in `unit`s, when known: the progress bar's ETA
    unit: str = "B"
    what: str = "the input"
    started: float | None = None  # time.perf_counter() when the command started (default: when run() does)


def run(job: Job) -> dict[str, Any]:
    """Tokenise and write every task of the job (continuing an interrupted run of it); return meta.json."""
    started = time.perf_counter() if job.started is None else job.started
    val_target = job.shard_tokens if job.val_tokens is None else job.val_tokens  # for "stream" results
    check_positive(val_target, "--val_tokens")
    with DatasetWriter(job.out_dir, job.tokenizer, job.shard_tokens, fingerprint=job.fingerprint) as writer:
        saved = writer.resumed or {}
        documents, size, new_tokens = saved.get("documents", 0), saved.get("size", 0), 0
        if writer.resumed is not None:
            of = f" of {job.total:,}" if job.total else ""
            print(f"resuming the interrupted run in {writer.stage}: {writer.shards_done()} shard(s) and "
                  f"{size:,}{of} {'bytes' if job.unit == 'B' else job.unit + 's'} of input already done")
        bar = tqdm(total=job.total, initial=size, unit=job.unit, unit_scale=True, desc="tokenizing", smoothing=0.05)
        t0 = last_checkpoint = time.perf_counter()
        shards_at_checkpoint = writer.shards_done()
        with bar:
            for task, result in ordered_map(job.work, job.tasks(saved.get("task")), job.workers,
                                            initializer=init_worker, initargs=(job.tokenizer.to_meta(), job.extra)):
                for split, tokens in result.tokens.items():
                    if split == "stream":
                        _write_stream(writer, tokens, val_target)
                    else:
                        writer.write(split, tokens)
                    new_tokens += len(tokens)
                documents += result.documents
                size += result.size
                bar.update(result.size)
                now = time.perf_counter()
                bar.set_postfix_str(f"{new_tokens / max(now - t0, 1e-9) / 1e6:.2f}M tok/s", refresh=False)
                if writer.shards_done() > shards_at_checkpoint or now - last_checkpoint > CHECKPOINT_SECONDS:
                    writer.checkpoint({"task": task.cursor, "documents": documents, "size": size})
                    shards_at_checkpoint, last_checkpoint = writer.shards_done(), now
        meta = writer.finish(job.source, job.what, {"documents": documents})
    print_summary(job.out_dir, meta, time.perf_counter() - started, new_tokens, time.perf_counter() - t0)
    return meta


def _write_stream(writer: DatasetWriter, tokens: np.ndarray, val_target: int) -> None:
    """The first val_target tokens of the stream are val, the rest train. val is completed as soon as it is
    full, so only one split's shard is being filled at a time."""
    have = writer.tokens("val")
    if have < val_target:
        take = min(len(tokens), val_target - have)
        writer.write("val", tokens[:take])
        tokens = tokens[take:]
        if have + take == val_target:
            writer.close_split("val")
    if len(tokens):
        writer.write("train", tokens)


def print_summary(out_dir: Path, meta: dict[str, Any], seconds: float, new_tokens: int,
                  tokenizing_s: float) -> None:
    """The closing line: documents, tokens, shards, seconds."""
    splits = meta["splits"]
    total = sum(e["tokens"] for e in splits.values())
    parts = ", ".join(f"{s} {e['tokens']:,} in {len(e['shards'])} shard{'s' * (len(e['shards']) != 1)}"
                      for s, e in splits.items())
    resumed = "" if new_tokens == total else f", {new_tokens:,} of them in this run"
    rate = new_tokens / tokenizing_s / 1e6 if tokenizing_s > 0 else float("inf")
    docs = meta.get("documents", 0)
    print(f"prepared {out_dir}: {docs:,} document{'s' * (docs != 1)}, {total:,} tokens ({parts}; vocab_size "
          f"{meta['vocab_size']}{resumed}) in {seconds:.1f} s ({rate:.2f}M tokens/s tokenizing)")


# ----------------------------------------------------------------------------------------------------------
# In the workers


_WORKER: dict[str, Any] = {}


def init_worker(spec: dict[str, Any] | None, extra: Any = None) -> None:
    """Build a worker's state once: its tokenizer (from the meta.json entry) and the job's extra."""
    _WORKER["tokenizer"] = None if spec is None else Tokenizer.from_meta(spec)
    _WORKER["extra"] = extra


def worker_tokenizer() -> Tokenizer:
    return _WORKER["tokenizer"]


def worker_extra() -> Any:
    return _WORKER["extra"]


def encode_documents(tokenizer: Tokenizer, texts: Iterable[str], eot: bool = True) -> np.ndarray:
    """Texts -> one array in the on-disk dtype, each text followed by the end-of-text token (when there is one)."""
    dtype = shards.dtype_for_vocab(tokenizer.vocab_size)
    parts: list[np.ndarray] = []
    end = None if tokenizer.eot_id is None or not eot else np.array([tokenizer.eot_id], dtype=dtype)
    for text in texts:
        parts.append(tokenizer.encode_array(text).astype(dtype, copy=False))
        if end is not None:
            parts.append(end)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------
# Which documents are val


_MASK = (1 << 64) - 1


def doc_hash(index: int, seed: int = 0) -> float:
    """A fixed pseudo-random number in [0, 1) for a document's position (splitmix64's mixing function)."""
    x = (index + (seed << 32) + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) / 2.0**64


@dataclass(frozen=True)
class ValRule:
    """Document i (its position in the input) is val when doc_hash(i) < fraction: about that share of the
    documents, decided one document at a time, so it streams and does not depend on the number of workers.
    When the hash picks no document of the n, the one with the smallest hash is val anyway; when it picks
    all, the one with the largest stays train."""

    fraction: float
    forced_val: int | None = None
    forced_train: int | None = None

    @classmethod
    def for_documents(cls, fraction: float, n: int) -> ValRule:
        # Both scans stop at the first document that settles them (about 1/fraction on average).
        forced_val = forced_train = None
        if not any(doc_hash(i) < fraction for i in range(n)):
            forced_val = min(range(n), key=doc_hash, default=None)
        if n > 1 and all(doc_hash(i) < fraction for i in range(n)):
            forced_train = max(range(n), key=doc_hash)
        return cls(fraction, forced_val, forced_train)

    def split(self, index: int) -> str:
        if index == self.forced_val:
            return "val"
        if index == self.forced_train:
            return "train"
        return "val" if doc_hash(index) < self.fraction else "train"
