"""Prepare tiny Shakespeare (1.1M characters) as a character-level dataset.

    python prepare/shakespeare_char.py [--input PATH] [--out_dir data/shakespeare_char]

The vocabulary is the sorted set of characters in the text (65 for tiny Shakespeare). The first 90% of the
characters are the train split and the last 10% val, so decoding train then val gives back the input exactly.
Without --input the text is downloaded once into the output folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as `python prepare/shakespeare_char.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from prepare import common  # noqa: E402
from shards import Tokenizer  # noqa: E402

NAME = "shakespeare_char"
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default=None, help="local copy of the text (default: download it)")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of characters for val")
    common.add_common_args(parser, NAME)
    return parser


def prepare(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    out_dir = Path(args.out_dir or f"data/{NAME}")
    path = common.obtain_input(args.input, URL, out_dir)
    text = common.read_text(path)
    common.require_text(text, str(path))
    tokenizer = Tokenizer.char_from_text(text)
    meta = common.prepare_single_text(
        out_dir, text, tokenizer, val_fraction=args.val_fraction, source=args.input or URL, num_proc=args.num_proc
    )
    common.summarize(out_dir, meta)
    print(f"done in {time.perf_counter() - t0:.2f} s")


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    common.run(lambda: prepare(args))


if __name__ == "__main__":
    main()
