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
least one, and at least one stays train). The last lines name the documents that went to val, and warn when
val is one of very few documents or a much larger share of the tokens than val_fraction.

Everything streams: the input is read, tokenised by --num_proc processes and written in bounded pieces
(a file larger than a piece is cut only where the tokenizer's split pattern always breaks, so its tokens
equal those of one encode call), and the shards are the same whatever --num_proc. A run that is killed
continues where it stopped when run again; a folder already prepared from the same input, tokenizer and
options is left alone (--overwrite prepares it again).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gptkit import cli
from gptkit.data.prepare import hub, local, script
from gptkit.data.prepare.writer import DEFAULT_SHARD_TOKENS, make_fingerprint
from gptkit.errors import DataError
from gptkit.options import setting
from gptkit.tokenizer import resolve_tokenizer


@dataclass
class TextConfig(script.PrepareSettings, script.TextSource):
    name: str = setting("", "output goes to DATA_ROOT/NAME; '' = the input's name")
    val_fraction: float = setting(0.1, "share of the data used for val")
    shard_tokens: int = setting(DEFAULT_SHARD_TOKENS, "tokens per shard")


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    cfg = script.load(TextConfig, argv, "prepare/text.py", __doc__)
    started = time.perf_counter()
    cfg.check_source()
    if cfg.input:
        path = Path(cfg.input)
        default_name = path.resolve().name if path.is_dir() else path.stem
    else:
        default_name = cfg.hf_dataset.rstrip("/").split("/")[-1]
    name = cfg.name or default_name
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DataError(f"--name {name!r} must be a plain folder name; use --out_dir for a path")
    out_dir = cfg.output(name)
    num_proc = cfg.processes()
    if cfg.input:
        local.prepare_local(out_dir, cfg.input, cfg.tokenizer, val_fraction=cfg.val_fraction, num_proc=num_proc,
                            shard_tokens=cfg.shard_tokens, overwrite=cfg.overwrite, data_root=cfg.data_root,
                            started=started)
        return
    local.check_fraction(cfg.val_fraction)
    tok = None if cfg.tokenizer == "char" else resolve_tokenizer(cfg.tokenizer, data_root=cfg.data_root)
    hf_config = cfg.hf_config or None
    ds = hub.load_hf_dataset(cfg.hf_dataset, hf_config, split=cfg.hf_split)
    if cfg.text_column not in ds.column_names:
        raise DataError(f"{cfg.hf_dataset} has no column {cfg.text_column!r} (columns: "
                        f"{', '.join(ds.column_names)}); pass --text_column")
    if tok is None:
        tok = resolve_tokenizer("char", chars=hub.dataset_chars(ds, cfg.text_column, num_proc))
    fp = make_fingerprint(hub=[cfg.hf_dataset, hf_config, cfg.hf_split, cfg.text_column],
                          tokenizer=tok.to_meta(), val_fraction=cfg.val_fraction, shard_tokens=cfg.shard_tokens,
                          rows_per_task=hub.ROWS_PER_TASK)
    hub.write_hf_corpus(out_dir, ds, tok, source=f"hf:{cfg.hf_dataset}", text_column=cfg.text_column,
                        num_proc=num_proc, shard_tokens=cfg.shard_tokens, val_fraction=cfg.val_fraction,
                        fingerprint=fp, overwrite=cfg.overwrite, started=started)


if __name__ == "__main__":
    main()
