"""Our tokenizers as Hugging Face tokenizer files, and the byte-level BPE text forms they (and GGUF) use.

tiktoken stores a BPE as mergeable ranks (token bytes -> id, merges in rank order); Hugging Face's
tokenizer.json, GPT-2's vocab.json/merges.txt and GGUF store it as a vocabulary of printable strings (GPT-2's
byte-to-character map, `bytes_to_unicode`) plus the ordered list of merges (`bpe_merges`).

    files = hf_tokenizer_files(tokenizer, model_max_length=1024)   # name -> text; export.py writes them

The files make `transformers.AutoTokenizer.from_pretrained(folder)` give exactly our ids: for ordinary text
the same tokens as `Tokenizer.encode`, and a special token's name in the text becomes that special token (an
added special token), which is how chat templates put them in.
"""

from __future__ import annotations

import json
import re
from typing import Any


class BPEMergeError(ValueError):
    """The ranks are not those of a byte-pair encoding (a token is not the merge of two lower-ranked ones)."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters, used to write byte strings as
    text in vocab.json, merges.txt and tokenizer.json: bytes that are visible Latin-1 characters stand for
    themselves, the others (control characters, space, ...) are given the characters from U+0100 on, in byte
    order. So the space byte is 'Ġ' (U+0120) and newline is 'Ċ'."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in visible}
    next_char = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(next_char)
            next_char += 1
    return table


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges of a byte-level BPE, in rank order, from its mergeable ranks (every multi-byte token, as
    the pair of tokens whose merge created it). For GPT-2 this rebuilds OpenAI's merges.txt line for line.
    A BPEMergeError if a token is not the merge of two lower-ranked tokens."""
    return [_merge_parts(token, ranks) for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])
            if len(token) > 1]  # the single bytes are the alphabet, not merges


def _merge_parts(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens whose merge created `token`.

    BPE training creates the token of rank r by merging two tokens of lower ranks, and encoding applies
    merges in rank order. So byte-pair encoding the token's bytes with only the merges ranked below r stops at
    the two parts that merge r joins.
    """
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best_rank, best_i = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise BPEMergeError(
            f"cannot recover the BPE merge of token {token!r} (rank {limit}); is the encoding a BPE?"
        )
    return parts[0], parts[1]


# ----------------------------------------------------------------------------- tokenizer.json


def byte_bpe_tokenizer_json(ranks: dict[bytes, int], pattern: str, special: dict[str, int]) -> dict[str, Any]:
    """tokenizer.json of a tiktoken-style byte-level BPE: the split regex, then bytes as GPT-2's characters,
    then BPE with the merges in rank order.

    ignore_merges: a piece of text that is a token as a whole is that token, without merging. tiktoken
    encodes that way, so this makes the two the same algorithm, not only the same result wherever merging
    happens to end on the whole-piece token (it did on every text tested, but nothing guarantees it).
    """
    text = _byte_text()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(special),
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": onig_pattern(pattern)}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            **_BPE_OPTIONS,
            "ignore_merges": True,
            "vocab": {text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": [[text(left), text(right)] for left, right in bpe_merges(ranks)],
        },
    }


def onig_pattern(pattern: str) -> str:
    """A tiktoken split regex as Oniguruma (the regex engine of Hugging Face tokenizers) must read it to
    match the same pieces. Oniguruma reads a possessive interval `{n,m}+` as the interval repeated (GPT-4's
    `\\p{N}{1,3}+` would take any number of digits, not 1-3), so it becomes the plain interval: the same
    matches wherever the interval ends its alternative, as in GPT-4's pattern, where nothing after it could
    backtrack into it. (Its other possessive forms, `?+ *+ ++`, mean the same in both engines.)"""
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


def char_tokenizer_json(chars: list[str], special: dict[str, int]) -> dict[str, Any]:
    """tokenizer.json of a character vocabulary (id i is chars[i]): a BPE whose vocabulary is the characters
    and which has no merges, so each character is its own token; no normalizer and no pre-tokenizer (the
    text is one piece, split into characters), and a decoder that concatenates the tokens."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(special),
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {**_BPE_OPTIONS, "ignore_merges": False, "vocab": {c: i for i, c in enumerate(chars)},
                  "merges": []},
    }


