"""Prepare OpenWebText (~9B GPT-2 tokens) from the Hugging Face Hub (Skylion007/openwebtext).

    python prepare/openwebtext.py [--streaming] [--num_proc N] [--shard_tokens 100000000] [--val_tokens N]

Each document is GPT-2-tokenised and followed by the end-of-text token (50256). The first --val_tokens
tokens of the stream (default: one shard) are the val split, the rest train, in shards of --shard_tokens.
Downloaded mode tokenises with datasets' map(num_proc=...) (cached, so an interrupted run resumes quickly);
--streaming reads the Hub on the fly and never stores the raw text. Either way the writer holds at most
one shard of tokens in memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as `python prepare/openwebtext.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from prepare import common  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

NAME = "openwebtext"
HF_PATH = "Skylion007/openwebtext"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_corpus_args(parser)
    common.add_common_args(parser, NAME)
    return parser


def prepare(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    out_dir = Path(args.out_dir or f"data/{NAME}")
    tokenizer = Tokenizer.tiktoken("gpt2")  # fail fast (before any download) if the BPE files are missing
    ds = common.load_hf_dataset(HF_PATH, split="train", streaming=args.streaming, revision=args.revision)
    meta = common.write_hf_corpus(
        out_dir, ds, tokenizer, source=f"https://huggingface.co/datasets/{HF_PATH}", num_proc=args.num_proc,
        shard_tokens=args.shard_tokens, val_tokens=args.val_tokens,
    )
    common.summarize(out_dir, meta)
    print(f"done in {time.perf_counter() - t0:.2f} s")


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    common.run(lambda: prepare(args))


if __name__ == "__main__":
    main()
