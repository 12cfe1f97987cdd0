"""Tokenizer training speed, encoding speed and compression, on a generated corpus of a chosen size.

    python -m benchmarks.tokenizer --input data/shakespeare_char/input.txt --mb 100     # from the repository root
    python -m benchmarks.tokenizer --input tinyshakespeare.txt --mb 5 --vocabs 1024,4096   # a quick check

The corpus: documents of 100 lines each, every line drawn at random (seeded) from --input's non-empty lines,
and each of its words replaced, with probability 0.2, by a word drawn from all of the input's words (a number
instead, one time in 20), until --mb megabytes (UTF-8) are made. The same seed makes the same corpus. Its last
10% of documents are held out: the tokenizers are trained on the first 90% and measured on the held-out part.

Prints, as markdown tables:
* training MB/s (the train part's bytes / seconds) of rustbpe (gptkit.bpe.train, what prepare/tokenizer.py
  uses) and of Hugging Face tokenizers' BpeTrainer with the same split pattern, at --train_vocab;
* encoding tokens/s of the rustbpe-trained tokenizer (gptkit's Tokenizer: tiktoken built from its ranks) and
  of tiktoken's GPT-2 on the held-out text, one document per call, one thread;
* bytes per token on the held-out text for tokenizers trained at each of --vocabs, beside GPT-2's BPE.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator

from gptkit import bpe, cli
from gptkit.hf_tokenizer import onig_pattern
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer


def make_corpus(source: str, mb: float, seed: int) -> list[str]:
    """Documents of 100 varied lines from `source` (see the module docstring), mb megabytes in all."""
    lines = [line for line in source.splitlines() if line.strip()]
    words = sorted({w for line in lines for w in line.split()})
    rng = random.Random(seed)
    docs, size, target = [], 0, mb * 1e6
    while size < target:
        out = []
        for _ in range(100):
            parts = rng.choice(lines).split(" ")
            for i in range(len(parts)):
                if rng.random() < 0.2:
                    parts[i] = str(rng.randrange(10**rng.randint(1, 6))) if rng.random() < 0.05 else rng.choice(words)
            out.append(" ".join(parts))
        doc = "\n".join(out) + "\n"
        docs.append(doc)
        size += len(doc.encode("utf-8"))
    return docs


def megabytes(docs: list[str]) -> float:
    return sum(len(d.encode("utf-8")) for d in docs) / 1e6


def train_rustbpe(docs: list[str], vocab_size: int) -> tuple[Tokenizer, float]:
    t0 = time.perf_counter()
    model = bpe.train(iter(docs), vocab_size, CHAT_SPECIALS, "bench")
    seconds = time.perf_counter() - t0
    spec = {"kind": "bpe", "name": model.name, "hash": model.hash, "path": "(in memory)", "special": model.special}
    files = {name: text for name, text in model.files().items() if name in bpe.DEFINING_FILES}
    return Tokenizer(spec, files), seconds


def train_hf(docs: list[str], vocab_size: int) -> float:
    """Seconds to train the same kind of BPE with Hugging Face tokenizers (the alternative to rustbpe)."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(onig_pattern(bpe.SPLIT_PATTERN)), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    tok.train_from_iterator(iter(docs), trainer)
    return time.perf_counter() - t0


def encode_speed(tok: Tokenizer, docs: list[str], repeats: int) -> tuple[float, int]:
    """(best seconds over `repeats` passes, tokens) to encode every document."""
    best, n = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = sum(len(tok.encode_array(d)) for d in docs)
        best = min(best, time.perf_counter() - t0)
    return best, n


def table(header: list[str], rows: list[list[str]]) -> Iterator[str]:
    yield "| " + " | ".join(header) + " |"
    yield "|" + "|".join("---" for _ in header) + "|"
    for row in rows:
        yield "| " + " | ".join(row) + " |"


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="the text the corpus is made from (e.g. tiny Shakespeare)")
    p.add_argument("--mb", type=float, default=100, help="corpus size in MB (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train_vocab", type=int, default=16384, help="vocab_size of the timed trainings")
    p.add_argument("--vocabs", default="4096,16384,50257", help="vocab sizes for the compression table")
    p.add_argument("--repeats", type=int, default=3, help="encoding passes (the best is reported)")
    p.add_argument("--skip_hf", action="store_true", help="do not time Hugging Face tokenizers")
    args = p.parse_args(argv)

    with open(args.input, encoding="utf-8") as f:
        docs = make_corpus(f.read(), args.mb, args.seed)
    cut = len(docs) * 9 // 10
    train, held = docs[:cut], docs[cut:]
    mb_train, mb_held = megabytes(train), megabytes(held)
    print(f"corpus: {megabytes(docs):.1f} MB from {args.input} (seed {args.seed}), {len(docs)} documents: "
          f"train {mb_train:.1f} MB, held-out {mb_held:.1f} MB\n")

    trained, seconds = train_rustbpe(train, args.train_vocab)
    rows = [["rustbpe (gptkit.bpe, chosen)", f"{seconds:.1f}", f"{mb_train / seconds:.2f}"]]
    if not args.skip_hf:
        hf_seconds = train_hf(train, args.train_vocab)
        rows.append(["Hugging Face tokenizers BpeTrainer", f"{hf_seconds:.1f}", f"{mb_train / hf_seconds:.2f}"])
    print(f"training, vocab {args.train_vocab}, on the {mb_train:.1f} MB train part:\n")
    print("\n".join(table(["trainer", "seconds", "MB/s"], rows)) + "\n")

    gpt2 = Tokenizer.tiktoken("gpt2")
    rows = []
    speeds = {}
    for label, tok in ((f"trained {trained.vocab_size} (tiktoken from its ranks)", trained),
                       ("GPT-2 (tiktoken's own)", gpt2)):
        s, n = encode_speed(tok, held, args.repeats)
        speeds[label] = n / s
        rows.append([label, f"{n / s / 1e6:.2f}M", f"{mb_held / s:.1f}"])
    print(f"encoding the {mb_held:.1f} MB held-out part, one document per call, one thread (best of "
          f"{args.repeats}):\n")
    print("\n".join(table(["tokenizer", "tokens/s", "MB/s"], rows)))
    a, b = speeds.values()
    print(f"\ntrained / GPT-2 tokens/s: {a / b:.2f}\n")

    held_bytes = mb_held * 1e6
    rows = []
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        tok = trained if vocab == args.train_vocab else train_rustbpe(train, vocab)[0]
        n = sum(len(tok.encode_array(d)) for d in held)
        rows.append([f"trained, asked {vocab}", str(tok.vocab_size), f"{held_bytes / n:.2f}"])
    n = sum(len(gpt2.encode_array(d)) for d in held)
    rows.append(["GPT-2's BPE", str(gpt2.vocab_size), f"{held_bytes / n:.2f}"])
    print("compression on the held-out part:\n")
    print("\n".join(table(["tokenizer", "vocab_size", "bytes/token"], rows)))


if __name__ == "__main__":
    main()
