"""A synthetic preference task small enough for the CPU: a chat model that ends its replies with any mark,
and pairs that prefer the mark the prompt asks for.

    python -m benchmarks.dpo_rule --out bench-dpo-rule/          # writes sft.jsonl and pairs.jsonl there
    python -m benchmarks.dpo_rule --out bench-dpo-rule/ --train  # and SFT -> DPO -> eval: the table by step

The user asks for a made-up word and the mark to end it with ("say qoxet, end with !"); the reply is the word
and a mark ("qoxet!"). In sft.jsonl (conversations, prepare/chat.py) the reply's mark is drawn at random
whatever the prompt asks, so a model fine-tuned on them learns the format and to copy the word, and ends with
each mark a third of the time: it prefers the asked-for mark on about half of the pairs. In pairs.jsonl
(prepare/preference.py) the chosen reply ends with the asked-for mark and the rejected one with another: DPO
on them teaches the rule. The two replies of a pair differ in that one token, as a rule-following preference
should: what they share cancels in DPO's margin. Every pair has its own word, and none of them is an SFT
word, so a pair of the val split is held out twice over: its word was never seen, neither in the SFT data nor
in the pairs tuned on.

--train runs the recipe with the project's own commands, each in its own process (all under --out):

    python prepare/chat.py --input OUT/sft.jsonl --tokenizer char --block_size 40 --name sft
    python train.py --dataset=sft ...                   # a tiny chat model from scratch (--sft_steps)
    python prepare/preference.py --input OUT/pairs.jsonl --tokenizer OUT/sft --block_size 40 --name pairs
    python eval.py --ckpt OUT/sft --task preference --dataset pairs       # the SFT model on the val pairs
    python train.py --objective=dpo --init_from=OUT/sft --dataset=pairs ...   # once per --nll_weights value

and prints, by step, each DPO run's val pairs (its evaluations: the accuracy and mean margin of the implicit
reward against the SFT model, the chosen replies' mean log-probability), then each model scored alone (eval.py
--task preference: the share of val pairs whose chosen reply it finds likelier) and the share of greedy
replies, through the chat template and the serving engine as chat.py decodes, to prompts with unseen words
that end with the asked-for mark.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from benchmarks.preference_recipe import (
    dpo_run,
    greedy_replies,
    made_up_words,
    percent,
    prepare_pairs,
    scores,
    train_chat_model,
)
from gptkit import cli
from gptkit.errors import UsageError

MARKS = "!?."


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


BLOCK = 40  # every conversation and pair of the task fits


def unseen_prompts(out: Path, n: int, seed: int) -> list[tuple[str, str]]:
    """n (word, asked mark) with words that neither file holds."""
    seen = {json.loads(line)["messages"][0]["content"].split()[1].rstrip(",")
            for line in (out / "sft.jsonl").read_text().splitlines()}
    seen |= {json.loads(line)["prompt"].split()[1].rstrip(",")
             for line in (out / "pairs.jsonl").read_text().splitlines()}
    rng = random.Random(seed + 1)
    words = [w for w in made_up_words(n + len(seen), rng) if w not in seen][:n]
    return [(w, rng.choice(MARKS)) for w in words]


def rule_followed(ckpt: Path, prompts: list[tuple[str, str]]) -> float:
    """The share of greedy chat replies (preference_recipe.greedy_replies) that end with the asked-for mark."""
    replies = greedy_replies(ckpt, [prompt(word, mark) for word, mark in prompts], 10)
    return sum(reply.endswith(mark) for reply, (_, mark) in zip(replies, prompts)) / len(prompts)


def train_and_compare(args, out: Path) -> None:
    data = out / "data"
    sft = train_chat_model(out / "sft.jsonl", data, out, block=BLOCK, steps=args.sft_steps)
    pairs = prepare_pairs(out / "pairs.jsonl", sft, data, "pairs", block=BLOCK)
    prompts = unseen_prompts(out, args.chat_prompts, args.seed)
    rows = {"SFT": (scores(sft, pairs), rule_followed(sft, prompts))}
    by_step = {}
    for weight in args.nll_weights:
        name = f"DPO, nll_weight {weight:g}"
        dpo = out / f"dpo_nll{weight:g}"
        seconds, by_step[name] = dpo_run(sft, pairs, dpo, steps=args.dpo_steps, batch_size=args.batch_size,
                                         eval_interval=args.eval_interval,
                                         settings=[f"--dpo_beta={args.beta}", f"--dpo_nll_weight={weight}"])
        rows[name] = (scores(dpo / "last.pt", pairs), rule_followed(dpo / "last.pt", prompts))
        print(f"{name}: {args.dpo_steps} steps in {seconds:.0f} s", flush=True)

    n_val = rows["SFT"][0]["pairs"]
    print(f"\nthe val pairs ({n_val}, words never seen) by step, against the SFT model: accuracy (margin > 0, of "
          f"the pairs not tied: n/a when all tie), mean margin (beta x nats), chosen replies' mean log-prob")
    print(f"{'step':>6}" + "".join(f"{name:>34}" for name in by_step))
    for step in sorted(next(iter(by_step.values()))):
        cells = [by_step[name].get(step) for name in by_step]
        print(f"{step:>6}" + "".join(f"{percent(m['val_accuracy']):>14}{m['val_reward_margin']:>10.3f}"
                                     f"{m['val_chosen_logp']:>10.2f}" if m else f"{'':>34}" for m in cells))
    print(f"\neach model alone on the val pairs (its own log-probabilities), and greedy chat replies to "
          f"{len(prompts)} prompts with unseen words")
    print(f"{'model':<24}{'accuracy':>10}{'margin':>10}{'chosen':>10}{'rejected':>10}{'rule followed':>15}")
    for name, (s, followed) in rows.items():
        print(f"{name:<24}{percent(s['accuracy']):>10}{s['margin_nats']:>10.3f}{s['chosen_logp']:>10.2f}"
              f"{s['rejected_logp']:>10.2f}{followed:>15.1%}")


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(prog="python -m benchmarks.dpo_rule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-dpo-rule", help="folder for sft.jsonl and pairs.jsonl (and --train's "
                                                                "runs)")
    parser.add_argument("--sft", type=int, default=20_000, help="SFT conversations")
    parser.add_argument("--pairs", type=int, default=4_000, help="preference pairs (train and val)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", action="store_true", help="then SFT -> DPO -> eval, and the tables")
    parser.add_argument("--sft_steps", type=int, default=800, help="--train: SFT steps (32 conversations each)")
    parser.add_argument("--dpo_steps", type=int, default=300, help="--train: DPO steps of each run")
    parser.add_argument("--batch_size", type=int, default=64, help="--train: pairs per DPO step")
    parser.add_argument("--beta", type=float, default=0.5, help="--train: dpo_beta")
    parser.add_argument("--nll_weights", type=lambda s: [float(w) for w in s.split(",")], default=[0.0, 0.5],
                        help="--train: one DPO run per dpo_nll_weight (a comma list)")
    parser.add_argument("--eval_interval", type=int, default=25, help="--train: DPO steps between evaluations")
    parser.add_argument("--chat_prompts", type=int, default=100, help="--train: prompts with unseen words")
    args = parser.parse_args(argv)
    if args.sft < 1 or args.pairs < 2:
        raise UsageError("--sft must be at least 1 and --pairs at least 2")
    out = Path(args.out).resolve()
    sft, pairs = write(out, args.sft, args.pairs, args.seed)
    print(f"wrote {sft} ({args.sft:,} conversations) and {pairs} ({args.pairs:,} pairs)")
    if args.train:
        train_and_compare(args, out)


if __name__ == "__main__":
    main()
