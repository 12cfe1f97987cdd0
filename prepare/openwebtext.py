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
from dataclasses import dataclass

from gptkit import cli
from gptkit.data.prepare import hub, script

NAME = "openwebtext"
HF_PATH = "Skylion007/openwebtext"


@dataclass
class OpenWebTextConfig(script.CorpusSettings):
    """The Hub corpus's options; nothing of its own."""


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    cfg = script.load(OpenWebTextConfig, argv, "prepare/openwebtext.py", __doc__)
    started = time.perf_counter()
    hub.prepare_hub_corpus(
        cfg.output(NAME), HF_PATH, streaming=cfg.streaming, revision=cfg.revision or None,
        num_proc=cfg.processes(), shard_tokens=cfg.shard_tokens, val_tokens=cfg.val_tokens,
        tokenizer=cfg.tokenizer, overwrite=cfg.overwrite, data_root=cfg.data_root, started=started,
    )


if __name__ == "__main__":
    main()
