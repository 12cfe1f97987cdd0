"""Tokenizers behind one interface: characters, GPT-2's BPE (tiktoken), or a byte-level BPE trained on your own
text (gptkit/bpe.py, prepare/tokenizer.py), each with named special tokens.

A dataset's meta.json names its tokenizer (its "tokenizer" entry), and `Tokenizer.from_meta` rebuilds it, so
training, sampling and evaluation never guess which ids mean which text:

    {"kind": "char", "chars": ["\\n", " ", "!", ...]}     id i is chars[i]
    {"kind": "tiktoken", "name": "gpt2"}                  GPT-2's BPE (50257 ids); <|endoftext|> is 50256
    {"kind": "bpe", "name": "mytok", "hash": "1a2b...",   a trained BPE: its folder, checked against the hash
     "path": "data/tokenizers/mytok-1a2b3c4d5e6f", "special": {"<|endoftext|>": 8187, ...}}

Special tokens: `special` maps each name to its id, after the ordinary ids (GPT-2: <|endoftext|> is 50256 and
added ones take 50257, 50258, ...; char: after the characters; a trained BPE has its own, CHAT_SPECIALS by
default). The entry's "special" lists them all; for char and tiktoken it is written only when it differs from
the kind's own (none; GPT-2's <|endoftext|>), so entries written before special tokens existed keep their
meaning, and `vocab_size` counts ordinary and special ids. encode never produces a special id (a user who
types "<|user|>" gets ordinary tokens); decode writes a special id as its name.

Text that is not Unicode: a lone surrogate (a str from a broken decoder, never from reading UTF-8) is encoded
by the BPE kinds as U+FFFD, as tiktoken does; a char vocabulary holds none, so there it is an unknown character.

A checkpoint carries a trained BPE's files inline (`with_tokenizer_files`: a "tokenizer_files" entry beside
the meta's "tokenizer"), so sampling or exporting it needs no data/ folder; from_meta uses them, checked
against the hash, exactly as it would use the folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from gptkit import bpe
from gptkit.cli import one_line
from gptkit.errors import DataError

KINDS = ("char", "tiktoken", "bpe")


class Tokenizer:
    """Encodes/decodes text for a dataset, built from (and saved as) the ``tokenizer`` entry of meta.json (see
    the module docstring for the three kinds). `files`: a trained BPE's defining files (name -> text) to use
    instead of reading its folder."""

    def __init__(self, spec: dict[str, Any], files: dict[str, str] | None = None):
        self.kind: str = spec.get("kind", "")
        self.chars: list[str] = []  # char: id i is chars[i]
        self.ranks: dict[bytes, int] = {}  # tiktoken, bpe: the ordinary tokens (bytes -> id)
        self.pattern = ""  # tiktoken, bpe: the regex that splits text into pieces before BPE
        self.files: dict[str, str] | None = None  # bpe: its folder's defining files
        if self.kind == "char":
            chars = spec.get("chars")
            if not isinstance(chars, list) or not chars or not all(isinstance(c, str) and len(c) == 1 for c in chars):
                raise DataError("char tokenizer needs a non-empty 'chars' list of single characters in meta.json")
            if len(set(chars)) != len(chars):
                raise DataError("char tokenizer 'chars' list in meta.json contains duplicates; re-run prepare")
            if any(0xD800 <= ord(c) < 0xE000 for c in chars):
                raise DataError("char tokenizer 'chars' holds a lone surrogate, which is not Unicode text; "
                                "read the text as UTF-8 and re-run prepare")
            self.chars = list(chars)
            self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)
            # Lookup via a sorted copy so unsorted-but-valid vocabularies still work.
            self._order = np.argsort(self._codepoints, kind="stable")
            self._sorted_cp = self._codepoints[self._order]
            n_ordinary, own = len(chars), {}
            self._name = ""
        elif self.kind == "tiktoken":
            name = spec.get("name")
            if not isinstance(name, str):
                raise DataError("tiktoken tokenizer needs a 'name' (e.g. 'gpt2') in meta.json")
            base = _get_tiktoken(name)
            self.ranks, self.pattern, own = base._mergeable_ranks, base._pat_str, dict(base._special_tokens)
            n_ordinary, self._name = max(self.ranks.values()) + 1, name
        elif self.kind == "bpe":
            trained, self.files = _load_bpe(spec, files)
            self.ranks, self.pattern, own = trained.ranks, trained.pattern, trained.special
            n_ordinary, self._name = len(self.ranks), spec["name"]
            self._hash, self._path = spec["hash"], spec["path"]
        else:
            raise DataError(f"unknown tokenizer kind {self.kind!r} in meta.json; expected one of {', '.join(KINDS)}")
        self.special: dict[str, int] = _check_special(spec.get("special", own), own, n_ordinary)
        self._own_special = own
        self._special_names = {i: s for s, i in self.special.items()}
        self.vocab_size: int = max([n_ordinary - 1, *self.special.values()]) + 1
        self.eot_id: int | None = self.special.get("<|endoftext|>")
        if self.kind == "tiktoken" and self.special == own:
            self._enc = base  # tiktoken's own (cached) encoding
        elif self.kind != "char":
            import tiktoken

            # tiktoken's Rust BPE encodes a trained BPE too (and GPT-2's with added special tokens): the same
            # encoder for every BPE here, measured against GPT-2's own in benchmarks/tokenizer.py.
            self._enc = tiktoken.Encoding(f"gptkit-{self._name}", pat_str=self.pattern, mergeable_ranks=self.ranks,
                                          special_tokens=self.special)

    # ----------------------------------------------------------------------------- building

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from a whole meta dict or just its ``tokenizer`` entry. A whole meta may carry a trained
        BPE's files inline ("tokenizer_files", see `with_tokenizer_files`): they are used instead of its
        folder. Cheap enough to call once per worker process (a 50K-token BPE: ~0.1 s)."""
        spec = meta.get("tokenizer", meta)
        if not isinstance(spec, dict):
            raise DataError("meta.json 'tokenizer' entry must be an object; re-run prepare")
        files = meta.get("tokenizer_files") if spec is not meta else None
        if files is not None and not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
            raise DataError("the 'tokenizer_files' entry must map file names to their text")
        return cls(spec, files)

    @classmethod
    def char_from_text(cls, text: str) -> Tokenizer:
        """A character vocabulary made of the sorted set of characters in ``text``."""
        if not text:
            raise DataError("cannot build a character vocabulary from empty text; give a non-empty input")
        return cls({"kind": "char", "chars": sorted(set(text))})

    @classmethod
    def tiktoken(cls, name: str = "gpt2") -> Tokenizer:
        return cls({"kind": "tiktoken", "name": name})

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """A trained BPE from its folder (gptkit/bpe.py), with the special tokens it was trained with."""
        folder = Path(folder)
        files = bpe.read_files(folder)
        trained = bpe.from_files(files, str(folder))
        return cls({"kind": "bpe", "name": trained.name, "hash": trained.hash, "path": str(folder),
                    "special": trained.special}, files)

    def with_special(self, names: Iterable[str]) -> Tokenizer:
        """The same ordinary ids, plus the special tokens of `names` that are missing, appended in order after
        the current last id (GPT-2: from 50257, inside a model's padded embedding rows)."""
        special = dict(self.special)
        for name in names:
            if name not in special:
                special[name] = max([self.vocab_size - 1, *special.values()]) + 1
        return Tokenizer({**self.to_meta(), "special": special}, self.files)

    def to_meta(self) -> dict[str, Any]:
        if self.kind == "char":
            spec: dict[str, Any] = {"kind": "char", "chars": list(self.chars)}
        elif self.kind == "tiktoken":
            spec = {"kind": "tiktoken", "name": self._name}
        else:
            return {"kind": "bpe", "name": self._name, "hash": self._hash, "path": self._path,
                    "special": dict(self.special)}
        if self.special != self._own_special:
            spec["special"] = dict(self.special)
        return spec

    # ----------------------------------------------------------------------------- using

    def special_id(self, name: str) -> int:
        """The id of special token `name`; a DataError naming this tokenizer's special tokens if it has none."""
        if name not in self.special:
            have = ", ".join(self.special) or "none"
            raise DataError(f"the {self.describe()} has no special token {name!r} (it has: {have}); prepare the "
                            f"dataset with a tokenizer that has it")
        return self.special[name]

    def encode(self, text: str) -> list[int]:
        if self.kind != "char":
            return self._enc.encode_ordinary(text)  # a lone surrogate: U+FFFD (tiktoken's own handling)
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Encode to a numpy array (uint32 ids); the fast path used by the prepare scripts."""
        if self.kind != "char":
            # Ordinary encoding: "<|endoftext|>" typed by a user is just text, never the special token.
            # (No special token is allowed and none is disallowed; that is exactly encode_ordinary, and
            # encode_to_numpy skips building a Python list, which makes it the fastest path.)
            try:
                return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
            except UnicodeEncodeError:  # a lone surrogate: U+FFFD, as tiktoken's encode_ordinary does
                text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
                return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        # Vectorised char lookup: UTF-32 gives one uint32 code point per character.
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        pos = np.searchsorted(self._sorted_cp, cps)
        pos_c = np.minimum(pos, len(self._sorted_cp) - 1)
        known = self._sorted_cp[pos_c] == cps
        if not known.all():
            bad = chr(int(cps[np.argmin(known)]))
            raise DataError(
                f"character {bad!r} is not in the model's vocabulary (this char-level dataset has "
                f"{len(self.chars)} characters); remove it from the text"
            )
        return self._order[pos_c].astype(np.uint32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text of `ids`; a special id is written as its name. Bytes that are not valid UTF-8 (a token
        sequence cut inside a character) become U+FFFD."""
        if type(ids) is list and all(type(i) is int for i in ids):
            # A list of ints, as a stream decodes them token by token: no numpy. (Through numpy, one GPT-2
            # token took 6 us on a warm CPU and ~120 us in a server whose caches the model's step had just
            # emptied; this path: ~1 us warm.)
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                self._out_of_range(min(ids) if min(ids) < 0 else max(ids))
            if self.kind != "char":
                return self._decode_bpe(ids)
            if not ids or max(ids) < len(self.chars):  # (special ids: below)
                return "".join([self.chars[i] for i in ids])
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            self._out_of_range(int(arr.min() if arr.min() < 0 else arr.max()))
        if self.kind != "char":
            return self._decode_bpe(arr.tolist())
        if not arr.size or arr.max() < len(self.chars):
            return self._codepoints[arr].astype("<u4").tobytes().decode("utf-32-le")
        pieces, start = [], 0
        for at in np.flatnonzero(arr >= len(self.chars)).tolist():
            pieces.append(self.decode(arr[start:at]))
            pieces.append(self._special_names[int(arr[at])])
            start = at + 1
        pieces.append(self.decode(arr[start:]))
        return "".join(pieces)

    def _decode_bpe(self, ids: list[int]) -> str:
        try:
            return self._enc.decode(ids)
        except KeyError:  # an id inside the range that the encoding leaves unused
            raise DataError(f"the token ids include one that is not a token of the {self.describe()}") from None

    def _out_of_range(self, bad: int) -> NoReturn:
        raise DataError(f"token id {bad} is outside this tokenizer's vocabulary [0, {self.vocab_size})")

    def token_bytes(self) -> np.ndarray:
        """How many bytes of UTF-8 text each id stands for (int64, one per id): the denominator of bits per
        byte, exact because a token sequence's text is the concatenation of its tokens' bytes. Special tokens
        stand for no text: 0."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        if self.kind == "char":
            lengths[: len(self.chars)] = [len(c.encode("utf-8")) for c in self.chars]
        else:
            for token, rank in self.ranks.items():
                lengths[rank] = len(token)
        return lengths

    def describe(self) -> str:
        if self.kind == "char":
            return f"{len(self.chars)}-character vocabulary"
        return f"{self._name} BPE"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and self.to_meta() == other.to_meta()

    __hash__ = None  # mutable-looking and compared by content: not a dict key

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


def _check_special(special: Any, own: dict[str, int], n_ordinary: int) -> dict[str, int]:
    """The entry's special tokens, checked: names to distinct ids, none an ordinary id, the kind's own
    included with their own ids. Returned in id order."""
    if not isinstance(special, dict) or not all(
            isinstance(k, str) and k and isinstance(v, int) and not isinstance(v, bool) for k, v in special.items()):
        raise DataError("the tokenizer's 'special' entry must map names to integer ids; re-run prepare")
    for name, i in own.items():
        if special.get(name) != i:
            raise DataError(f"the tokenizer's 'special' entry gives {name!r} id {special.get(name)}, not its own "
                            f"{i}; re-run prepare")
    extra = {v for k, v in special.items() if k not in own}
    if len(set(special.values())) != len(special) or any(v < n_ordinary for v in extra):
        raise DataError(f"the tokenizer's special tokens need distinct ids from {n_ordinary} on (after the "
                        f"ordinary tokens); re-run prepare")
    return dict(sorted(special.items(), key=lambda kv: kv[1]))


def _load_bpe(spec: dict[str, Any], files: dict[str, str] | None) -> tuple[bpe.BPE, dict[str, str]]:
    """The trained BPE a meta entry names, from `files` if given (a checkpoint's copy), else from its folder;
    checked against the entry's hash either way."""
    for key in ("name", "hash", "path"):
        if not isinstance(spec.get(key), str):
            raise DataError(f"trained tokenizer entry in meta.json lacks its {key!r}; re-run prepare")
    where = f"{spec['path']} (as stored inline)" if files is not None else spec["path"]
    if files is None:
        files = bpe.read_files(spec["path"])
    return bpe.from_files(files, where, expected_hash=spec["hash"]), files


def with_tokenizer_files(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` (a dataset's meta.json), made self-contained: for a trained BPE, its folder's defining files are
    added as "tokenizer_files" (checked against the hash), so whoever has this dict can rebuild the tokenizer
    without data/. Other kinds need no files: `meta` as it is. The files are remembered by hash, so a
    training run reads the folder once, however often it saves."""
    spec = meta.get("tokenizer")
    if not isinstance(spec, dict) or spec.get("kind") != "bpe" or "tokenizer_files" in meta:
        return meta
    key = spec.get("hash")
    if key not in _FILES_BY_HASH:
        _FILES_BY_HASH[key] = Tokenizer.from_meta(meta).files
    return {**meta, "tokenizer_files": _FILES_BY_HASH[key]}


_FILES_BY_HASH: dict[Any, dict[str, str]] = {}


# The special tokens of a chat model (gptkit/chat.py's template), in this order: a conversation starts after
# <|endoftext|>, each turn is <|ROLE|>content<|end|>. prepare/chat.py gives a dataset's tokenizer all of them
# (Tokenizer.with_special); a trained BPE reserves them when it is trained.
CHAT_SPECIALS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


def resolve_tokenizer(arg: str, *, data_root: str | Path = "data", chars: Iterable[str] | None = None) -> Tokenizer:
    """The tokenizer a prepare script's --tokenizer names: "gpt2" (GPT-2's BPE), "char" (the characters
    `chars`, which the caller collects from its text), or a trained BPE by NAME (the one folder
    data_root/tokenizers/NAME-HASH12) or by the PATH of its folder. A DataError (one line) for anything else."""
    if arg == "gpt2":
        return Tokenizer.tiktoken("gpt2")
    if arg == "char":
        if chars is None:
            raise DataError("--tokenizer char needs the text's characters first (a bug in the caller)")
        chosen = sorted(set(chars))
        if not chosen:
            raise DataError("cannot build a character vocabulary from empty text; give a non-empty input")
        return Tokenizer({"kind": "char", "chars": chosen})
    if (Path(arg) / bpe.INFO_FILE).is_file():  # a tokenizer's folder (a plain word is a NAME otherwise)
        return Tokenizer.from_folder(arg)
    if bpe.NAME_RE.fullmatch(arg):
        return Tokenizer.from_folder(bpe.find(arg, Path(data_root) / "tokenizers"))
    raise DataError(f"--tokenizer {arg!r}: use gpt2, char, or the NAME or folder PATH of a tokenizer trained "
                    f"with python prepare/tokenizer.py ({arg} is not a tokenizer folder)")


def _get_tiktoken(name: str) -> Any:
    import tiktoken  # lazy: char-level datasets should not need tiktoken's BPE files

    try:
        return tiktoken.get_encoding(name)
    except ValueError as e:  # unknown encoding name
        raise DataError(f"unknown tiktoken encoding {name!r} ({one_line(e)})") from None
    except Exception as e:  # the BPE files are downloaded on first use; offline that fails in various ways
        cache = os.environ.get("TIKTOKEN_CACHE_DIR")
        where = f"not in TIKTOKEN_CACHE_DIR={cache}" if cache else "no TIKTOKEN_CACHE_DIR set"
        raise DataError(
            f"could not download tiktoken's {name} BPE files ({download_failure(e)}; {where}); offline, set "
            f"TIKTOKEN_CACHE_DIR to a folder that holds them, filled where there is network by: "
            f"TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('{name}')\""
        ) from None


def download_failure(e: BaseException) -> str:
    """What matters of a failed download, in a few words: the host it could not reach and why (a network
    library's message runs to hundreds of characters of nested exceptions)."""
    text = one_line(e)
    host = re.search(r"host='([^']+)'|https?://([^/:'\s]+)", text)
    at = f" {host.group(1) or host.group(2)}" if host else ""
    for words, why in ((("Failed to resolve", "Name or service not known", "name resolution", "getaddrinfo"),
                        f"cannot resolve{at}: no network?"),
                       (("timed out", "Timeout"), f"timed out reaching{at}"),
                       (("Connection refused",), f"connection refused by{at}"),
                       (("Network is unreachable",), f"network unreachable{at and ' for' + at}")):
        if any(w in text for w in words):
            return why
    return f"{type(e).__name__}: {text[:120] + '...' if len(text) > 120 else text}"
