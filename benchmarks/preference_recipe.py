"""What the synthetic preference benchmarks (dpo_rule.py, dpo_length.py) share: made-up words, the recipe's
commands each in its own process (a tiny chat model trained from scratch on conversations, preference pairs
in its tokens, DPO runs, eval.py's scores of the pairs), and greedy chat replies through the chat template and
the serving engine, as chat.py decodes them.
"""

from __future__ import annotations

import json
import queue
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

from gptkit.chat import ChatTokens, prompt_ids
from gptkit.checkpoint import load_model
from gptkit.serving.engine import Engine, Finished, Request

REPO = Path(__file__).resolve().parents[1]
LETTERS = "abcdefghijklmnopqrstuvwxyz"

# the tiny chat model (its block_size is the task's), its DPO runs, and what every run of the recipe sets
SFT_ARGS = ["--n_layer=2", "--n_head=2", "--n_embd=64"]
SFT_TRAIN = ["--batch_size=32", "--gradient_accumulation_steps=1", "--warmup_iters=20", "--learning_rate=3e-3",
             "--min_lr=3e-4", "--dropout=0.0", "--eval_iters=5"]
DPO_ARGS = ["--objective=dpo", "--gradient_accumulation_steps=1", "--warmup_iters=5", "--learning_rate=3e-3",
            "--min_lr=1e-4", "--dropout=0.0", "--eval_iters=100"]
COMMON = ["--device=cpu", "--compile=False", "--overwrite=True", "--always_save_checkpoint=True"]


def made_up_words(n: int, rng: random.Random, lo: int = 3, hi: int = 6) -> list[str]:
    """n distinct random lowercase words of lo to hi letters."""
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi))))
    return sorted(words)


def run(cmd: list[str]) -> float:
    """Run a command from the repository's root, its output hidden (it fails loudly); its seconds."""
    print("$", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def train_chat_model(conversations: Path, data: Path, out: Path, *, block: int, steps: int,
                     extra: tuple[str, ...] = ()) -> Path:
    """prepare/chat.py on the conversations (character tokens) as data/sft, then a chat model trained from
    scratch on them for `steps` steps of 32 (train.py, SFT_ARGS): its out_dir."""
    run([sys.executable, "prepare/chat.py", f"--input={conversations}", "--tokenizer=char", f"--block_size={block}",
         "--name=sft", f"--data_root={data}", "--overwrite"])
    sft = out / "sft"
    run([sys.executable, "train.py", f"--dataset={data / 'sft'}", f"--out_dir={sft}", *SFT_ARGS,
         f"--block_size={block}", *SFT_TRAIN, *COMMON, f"--max_iters={steps}", f"--lr_decay_iters={steps}",
         f"--eval_interval={steps}", f"--log_interval={steps}", *extra])
    return sft


def prepare_pairs(pairs: Path, tokenizer: Path, data: Path, name: str, *, block: int) -> Path:
    """prepare/preference.py on the pairs in the chat model's tokens, a tenth of them held out: the dataset."""
    run([sys.executable, "prepare/preference.py", f"--input={pairs}", f"--tokenizer={tokenizer}",
         f"--block_size={block}", f"--name={name}", f"--data_root={data}", "--val_fraction=0.1", "--overwrite"])
    return data / name


def dpo_run(sft: Path, pairs: Path, out: Path, *, steps: int, batch_size: int, eval_interval: int,
            settings: list[str]) -> tuple[float, dict[int, dict]]:
    """train.py --objective=dpo from the chat model (DPO_ARGS and `settings`): its seconds, and its
    evaluations of the val pairs by step (metrics.jsonl)."""
    seconds = run([sys.executable, "train.py", f"--init_from={sft}", f"--dataset={pairs}", f"--out_dir={out}",
                   *DPO_ARGS, *COMMON, f"--batch_size={batch_size}", *settings, f"--max_iters={steps}",
                   f"--lr_decay_iters={steps}", f"--eval_interval={eval_interval}", f"--log_interval={eval_interval}"])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return seconds, {m["step"]: m for m in lines if "val_loss" in m}


def scores(ckpt: Path, data: Path, reference: Path | None = None) -> dict:
    """eval.py --task preference on the val pairs (against the reference, or by the model's log-probs)."""
    cmd = [sys.executable, "eval.py", f"--ckpt={ckpt}", "--task=preference", f"--dataset={data}", "--device=cpu"]
    done = subprocess.run(cmd + ([f"--reference={reference}"] if reference else []), cwd=REPO, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def greedy_replies(ckpt: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The model's greedy reply to each prompt (one user message each), through the chat template and the
    serving engine as chat.py decodes: at most max_new_tokens tokens, up to its <|end|>."""
    model, tokenizer, _ = load_model(str(ckpt))
    engine = Engine(model, max_batch=16, max_queue=len(prompts)).start()
    stops = ChatTokens.of(tokenizer).stop_ids
    events = [queue.SimpleQueue() for _ in prompts]
    for text, box in zip(prompts, events):
        engine.submit(Request(prompt_ids([{"role": "user", "content": text}], tokenizer), max_new_tokens,
                              emit=box.put, stop_ids=stops))
    replies = []
    for box in events:
        tokens = []
        while not isinstance(event := box.get(timeout=600), Finished):
            tokens.append(event.id)
        replies.append(tokenizer.decode(tokens))
    engine.stop()
    return replies


def percent(accuracy: float | None) -> str:
    """An accuracy as a percentage, "n/a" where there is none (every pair tied)."""
    return "n/a" if accuracy is None else f"{accuracy:.1%}"
