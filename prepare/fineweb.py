"""Prepare a FineWeb sample (HuggingFaceFW/fineweb, or FineWeb-Edu with --edu) from the Hugging Face Hub.

    python prepare/fineweb.py [--edu] [--sample sample-10BT] [--streaming] [--num_proc N] [--shard_tokens N]

Output goes to data/fineweb (or data/fineweb_edu). Each document is GPT-2-tokenised and followed by the
end-of-text token; the first --val_tokens tokens (default: the first shard) are val, the rest train. The
writer streams: at most one shard of tokens is in memory, whatever the corpus size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as `python prepare/fineweb.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from prepare import common  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

SAMPLES = ("sample-10BT", "sample-100BT", "sample-350BT")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edu", action="store_true", help="use FineWeb-Edu (HuggingFaceFW/fineweb-edu)")
    parser.add_argument("--sample", choices=SAMPLES, default="sample-10BT", help="which published sample")
    common.add_corpus_args(parser)
    common.add_common_args(parser, "fineweb (or fineweb_edu with --edu)")
    return parser


def prepare(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    hf_path = "HuggingFaceFW/fineweb-edu" if args.edu else "HuggingFaceFW/fineweb"
    out_dir = Path(args.out_dir or ("data/fineweb_edu" if args.edu else "data/fineweb"))
    tokenizer = Tokenizer.tiktoken("gpt2")  # fail fast (before any download) if the BPE files are missing
    ds = common.load_hf_dataset(hf_path, args.sample, split="train", streaming=args.streaming, revision=args.revision)
    meta = common.write_hf_corpus(
        out_dir, ds, tokenizer, source=f"https://huggingface.co/datasets/{hf_path} ({args.sample})",
        num_proc=args.num_proc, shard_tokens=args.shard_tokens, val_tokens=args.val_tokens,
    )
    common.summarize(out_dir, meta)
    print(f"done in {time.perf_counter() - t0:.2f} s")


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    common.run(lambda: prepare(args))


if __name__ == "__main__":
    main()
