"""Where a long text can be cut so that tokenising the pieces gives exactly the tokens of the whole.

    rule = choose_rule(tokenizer)                    # "gpt2", "newline" or "none", checked on a probe text
    cut = find_cut(f, pos, end, rule)                # the first safe cut at or after byte pos of a file

A byte-level BPE first splits text into pieces with a regex and merges within each piece only, so a cut where
the regex always ends a piece, and where the text on the left alone is split into the same pieces, changes
nothing. Which positions qualify depends on the split pattern:

* ``gpt2`` (GPT-2's pattern, tiktoken "gpt2"/r50k): just before the last character of a whitespace run that is
  followed by a non-space. No piece runs from a non-space into the whitespace after it, the run minus its last
  character is one piece (``\\s+(?!\\S)``, or ``\\s++$`` on the left alone), and the last character either
  stands alone or starts the next word (`` ?\\p{L}+``), on the right alone too. Cuts fall between words, so
  even a file without line breaks is cut.
* ``newline`` (GPT-4's cl100k pattern, which trained tokenizers use; o200k's too): just after a ``\\r`` or
  ``\\n`` that is followed by a non-space other than ``/``. cl100k keeps newlines with the whitespace or
  punctuation before them (``\\s*[\\r\\n]``, ``[^\\s\\p{L}\\p{N}]++[\\r\\n]*``) and never lets a word, number or
  punctuation run start with one, so a piece always ends there; o200k lets punctuation absorb a following
  ``/``, hence the exception. GPT-2's rule is wrong for cl100k (``".\\n\\nX"`` keeps ``".\\n\\n"`` together)
  and this one is wrong for GPT-2 (``"a\\n\\nX"`` is ``"\\n", "\\n"`` there), so the rule follows the tokenizer.
* ``none``: no cut is known to be exact; each document is tokenised whole.

Whitespace is tested with Python's ``str.isspace``, a superset of the Unicode White_Space the tokenizers' Rust
regexes use, so "non-space" here is never whitespace there; the rule's own characters are ASCII.
``choose_rule`` checks a rule on a probe text full of the awkward cases before using it.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

from gptkit.cli import one_line
from gptkit.errors import DataError

# Each rule: a regex and whether the cut is at the start or the end of its match.
RULES: dict[str, tuple[re.Pattern[str], str]] = {
    "gpt2": (re.compile(r"[\t\n\x0b\x0c\r ](?=\S)"), "start"),
    "newline": (re.compile(r"[\r\n](?=[^\s/])"), "end"),
}
RULE_ORDER = ("gpt2", "newline")  # tried in this order; "none" when neither passes the probe

# The cases that break a wrong rule: whitespace runs of every kind before words, digits and punctuation,
# punctuation before newlines, CRLF, tabs, a slash after a newline, non-ASCII letters and spaces.
PROBE = (
    "Hello world.\n\nIt's 12345 apples,\r\n  indented\tline\n\n\n(paren) x.\n/slash\r\n\r\nNext  two"
    "   three\n \n\tTab\u00a0nbsp \u3000full\n\u00dcber na\u00efve \u2603\n\u65e5\u672c\u8a9e\n12\n345 ok?!\n"
    "end:\n\n\n    code = [1, 2]\n  # comment\n'quoted'\n\"dq\"\n--\n\n"
) * 3

_WINDOW = 1 << 16  # bytes read at a time while looking for a cut


def cuts_in(text: str, rule: str) -> list[int]:
    """Every safe cut position of `text` under `rule` (0 < cut < len(text))."""
    if rule == "none":
        return []
    pattern, side = RULES[rule]
    cuts = (m.start() if side == "start" else m.end() for m in pattern.finditer(text))
    return [c for c in cuts if 0 < c < len(text)]


def is_exact(encode: Callable[[str], np.ndarray], text: str, rule: str) -> bool:
    """Whether cutting `text` at every position the rule allows gives the tokens of one encode call."""
    bounds = [0, *cuts_in(text, rule), len(text)]
    pieces = [encode(text[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return np.concatenate(pieces).tolist() == np.asarray(encode(text)).tolist()


def choose_rule(tokenizer) -> str:
    """The cut rule for a tokenizer: any cut is exact for characters; a BPE gets the first rule that is exact
    on the probe text (see the module docstring for why each one is)."""
    if tokenizer.kind == "char":
        return "gpt2"  # every cut is exact; this rule has the most cut points
    for rule in RULE_ORDER:
        if is_exact(tokenizer.encode_array, PROBE, rule):
            return rule
    return "none"


def find_cut(f: BinaryIO, pos: int, end: int, rule: str, name: str = "the input") -> int:
    """The first safe cut at or after byte `pos` of an open UTF-8 file, looking no further than byte `end`
    (the end of the document, which is returned when there is no cut before it).

    The answer depends only on the file's bytes, pos and end, never on where reading started before, so the
    worker that ends one piece and the one that starts the next agree. The text after `end` is another
    document and is never looked at.
    """
    if rule == "none" or pos >= end:
        return end
    pattern, side = RULES[rule]
    # Start one character early: the "newline" rule cuts after the character it matches.
    start = max(pos - 1, 0)
    f.seek(start)
    head = f.read(4)
    skip = 0
    while skip < len(head) and head[skip] & 0xC0 == 0x80:  # a UTF-8 continuation byte: not a character start
        skip += 1
    at = start + skip  # byte offset of buf[0]
    f.seek(at)
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf = ""
    read = at
    while True:
        data = f.read(min(_WINDOW, end - read))
        read += len(data)
        try:
            buf += decoder.decode(data, final=read >= end)
        except UnicodeDecodeError as e:
            raise DataError(f"{name} is not UTF-8 text near byte {read - len(data) + e.start} ({one_line(e)}); "
                            "convert it to UTF-8 first") from None
        search_from = 0
        while (m := pattern.search(buf, search_from)) is not None:
            cut_char = m.start() if side == "start" else m.end()
            cut = at + len(buf[:cut_char].encode("utf-8"))
            if cut >= pos:
                return cut
            search_from = m.start() + 1
        if read >= end:
            return end
        # Keep the last character: its lookahead was the end of the buffer, not of the text.
        keep = buf[-1:]
        at += len(buf[:-1].encode("utf-8")) if buf else 0
        buf = keep
