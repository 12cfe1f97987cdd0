"""Prepare preference data: for DPO, token shards of (prompt + chosen reply, prompt + rejected reply); or
unpaired rows (prompt + completion, with a desirable/undesirable label) for a loss that takes them. The loss
mask is on the reply tokens only.

    python prepare/preference.py --input pairs.jsonl --name mypairs                       # GPT-2's BPE
    python prepare/preference.py --input pairs.jsonl --name mypairs --tokenizer out-chat/ --block_size 64
    python prepare/preference.py --hf_dataset NAME --hf_split train --name mypairs          # a Hub dataset

Each line (or Hub row) is one row, in the layouts preference datasets (and TRL) use:
    {"prompt": "What is 2+2?", "chosen": "4.", "rejected": "5."}                  pairs, explicit prompt
    {"prompt": [{"role": "system", ...}, {"role": "user", ...}, ...],
     "chosen": [{"role": "assistant", "content": ...}], "rejected": [{"role": "assistant", "content": ...}]}
    {"chosen": [...the whole conversation...], "rejected": [...the same, another last reply...]}   implicit
    {"prompt": "What is 2+2?", "completion": "4.", "label": true}                 unpaired (or as messages)
(a prompt as a string is one user message; conversations that repeat the prompt, or share it when no prompt is
given, are cut after it; each reply must be one assistant message; a file holds pairs or unpaired rows, not
both. Unpaired rows make a dataset of their own kind, which DPO refuses: it needs pairs.)

--tokenizer: gpt2, char, the NAME or PATH of a trained tokenizer, or a checkpoint (an out_dir or a .pt file)
whose tokenizer to use: prepare the pairs with the tokenizer of the chat model you will tune. --block_size:
the context the tuning will use; a pair whose longer sequence does not fit has its prompt cut from the start
(its end, with the question, stays), and is left out when fewer than --min_prompt_tokens of the prompt would
remain; lengths are checked before tokenising, so a huge row costs no more than its line. Rows that cannot be
used (not UTF-8, not JSON, a missing field, an empty reply, chosen = rejected, ...) are left out, counted and
named by line. Output goes to DATA_ROOT/NAME.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gptkit import cli
from gptkit.data.prepare import preferences, script
from gptkit.data.prepare.conversations import chat_tokenizer
from gptkit.data.prepare.hub import load_hf_dataset
from gptkit.data.prepare.local import check_fraction
from gptkit.data.prepare.writer import DEFAULT_SHARD_TOKENS, make_fingerprint
from gptkit.errors import ConfigError, DataError
from gptkit.options import setting


@dataclass
class PreferenceDataConfig(script.OutputSettings):
    input: str = setting("", "a JSONL file, one preference pair (or unpaired row) per line")
    hf_dataset: str = setting("", "a Hugging Face dataset of pairs or unpaired rows (instead of --input): its "
                                  "name, or a local folder of its files")
    hf_config: str = setting("", "the dataset's configuration name, if it has several")
    hf_split: str = setting("train", "which split of the Hub dataset to read (its pairs are then split into "
                                     "train and val by --val_fraction)")
    revision: str = setting("", "the Hub dataset's revision (branch, tag or commit); '' = the latest")
    name: str = setting("", "output goes to DATA_ROOT/NAME; '' = the input's name")
    tokenizer: str = setting("gpt2", "gpt2, char, a trained tokenizer's NAME or PATH, or a checkpoint (out_dir or "
                                     ".pt) whose tokenizer to use")
    block_size: int = setting(1024, "the tuning's context (1024 is GPT-2's): each sequence, prompt and reply, "
                                    "fits in block_size + 1 tokens")
    min_prompt_tokens: int = setting(16, "leave out a pair whose replies leave fewer than this many of its "
                                         "prompt's tokens in the block")
    val_fraction: float = setting(0.05, "share of the pairs for val")
    shard_tokens: int = setting(DEFAULT_SHARD_TOKENS, "tokens per shard")

    def validate(self) -> None:
        if bool(self.input) == bool(self.hf_dataset):
            raise ConfigError("give exactly one of --input PAIRS.jsonl or --hf_dataset NAME")
        if self.block_size < 2:
            raise ConfigError(f"--block_size must be at least 2, got {self.block_size}")
        if self.min_prompt_tokens < 1:
            raise ConfigError(f"--min_prompt_tokens must be at least 1, got {self.min_prompt_tokens}")


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    cfg = script.load(PreferenceDataConfig, argv, "prepare/preference.py", __doc__)
    check_fraction(cfg.val_fraction)
    name = cfg.name or (Path(cfg.input).stem if cfg.input else Path(cfg.hf_dataset.rstrip("/")).name)
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DataError(f"--name {name!r} must be a plain folder name; use --out_dir for a path")
    out_dir = cfg.output(name)
    options = dict(block_size=cfg.block_size, min_prompt_tokens=cfg.min_prompt_tokens,
                   val_fraction=cfg.val_fraction, shard_tokens=cfg.shard_tokens)
    if cfg.input:
        path = Path(cfg.input)
        if not path.is_file():
            raise DataError(f"--input {path} is not a file; give a JSONL file with one preference pair per line")

        def rows():
            return preferences.jsonl_rows(path)

        source = str(path)
        identity = [str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]
    else:
        ds = load_hf_dataset(cfg.hf_dataset, cfg.hf_config or None, split=cfg.hf_split,
                             revision=cfg.revision or None)

        def rows():
            return preferences.dataset_rows(ds)

        source = f"{cfg.hf_dataset} ({cfg.hf_split} split)"
        # datasets' own hash of the data it loaded: another revision or changed local files are another input
        identity = [cfg.hf_dataset, cfg.hf_config, cfg.hf_split, getattr(ds, "_fingerprint", None)]
    char = cfg.tokenizer == "char"
    tokenizer = None if char else chat_tokenizer(cfg.tokenizer, lambda: (), cfg.data_root)
    per_token = 1 if tokenizer is None else preferences.chars_per_token(tokenizer)
    # One pass before anything is written: the rows, their kind, and the characters a char vocabulary needs.
    found = preferences.survey(rows(), source, cfg.block_size, per_token, chars=char)
    if not found.usable:
        if found.rows:  # why each row was left out, by line, before the error
            for line in preferences.bad_rows(rows(), found.kind, cfg.block_size, per_token).lines():
                print(line)
        raise preferences.no_usable_rows(source, found.kind, found.rows)
    if tokenizer is None:
        tokenizer = chat_tokenizer("char", lambda: found.chars, cfg.data_root)
    fingerprint = make_fingerprint(preference=identity, tokenizer=tokenizer.to_meta(), **options)
    preferences.prepare_pairs(out_dir, rows, tokenizer, source=source, fingerprint=fingerprint, n_rows=found.rows,
                              overwrite=cfg.overwrite, kind=found.kind, **options)

if __name__ == "__main__":
    main()
