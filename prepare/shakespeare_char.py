"""Prepare tiny Shakespeare (1.1M characters) as a character-level dataset.

    python prepare/shakespeare_char.py [--input PATH] [--out_dir data/shakespeare_char] [--tokenizer char|...]

The vocabulary is the sorted set of characters in the text (65 for tiny Shakespeare). The first 90% of the
characters are the train split and the last 10% val, so decoding train then val gives back the input exactly.
Without --input the text is downloaded once into the output folder. (--tokenizer takes the other values of
prepare/text.py too; the default is char.) A folder already prepared from the same text and tokenizer is left
alone (--overwrite prepares it again).
"""

from __future__ import annotations

from collections.abc import Sequence

from gptkit import cli
from gptkit.data.prepare import tiny_shakespeare
from gptkit.data.prepare.tiny_shakespeare import ShakespeareCharConfig

NAME = "shakespeare_char"
URL = tiny_shakespeare.URL


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    tiny_shakespeare.run_script(argv, NAME, ShakespeareCharConfig, __doc__)


if __name__ == "__main__":
    main()
