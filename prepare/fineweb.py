"""Prepare a FineWeb sample (HuggingFaceFW/fineweb, or FineWeb-Edu with --edu) from the Hugging Face Hub.

    python prepare/fineweb.py [--edu] [--sample sample-10BT] [--streaming] [--num_proc N] [--shard_tokens N]
                              [--tokenizer gpt2|char|NAME|PATH]

Output goes to data/fineweb (or data/fineweb_edu). Each document is tokenised (GPT-2's BPE by default) and
followed by the end-of-text token; the first --val_tokens tokens (default: the first shard) are val, the rest
train. As for prepare/openwebtext.py: flat memory, --num_proc processes with the same shards whatever their
number, resumable after a kill, and a finished dataset is left alone unless --overwrite.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from gptkit import cli
from gptkit.prepare import hub, script

SAMPLES = ("sample-10BT", "sample-100BT", "sample-350BT")


def build_parser() -> cli.ArgumentParser:
    parser = script.make_parser(__doc__)
    parser.add_argument("--edu", action="store_true", help="use FineWeb-Edu (HuggingFaceFW/fineweb-edu)")
    parser.add_argument("--sample", choices=SAMPLES, default="sample-10BT", help="which published sample")
    hub.add_corpus_args(parser)
    script.add_tokenizer_arg(parser, "gpt2")
    script.add_common_args(parser, "fineweb (or fineweb_edu with --edu)")
    return parser


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    name = "fineweb_edu" if args.edu else "fineweb"
    out_dir = Path(args.out_dir or Path(args.data_root) / name)
    hub.prepare_hub_corpus(
        out_dir, "HuggingFaceFW/fineweb-edu" if args.edu else "HuggingFaceFW/fineweb", args.sample,
        streaming=args.streaming, revision=args.revision, num_proc=args.num_proc,
        shard_tokens=args.shard_tokens, val_tokens=args.val_tokens, tokenizer=args.tokenizer,
        overwrite=args.overwrite, data_root=args.data_root, started=started,
    )


if __name__ == "__main__":
    main()