_BPE_OPTIONS = {
    "type": "BPE",
    "dropout": None,
    "unk_token": None,  # byte-level: nothing is unknown (a char vocabulary's unknown characters are dropped)
    "continuing_subword_prefix": None,
    "end_of_word_suffix": None,
    "fuse_unk": False,
    "byte_fallback": False,
}


def _added_tokens(special: dict[str, int]) -> list[dict[str, Any]]:
    # normalized False and no stripping: the name is matched exactly as written, nothing around it changes.
    return [
        {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for name, i in sorted(special.items(), key=lambda kv: kv[1])
    ]


def _byte_text():
    to_text = bytes_to_unicode()
    return lambda token: "".join(to_text[b] for b in token)


# ----------------------------------------------------------------------------- the files of a tokenizer


EOT = "<|endoftext|>"
# Our own description of the tokenizer, beside Hugging Face's files: sample.py --init_from FOLDER rebuilds our
# Tokenizer from it exactly (the ids, the special tokens, a trained BPE's files inline, checked by its hash).
GPTKIT_FILE = "gptkit_tokenizer.json"


def hf_tokenizer_files(tokenizer: Any, model_max_length: int, chat_template: str | None = None) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json of a gptkit.tokenizer.Tokenizer (any
    kind), GPTKIT_FILE, and for GPT-2's BPE also its vocab.json and merges.txt (the files GPT-2 shipped).
    chat_template: a chat model's template in Jinja (gptkit/chat.py), for transformers' apply_chat_template."""
    special = tokenizer.special
    if tokenizer.kind == "char":
        model = char_tokenizer_json(tokenizer.chars, special)
    else:
        model = byte_bpe_tokenizer_json(tokenizer.ranks, tokenizer.pattern, special)
    # <|endoftext|>, where there is one, is BOS and EOS (as for GPT-2); the other special tokens are named
    # too, so transformers lists them among the special tokens (skip_special_tokens, chat templates).
    named = {"bos_token": EOT, "eos_token": EOT} if EOT in special else {}
    others = [name for name, _ in sorted(special.items(), key=lambda kv: kv[1]) if name != EOT]
    special_map = {**named, **({"additional_special_tokens": others} if others else {})}
    config = {
        # The generic class: it reads tokenizer.json as it is, whatever the model's vocabulary.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_prefix_space": False,  # tiktoken does not add a leading space either
        "clean_up_tokenization_spaces": False,  # decoding gives the text back exactly
        **special_map,
        **({"chat_template": chat_template} if chat_template else {}),
    }
    files = {
        "tokenizer.json": json.dumps(model, ensure_ascii=False) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(special_map, indent=2, ensure_ascii=False) + "\n",
        GPTKIT_FILE: json.dumps({"tokenizer": tokenizer.to_meta(),
                                 **({"tokenizer_files": tokenizer.files} if tokenizer.files else {})},
                                indent=2, ensure_ascii=False) + "\n",
    }
    if tokenizer.kind == "tiktoken" and tokenizer.to_meta().get("name") == "gpt2":
        files.update(gpt2_vocab_files(tokenizer.ranks, special))
    return files


def gpt2_vocab_files(ranks: dict[bytes, int], special: dict[str, int]) -> dict[str, str]:
    """vocab.json and merges.txt, GPT-2's own form of its BPE: its ranks are GPT-2's token ids, and a merged
    token's id is 256 + the line number of its merge in merges.txt, so the merges in rank order are
    merges.txt's order."""
    text = _byte_text()
    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    vocab.update(special)
    merges = ["#version: 0.2"]  # the header GPT-2's own merges.txt has; readers skip it
    merges += [f"{text(left)} {text(right)}" for left, right in bpe_merges(ranks)]
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False) + "\n",
        "merges.txt": "\n".join(merges) + "\n",
    }
