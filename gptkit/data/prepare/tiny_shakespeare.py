"""Tiny Shakespeare (1.1M characters of plays), prepared with any tokenizer (characters by default).

    from gptkit.data.prepare.tiny_shakespeare import DATASETS, prepare_shakespeare
    meta = prepare_shakespeare("data/shakespeare_char", "char")   # downloads the text once, then reuses it
    meta = prepare_shakespeare(path, DATASETS[path.name])          # train.py: a dataset name's tokenizer

The one implementation behind train.py's preparing of the two datasets on the fly and the scripts
prepare/shakespeare_char.py and prepare/shakespeare.py (whose command line is ``run_script``, with ShakespeareConfig or ShakespeareCharConfig). The first 90%
of the characters are train and the rest val; the text is a single document, so no end-of-text token is
inserted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptkit import cli
from gptkit.data.prepare import local, script
from gptkit.errors import DataError
from gptkit.options import redefault, setting
from gptkit.tokenizer import resolve_tokenizer

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# The two datasets made of the text: name (its script prepare/NAME.py, its folder data/NAME) -> default tokenizer.
DATASETS = {"shakespeare_char": "char", "shakespeare": "gpt2"}


def prepare_shakespeare(
    out_dir: str | os.PathLike,
    tokenizer: str = "char",
    input_path: str | os.PathLike | None = None,
    *,
    val_fraction: float = 0.1,
    num_proc: int | None = None,
    overwrite: bool = False,
    data_root: str | os.PathLike = "data",
    started: float | None = None,
) -> dict[str, Any]:
    """Prepare tiny Shakespeare in out_dir and return its meta.json contents.

    tokenizer: a --tokenizer value: "char" (the sorted characters of the text, 65), "gpt2" (tiktoken's BPE),
    or a trained tokenizer's NAME (under data_root/tokenizers/) or PATH. input_path: a local copy of the text;
    without it the text is downloaded once into out_dir/input.txt and reused after. num_proc: tokenizer
    processes (default: all CPU cores; this small text is tokenised in this process anyway). Every failure
    (no network, a missing or empty input, a folder that cannot be written) is a DataError with a one-line
    message.
    """
    out_dir = Path(out_dir)
    if tokenizer != "char":
        resolve_tokenizer(tokenizer, data_root=data_root)  # a bad name fails before any download
    try:
        path = local.obtain_input(None if input_path is None else str(input_path), URL, out_dir)
        return local.prepare_local(
            out_dir, path, tokenizer, source=URL if input_path is None else str(input_path),
            val_fraction=val_fraction, num_proc=(os.cpu_count() or 1) if num_proc is None else num_proc,
            overwrite=overwrite, data_root=data_root, started=started,
        )
    except OSError as e:  # e.g. an out_dir that cannot be written
        raise DataError(cli.describe_os_error(e)) from None


@dataclass
class ShakespeareConfig(script.PrepareSettings):
    """prepare/shakespeare.py's command line: the text with GPT-2's BPE (by default)."""

    input: str = setting("", "local copy of the text; '' = download it once into the output folder")
    val_fraction: float = setting(0.1, "share of the characters for val (the end of the text)")


@dataclass
class ShakespeareCharConfig(ShakespeareConfig):
    """prepare/shakespeare_char.py's: the same, character-level by default."""

    tokenizer: str = redefault(script.PrepareSettings, "tokenizer", DATASETS["shakespeare_char"])


def run_script(argv: Sequence[str] | None, name: str, config: type, description: str) -> None:
    """The command line of both scripts (`name`: a key of DATASETS; `config`: its settings class)."""
    cfg = script.load(config, argv, f"prepare/{name}.py", description)
    started = time.perf_counter()
    prepare_shakespeare(cfg.output(name), cfg.tokenizer, cfg.input or None, val_fraction=cfg.val_fraction,
                        num_proc=cfg.processes(), overwrite=cfg.overwrite, data_root=cfg.data_root,
                        started=started)
