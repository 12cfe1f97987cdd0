"""Tokenizers behind one interface: characters, or a tiktoken BPE (GPT-2's).

A dataset's meta.json names its tokenizer (its "tokenizer" entry), and `Tokenizer.from_meta` rebuilds it, so
training, sampling and evaluation never guess which ids mean which text:

    {"kind": "char", "chars": ["\\n", " ", "!", ...]}     id i is chars[i]; no end-of-text token
    {"kind": "tiktoken", "name": "gpt2"}                  GPT-2's BPE (50257 ids); <|endoftext|> is 50256
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.cli import one_line
from gptkit.shards import DataError


class Tokenizer:
    """Encodes/decodes text for a dataset, built from (and saved as) the ``tokenizer`` entry of meta.json.

    kind "char":     {"kind": "char", "chars": [...]}: id i is chars[i]; no end-of-text token.
    kind "tiktoken": {"kind": "tiktoken", "name": "gpt2"}: tiktoken's BPE; eot_id is its <|endoftext|>.
    """

    def __init__(self, spec: dict[str, Any]):
        self._spec = dict(spec)
        self.kind: str = spec.get("kind", "")
        if self.kind == "char":
            chars = spec.get("chars")
            if not isinstance(chars, list) or not chars or not all(isinstance(c, str) and len(c) == 1 for c in chars):
                raise DataError("char tokenizer needs a non-empty 'chars' list of single characters in meta.json")
            if len(set(chars)) != len(chars):
                raise DataError("char tokenizer 'chars' list in meta.json contains duplicates; re-run prepare")
            self._chars = chars
            self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)
            # Lookup via a sorted copy so unsorted-but-valid vocabularies still work.
            self._order = np.argsort(self._codepoints, kind="stable")
            self._sorted_cp = self._codepoints[self._order]
            self.vocab_size = len(chars)
            self.eot_id: int | None = None
        elif self.kind == "tiktoken":
            name = spec.get("name")
            if not isinstance(name, str):
                raise DataError("tiktoken tokenizer needs a 'name' (e.g. 'gpt2') in meta.json")
            self._enc = _get_tiktoken(name)
            self.vocab_size = self._enc.n_vocab
            self.eot_id = self._enc.eot_token
        else:
            raise DataError(f"unknown tokenizer kind {self.kind!r} in meta.json; expected 'char' or 'tiktoken'")

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from a whole meta dict or just its ``tokenizer`` entry."""
        spec = meta.get("tokenizer", meta)
        if not isinstance(spec, dict):
            raise DataError("meta.json 'tokenizer' entry must be an object; re-run prepare")
        return cls(spec)

    @classmethod
    def char_from_text(cls, text: str) -> Tokenizer:
        """A character vocabulary made of the sorted set of characters in ``text``."""
        if not text:
            raise DataError("cannot build a character vocabulary from empty text; give a non-empty input")
        return cls({"kind": "char", "chars": sorted(set(text))})

    @classmethod
    def tiktoken(cls, name: str = "gpt2") -> Tokenizer:
        return cls({"kind": "tiktoken", "name": name})

    def to_meta(self) -> dict[str, Any]:
        return dict(self._spec)

    def encode(self, text: str) -> list[int]:
        if self.kind == "tiktoken":
            return self._enc.encode_ordinary(text)
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Encode to a numpy array (uint32 ids); the fast path used by the prepare scripts."""
        if self.kind == "tiktoken":
            # Ordinary encoding: "<|endoftext|>" typed by a user is just text, never the special token.
            # (No special token is allowed and none is disallowed; that is exactly encode_ordinary, and
            # encode_to_numpy skips building a Python list, which makes it the fastest path.)
            if hasattr(self._enc, "encode_to_numpy"):
                return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
            return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)
        # Vectorised char lookup: UTF-32 gives one uint32 code point per character.
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        pos = np.searchsorted(self._sorted_cp, cps)
        pos_c = np.minimum(pos, len(self._sorted_cp) - 1)
        known = self._sorted_cp[pos_c] == cps
        if not known.all():
            bad = chr(int(cps[np.argmin(known)]))
            raise DataError(
                f"character {bad!r} is not in the model's vocabulary (this char-level dataset has "
                f"{self.vocab_size} characters); remove it from the text"
            )
        return self._order[pos_c].astype(np.uint32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr.min() if arr.min() < 0 else arr.max())
            raise DataError(f"token id {bad} is outside this tokenizer's vocabulary [0, {self.vocab_size})")
        if self.kind == "tiktoken":
            return self._enc.decode(arr.tolist())
        return self._codepoints[arr].astype("<u4").tobytes().decode("utf-32-le")

    def token_bytes(self) -> np.ndarray:
        """How many bytes of UTF-8 text each id stands for (int64, one per id): the denominator of bits per
        byte, exact because a token sequence's text is the concatenation of its tokens' bytes. Special tokens
        (<|endoftext|>) stand for no text: 0."""
        if self.kind == "char":
            return np.array([len(c.encode("utf-8")) for c in self._chars], dtype=np.int64)
        special = {self._enc.encode_single_token(s) for s in self._enc.special_tokens_set}
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if i not in special:
                try:
                    lengths[i] = len(self._enc.decode_single_token_bytes(i))
                except KeyError:  # an id the encoding leaves unused
                    pass
        return lengths

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


# The special tokens of a chat model (gptkit/chat.py's template), in this order: a conversation starts after
# <|endoftext|>, each turn is <|ROLE|>content<|end|>. prepare/chat.py gives a dataset's tokenizer all of them
# (Tokenizer.with_special); a trained BPE reserves them when it is trained.
CHAT_SPECIALS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


def resolve_tokenizer(arg: str, *, data_root: str | Path = "data", chars: Iterable[str] | None = None) -> Tokenizer:
    """The tokenizer a prepare script's --tokenizer names: "gpt2" (GPT-2's BPE), "char" (the characters
    `chars`, which the caller collects from its text), or a trained BPE by NAME (under data_root/tokenizers/)
    or by the PATH of its folder. A DataError (one line) for anything else."""
    if arg == "gpt2":
        return Tokenizer.tiktoken("gpt2")
    if arg == "char":
        if chars is None:
            raise DataError("--tokenizer char needs the text's characters first (a bug in the caller)")
        chosen = sorted(set(chars))
        if not chosen:
            raise DataError("cannot build a character vocabulary from empty text; give a non-empty input")
        return Tokenizer({"kind": "char", "chars": chosen})
    raise DataError(f"--tokenizer {arg!r}: use gpt2, char, or the NAME or PATH of a tokenizer trained with "
                    f"python prepare/tokenizer.py")


def _get_tiktoken(name: str) -> Any:
    import tiktoken  # lazy: char-level datasets should not need tiktoken's BPE files

    try:
        return tiktoken.get_encoding(name)
    except ValueError as e:  # unknown encoding name
        raise DataError(f"unknown tiktoken encoding {name!r} ({one_line(e)})") from None
    except Exception as e:  # the BPE files are downloaded on first use; offline that fails in various ways
        raise DataError(
            f"could not load tiktoken encoding {name!r} ({type(e).__name__}: {one_line(e)}); it is downloaded on "
            "first use, so run once with network access or set TIKTOKEN_CACHE_DIR to a folder with the cached files"
        ) from None


