"""A DPO step's time and peak memory on the CPU: a full fine-tune (its reference precomputed) against LoRA (its
reference the adapters off), on a GPT-2-shaped chat model with random weights, beside an SFT step (the
next-token loss on chat windows) on as many tokens: 2 x pairs sequences of --seq.

    python -m benchmarks.dpo_step                                   # GPT-2 124M, 2 pairs of 256 tokens a step
    python -m benchmarks.dpo_step --baseline HEAD~1                 # and the DPO runs of that commit's code
    python -m benchmarks.dpo_step --shape tiny --seq 64 --steps 3   # a check that it runs, in seconds

It writes under --work: a chat model of the shape with random weights, saved as a checkpoint of this project
(GPT-2's BPE and the chat tokens: what configs/finetune_chat.py's out-chat/ holds); --pairs preference pairs
of random words in those tokens, prepared with prepare/preference.py at --seq (every sequence cut to fit, so
each is --seq tokens); then one train.py DPO run per variant, each in its own process:

    python train.py --objective=dpo --init_from=WORK/base --dataset=WORK/data/pairs --batch_size=PAIRS ...
    python train.py ... --lora_rank=8
    python train.py --init_from=WORK/base --dataset=WORK/data/chat --batch_size=2xPAIRS --block_size=SEQ ...

(the SFT runs on the pairs' prompts and chosen replies as conversations, prepared with prepare/chat.py); with
--baseline REV also the DPO runs of the code at git revision REV (extracted under WORK with git archive), in
the same invocation, so that the before and after share the machine's load. It prints, per run, the median step time after the first step (metrics.jsonl's ms_per_step), the process's
peak resident memory (metrics.jsonl's peak_mem_mb: the OS's count, the model load and, for the full
fine-tune, the reference's precomputation included) and the time from the process's start to the first
step's end (imports, model load, the reference, the first evaluation and step).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gptkit import cli
from gptkit.checkpoint import save_checkpoint
from gptkit.data.shards import read_meta
from gptkit.errors import UsageError
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"tiny": (2, 2, 64), "gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024)}  # n_layer, n_head, n_embd
WORDS = ("the king queen lord sword rose night star crown shall speak thou art good sir my to and of in it "
         "is that for with as was his her be by not but at from").split()
VARIANTS = {"full fine-tune": [], "LoRA (rank 8)": ["--lora_rank=8", "--lora_dropout=0.0"]}
COMMON = ["--overwrite=True", "--device=cpu", "--compile=False", "--dtype=float32", "--gradient_accumulation_steps=1",
          "--warmup_iters=1", "--learning_rate=1e-5", "--min_lr=1e-6", "--dropout=0.0", "--eval_iters=1",
          "--log_interval=1"]


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_pairs(path: Path, chats: Path, n: int, seq: int, seed: int) -> None:
    """n pairs whose prompts are longer than seq tokens (prepare cuts them from the start to fit), and the same
    prompts' ends and chosen replies as conversations (for the SFT step: its windows are block_size long
    whatever they hold)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f, open(chats, "w", encoding="utf-8") as g:
        for _ in range(n):
            reply = max(4, seq // 8)
            row = {"prompt": text(rng, seq), "chosen": text(rng, reply), "rejected": text(rng, reply)}
            f.write(json.dumps(row) + "\n")
            short = " ".join(row["prompt"].split()[-(seq // 2):])  # (chat windows cut the end, and the reply)
            g.write(json.dumps({"messages": [{"role": "user", "content": short},
                                             {"role": "assistant", "content": row["chosen"]}]}) + "\n")


def write_base(folder: Path, shape: str, data: Path) -> int:
    """A chat model of the shape with random weights, in the pairs' tokens; returns its parameter count."""
    n_layer, n_head, n_embd = SHAPES[shape]
    meta = read_meta(data)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=1024, vocab_size=int(meta["vocab_size"]), vocab_multiple=64, n_layer=n_layer,
                          n_head=n_head, n_embd=n_embd, dropout=0.0, bias=True))
    folder.mkdir(parents=True, exist_ok=True)
    save_checkpoint({"format": 1, "model_config": model.config.to_dict(), "model": model.state_dict(),
                     "tokenizer": meta, "step": 0, "config": {}}, folder / "best.pt")
    return model.num_params(non_embedding=False)


def run(cmd: list[str], cwd: Path = REPO) -> float:
    print("$", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def checkout(rev: str, folder: Path) -> Path:
    """The repository's files at git revision rev, extracted into folder (replaced)."""
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def measure(out: Path) -> tuple[float, float, float]:
    """(median ms per step after the first, peak RSS in MB, seconds to the first step's end) of a run."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    ms = statistics.median(m["ms_per_step"] for m in steps if m.get("ms_per_step"))
    return ms, max(m["peak_mem_mb"] for m in steps), steps[0]["elapsed_s"]


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(prog="python -m benchmarks.dpo_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench-dpo-step", help="folder for the base, the pairs and the runs")
    parser.add_argument("--shape", default="gpt2", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (each pair is two)")
    parser.add_argument("--batch_size", type=int, default=2, help="pairs per step")
    parser.add_argument("--pairs", type=int, default=200, help="pairs prepared (the full fine-tune scores them all "
                                                               "once, for its reference)")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run (the first is left out of the time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", default="", help="a git revision whose DPO runs to add (the code before a "
                                                       "change), e.g. HEAD~1")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.seq < 32 or args.batch_size < 1 or args.pairs < 20:
        raise UsageError("--steps must be at least 2, --seq at least 32, --batch_size at least 1 and --pairs "
                             "at least 20")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    write_pairs(work / "pairs.jsonl", work / "chats.jsonl", args.pairs, args.seq, args.seed)
    run([sys.executable, "prepare/preference.py", f"--input={work / 'pairs.jsonl'}", "--tokenizer=gpt2",
         f"--block_size={args.seq}", "--name=pairs", f"--data_root={work / 'data'}", "--val_fraction=0.1",
         "--overwrite"])
    run([sys.executable, "prepare/chat.py", f"--input={work / 'chats.jsonl'}", "--tokenizer=gpt2",
         f"--block_size={args.seq}", "--name=chat", f"--data_root={work / 'data'}", "--val_fraction=0.1",
         "--overwrite"])
    params = write_base(work / "base", args.shape, work / "data" / "pairs")
    steps = [f"--max_iters={args.steps}", f"--lr_decay_iters={args.steps}", f"--eval_interval={args.steps}"]
    codes = [("", REPO)] + ([(f" [{args.baseline}]", checkout(args.baseline, work / "baseline"))]
                            if args.baseline else [])
    rows = []
    for name, extra in VARIANTS.items():
        kind = name.split()[0].lower()
        out = work / f"out-sft-{kind}"
        run([sys.executable, "train.py", f"--init_from={work / 'base'}", f"--dataset={work / 'data' / 'chat'}",
             f"--out_dir={out}", f"--batch_size={2 * args.batch_size}", f"--block_size={args.seq}", *COMMON, *steps,
             *extra])
        rows.append((f"SFT, {name}", *measure(out)))
        for label, code in codes:
            out = work / f"out-{kind}{'-baseline' if label else ''}"
            run([sys.executable, "train.py", "--objective=dpo", f"--init_from={work / 'base'}",
                 f"--dataset={work / 'data' / 'pairs'}", f"--out_dir={out}", f"--batch_size={args.batch_size}",
                 *COMMON, *steps, *extra], cwd=code)
            rows.append((f"DPO, {name}{label}", *measure(out)))
    T = args.seq
    print(f"\nDPO and SFT on the CPU: {args.shape} ({params / 1e6:.1f}M parameters), {args.batch_size} pairs = "
          f"{2 * args.batch_size} sequences of {T} tokens a step (SFT: {2 * args.batch_size} windows of {T}), "
          f"float32, eager")
    print(f"{'':<36}{'ms/step':>10}{'peak RSS':>12}{'first step done':>18}")
    for name, ms, peak, first in rows:
        print(f"{name:<36}{ms:>10.0f}{peak / 1024:>10.2f} GB{first:>16.1f} s")

if __name__ == "__main__":
    main()
