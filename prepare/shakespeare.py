"""Prepare tiny Shakespeare with the GPT-2 BPE tokenizer (tiktoken "gpt2", vocab 50257, EOT id 50256).

    python prepare/shakespeare.py [--input PATH] [--out_dir data/shakespeare] [--tokenizer gpt2|char|NAME|PATH]

The first 90% of the characters are tokenised as the train split and the last 10% as val (splitting the
text, not the tokens, keeps decode(train) + decode(val) equal to the input). The text is a single document,
so no end-of-text token is inserted; eot_id is still recorded in meta.json for sampling.
Without --input the text is downloaded once into the output folder. --tokenizer NAME or PATH uses a tokenizer
trained with prepare/tokenizer.py instead. A folder already prepared from the same text and tokenizer is left
alone (--overwrite prepares it again).
"""

from __future__ import annotations

from collections.abc import Sequence

from gptkit import cli
from gptkit.data.prepare import tiny_shakespeare
from gptkit.data.prepare.tiny_shakespeare import ShakespeareConfig

NAME = "shakespeare"
URL = tiny_shakespeare.URL


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    tiny_shakespeare.run_script(argv, NAME, ShakespeareConfig, __doc__)


if __name__ == "__main__":
    main()
