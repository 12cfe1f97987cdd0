"""Preference data -> a preference dataset: token shards with a loss mask on the reply tokens, rendered by
gptkit/chat.py (the template chat.py and serve.py use too). Two kinds, one per dataset:

* pairs (for DPO): a prompt, a chosen reply and a rejected one, written as two sequences;
* unpaired rows (for a loss that takes them, such as KTO): a prompt, one completion and a label (true: a
  desirable completion, false: an undesirable one), written as one sequence each, the labels in their own
  shards (train_labels_000000.bin: one 0/1 per row); meta.json's "preference" entry says "format": "unpaired",
  and DPO refuses such a dataset.

    meta = prepare_pairs(out_dir, rows, tokenizer, source="pairs.jsonl", fingerprint=fp, n_rows=n, block_size=1024)

A pair row holds `prompt` (a string: one user message, or a list of messages, system messages and earlier
turns included) and `chosen` / `rejected` (each a string, an assistant message, or a list holding one); or,
the implicit-prompt layout, no prompt and two whole conversations that share it (the longest common run of
leading messages is the prompt), or two texts that start the same way (what they share up to the last
whitespace before they differ is the prompt, a user message); or a prompt and two conversations that start
with it. An unpaired row holds
`prompt`, `completion` (as a reply is given) and `label` (true or false). Each reply must be one assistant
message.

Each sequence starts with <|endoftext|> (how gptkit/data/pairs.py finds them), a pair's chosen one first: the
prompt's tokens, then the reply's. The loss mask is 1 on the reply (its content and the <|end|> that closes it)
and 0 on the prompt, its markers included. A row whose longer sequence exceeds block_size + 1 tokens has its
prompt cut from the start, just after <|endoftext|> (the prompt's end, where the question is, stays; a pair's
two sequences lose the same tokens, so they keep one prompt); one that would keep fewer than min_prompt_tokens
of its prompt is left out.

Lengths are checked before anything is tokenised (`fit`): a token covers at most `chars_per_token` characters
(one for a character vocabulary; a BPE's longest token in bytes, a character being at least one byte), so a
reply longer than (block_size + 1) times that can never fit and is left out unread, and of a longer prompt
only its last that many characters are tokenised (the cut keeps no more). A huge row costs its line's bytes,
never its tokens. The input is read a line at a time, as bytes: a line that is not UTF-8 is a bad row like
any other, and a byte-order mark before the first line is skipped.

Bad rows are never kept, and never silently dropped: each is counted by reason and named by its line (row of
a Hub dataset), in the printed report and in meta.json's "preference" entry, which also marks the folder as a
preference dataset (gptkit/data/pairs.py reads it). A file that mixes pairs and unpaired rows is refused,
naming the first row of the other kind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.chat import ChatError, check_messages, prompt_ids, render
from gptkit.data.prepare.pipeline import ValRule
from gptkit.data.prepare.writer import DEFAULT_SHARD_TOKENS, MIN_TOKENS, DatasetWriter, already_prepared
from gptkit.data.shards import dtype_for_vocab
from gptkit.errors import DataError
from gptkit.tokenizer import Tokenizer

PAIRS, UNPAIRED = "pairs", "unpaired"  # the two kinds of preference dataset (meta.json's "format")
KINDS = {PAIRS: "a pair (prompt, chosen, rejected)", UNPAIRED: "an unpaired row (prompt, completion, label)"}

# Why a row is not kept, in the order the checks run; the report names each reason's rows.
BAD = {
    "not_utf8": "not UTF-8 text (save the file as UTF-8)",
    "not_json": "not a JSON object",
    "missing": "no chosen or no rejected field",
    "no_label": "no completion or no label field",
    "bad_label": "a label that is not true or false",
    "malformed": "a field that is neither text nor chat messages",
    "no_prompt": "no prompt (none given, and the replies share no beginning to take it from)",
    "not_one_reply": "a reply that is not one assistant message",
    "empty": "an empty prompt or reply",
    "identical": "chosen and rejected are the same reply",
    "not_text": "a text holding an escaped lone surrogate (\\ud800-\\udfff), which is no character",
    "unknown_char": "a character the tokenizer does not have",
    "too_long": "too long: a reply does not fit in --block_size, or leaves less than --min_prompt_tokens of the "
                "prompt",
}
NAMED = 20  # line numbers kept per reason in meta.json and printed (the counts are always whole)


class BadPair(Exception):
    """A row that cannot be used; `reason` is a key of BAD."""

    def __init__(self, reason: str):
        super().__init__(BAD[reason])
        self.reason = reason


class NotUTF8:
    """What jsonl_rows gives for a line that is not UTF-8 (a bad row, by its line)."""


@dataclass(frozen=True)
class Pair:
    """One preference: the prompt's messages, and the two replies (assistant messages)."""

    prompt: list[dict[str, str]]
    chosen: dict[str, str]
    rejected: dict[str, str]

    @property
    def replies(self) -> tuple[dict[str, str], ...]:
        return self.chosen, self.rejected

    def texts(self) -> Iterator[str]:
        for m in [*self.prompt, *self.replies]:
            yield m["content"]


