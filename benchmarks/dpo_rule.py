"""A synthetic preference task small enough for the CPU: a chat model that ends its replies with any mark,
and pairs that prefer the mark the prompt asks for.

    python -m benchmarks.dpo_rule --out bench-dpo-rule/          # writes sft.jsonl and pairs.jsonl there

The user asks for a made-up word and the mark to end it with ("say qoxet, end with !"); the reply is the word
and a mark ("qoxet!"). In sft.jsonl (conversations, prepare/chat.py) the reply's mark is drawn at random
whatever the prompt asks, so a model fine-tuned on them learns the format and to copy the word, and ends with
each mark a third of the time: it prefers the asked-for mark on about half of the pairs. In pairs.jsonl
(prepare/preference.py) the chosen reply ends with the asked-for mark and the rejected one with another: DPO
on them teaches the rule. The two replies of a pair differ in that one token, as a rule-following preference
should: what they share cancels in DPO's margin. Every pair has its own word, and none of them is an SFT
word, so a pair of the val split is held out twice over: its word was never seen, neither in the SFT data nor
in the pairs tuned on.

    python prepare/chat.py --input bench-dpo-rule/sft.jsonl --tokenizer char --block_size 32 --name rule_sft
    python train.py --dataset=rule_sft ...                    # a tiny chat model from scratch
    python prepare/preference.py --input bench-dpo-rule/pairs.jsonl --tokenizer OUT_DIR --block_size 32 \
        --name rule_pairs --val_fraction 0.1
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from gptkit import cli

MARKS = "!?."
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def made_up_words(n: int, rng: random.Random, lo: int = 3, hi: int = 6) -> list[str]:
    """n distinct random lowercase words of lo to hi letters."""
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi))))
    return sorted(words)


def prompt(word: str, mark: str) -> str:
    return f"say {word}, end with {mark}"


def sft_conversation(word: str, rng: random.Random) -> dict:
    """A conversation whose reply's mark is drawn at random, whatever the prompt asks."""
    reply = word + rng.choice(MARKS)
    return {"messages": [{"role": "user", "content": prompt(word, rng.choice(MARKS))},
                         {"role": "assistant", "content": reply}]}


def preference_pair(word: str, rng: random.Random) -> dict:
    """The reply with the asked-for mark (chosen) against the same word with another mark (rejected)."""
    mark = rng.choice(MARKS)
    other = rng.choice([m for m in MARKS if m != mark])
    return {"prompt": prompt(word, mark), "chosen": word + mark, "rejected": word + other}


def write(out: Path, n_sft: int, n_pairs: int, seed: int) -> tuple[Path, Path]:
    """sft.jsonl (n_sft conversations) and pairs.jsonl (n_pairs pairs, one word each) in out."""
    rng = random.Random(seed)
    words = made_up_words(n_sft + n_pairs, rng)
    rng.shuffle(words)
    out.mkdir(parents=True, exist_ok=True)
    sft, pairs = out / "sft.jsonl", out / "pairs.jsonl"
    sft.write_text("".join(json.dumps(sft_conversation(w, rng)) + "\n" for w in words[:n_sft]))
    pairs.write_text("".join(json.dumps(preference_pair(w, rng)) + "\n" for w in words[n_sft:]))
    return sft, pairs


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(prog="python -m benchmarks.dpo_rule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-dpo-rule", help="folder for sft.jsonl and pairs.jsonl")
    parser.add_argument("--sft", type=int, default=20_000, help="SFT conversations")
    parser.add_argument("--pairs", type=int, default=4_000, help="preference pairs (train and val)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.sft < 1 or args.pairs < 2:
        raise cli.UsageError("--sft must be at least 1 and --pairs at least 2")
    sft, pairs = write(Path(args.out), args.sft, args.pairs, args.seed)
    print(f"wrote {sft} ({args.sft:,} conversations) and {pairs} ({args.pairs:,} pairs)")


if __name__ == "__main__":
    main()
