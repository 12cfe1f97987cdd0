"""Conversations (JSONL, one per line: {"messages": [{"role", "content"}, ...]}) -> a chat dataset: token shards
and, beside them, a loss mask (gptkit/data/shards.py) saying which tokens are trained: the assistant's replies and
their <|end|>, rendered by gptkit/chat.py, the template chat.py and serve.py use too.

    meta = prepare_conversations(out_dir, "chats.jsonl", tokenizer, block_size=1024, val_fraction=0.05)

Each conversation is one document, starting with <|endoftext|> (the loader starts its windows there). One
longer than block_size + 1 tokens is cut there (the model never sees more at once); one with nothing left to
learn (no assistant reply, or none inside the cut) is dropped. The counts go into meta.json's "chat" entry
and are printed. Conversations are read one line at a time: memory does not grow with the file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.chat import ChatError, check_messages, render
from gptkit.data.prepare.pipeline import ValRule
from gptkit.data.prepare.writer import DEFAULT_SHARD_TOKENS, DatasetWriter, already_prepared, make_fingerprint
from gptkit.data.shards import dtype_for_vocab
from gptkit.errors import DataError
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer, resolve_tokenizer

TRAIN_ON = ("assistant", "all")  # which tokens carry loss: the replies only (the point), or every token


def read_conversations(path: Path) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """(line number, messages) for every non-blank line of a JSONL file; a DataError naming a bad line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read --input {path} ({e.strerror}); give a JSONL file of conversations") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path} line {n} is not JSON ({e}); each line must be one conversation") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            try:
                yield n, check_messages(messages, where=f"{path} line {n}: messages")
            except ChatError as e:
                raise DataError(f"{e} (each line: {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}})") \
                    from None


def prepare_conversations(out_dir: Path, input_path: str | Path, tokenizer: Tokenizer, *, block_size: int,
                          val_fraction: float, train_on: str = "assistant",
                          shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False) -> dict[str, Any]:
    """Write the chat dataset of the conversations in input_path; returns meta.json. `tokenizer` must have the
    chat template's special tokens (Tokenizer.with_special(CHAT_SPECIALS))."""
    path = Path(input_path)
    if not path.is_file():
        raise DataError(f"--input {path} is not a file; give a JSONL file with one conversation per line")
    if train_on not in TRAIN_ON:
        raise DataError(f"--train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    if block_size < 2:
        raise DataError(f"--block_size must be at least 2, got {block_size}")
    fingerprint = make_fingerprint(chat=[str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns],
                                   tokenizer=tokenizer.to_meta(), block_size=block_size, val_fraction=val_fraction,
                                   train_on=train_on, shard_tokens=shard_tokens)
    done = already_prepared(out_dir, fingerprint, overwrite, path)
    if done is not None:
        return done
    started = time.perf_counter()
    n_lines = sum(1 for _ in read_conversations(path))  # checks every line before anything is written
    rule = ValRule.for_documents(val_fraction, n_lines)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    counts = {"kept": 0, "cut": 0, "dropped": 0}
    trained_tokens = {"train": 0, "val": 0}
    with DatasetWriter(out_dir, tokenizer, shard_tokens, fingerprint=fingerprint, masks=True) as writer:
        for index, (line, messages) in enumerate(read_conversations(path)):
            try:
                ids, trained = render(messages, tokenizer)
            except DataError as e:  # a character the tokenizer's vocabulary lacks: the line, as for bad JSON
                raise DataError(f"{path} line {line}: {e}") from None
            if len(ids) > block_size + 1:
                ids, trained = ids[: block_size + 1], trained[: block_size + 1]
                cut = True
            else:
                cut = False
            if not any(trained):  # nothing to learn: no reply, or none that fits
                counts["dropped"] += 1
                continue
            counts["cut" if cut else "kept"] += 1
            mask = np.ones(len(ids), np.uint16) if train_on == "all" else np.array(trained, np.uint16)
            split = rule.split(index)
            writer.write(split, np.array(ids, dtype=dtype), mask)
            trained_tokens[split] += int(mask.sum())
        totals = {s: writer.tokens(s) for s in ("train", "val")}
        if min(totals.values()) == 0:
            raise DataError(f"{path} gives an empty {min(totals, key=totals.get)} split ({counts['kept'] + counts['cut']}"
                            f" conversations kept); give more conversations or change --val_fraction")
        share = sum(trained_tokens.values()) / max(1, sum(totals.values()))
        report = {**counts, "block_size": block_size, "train_on": train_on, "trained_share": round(share, 4)}
        meta = writer.finish(str(path), f"the conversations of {path}", extra={"chat": report})
    print(f"conversations: {counts['kept']:,} kept, {counts['cut']:,} cut at block_size + 1 = {block_size + 1} "
          f"tokens, {counts['dropped']:,} dropped (nothing to learn within the block); {share:.1%} of the tokens "
          f"carry loss ({'the assistant replies' if train_on == 'assistant' else 'every token'})")
    parts = [f"{s}: {e['tokens']:,} tokens in {len(e['shards'])} shard(s)" for s, e in meta["splits"].items()]
    print(f"wrote {out_dir} (vocab_size {meta['vocab_size']}; {'; '.join(parts)}) in "
          f"{time.perf_counter() - started:.2f} s")
    return meta


def chat_tokenizer(arg: str, chars: Callable[[], Iterable[str]], data_root: str | Path = "data") -> Tokenizer:
    """The tokenizer a chat prepare script's --tokenizer names, with the chat template's special tokens:
    gpt2, char (`chars()`: the input's characters, read only then), a trained tokenizer's NAME or PATH, or a
    checkpoint of this project (an out_dir or a .pt file), whose own tokenizer it is."""
    path = Path(arg)
    if arg not in ("gpt2", "char") and (path.suffix == ".pt" or path.is_dir()):
        from gptkit.checkpoint import holds_checkpoint, load_checkpoint  # (torch: only for a checkpoint)

        if path.suffix == ".pt" or holds_checkpoint(path):
            return Tokenizer.from_meta(load_checkpoint(path)["tokenizer"]).with_special(CHAT_SPECIALS)
    base = resolve_tokenizer(arg, data_root=data_root, chars=chars() if arg == "char" else None)
    return base.with_special(CHAT_SPECIALS)