@dataclass(frozen=True)
class Unpaired:
    """One unpaired row: the prompt's messages, a completion (an assistant message) and its label (True: a
    desirable completion)."""

    prompt: list[dict[str, str]]
    completion: dict[str, str]
    label: bool

    @property
    def replies(self) -> tuple[dict[str, str], ...]:
        return (self.completion,)

    def texts(self) -> Iterator[str]:
        for m in [*self.prompt, self.completion]:
            yield m["content"]


def row_kind(row: Any) -> str | None:
    """Which kind a row means to be, by its fields: PAIRS, UNPAIRED, or None (neither: a bad row)."""
    if not isinstance(row, dict):
        return None
    if "chosen" in row or "rejected" in row:
        return PAIRS
    if "completion" in row or "label" in row:
        return UNPAIRED
    return None


def _messages(value: Any, role: str) -> list[dict[str, str]]:
    """A field as messages: a string is one message of `role`, a message a list of one."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    try:
        return check_messages([value] if isinstance(value, dict) else value)
    except ChatError:
        raise BadPair("malformed") from None


def _check(prompt: list[dict[str, str]], replies: list[list[dict[str, str]]]) -> None:
    """What every row's prompt and replies must be: a prompt, each reply one non-empty assistant message."""
    if not prompt:
        raise BadPair("no_prompt")
    if any(len(r) != 1 or r[0]["role"] != "assistant" for r in replies):
        raise BadPair("not_one_reply")
    if not any(m["content"].strip() for m in prompt) or not all(r[0]["content"].strip() for r in replies):
        raise BadPair("empty")


