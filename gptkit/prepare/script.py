"""What every prepare script's command line shares: the parser, --tokenizer, --out_dir/--num_proc/--overwrite."""

from __future__ import annotations

import argparse
import os

from gptkit import cli


def make_parser(description: str) -> cli.ArgumentParser:
    """The script's parser, its module docstring (with the command lines) as the --help text."""
    return cli.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_tokenizer_arg(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--tokenizer", default=default,
        help=f"gpt2 (GPT-2's BPE), char (the text's characters), or the NAME (in DATA_ROOT/tokenizers) or "
             f"PATH of a tokenizer trained with prepare/tokenizer.py (default: {default})",
    )


def add_common_args(parser: argparse.ArgumentParser, name: str) -> None:
    """--data_root, --out_dir, --num_proc and --overwrite, which every script has."""
    parser.add_argument("--data_root", default="data", help="the folder of datasets (DATA_ROOT/NAME) and of "
                        "trained tokenizers (DATA_ROOT/tokenizers)")
    parser.add_argument("--out_dir", default=None, help=f"output folder (default: DATA_ROOT/{name})")
    parser.add_argument(
        "--num_proc", type=int, default=os.cpu_count() or 1,
        help="tokenizer processes (default: all CPU cores); the shards are the same whatever it is",
    )
    parser.add_argument(
        "--overwrite", action="store_true",
        help="prepare again even if the folder already holds this dataset (or replace a different one)",
    )
