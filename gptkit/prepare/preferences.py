"""Preference pairs (a prompt, a chosen reply and a rejected one) -> a preference dataset: token shards with a
loss mask on the reply tokens, two sequences per pair, rendered by gptkit/chat.py (the template chat.py and
serve.py use too).

    meta = prepare_pairs(out_dir, rows, tokenizer, source="pairs.jsonl", block_size=1024, val_fraction=0.05)

A row holds `prompt` (a string: one user message, or a list of messages) and `chosen` / `rejected` (each a
string, an assistant message, or a list holding one); or, the "chosen/rejected conversations" layout, no prompt
and two whole conversations that share it (the longest common run of leading messages is the prompt); or a
prompt and two conversations that start with it. Each reply must then be one assistant message.

Each pair is written as two sequences, the chosen one first, both starting with <|endoftext|> (how
gptkit/preference.py finds them): the prompt's tokens, then the reply's. The loss mask is 1 on the reply (its
content and the <|end|> that closes it) and 0 on the prompt, its markers included. A pair whose longer sequence
exceeds block_size + 1 tokens has its prompt cut from the start, just after <|endoftext|> (the prompt's end,
where the question is, stays; both sequences lose the same tokens, so they keep one prompt); one that would
keep fewer than min_prompt_tokens of its prompt is dropped.

Bad rows are never kept, and never silently dropped: each is counted by reason and named by its line (row of
a Hub dataset), in the printed report and in meta.json's "preference" entry, which also marks the folder as a
preference dataset (gptkit/preference.py reads it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.chat import ChatError, check_messages, prompt_ids, render
from gptkit.prepare.pipeline import ValRule
from gptkit.prepare.writer import DEFAULT_SHARD_TOKENS, MIN_TOKENS, DatasetWriter, check_prepared
from gptkit.shards import DataError, dtype_for_vocab
from gptkit.tokenizer import Tokenizer

# Why a row is not kept, in the order the checks run; the report names each reason's rows.
BAD = {
    "not_json": "not a JSON object",
    "missing": "no chosen or no rejected field",
    "malformed": "a field that is neither text nor chat messages",
    "no_prompt": "no prompt (none given, and the two conversations share no leading message)",
    "not_one_reply": "a reply that is not one assistant message",
    "empty": "an empty prompt or reply",
    "identical": "chosen and rejected are the same reply",
    "unknown_char": "a character the tokenizer does not have",
    "too_long": "too long: the replies leave less than --min_prompt_tokens of the prompt",
}
NAMED = 20  # line numbers kept per reason in meta.json and printed (the counts are always whole)


class BadPair(Exception):
    """A row that cannot be a pair; `reason` is a key of BAD."""

    def __init__(self, reason: str):
        super().__init__(BAD[reason])
        self.reason = reason


@dataclass(frozen=True)
class Pair:
    """One preference: the prompt's messages, and the two replies (assistant messages)."""

    prompt: list[dict[str, str]]
    chosen: dict[str, str]
    rejected: dict[str, str]

    def texts(self) -> Iterator[str]:
        for m in [*self.prompt, self.chosen, self.rejected]:
            yield m["content"]