def _after_prompt(reply: list[dict[str, str]], prompt: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation that starts with the prompt (a common Hub layout) less the prompt: its rest is the reply."""
    n = len(prompt)
    return reply[n:] if len(reply) > n and reply[:n] == prompt else reply


def parse_pair(row: Any) -> Pair:
    """The pair a row holds, or BadPair saying why it holds none (see the module docstring for the layouts)."""
    if isinstance(row, NotUTF8):
        raise BadPair("not_utf8")
    if not isinstance(row, dict):
        raise BadPair("not_json")
    if row.get("chosen") is None or row.get("rejected") is None:
        raise BadPair("missing")
    if row.get("prompt") is None and isinstance(row["chosen"], str) and isinstance(row["rejected"], str):
        return _text_pair(row["chosen"], row["rejected"])
    chosen, rejected = _messages(row["chosen"], "assistant"), _messages(row["rejected"], "assistant")
    if row.get("prompt") is not None:
        prompt = _messages(row["prompt"], "user")
        chosen, rejected = _after_prompt(chosen, prompt), _after_prompt(rejected, prompt)
    else:  # two conversations: the messages they share are the prompt
        if chosen == rejected:
            raise BadPair("identical")
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    _check(prompt, [chosen, rejected])
    if chosen[0]["content"] == rejected[0]["content"]:
        raise BadPair("identical")
    return Pair(prompt, chosen[0], rejected[0])


def _text_pair(chosen: str, rejected: str) -> Pair:
    """Two texts and no prompt (the implicit-prompt layout of plain text): the prompt is what they share up to
    the last whitespace before they differ, so that neither reply starts inside a word."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n and not chosen[n - 1].isspace():
        n -= 1
    if chosen == rejected:
        raise BadPair("identical")
    prompt = [{"role": "user", "content": chosen[:n]}] if chosen[:n].strip() else []
    replies = [[{"role": "assistant", "content": text[n:]}] for text in (chosen, rejected)]
    _check(prompt, replies)
    return Pair(prompt, replies[0][0], replies[1][0])


def parse_unpaired(row: Any) -> Unpaired:
    """The unpaired row (prompt, completion, label) a row holds, or BadPair saying why it holds none."""
    if isinstance(row, NotUTF8):
        raise BadPair("not_utf8")
    if not isinstance(row, dict):
        raise BadPair("not_json")
    if row.get("completion") is None or row.get("label") is None:
        raise BadPair("no_label")
    label = row["label"]
    if isinstance(label, bool) or (isinstance(label, int) and label in (0, 1)):
        label = bool(label)
    else:
        raise BadPair("bad_label")
    if row.get("prompt") is None:
        raise BadPair("no_prompt")
    prompt = _messages(row["prompt"], "user")
    completion = _after_prompt(_messages(row["completion"], "assistant"), prompt)
    _check(prompt, [completion])
    return Unpaired(prompt, completion[0], label)


PARSERS: dict[str, Callable[[Any], Pair | Unpaired]] = {PAIRS: parse_pair, UNPAIRED: parse_unpaired}


def chars_per_token(tokenizer: Tokenizer) -> int:
    """The most characters one token can stand for: 1 for a character vocabulary; for a BPE its longest token
    in bytes (a character is at least one byte)."""
    if tokenizer.kind == "char":
        return 1
    return max(len(b) for b in tokenizer.ranks)


def fit(item: Pair | Unpaired, block_size: int, per_token: int) -> Pair | Unpaired:
    """The row with no more text than block_size + 1 tokens could ever hold, checked before tokenising: a reply
    longer than that is BadPair("too_long"); a longer prompt keeps only its last that many characters (the
    cut from its start keeps no more of it), earlier messages dropped whole."""
    room = (block_size + 1) * per_token
    if any(len(r["content"]) > room for r in item.replies):
        raise BadPair("too_long")
    if sum(len(m["content"]) for m in item.prompt) <= room:
        return item
    kept: list[dict[str, str]] = []
    left = room
    for m in reversed(item.prompt):
        if left <= 0:
            break
        text = m["content"]
        kept.append({"role": m["role"], "content": text[len(text) - left :] if len(text) > left else text})
        left -= len(text)
    return replace(item, prompt=kept[::-1])


def _check_text(item: Pair | Unpaired) -> None:
    for text in item.texts():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a JSON escape of half a surrogate pair
            raise BadPair("not_text") from None


def read_row(row: Any, kind: str, block_size: int, per_token: int) -> Pair | Unpaired:
    """A row of a dataset of `kind`, parsed, checked and fitted to the context, ready to render; else BadPair."""
    item = fit(PARSERS[kind](row), block_size, per_token)
    _check_text(item)
    return item


@dataclass
class Rendered:
    """A row as token ids and loss masks (1 = a reply token), one (ids, mask) per reply, each of at most
    block_size + 1 tokens; `cut`: how many prompt tokens were dropped from its start."""

    sequences: list[tuple[list[int], list[int]]]
    cut: int

    @property
    def chosen(self) -> tuple[list[int], list[int]]:
        return self.sequences[0]

    @property
    def rejected(self) -> tuple[list[int], list[int]]:
        return self.sequences[1]


def render_pair(pair: Pair | Unpaired, tokenizer: Tokenizer, block_size: int, min_prompt_tokens: int) -> Rendered:
    """The row rendered by the chat template, one sequence per reply, its prompt cut from the start when the
    longest sequence exceeds block_size + 1 tokens; BadPair("too_long") when that would leave fewer than
    min_prompt_tokens of it."""
    try:
        head = len(prompt_ids(pair.prompt, tokenizer))  # <|endoftext|> ... <|assistant|>
        seqs = [render([*pair.prompt, reply], tokenizer) for reply in pair.replies]
    except DataError:  # a character a char tokenizer lacks
        raise BadPair("unknown_char") from None
    cut = max(0, max(len(ids) for ids, _ in seqs) - (block_size + 1))
    if cut and head - 1 - cut < min_prompt_tokens:
        raise BadPair("too_long")
    out = []
    for ids, trained in seqs:
        mask = [0] * head + [int(t) for t in trained[head:]]  # the reply only: never a prompt's assistant turn
        out.append((ids[:1] + ids[1 + cut :], mask[:1] + mask[1 + cut :]))
    return Rendered(out, cut)


# ----------------------------------------------------------------------------------------------------------
# Reading rows

BOM = b"\xef\xbb\xbf"


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """("line N", the parsed row) for every non-blank line, read one line at a time as bytes; a line that is
    not JSON comes as None, one that is not UTF-8 as a NotUTF8 (both bad rows). A byte-order mark before the
    first line is skipped."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read --input {path} ({e.strerror}); give a JSONL file of preference data") \
            from None
    with f:
        n = 0
        while raw := f.readline():
            n += 1
            if n == 1 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            if not raw or raw.isspace():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield f"line {n}", NotUTF8()
                continue
            raw = b""  # a huge line is held as its text alone, then as the parsed row alone
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            line = ""
            yield f"line {n}", row


def dataset_rows(ds: Any) -> Iterator[tuple[str, Any]]:
    """("row N", the row) for every row of a Hugging Face Dataset (N counts from 0, as datasets does)."""
    for n, row in enumerate(ds):
        yield f"row {n}", row


@dataclass
class Survey:
    """A first pass over the rows, before anything is tokenised or written: how many, their kind, how many can
    be used, and (for a character vocabulary) the characters of those."""

    rows: int = 0
    usable: int = 0
    kind: str = PAIRS
    first: str = ""  # the row that set the kind ("" when no row has one: then pairs)
    chars: set[str] = field(default_factory=set)


def survey(rows: Iterable[tuple[str, Any]], source: str, block_size: int, per_token: int = 1,
           chars: bool = False) -> Survey:
    """Read every row once: count them, find the dataset's kind (the first row that has one decides; a
    DataError naming the row when a file mixes the two), and with `chars` collect the characters a character
    vocabulary needs, of the usable rows (per_token: chars_per_token's, 1 for a character vocabulary). (A row with
    neither kind's fields is bad under both, so the kind is known whenever a row is parsed.)"""
    found = Survey()
    for name, row in rows:
        found.rows += 1
        kind = row_kind(row)
        if kind is None:
            continue
        if not found.first:
            found.kind, found.first = kind, name
        elif kind != found.kind:
            raise DataError(f"{source} {name} is {KINDS[kind]}, but {found.first} is {KINDS[found.kind]}: a "
                            f"dataset holds one kind; put pairs and unpaired rows in separate files")
        try:
            item = read_row(row, kind, block_size, per_token)
        except BadPair:
            continue
        found.usable += 1
        if chars:
            for text in item.texts():
                found.chars.update(text)
    return found


def bad_rows(rows: Iterable[tuple[str, Any]], kind: str, block_size: int, per_token: int = 1) -> Report:
    """The report of the rows a parse leaves out (what a dataset with no usable row prints before its error)."""
    report = Report()
    for name, row in rows:
        try:
            read_row(row, kind, block_size, per_token)
        except BadPair as e:
            report.add_bad(e.reason, name)
    return report


# ----------------------------------------------------------------------------------------------------------
# Writing the dataset


@dataclass
class Report:
    """What became of the rows: kept whole or cut, by split (and, unpaired, by label), and the bad ones by
    reason with their names."""

    kind: str = PAIRS
    kept: int = 0
    cut: int = 0
    pairs: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})  # rows kept (pairs or unpaired)
    labels: dict[str, int] = field(default_factory=lambda: {"desirable": 0, "undesirable": 0})  # unpaired only
    bad: dict[str, list[str]] = field(default_factory=dict)  # reason -> its rows' names (NAMED go to meta.json)

    def add_bad(self, reason: str, name: str) -> None:
        self.bad.setdefault(reason, []).append(name)

    @property
    def dropped(self) -> int:
        return sum(len(v) for v in self.bad.values())

    def lines(self) -> list[str]:
        """The report's lines: one for the rows kept, one per reason of the bad rows."""
        what = "pairs" if self.kind == PAIRS else "unpaired rows"
        labels = (f" ({self.labels['desirable']:,} desirable, {self.labels['undesirable']:,} undesirable)"
                  if self.kind == UNPAIRED else "")
        out = [f"{what}: {self.kept + self.cut:,} kept{labels} ({self.cut:,} with their prompt cut from the start "
               f"to fit), {self.dropped:,} rows left out; train {self.pairs['train']:,}, val {self.pairs['val']:,}"]
        for reason, names in sorted(self.bad.items(), key=lambda kv: list(BAD).index(kv[0])):
            more = f" and {len(names) - NAMED:,} more" if len(names) > NAMED else ""
            out.append(f"  left out, {BAD[reason]}: {len(names):,} ({', '.join(names[:NAMED])}{more})")
        return out

    def to_meta(self, block_size: int, min_prompt_tokens: int) -> dict[str, Any]:
        meta: dict[str, Any] = {"format": self.kind}
        if self.kind == UNPAIRED:
            meta["rows"] = dict(self.pairs)
            meta["labels"] = dict(self.labels)
        else:
            meta["pairs"] = dict(self.pairs)
        return {**meta, "kept": self.kept, "cut": self.cut,
                "bad": {r: len(v) for r, v in self.bad.items()},
                "bad_rows": {r: v[:NAMED] for r, v in self.bad.items()},
                "block_size": block_size, "min_prompt_tokens": min_prompt_tokens}


