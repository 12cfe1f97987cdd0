"""Multi-digit addition, written in one fixed format, checked by a program: a task a small model can learn from
reward alone (GRPO, `objective=grpo`), and that eval.py scores (greedy accuracy, pass@k).

    prompt   "317+45="           two numbers of 1..DIGITS digits, no spaces, then "="
    reply    "362\n"             the sum in decimal, then a newline (the reply ends at the first newline)

    prompts("train", seed=0)     -> an endless, seeded stream of training prompts
    prompts("heldout", seed=0)   -> the held-out prompts (HELDOUT of them), never in the training stream
    reward(prompt, reply)        -> 1.0 if the reply's first line is the sum, else 0.0
    sft_text(count, seed=0)      -> "a+b=c\\n" lines from the training side, for a supervised start
    python tasks/arithmetic.py 20000 arithmetic.txt            # the same, written to a file

The split is a function of the numbers and the seed (a CRC of "seed:a+b"), one problem in ten held out, so
the training stream and the held-out set never meet whatever their lengths, and a seed gives the same split on
every machine. A task is one file like this one: its `prompts` and its `reward`, and nothing of gptkit.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator

DIGITS = 3  # the numbers have 1..DIGITS digits (uniform in the number of digits, then in the value)
HELDOUT = 200  # the held-out prompts eval.py scores
CHARS = "0123456789+=\n"  # every character the task writes: a char-level model needs only these
STOP = "\n"  # a reply ends where the model writes this (the rollouts stop there; it is not part of the reply)


def held_out(a: int, b: int, seed: int) -> bool:
    """Whether a+b is on the held-out side of the split (one problem in ten)."""
    return zlib.crc32(f"{seed}:{a}+{b}".encode()) % 10 == 0


def _problems(rng: random.Random, seed: int, heldout: bool) -> Iterator[tuple[int, int]]:
    while True:
        a, b = (rng.randrange(10 ** (rng.randrange(DIGITS) + 1)) for _ in range(2))
        if held_out(a, b, seed) == heldout:
            yield a, b


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def prompts(split: str, seed: int = 0) -> Iterator[str]:
    """"train": an endless seeded stream of training prompts; "heldout": the HELDOUT held-out ones (distinct)."""
    if split == "train":
        for a, b in _problems(random.Random(f"train:{seed}"), seed, heldout=False):
            yield prompt_of(a, b)
    elif split == "heldout":
        seen: set[tuple[int, int]] = set()
        for a, b in _problems(random.Random(f"heldout:{seed}"), seed, heldout=True):
            if (a, b) not in seen:
                seen.add((a, b))
                yield prompt_of(a, b)
                if len(seen) == HELDOUT:
                    return
    else:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")


def answer(prompt: str) -> str:
    """The right reply's first line: the sum of the prompt's two numbers."""
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


def reward(prompt: str, reply: str) -> float:
    """1.0 when the reply's first line is exactly the sum (no spaces, no leading zeros), else 0.0."""
    return 1.0 if reply.split("\n", 1)[0] == answer(prompt) else 0.0


def sft_text(count: int, seed: int = 0) -> str:
    """`count` worked problems from the training side, one "a+b=c" line each: a supervised start."""
    stream = prompts("train", seed)
    return "".join(p + answer(p) + "\n" for p in (next(stream) for _ in range(count)))


if __name__ == "__main__":  # python tasks/arithmetic.py COUNT OUT.txt [SEED]: worked problems for an SFT start
    import sys

    count, out = int(sys.argv[1]), sys.argv[2]
    with open(out, "w", encoding="utf-8") as f:
        f.write(sft_text(count, int(sys.argv[3]) if len(sys.argv) > 3 else 0))
