"""Prepare OpenWebText (~9B GPT-2 tokens) from the Hugging Face Hub (Skylion007/openwebtext).

    python prepare/openwebtext.py [--streaming] [--num_proc N] [--shard_tokens 100000000] [--val_tokens N]

Each document is GPT-2-tokenised and followed by the end-of-text token (50256). The first --val_tokens
tokens of the stream (default: one shard) are the val split, the rest train, in shards of --shard_tokens.
Downloaded mode tokenises with datasets' map(num_proc=...) (cached, so an interrupted run resumes quickly);
--streaming reads the Hub on the fly and never stores the raw text. Either way the writer holds at most
one shard of tokens in memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from gptkit import cli
from gptkit.prepare import hub, script

NAME = "openwebtext"
HF_PATH = "Skylion007/openwebtext"


def build_parser() -> cli.ArgumentParser:
    parser = script.make_parser(__doc__)
    hub.add_corpus_args(parser)
    script.add_common_args(parser, NAME)
    return parser


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    out_dir = Path(args.out_dir or f"data/{NAME}")
    meta = hub.prepare_gpt2_corpus(
        out_dir, HF_PATH, streaming=args.streaming, revision=args.revision, num_proc=args.num_proc,
        shard_tokens=args.shard_tokens, val_tokens=args.val_tokens,
    )
    script.print_summary(out_dir, meta, started)


if __name__ == "__main__":
    main()
