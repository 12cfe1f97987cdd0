"""GPT-2's BPE against a tokenizer trained on the data: the same small model trained on the same Shakespeare
bytes with each, for the same wall time, compared by validation bits per byte (loss per token does not compare
across tokenizers: a token of one is not a token of the other; bits per byte of the same text does).

    python -m benchmarks.tokenizer_bpb --text ../shared/data/tinyshakespeare.txt            # ~2 x 5 minutes
    python -m benchmarks.tokenizer_bpb --text ... --seconds 600 --vocab_size 4096

Steps, all with the project's own commands, under --work (default bench-tokenizer-bpb/):
  1. the first 90% of the text (the training split's characters; the val split never reaches the tokenizer)
     -> python prepare/tokenizer.py --vocab_size 4096 --name shakes4k
  2. python prepare/shakespeare.py --input TEXT (--tokenizer gpt2, and --tokenizer shakes4k)
  3. for each: 30 steps to time a step, then train.py for the number of steps that fills --seconds
     (4 layers x 256, block 128, batch 16: configs/shakespeare_cpu.py's recipe, a BPE-sized model)
  4. python eval.py --task loss on the val split: loss, and bpb over all of its bytes
The table: tokenizer, vocab, bytes per token of val, steps, wall seconds, val loss, val bpb.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: gptkit from this checkout

from gptkit import cli  # noqa: E402

MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=256", "--block_size=128", "--batch_size=16",
         "--gradient_accumulation_steps=1", "--dropout=0.0", "--bias=False", "--learning_rate=1e-3",
         "--beta2=0.99", "--warmup_iters=50", "--device=cpu", "--compile=False", "--eval_iters=20",
         "--always_save_checkpoint=True", "--overwrite=True"]


def sh(cmd: list[str], capture: bool = False) -> str:
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO, check=True, text=True, capture_output=capture)
    return done.stdout if capture else ""


def train(work: Path, name: str, steps: int) -> float:
    """Train on data NAME for `steps`; returns the wall seconds of train.py."""
    t0 = time.perf_counter()
    sh([sys.executable, "train.py", f"--dataset={name}", f"--data_root={work / 'data'}",
        f"--out_dir={work / ('out-' + name)}", f"--max_iters={steps}", f"--lr_decay_iters={steps}",
        "--min_lr=1e-4", f"--eval_interval={steps}", f"--log_interval={max(1, steps // 10)}", *MODEL])
    return time.perf_counter() - t0


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", required=True, help="tiny Shakespeare (a UTF-8 text file)")
    parser.add_argument("--work", default="bench-tokenizer-bpb")
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=300.0, help="training wall time of each model")
    args = parser.parse_args(argv)
    work = Path(args.work).resolve()
    (work / "data").mkdir(parents=True, exist_ok=True)
    text = Path(args.text).read_text(encoding="utf-8")
    train_part = work / "train_part.txt"
    train_part.write_text(text[: round(len(text) * 0.9)], encoding="utf-8", newline="")
    tok = f"shakes{args.vocab_size // 1024}k"
    sh([sys.executable, "prepare/tokenizer.py", f"--input={train_part}", f"--vocab_size={args.vocab_size}",
        f"--name={tok}", f"--data_root={work / 'data'}"])
    rows = []
    for name, tokenizer in (("gpt2", "gpt2"), (tok, tok)):
        sh([sys.executable, "prepare/shakespeare.py", f"--input={args.text}", f"--tokenizer={tokenizer}",
            f"--out_dir={work / 'data' / name}", f"--data_root={work / 'data'}"])
        per_step = train(work, name, 30) / 30  # start-up included: the long run's steps are a little cheaper
        steps = max(50, int(args.seconds / per_step))
        seconds = train(work, name, steps)
        result = json.loads(sh([sys.executable, "eval.py", f"--ckpt={work / ('out-' + name)}", "--task=loss",
                                f"--dataset={name}", f"--data_root={work / 'data'}", "--device=cpu"],
                               capture=True).strip().splitlines()[-1])
        meta = json.loads((work / "data" / name / "meta.json").read_text())
        rows.append((name, meta["vocab_size"], result["bytes"] / result["tokens"], steps, seconds, result["loss"],
                     result["bpb"]))
    print(f"\n{'tokenizer':<12}{'vocab':>8}{'bytes/tok':>10}{'steps':>8}{'wall s':>8}{'val loss':>10}{'val bpb':>9}")
    for name, vocab, bpt, steps, seconds, loss, bpb in rows:
        print(f"{name:<12}{vocab:>8}{bpt:>10.2f}{steps:>8}{seconds:>8.0f}{loss:>10.3f}{bpb:>9.3f}")


if __name__ == "__main__":
    main()
