"""benchmarks/dpo_rule.py's synthetic task made unpaired, for KTO: each pair gives one row, its prompt and one of its
two replies, labelled desirable (the asked-for mark) or not, at random, so that every word is in one row only.

    python -m benchmarks.kto_rule --out bench-kto-rule/          # writes sft.jsonl, pairs.jsonl, rows.jsonl there
    python -m benchmarks.kto_rule --out bench-kto-rule/ --train  # and SFT -> KTO -> the tables

The files: `python -m benchmarks.dpo_rule --out OUT` writes sft.jsonl and pairs.jsonl, and rows.jsonl is made of
the pairs. --train runs the recipe with the project's own commands, each in its own process (all under --out):

    python prepare/chat.py --input OUT/sft.jsonl --tokenizer char --block_size 40 --name sft
    python train.py --dataset=sft ...                        # dpo_rule.py's tiny chat model (--sft_steps)
    python prepare/preference.py --input OUT/rows.jsonl --tokenizer OUT/sft --block_size 40 --name rows
    python train.py --objective=kto --init_from=OUT/sft --dataset=rows ...

    python prepare/preference.py --input OUT/pairs.jsonl ... --name pairs     # the rows' pairs, for eval.py
    python eval.py --ckpt OUT/kto_lrX --task preference --dataset pairs --reference OUT/sft

and prints, by step, each KTO run's evaluations on the held-out rows (words in neither the SFT data nor the rows
tuned on): auc, the share of (desirable, undesirable) pairs of rows whose rewards are in the right order, the
mean rewards of each kind, the desirable completions' mean log-probability, and z (kl); then each model on the
held-out pairs those rows come from (DPO's accuracy, by the implicit reward against the SFT model) and the share
of chat.py's greedy replies (one conversation a prompt) to prompts with unseen words that end with the
asked-for mark.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks.preference_recipe import COMMON, REPO, percent, prepare_pairs, run, scores, train_chat_model
from gptkit import cli
from gptkit.errors import UsageError

# dpo_rule.py's context (a script: run here as one for its files, not imported)
BLOCK = 40
KTO_ARGS = ["--objective=kto", "--gradient_accumulation_steps=1", "--warmup_iters=5", "--dropout=0.0",
            "--eval_iters=100"]


def unseen_prompts(out: Path, n: int, seed: int) -> list[tuple[str, str]]:
    """n (word, asked mark): words of 3 to 6 letters that neither sft.jsonl nor pairs.jsonl holds."""
    seen = {json.loads(line)["messages"][0]["content"].split()[1].rstrip(",")
            for line in (out / "sft.jsonl").read_text().splitlines()}
    seen |= {json.loads(line)["prompt"].split()[1].rstrip(",")
             for line in (out / "pairs.jsonl").read_text().splitlines()}
    rng = random.Random(seed + 3)
    found: dict[str, str] = {}
    while len(found) < n:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        if word not in seen:
            found.setdefault(word, rng.choice("!?."))
    return list(found.items())


def rule_followed(ckpt: Path, prompts: list[tuple[str, str]]) -> float:
    """The share of greedy chat.py replies (one conversation a prompt, /reset between them) that end with the
    asked-for mark."""
    lines = "".join(f"say {word}, end with {mark}\n/reset\n" for word, mark in prompts)
    cmd = [sys.executable, "chat.py", f"--ckpt={ckpt}", "--temperature=0", "--max_new_tokens=10", "--device=cpu",
           "--quantize=none"]
    print("$", shlex.join(cmd), flush=True)
    said = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, input=lines).stdout
    replies = said.split("\n\n")[: len(prompts)]
    return sum(r.endswith(mark) for r, (_, mark) in zip(replies, prompts, strict=True)) / len(prompts)


def unpaired(pairs: Path, rows: Path, seed: int) -> tuple[int, int]:
    """rows.jsonl from pairs.jsonl: one row a pair, its chosen reply labelled true or its rejected one labelled
    false, a coin toss each; returns (desirable, undesirable)."""
    rng = random.Random(seed + 2)
    out, counts = [], [0, 0]
    for line in pairs.read_text().splitlines():
        pair = json.loads(line)
        good = rng.random() < 0.5
        out.append({"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good})
        counts[not good] += 1
    rows.write_text("".join(json.dumps(r) + "\n" for r in out))
    return counts[0], counts[1]


def train_and_report(args, out: Path) -> None:
    data = out / "data"
    sft = train_chat_model(out / "sft.jsonl", data, out, block=BLOCK, steps=args.sft_steps)
    # the rows, and the pairs they come from: one row a pair, in the same order, so the two val splits hold the
    # same (held-out) words, and eval.py scores the KTO model on the held-out pairs as DPO's are
    rows, pairs = (prepare_pairs(out / f"{name}.jsonl", sft, data, name, block=BLOCK) for name in ("rows", "pairs"))
    prompts = unseen_prompts(out, args.chat_prompts, args.seed)
    finals = {"SFT model": (scores(sft, pairs), rule_followed(sft, prompts))}
    by_step = {}
    for lr in args.lrs:
        name, kto = f"KTO, lr {lr:g}", out / f"kto_lr{lr:g}"
        seconds = run([sys.executable, "train.py", f"--init_from={sft}", f"--dataset={rows}", f"--out_dir={kto}",
                       *KTO_ARGS, *COMMON, f"--batch_size={args.batch_size}", f"--dpo_beta={args.beta}",
                       f"--learning_rate={lr}", f"--min_lr={lr / 30:g}", f"--max_iters={args.kto_steps}",
                       f"--lr_decay_iters={args.kto_steps}", f"--eval_interval={args.eval_interval}",
                       f"--log_interval={args.eval_interval}"])
        print(f"{name}: {args.kto_steps} steps in {seconds:.0f} s", flush=True)
        lines = [json.loads(line) for line in (kto / "metrics.jsonl").read_text().splitlines()]
        by_step[name] = [m for m in lines if "val_loss" in m]
        finals[name] = (scores(kto / "last.pt", pairs, reference=sft), rule_followed(kto / "last.pt", prompts))
    meta = json.loads((rows / "meta.json").read_text())["preference"]
    print(f"\nthe val rows ({meta['rows']['val']}, words never seen) by step, against the SFT model: val loss, auc, "
          f"mean rewards (beta x nats) of the desirable and the undesirable rows, the desirable completions' mean "
          f"log-prob (nats), z")
    for name, evals in by_step.items():
        print(f"{name}\n{'step':>6}{'val loss':>10}{'auc':>8}{'desirable':>11}{'undesirable':>13}{'log-prob':>10}"
              f"{'z':>8}")
        for m in evals:
            print(f"{m['step']:>6}{m['val_loss']:>10.4f}{m['val_auc']:>8.1%}{m['val_chosen_reward']:>11.3f}"
                  f"{m['val_rejected_reward']:>13.3f}{m['val_chosen_logp']:>10.2f}{m['val_kl']:>8.3f}")
    print(f"\nthe held-out pairs (eval.py --task preference; the KTO models against the SFT model, by the implicit "
          f"reward: DPO's accuracy), and greedy chat replies to {len(prompts)} prompts with unseen words")
    print(f"{'model':<20}{'accuracy':>10}{'margin':>10}{'chosen':>10}{'rejected':>10}{'rule followed':>15}")
    for name, (s, followed) in finals.items():
        print(f"{name:<20}{percent(s['accuracy']):>10}{s['margin_nats']:>10.3f}{s['chosen_logp']:>10.2f}"
              f"{s['rejected_logp']:>10.2f}{followed:>15.1%}")


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(prog="python -m benchmarks.kto_rule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-kto-rule", help="folder for sft.jsonl, pairs.jsonl and rows.jsonl "
                                                                "(and --train's runs)")
    parser.add_argument("--sft", type=int, default=20_000, help="SFT conversations")
    parser.add_argument("--rows", type=int, default=4_000, help="unpaired rows (train and val)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", action="store_true", help="then SFT -> KTO, and the tables")
    parser.add_argument("--sft_steps", type=int, default=800, help="--train: SFT steps (32 conversations each)")
    parser.add_argument("--kto_steps", type=int, default=300, help="--train: KTO steps")
    parser.add_argument("--batch_size", type=int, default=64, help="--train: rows per KTO step")
    parser.add_argument("--beta", type=float, default=0.5, help="--train: dpo_beta (KTO's beta)")
    parser.add_argument("--lrs", type=lambda v: [float(x) for x in v.split(",")], default=[3e-3, 3e-4],
                        help="--train: one KTO run per learning rate (a comma list)")
    parser.add_argument("--eval_interval", type=int, default=25, help="--train: KTO steps between evaluations")
    parser.add_argument("--chat_prompts", type=int, default=100, help="--train: prompts with unseen words")
    args = parser.parse_args(argv)
    if args.sft < 1 or args.rows < 2:
        raise UsageError("--sft must be at least 1 and --rows at least 2")
    out = Path(args.out).resolve()
    run([sys.executable, "-m", "benchmarks.dpo_rule", f"--out={out}", f"--sft={args.sft}", f"--pairs={args.rows}",
         f"--seed={args.seed}"])  # sft.jsonl and pairs.jsonl
    sft, pairs = out / "sft.jsonl", out / "pairs.jsonl"
    desirable, undesirable = unpaired(pairs, out / "rows.jsonl", args.seed)
    print(f"wrote {sft} ({args.sft:,} conversations) and {out / 'rows.jsonl'} ({desirable:,} desirable and "
          f"{undesirable:,} undesirable rows, one per pair of {pairs})")
    if args.train:
        train_and_report(args, out)


if __name__ == "__main__":
    main()
