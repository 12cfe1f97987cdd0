"""Prepare a FineWeb sample (HuggingFaceFW/fineweb, or FineWeb-Edu with --edu) from the Hugging Face Hub.

    python prepare/fineweb.py [--edu] [--sample sample-10BT] [--streaming] [--num_proc N] [--shard_tokens N]
                              [--tokenizer gpt2|char|NAME|PATH]

Output goes to data/fineweb (or data/fineweb_edu). Each document is tokenised (GPT-2's BPE by default) and
followed by the end-of-text token; the first --val_tokens tokens (default: the first shard) are val, the rest
train. As for prepare/openwebtext.py: flat memory, --num_proc processes with the same shards whatever their
number, resumable after a kill, and a finished dataset is left alone unless --overwrite.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gptkit import cli
from gptkit.data.prepare import hub, script
from gptkit.options import setting

SAMPLES = ("sample-10BT", "sample-100BT", "sample-350BT")


@dataclass
class FinewebConfig(script.CorpusSettings):
    edu: bool = setting(False, "use FineWeb-Edu (HuggingFaceFW/fineweb-edu); the output goes to DATA_ROOT/fineweb_edu")
    sample: str = setting("sample-10BT", "which published sample", SAMPLES)


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    cfg = script.load(FinewebConfig, argv, "prepare/fineweb.py", __doc__)
    started = time.perf_counter()
    name = "fineweb_edu" if cfg.edu else "fineweb"
    hub.prepare_hub_corpus(
        cfg.output(name), "HuggingFaceFW/fineweb-edu" if cfg.edu else "HuggingFaceFW/fineweb", cfg.sample,
        streaming=cfg.streaming, revision=cfg.revision or None, num_proc=cfg.processes(),
        shard_tokens=cfg.shard_tokens, val_tokens=cfg.val_tokens, tokenizer=cfg.tokenizer,
        overwrite=cfg.overwrite, data_root=cfg.data_root, started=started,
    )


if __name__ == "__main__":
    main()
