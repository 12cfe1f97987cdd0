"""Answer-only loss, end to end on the CPU: fine-tune a base model the project trained into an assistant that
spells words backwards, through the project's own commands, and score it on words it never saw.

    python train.py configs/shakespeare_cpu.py --out_dir=out-cpu          # the base (about 2.5 minutes)
    python -m benchmarks.chat_reverse --base out-cpu --text ../shared/data/tinyshakespeare.txt

The task: the user asks for a word of 3 to 8 letters spelled backwards ("spell crown backwards"); the assistant
answers it reversed ("nworc"). The words are the distinct lowercase words of the text; --test_words of them are
held out of training. For each of two runs, identical but for the loss (answer tokens only: the default;
every token: prepare/chat.py --train_on all), the script runs:

    python prepare/chat.py --input WORK/train.jsonl --tokenizer BASE --block_size 64 --name ... [--train_on all]
    python train.py --init_from=BASE --dataset=... (the settings below, --max_iters=--steps)

then answers every held-out word greedily through the chat template (gptkit/chat.py, as chat.py and the server
do, decoded by the server's engine) and prints a table: exact-match accuracy, training seconds, final val loss.
Everything it writes goes under --work (default bench-chat-reverse/).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from gptkit import cli
from gptkit.chat import ChatTokens, prompt_ids
from gptkit.checkpoint import load_model
from gptkit.serving.engine import Engine, Finished, Request

REPO = Path(__file__).resolve().parents[1]

PHRASINGS = ("spell {} backwards", "reverse {}", "{} backwards, please", "what is {} spelled backwards?")


def words_of(text: str, lo: int = 3, hi: int = 8) -> list[str]:
    return sorted({w for w in re.findall(r"[a-z]+", text) if lo <= len(w) <= hi})


def conversation(word: str, rng: random.Random) -> dict:
    return {"messages": [{"role": "user", "content": rng.choice(PHRASINGS).format(word)},
                         {"role": "assistant", "content": word[::-1]}]}


def write_data(work: Path, text: str, n_test: int, n_train: int, seed: int) -> list[str]:
    """train.jsonl (n_train conversations over the training words); returns the held-out test words."""
    rng = random.Random(seed)
    words = words_of(text)
    rng.shuffle(words)
    test, train = words[:n_test], words[n_test:]
    with open(work / "train.jsonl", "w", encoding="utf-8") as f:
        for _ in range(n_train):
            f.write(json.dumps(conversation(rng.choice(train), rng)) + "\n")
    (work / "test_words.json").write_text(json.dumps(test))
    print(f"{len(words):,} words of 3-8 letters: {len(train):,} for training, {len(test):,} held out")
    return test


def run(cmd: list[str]) -> float:
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    return time.perf_counter() - t0


def accuracy(out_dir: Path, words: list[str], phrasing: str = PHRASINGS[0]) -> float:
    """Exact-match accuracy of greedy answers to the held-out words (the engine decodes 16 at a time)."""
    model, tokenizer, _ = load_model(str(out_dir))
    engine = Engine(model, max_batch=16, max_queue=len(words)).start()
    stops = ChatTokens.of(tokenizer).stop_ids
    events = {w: queue.SimpleQueue() for w in words}
    for w in words:
        engine.submit(Request(prompt_ids([{"role": "user", "content": phrasing.format(w)}], tokenizer), 16,
                              emit=events[w].put, stop_ids=stops))
    right = 0
    for w in words:
        tokens = []
        while not isinstance(event := events[w].get(timeout=600), Finished):
            tokens.append(event.id)
        right += tokenizer.decode(tokens) == w[::-1]
    engine.stop()
    return right / len(words)


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the base model's out_dir (configs/shakespeare_cpu.py's)")
    parser.add_argument("--text", required=True, help="the text the words come from (tiny Shakespeare)")
    parser.add_argument("--work", default="bench-chat-reverse", help="folder for the data and the runs")
    parser.add_argument("--test_words", type=int, default=600)
    parser.add_argument("--conversations", type=int, default=60_000)
    parser.add_argument("--steps", type=int, default=4000, help="fine-tuning steps of each run")
    parser.add_argument("--runs", default="assistant,all", help="which losses to compare")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    test = write_data(work, Path(args.text).read_text(encoding="utf-8"), args.test_words, args.conversations,
                      args.seed)
    rows = []
    for train_on in args.runs.split(","):
        name = f"reverse_{train_on}"
        run([sys.executable, "prepare/chat.py", f"--input={work / 'train.jsonl'}", f"--tokenizer={args.base}",
             "--block_size=64", f"--name={name}", f"--data_root={work / 'data'}", f"--train_on={train_on}"])
        out = work / f"out-{train_on}"
        seconds = run([sys.executable, "train.py", f"--init_from={args.base}", f"--dataset={name}",
                       f"--data_root={work / 'data'}", f"--out_dir={out}", "--overwrite=True", "--device=cpu",
                       "--compile=False", "--block_size=64", "--batch_size=32", "--gradient_accumulation_steps=1",
                       f"--max_iters={args.steps}", f"--lr_decay_iters={args.steps}", "--warmup_iters=100",
                       "--learning_rate=1e-3", "--min_lr=1e-4", "--beta2=0.99", "--dropout=0.0",
                       f"--eval_interval={args.steps // 4}", "--eval_iters=20", "--log_interval=200",
                       "--always_save_checkpoint=True"])
        val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        val_loss = [r["val_loss"] for r in val if "val_loss" in r][-1]
        acc = accuracy(out, test)
        rows.append((train_on, acc, seconds, val_loss))
        print(f"{train_on}: exact match {acc:.1%} on {len(test)} held-out words", flush=True)
    print(f"\n{'loss on':<12}{'exact match':>12}{'train s':>10}{'val loss':>10}   ({len(test)} held-out words, "
          f"{args.steps} steps of 32 x 64 tokens)")
    for train_on, acc, seconds, val_loss in rows:
        print(f"{train_on:<12}{acc:>12.1%}{seconds:>10.0f}{val_loss:>10.3f}")


if __name__ == "__main__":
    main()