def _messages(value: Any, role: str) -> list[dict[str, str]]:
    """A field as messages: a string is one message of `role`, a message a list of one."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    try:
        return check_messages([value] if isinstance(value, dict) else value)
    except ChatError:
        raise BadPair("malformed") from None


def parse_pair(row: Any) -> Pair:
    """The pair a row holds, or BadPair saying why it holds none (see the module docstring for the layouts)."""
    if not isinstance(row, dict):
        raise BadPair("not_json")
    if row.get("chosen") is None or row.get("rejected") is None:
        raise BadPair("missing")
    chosen, rejected = _messages(row["chosen"], "assistant"), _messages(row["rejected"], "assistant")
    if row.get("prompt") is not None:
        prompt = _messages(row["prompt"], "user")
        n = len(prompt)
        # Conversations that start with the prompt (a common Hub layout): their rest is the reply.
        chosen, rejected = (r[n:] if len(r) > n and r[:n] == prompt else r for r in (chosen, rejected))
    else:  # two conversations: the messages they share are the prompt
        if chosen == rejected:
            raise BadPair("identical")
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if not prompt:
        raise BadPair("no_prompt")
    if any(len(r) != 1 or r[0]["role"] != "assistant" for r in (chosen, rejected)):
        raise BadPair("not_one_reply")
    if not any(m["content"].strip() for m in prompt) or not all(r[0]["content"].strip()
                                                                   for r in (chosen, rejected)):
        raise BadPair("empty")
    if chosen[0]["content"] == rejected[0]["content"]:
        raise BadPair("identical")
    return Pair(prompt, chosen[0], rejected[0])


@dataclass
class Rendered:
    """A pair as token ids and loss masks (1 = a reply token), each of at most block_size + 1 tokens; `cut`:
    how many prompt tokens were dropped from its start."""

    chosen: tuple[list[int], list[int]]
    rejected: tuple[list[int], list[int]]
    cut: int


def render_pair(pair: Pair, tokenizer: Tokenizer, block_size: int, min_prompt_tokens: int) -> Rendered:
    """The pair rendered by the chat template, its prompt cut from the start when the longer sequence exceeds
    block_size + 1 tokens; BadPair("too_long") when that would leave fewer than min_prompt_tokens of it."""
    try:
        head = len(prompt_ids(pair.prompt, tokenizer))  # <|endoftext|> ... <|assistant|>
        seqs = [render([*pair.prompt, reply], tokenizer) for reply in (pair.chosen, pair.rejected)]
    except DataError:  # a character a char tokenizer lacks
        raise BadPair("unknown_char") from None
    cut = max(0, max(len(ids) for ids, _ in seqs) - (block_size + 1))
    if cut and head - 1 - cut < min_prompt_tokens:
        raise BadPair("too_long")
    out = []
    for ids, trained in seqs:
        mask = [0] * head + [int(t) for t in trained[head:]]  # the reply only: never a prompt's assistant turn
        out.append((ids[:1] + ids[1 + cut :], mask[:1] + mask[1 + cut :]))
    return Rendered(out[0], out[1], cut)


# ----------------------------------------------------------------------------------------------------------
# Reading rows


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """("line N", the parsed row) for every non-blank line; a line that is not JSON comes as None (a bad row)."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read --input {path} ({e.strerror}); give a JSONL file of preference pairs") \
            from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"line {n}", json.loads(line)
            except json.JSONDecodeError:
                yield f"line {n}", None


def dataset_rows(ds: Any) -> Iterator[tuple[str, Any]]:
    """("row N", the row) for every row of a Hugging Face Dataset (N counts from 0, as datasets does)."""
    for n, row in enumerate(ds):
        yield f"row {n}", row


def pair_chars(rows: Iterable[tuple[str, Any]]) -> set[str]:
    """Every character of the pairs' texts (what --tokenizer char needs); bad rows are skipped."""
    chars: set[str] = set()
    for _, row in rows:
        try:
            for text in parse_pair(row).texts():
                chars.update(text)
        except BadPair:
            continue
    return chars


# ----------------------------------------------------------------------------------------------------------
# Writing the dataset