def no_usable_rows(source: str, kind: str, rows: int) -> DataError:
    """The error of an input with no row to keep (the report of its bad rows printed before it)."""
    what = "preference pair" if kind == PAIRS else "unpaired row"
    if not rows:
        return DataError(f"{source} holds no rows; give JSONL with one {what} per line, e.g. "
                         + ('{"prompt": "What is 2+2?", "chosen": "4.", "rejected": "5."}' if kind == PAIRS else
                            '{"prompt": "What is 2+2?", "completion": "4.", "label": true}'))
    return DataError(f"no usable {what} in {source}: all {rows:,} rows were left out, for the reasons above; fix "
                     f"the rows named there (or check that this is the input you meant)")


def prepare_pairs(out_dir: Path, rows: Callable[[], Iterable[tuple[str, Any]]], tokenizer: Tokenizer, *,
                  source: str, fingerprint: str, n_rows: int, block_size: int, min_prompt_tokens: int = 16,
                  val_fraction: float = 0.05, shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False,
                  kind: str = PAIRS) -> dict[str, Any]:
    """Write the preference dataset of `rows` (a callable giving a fresh iterator of (name, row), n_rows of
    them, all of `kind`: PAIRS or UNPAIRED) into out_dir; returns meta.json. `tokenizer` must have the chat
    template's special tokens. The split is decided per row (ValRule on its position), so it does not depend
    on which rows are bad."""
    if block_size < 2:
        raise DataError(f"--block_size must be at least 2, got {block_size}")
    if min_prompt_tokens < 1:
        raise DataError(f"--min_prompt_tokens must be at least 1, got {min_prompt_tokens}")
    done = already_prepared(out_dir, fingerprint, overwrite, source)
    if done is not None:
        return done
    started = time.perf_counter()
    rule = ValRule.for_documents(val_fraction, n_rows)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    per_token = chars_per_token(tokenizer)
    report = Report(kind)
    reply_tokens = 0
    with DatasetWriter(out_dir, tokenizer, shard_tokens, fingerprint=fingerprint, masks=True,
                       labels=kind == UNPAIRED) as writer:
        for index, (name, row) in enumerate(rows()):
            try:
                item = read_row(row, kind, block_size, per_token)
                rendered = render_pair(item, tokenizer, block_size, min_prompt_tokens)
            except BadPair as e:
                report.add_bad(e.reason, name)
                continue
            split = rule.split(index)
            for ids, mask in rendered.sequences:
                writer.write(split, np.array(ids, dtype=dtype), np.array(mask, dtype=np.uint16))
                reply_tokens += sum(mask)
            if isinstance(item, Unpaired):
                writer.write_label(split, int(item.label))
                report.labels["desirable" if item.label else "undesirable"] += 1
            report.pairs[split] += 1
            if rendered.cut:
                report.cut += 1
            else:
                report.kept += 1
        for line in report.lines():
            print(line)
        if report.kept + report.cut == 0:
            raise no_usable_rows(source, kind, n_rows)
        total = writer.tokens("train") + writer.tokens("val")
        if min(report.pairs.values()) == 0 or total < MIN_TOKENS:
            empty = min(report.pairs, key=report.pairs.get)
            what = "pairs" if kind == PAIRS else "rows"
            raise DataError(
                f"{source} gives {report.pairs['train']:,} train and {report.pairs['val']:,} val {what} "
                f"({total:,} tokens); a dataset needs {what} in both splits and at least {MIN_TOKENS:,} tokens: "
                + (f"give more {what} or change --val_fraction (the {empty} split is empty)"
                   if report.pairs[empty] == 0 else f"give more {what}"))
        meta = writer.finish(source, f"the {'pairs' if kind == PAIRS else 'unpaired rows'} of {source}",
                             extra={"preference": report.to_meta(block_size, min_prompt_tokens)})
    print(f"wrote {out_dir}: {total:,} tokens, {reply_tokens / max(1, total):.1%} of them reply tokens (the "
          f"loss mask), vocab_size {meta['vocab_size']}, in {time.perf_counter() - started:.2f} s")
    return meta
