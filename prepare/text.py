"""Prepare any text as a dataset: a file, a folder of .txt files, or a Hugging Face dataset column.

    python prepare/text.py --input book.txt --name mybook                  # one document
    python prepare/text.py --input texts/ --name mytexts                   # every .txt below texts/, sorted
    python prepare/text.py --hf_dataset NAME [--hf_config C] [--hf_split train] --text_column text --name X
    python prepare/text.py --input texts/ --name mytexts --tokenizer mytok # a tokenizer from prepare/tokenizer.py

--tokenizer: gpt2 (default), char (the vocabulary is every character of the input, collected by a first
pass), or the NAME (under DATA_ROOT/tokenizers/, default data/) or PATH of a trained tokenizer.

One document (a single file): the first (1 - val_fraction) of its characters are train, the rest val.
Many documents (a folder, a dataset): each document is followed by the end-of-text token (when the tokenizer
has one) and goes whole to one split: document i (its position in the sorted files or the dataset's rows) is
val when a seeded hash of i falls below val_fraction, so about val_fraction of the documents are val (at
least one, and at least one stays train).

Everything streams: the input is read, tokenised by --num_proc processes and written in bounded pieces
(a file larger than a piece is cut only where the tokenizer's split pattern always breaks, so its tokens
equal those of one encode call), and the shards are the same whatever --num_proc. A run that is killed
continues where it stopped when run again; a folder already prepared from the same input, tokenizer and
options is left alone (--overwrite prepares it again).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from gptkit import cli
from gptkit.prepare import hub, local, script
from gptkit.prepare.writer import DEFAULT_SHARD_TOKENS, make_fingerprint
from gptkit.shards import DataError
from gptkit.tokenizer import resolve_tokenizer


def build_parser() -> cli.ArgumentParser:
    parser = script.make_parser(__doc__)
    parser.add_argument("--input", default=None, help="a text file, or a folder of .txt files")
    parser.add_argument("--hf_dataset", default=None, help="a Hugging Face dataset name (instead of --input)")
    parser.add_argument("--hf_config", default=None, help="the dataset's configuration name, if it has several")
    parser.add_argument("--hf_split", default="train", help="which split of the dataset to read")
    parser.add_argument("--text_column", default="text", help="the dataset column holding the text")
    script.add_tokenizer_arg(parser, "gpt2")
    parser.add_argument("--name", default=None, help="output goes to DATA_ROOT/NAME (default: the input's name)")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of the data used for val")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    script.add_common_args(parser, "NAME")
    return parser


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    if (args.input is None) == (args.hf_dataset is None):
        raise DataError("give exactly one of --input PATH (file or folder) or --hf_dataset NAME")
    if args.input is not None:
        path = Path(args.input)
        default_name = path.resolve().name if path.is_dir() else path.stem
    else:
        default_name = args.hf_dataset.rstrip("/").split("/")[-1]
    name = args.name or default_name
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DataError(f"--name {name!r} must be a plain folder name; use --out_dir for a path")
    out_dir = Path(args.out_dir or Path(args.data_root) / name)
    if args.input is not None:
        local.prepare_local(out_dir, args.input, args.tokenizer, val_fraction=args.val_fraction,
                            num_proc=args.num_proc, shard_tokens=args.shard_tokens, overwrite=args.overwrite,
                            data_root=args.data_root, started=started)
        return
    local.check_fraction(args.val_fraction)
    tok = None if args.tokenizer == "char" else resolve_tokenizer(args.tokenizer, data_root=args.data_root)
    ds = hub.load_hf_dataset(args.hf_dataset, args.hf_config, split=args.hf_split)
    if args.text_column not in ds.column_names:
        raise DataError(f"{args.hf_dataset} has no column {args.text_column!r} (columns: "
                        f"{', '.join(ds.column_names)}); pass --text_column")
    if tok is None:
        tok = resolve_tokenizer("char", chars=hub.dataset_chars(ds, args.text_column, args.num_proc))
    fp = make_fingerprint(hub=[args.hf_dataset, args.hf_config, args.hf_split, args.text_column],
                          tokenizer=tok.to_meta(), val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
                          rows_per_task=hub.ROWS_PER_TASK)
    hub.write_hf_corpus(out_dir, ds, tok, source=f"hf:{args.hf_dataset}", text_column=args.text_column,
                        num_proc=args.num_proc, shard_tokens=args.shard_tokens, val_fraction=args.val_fraction,
                        fingerprint=fp, overwrite=args.overwrite, started=started)


if __name__ == "__main__":
    main()
