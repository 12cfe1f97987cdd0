"""Prepare tiny Shakespeare with the GPT-2 BPE tokenizer (tiktoken "gpt2", vocab 50257, EOT id 50256).

    python prepare/shakespeare.py [--input PATH] [--out_dir data/shakespeare]

The first 90% of the characters are tokenised as the train split and the last 10% as val (splitting the
text, not the tokens, keeps decode(train) + decode(val) equal to the input). The text is a single document,
so no end-of-text token is inserted; eot_id is still recorded in meta.json for sampling.
Without --input the text is downloaded once into the output folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as `python prepare/shakespeare.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from prepare import common  # noqa: E402
from shards import Tokenizer  # noqa: E402

NAME = "shakespeare"
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
    meta = common.prepare_single_text(
        out_dir, text, Tokenizer.tiktoken("gpt2"), val_fraction=args.val_fraction, source=args.input or URL,
        num_proc=args.num_proc,
    )
    common.summarize(out_dir, meta)
    print(f"done in {time.perf_counter() - t0:.2f} s")


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    common.run(lambda: prepare(args))


if __name__ == "__main__":
    main()