@dataclass
class Report:
    """What became of the rows: pairs kept whole or cut, and the bad ones by reason with their names."""

    kept: int = 0
    cut: int = 0
    pairs: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    bad: dict[str, list[str]] = field(default_factory=dict)  # reason -> its rows' names (NAMED go to meta.json)

    def add_bad(self, reason: str, name: str) -> None:
        self.bad.setdefault(reason, []).append(name)

    def lines(self) -> list[str]:
        """The report's lines: one for the pairs, one per reason of the bad rows."""
        dropped = sum(len(v) for v in self.bad.values())
        out = [f"pairs: {self.kept + self.cut:,} kept ({self.cut:,} with their prompt cut from the start to fit), "
               f"{dropped:,} rows left out; train {self.pairs['train']:,}, val {self.pairs['val']:,}"]
        for reason, names in sorted(self.bad.items(), key=lambda kv: list(BAD).index(kv[0])):
            more = f" and {len(names) - NAMED:,} more" if len(names) > NAMED else ""
            out.append(f"  left out, {BAD[reason]}: {len(names):,} ({', '.join(names[:NAMED])}{more})")
        return out

    def to_meta(self, block_size: int, min_prompt_tokens: int) -> dict[str, Any]:
        return {"pairs": dict(self.pairs), "kept": self.kept, "cut": self.cut,
                "bad": {r: len(v) for r, v in self.bad.items()},
                "bad_rows": {r: v[:NAMED] for r, v in self.bad.items()},
                "block_size": block_size, "min_prompt_tokens": min_prompt_tokens}


def prepare_pairs(out_dir: Path, rows: Any, tokenizer: Tokenizer, *, source: str, fingerprint: str,
                  n_rows: int, block_size: int, min_prompt_tokens: int = 16, val_fraction: float = 0.05,
                  shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False) -> dict[str, Any]:
    """Write the preference dataset of `rows` (a callable giving a fresh iterator of (name, row), n_rows of
    them) into out_dir; returns meta.json. `tokenizer` must have the chat template's special tokens. The
    split is decided per row (ValRule on its position), so it does not depend on which rows are bad."""
    if block_size < 2:
        raise DataError(f"--block_size must be at least 2, got {block_size}")
    if min_prompt_tokens < 1:
        raise DataError(f"--min_prompt_tokens must be at least 1, got {min_prompt_tokens}")
    done = check_prepared(out_dir, fingerprint, overwrite)
    if done is not None:
        print(f"{out_dir} is already prepared from {source} with this tokenizer and these options; nothing to do "
              f"(--overwrite prepares it again)")
        return done
    started = time.perf_counter()
    rule = ValRule.for_documents(val_fraction, n_rows)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    report = Report()
    reply_tokens = 0
    with DatasetWriter(out_dir, tokenizer, shard_tokens, fingerprint=fingerprint, masks=True) as writer:
        for index, (name, row) in enumerate(rows()):
            try:
                pair = render_pair(parse_pair(row), tokenizer, block_size, min_prompt_tokens)
            except BadPair as e:
                report.add_bad(e.reason, name)
                continue
            split = rule.split(index)
            for ids, mask in (pair.chosen, pair.rejected):
                writer.write(split, np.array(ids, dtype=dtype), np.array(mask, dtype=np.uint16))
                reply_tokens += sum(mask)
            report.pairs[split] += 1
            if pair.cut:
                report.cut += 1
            else:
                report.kept += 1
        for line in report.lines():
            print(line)
        total = writer.tokens("train") + writer.tokens("val")
        if min(report.pairs.values()) == 0 or total < MIN_TOKENS:
            empty = min(report.pairs, key=report.pairs.get)
            raise DataError(
                f"{source} gives {report.pairs['train']:,} train and {report.pairs['val']:,} val pairs "
                f"({total:,} tokens); a dataset needs pairs in both splits and at least {MIN_TOKENS:,} tokens: "
                + (f"give more pairs or change --val_fraction (the {empty} split is empty)"
                   if report.pairs[empty] == 0 else "give more pairs"))
        meta = writer.finish(source, f"the pairs of {source}",
                             extra={"preference": report.to_meta(block_size, min_prompt_tokens)})
    print(f"wrote {out_dir}: {total:,} tokens, {reply_tokens / max(1, total):.1%} of them reply tokens (the "
          f"loss mask), vocab_size {meta['vocab_size']}, in {time.perf_counter() - started:.2f} s")
    return meta
