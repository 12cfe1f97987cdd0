"""Prepare any text as a dataset: a file, a folder of .txt files, or a Hugging Face dataset column.

    python prepare/text.py --input book.txt --name mybook                  # one document
    python prepare/text.py --input texts/ --name mytexts                   # every .txt below texts/, sorted
    python prepare/text.py --hf_dataset NAME [--hf_config C] [--hf_split train] --text_column text --name X

One document (a single file): the first (1 - val_fraction) of its characters are train, the rest val.
Many documents (a folder, a dataset): each document is followed by the end-of-text token (gpt2), and whole
documents, about val_fraction of the tokens, picked at random with a fixed seed, form the val split.
With --tokenizer char the vocabulary is the set of characters of all documents (no end-of-text token).

Tokenisation runs on --num_proc threads (tiktoken releases the GIL). A long file is cut at line breaks
where GPT-2's pre-tokeniser always splits, so the tokens equal those of one encode call.
All tokens are kept in memory until written (2 bytes per token); for corpora larger than memory use
prepare/openwebtext.py-style streaming instead.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from gptkit import cli
from gptkit.prepare import hub, local, script
from gptkit.prepare.writer import DEFAULT_SHARD_TOKENS, MIN_TOKENS
from gptkit.shards import DataError
from gptkit.tokenizer import Tokenizer


def build_parser() -> cli.ArgumentParser:
    parser = script.make_parser(__doc__)
    parser.add_argument("--input", default=None, help="a text file, or a folder of .txt files")
    parser.add_argument("--hf_dataset", default=None, help="a Hugging Face dataset name (instead of --input)")
    parser.add_argument("--hf_config", default=None, help="the dataset's configuration name, if it has several")
    parser.add_argument("--hf_split", default="train", help="which split of the dataset to read")
    parser.add_argument("--text_column", default="text", help="the dataset column holding the text")
    parser.add_argument("--tokenizer", choices=["gpt2", "char"], default="gpt2")
    parser.add_argument("--name", default=None, help="dataset name: output goes to data/NAME (default: input's name)")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of the data used for val")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    script.add_common_args(parser, "NAME")
    return parser


def load_documents(args: argparse.Namespace) -> tuple[list[str], str, str]:
    """(documents, source, default name) from --input or --hf_dataset."""
    if (args.input is None) == (args.hf_dataset is None):
        raise DataError("give exactly one of --input PATH (file or folder) or --hf_dataset NAME")
    if args.hf_dataset is not None:
        ds = hub.load_hf_dataset(args.hf_dataset, args.hf_config, split=args.hf_split)
        if args.text_column not in ds.column_names:
            raise DataError(
                f"{args.hf_dataset} has no column {args.text_column!r} (columns: {', '.join(ds.column_names)}); "
                "pass --text_column"
            )
        name = args.hf_dataset.rstrip("/").split("/")[-1]
        return [t for t in ds[args.text_column] if t], f"hf:{args.hf_dataset}", name
    path = Path(args.input)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"--input folder {path} contains no .txt files; add some or point at a text file")
        return [local.read_text(f) for f in files], str(path), path.resolve().name
    if not path.is_file():
        raise DataError(f"--input {path} does not exist; give a text file or a folder of .txt files")
    return [local.read_text(path)], str(path), path.stem


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    docs, source, default_name = load_documents(args)
    name = args.name or default_name
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DataError(f"--name {name!r} must be a plain folder name; use --out_dir for a path")
    out_dir = Path(args.out_dir or f"data/{name}")
    if not any(docs):
        raise DataError(f"the input ({source}) is empty; give text with at least {MIN_TOKENS} tokens")
    if args.tokenizer == "char":
        tokenizer = Tokenizer({"kind": "char", "chars": sorted(set().union(*map(set, docs)))})
    else:
        tokenizer = Tokenizer.tiktoken("gpt2")
    meta = local.prepare_documents(
        out_dir, docs, tokenizer, val_fraction=args.val_fraction, source=source, num_proc=args.num_proc,
        shard_tokens=args.shard_tokens,
    )
    script.print_summary(out_dir, meta, started)


if __name__ == "__main__":
    main()
