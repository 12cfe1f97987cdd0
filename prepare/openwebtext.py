"""Prepare OpenWebText (~9B GPT-2 tokens) from the Hugging Face Hub (Skylion007/openwebtext).

    python prepare/openwebtext.py [--streaming] [--num_proc N] [--shard_tokens 100000000] [--val_tokens N]
                                  [--tokenizer gpt2|char|NAME|PATH]

Each document is tokenised (GPT-2's BPE by default, or a tokenizer trained with prepare/tokenizer.py) and
followed by the end-of-text token. The first --val_tokens tokens of the corpus (default: one shard) are the
val split, the rest train, in shards of --shard_tokens. Downloaded (the default), the Arrow files are read by
--num_proc tokenizer processes; --streaming reads the Hub on the fly and never stores the raw text (and
refuses --tokenizer char, whose vocabulary needs a first pass over the text). Memory stays flat whatever the
corpus size, the shards are the same whatever --num_proc, a run that is killed continues where it stopped
when run again, and a finished dataset is left alone (--overwrite prepares it again).
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
    script.add_tokenizer_arg(parser, "gpt2")
    script.add_common_args(parser, NAME)
    return parser


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    out_dir = Path(args.out_dir or Path(args.data_root) / NAME)
    hub.prepare_hub_corpus(
        out_dir, HF_PATH, streaming=args.streaming, revision=args.revision, num_proc=args.num_proc,
        shard_tokens=args.shard_tokens, val_tokens=args.val_tokens, tokenizer=args.tokenizer,
        overwrite=args.overwrite, data_root=args.data_root, started=started,
    )


if __name__ == "__main__":
    main()
