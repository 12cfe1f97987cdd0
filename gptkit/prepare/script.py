"""What every prepare script's command line shares: the parser, --out_dir/--num_proc, the closing summary."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from gptkit import cli


def make_parser(description: str) -> cli.ArgumentParser:
    """The script's parser, its module docstring (with the command lines) as the --help text."""
    return cli.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(parser: argparse.ArgumentParser, name: str) -> None:
    """--out_dir and --num_proc, which every script has."""
    parser.add_argument("--out_dir", default=None, help=f"output folder (default: data/{name})")
    parser.add_argument(
        "--num_proc", type=int, default=os.cpu_count() or 1, help="tokeniser workers (default: all CPU cores)"
    )


def print_summary(out_dir: Path, meta: dict[str, Any], started: float) -> None:
    """What was written (from its meta.json) and how long it took since `started` (time.perf_counter())."""
    parts = [f"{s}: {e['tokens']:,} tokens in {len(e['shards'])} shard(s)" for s, e in meta["splits"].items()]
    print(f"wrote {out_dir} (vocab_size {meta['vocab_size']}; {'; '.join(parts)})")
    print(f"done in {time.perf_counter() - started:.2f} s")
