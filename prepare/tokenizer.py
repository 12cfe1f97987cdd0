"""Train a byte-level BPE tokenizer on your own text: a file, a folder of .txt files, or a Hugging Face dataset.

    python prepare/tokenizer.py --input my_texts/ --vocab_size 8192 --name mytok
    python prepare/tokenizer.py --hf_dataset NAME [--hf_config C] [--hf_split train] --text_column text \\
        --vocab_size 32768 --name web --max_chars 2000000000

It is saved as data/tokenizers/NAME-HASH12/ (HASH12: the start of its content hash; --data_root moves data/),
and the prepare scripts take it by name: python prepare/text.py --input my_texts/ --tokenizer mytok.

--vocab_size counts every id: the 256 byte tokens, the merges learned, and the special tokens (--special,
by default <|endoftext|> and the chat tokens <|system|>, <|user|>, <|assistant|>, <|end|>), so one tokenizer
serves pretraining and chat. The text is read once, as a stream (memory holds the counts of distinct pieces of
text, not the text), and training is deterministic: the same text and settings give the same tokenizer, and
running again finds its folder and leaves it as it is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from gptkit import bpe, cli
from gptkit.data.prepare import script
from gptkit.errors import ConfigError, DataError
from gptkit.options import setting
from gptkit.tokenizer import CHAT_SPECIALS

PIECE_CHARS = 1 << 20  # a long file is given to the trainer in pieces of about this many characters


@dataclass
class TokenizerConfig(script.TextSource):
    vocab_size: int = setting(0, "all ids: 256 bytes + merges + special tokens, e.g. 8192 (required)")
    name: str = setting("", "the tokenizer's name: letters, digits, . _ - (required)")
    special: list[str] = setting(list(CHAT_SPECIALS), "the special tokens to reserve, in id order; '' for none")
    max_chars: int = setting(0, "train on at most this many characters; 0 = all")
    data_root: str = setting("data", "tokenizers go to DATA_ROOT/tokenizers/")

    def validate(self) -> None:
        if not self.vocab_size:
            raise ConfigError("--vocab_size is required: all ids, 256 bytes + merges + special tokens (e.g. 8192)")
        if not self.name:
            raise ConfigError("--name is required: the tokenizer's name (letters, digits, . _ -)")


def file_texts(path: Path) -> Iterator[str]:
    """A UTF-8 file in pieces of about PIECE_CHARS characters, cut only after a line break that is followed
    by a non-space character: the split pattern always ends a piece of text there, so the trainer sees exactly
    the pieces it would see in the whole file."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            carry = ""
            while block := f.read(PIECE_CHARS):
                text = carry + block
                cut = _last_cut(text)
                if cut:
                    yield text[:cut]
                    carry = text[cut:]
                else:  # no place to cut yet: read on
                    carry = text
            if carry:
                yield carry
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({cli.one_line(e)}); convert it to UTF-8 first") from None


def _last_cut(text: str) -> int:
    """The position after the last "\\n" that a non-space character follows, or 0."""
    end = len(text) - 1
    while (i := text.rfind("\n", 0, end)) >= 0:
        if not text[i + 1].isspace():
            return i + 1
        end = i
    return 0


def input_texts(args: TokenizerConfig) -> tuple[Iterator[str], str, int | None]:
    """(the texts, a description of the source, their size in bytes where known) from --input or
    --hf_dataset."""
    args.check_source()
    if args.hf_dataset:
        from gptkit.data.prepare.hub import load_hf_dataset

        ds = load_hf_dataset(args.hf_dataset, args.hf_config or None, split=args.hf_split)
        if args.text_column not in ds.column_names:
            raise DataError(f"{args.hf_dataset} has no column {args.text_column!r} (columns: "
                            f"{', '.join(ds.column_names)}); pass --text_column")
        texts = (row[args.text_column] for row in ds)
        return (t for t in texts if t), f"hf:{args.hf_dataset}", None
    path = Path(args.input)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"--input folder {path} contains no .txt files; add some or point at a text file")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"--input {path} does not exist; give a text file or a folder of .txt files")
    texts = (text for f in files for text in file_texts(f))
    return texts, str(path), sum(f.stat().st_size for f in files)


def counted(texts: Iterator[str], bar: tqdm, max_chars: int, seen: list[int]) -> Iterator[str]:
    """The texts, cut off after max_chars characters (0: none), counting [bytes, texts] into `seen` and the
    bytes on the progress bar."""
    chars = 0
    for text in texts:
        if max_chars and chars + len(text) > max_chars:
            text = text[: max_chars - chars]
        chars += len(text)
        n = len(text.encode("utf-8"))
        seen[0] += n
        seen[1] += 1
        bar.update(n)
        yield text
        if max_chars and chars >= max_chars:
            break
    bar.set_description("read; learning the merges")  # the trainer's second phase, after the last text


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    args = script.load(TokenizerConfig, argv, "prepare/tokenizer.py", __doc__)
    bpe.check_name(args.name)
    special = list(dict.fromkeys(s for s in args.special if s))
    bpe.merges_for(args.vocab_size, len(special))  # a bad --vocab_size fails before reading anything
    if args.max_chars < 0:
        raise DataError(f"--max_chars must be 0 (all) or positive, got {args.max_chars}")
    texts, source, total = input_texts(args)
    started = time.perf_counter()
    seen = [0, 0]
    with tqdm(total=total, unit="B", unit_scale=True, desc="reading") as bar:
        trained = bpe.train(counted(texts, bar, args.max_chars, seen), args.vocab_size, special, args.name)
    if not seen[0]:
        raise DataError(f"the input ({source}) is empty; give text to train on")
    trained = dataclasses.replace(trained, trained_on=f"{source}: {seen[0]:,} bytes in {seen[1]:,} texts")
    seconds = time.perf_counter() - started
    folder, created = bpe.save(trained, Path(args.data_root) / "tokenizers")
    merges = len(trained.ranks) - 256
    print(f"trained {args.name}: vocab_size {trained.vocab_size} (256 bytes + {merges} merges + "
          f"{len(trained.special)} special tokens) on {seen[0] / 1e6:.1f} MB in {seconds:.1f} s "
          f"({seen[0] / 1e6 / max(seconds, 1e-9):.2f} MB/s)")
    if trained.vocab_size < args.vocab_size:
        print(f"note: the text allows only {merges} merges, so vocab_size is {trained.vocab_size}, not "
              f"{args.vocab_size}; give more text for a larger vocabulary")
    if created:
        print(f"wrote {folder}/ (hash {trained.hash[:12]})")
    else:
        print(f"{folder}/ already holds this exact tokenizer (same hash); left as it is")
    print(f"use it: python prepare/text.py --input TEXT --name DATASET --tokenizer {args.name}")


if __name__ == "__main__":
    main()
