"""What the prepare scripts' command lines share, as settings classes that each script's config extends (the
one parser, gptkit/options.py): where the dataset goes, the tokenizer, the processes; the Hub corpora's options.

    @dataclass
    class TextConfig(PrepareSettings):
        name: str = setting("", "...")

    cfg = script.load(TextConfig, argv, "prepare/text.py", __doc__)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gptkit.data.prepare.writer import DEFAULT_SHARD_TOKENS
from gptkit.errors import ConfigError
from gptkit.options import load_config, setting

TOKENIZER_HELP = ("gpt2 (GPT-2's BPE), char (the text's characters), or the NAME (in DATA_ROOT/tokenizers) or PATH "
                  "of a tokenizer trained with prepare/tokenizer.py")


def load(cls: type, argv: Sequence[str] | None, prog: str, description: str):
    """The script's settings from argv (sys.argv's when None); --help shows the module docstring, then them."""
    return load_config(cls, list(sys.argv[1:] if argv is None else argv), allow_files=False, prog=prog,
                       description=description)


@dataclass
class OutputSettings:
    """Where a prepared dataset goes."""

    data_root: str = setting("data", "the folder of datasets (DATA_ROOT/NAME) and of trained tokenizers "
                                     "(DATA_ROOT/tokenizers)")
    out_dir: str = setting("", "output folder; '' = DATA_ROOT/NAME, NAME the dataset's")
    overwrite: bool = setting(False, "prepare again even if the folder already holds this dataset (or replace a "
                                     "different one)")

    def output(self, name: str) -> Path:
        return Path(self.out_dir or Path(self.data_root) / name)


@dataclass
class PrepareSettings(OutputSettings):
    """...and how the text is tokenised (every script but prepare/chat.py, whose tokenizer is its own)."""

    tokenizer: str = setting("gpt2", TOKENIZER_HELP)
    num_proc: int = setting(0, "tokenizer processes; 0 = all CPU cores; the shards are the same whatever it is")

    def validate(self) -> None:
        if self.num_proc < 0:
            raise ConfigError(f"num_proc must be >= 0 (0 = all CPU cores), got {self.num_proc}")

    def processes(self) -> int:
        return self.num_proc or os.cpu_count() or 1


@dataclass
class CorpusSettings(PrepareSettings):
    """...and a Hub corpus's options (prepare/openwebtext.py, prepare/fineweb.py)."""

    streaming: bool = setting(False, "stream from the Hub instead of downloading first")
    shard_tokens: int = setting(DEFAULT_SHARD_TOKENS, "tokens per shard")
    val_tokens: int | None = setting(None, "val split size in tokens; auto = one shard")
    revision: str = setting("", "dataset revision on the Hub (branch, tag or commit); '' = the latest")


@dataclass
class TextSource:
    """Text to read: a file or folder, or a Hugging Face dataset (prepare/text.py, prepare/tokenizer.py)."""

    input: str = setting("", "a text file, or a folder of .txt files (read recursively, in sorted order)")
    hf_dataset: str = setting("", "a Hugging Face dataset name (instead of --input)")
    hf_config: str = setting("", "the dataset's configuration name, if it has several")
    hf_split: str = setting("train", "which split of the dataset to read")
    text_column: str = setting("text", "the dataset column holding the text")

    def check_source(self) -> None:
        if bool(self.input) == bool(self.hf_dataset):
            raise ConfigError("give exactly one of --input PATH (file or folder) or --hf_dataset NAME")
