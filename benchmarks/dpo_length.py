"""A synthetic preference task where length alone decides, to see what each preference loss learns from it:
the summed ones (DPO's sigmoid, hinge, robust, IPO) against the length-normalised ones (IPO per token, SimPO,
ORPO).

    python -m benchmarks.dpo_length --out bench-dpo-length/           # sft.jsonl, shorter.jsonl, longer.jsonl
    python -m benchmarks.dpo_length --out bench-dpo-length/ --train   # and SFT -> each loss on each -> the table

The user lists five made-up words of three letters and asks for the first few ("first few: kab tep zor mul
ris"); the first one, two, ... or all five of them are each a right reply ("kab tep"). In sft.jsonl
(conversations, prepare/chat.py) the number of words is drawn from 1 to 5, 3 most often (SFT_COUNTS), so a
model fine-tuned on them answers with replies of every length and its greedy replies stop in the middle. Each
pair holds two right replies to its prompt, a shorter and a longer one (two distinct word counts from 1 to 5,
uniformly; the shorter is the start of the longer): shorter.jsonl prefers the shorter reply of each pair,
longer.jsonl the longer one, the same pairs flipped. Nothing but the length tells the chosen reply from the
rejected one: both are right, their words random letters (a rule blind to the prompt and to length, such as
the earlier last letter or the more vowels per letter, scores about 50%: tests/test_dpo_length.py), and
every prompt is new.

--train runs the project's commands, each in its own process (benchmarks/preference_recipe.py; all under
--out): one chat model from scratch on the conversations (--sft_steps), the pairs in its tokens
(prepare/preference.py, a tenth held out), then for each variant and each loss of --losses a DPO run from the
chat model (train.py --objective=dpo --dpo_loss=...: TRL's default beta 0.1 unless --beta, SimPO's gamma 0.5,
no NLL anchor unless --nll_weight; robust with --robust_smoothing, since at 0 it is the sigmoid loss). Each
model, then:

- on the val pairs (`pair_scores`): "summed" and "per token", the share ordered right by DPO's implicit
  reward against the chat model, its log-probabilities summed over each reply or averaged over its tokens;
  "likelier", the share whose chosen reply the model alone finds likelier; "chosen" and "rejected", its mean
  log-probabilities of the replies (nats, summed over each);
- its greedy replies (the chat template and the serving engine, as chat.py decodes) to --chat_prompts prompts
  never seen: "length", their mean length in tokens (characters), "words", their mean word count, "right",
  the share that are right answers, and "run-on", the share cut off at --max_new_tokens without ending.

With several --seeds (each its own words, chat model and pairs), a cell is the median and the range.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

from benchmarks.preference_recipe import (
    dpo_run,
    greedy_replies,
    made_up_words,
    prepare_pairs,
    train_chat_model,
)
from gptkit import cli
from gptkit.checkpoint import load_model
from gptkit.data.pairs import ValPairs
from gptkit.data.prepare.pipeline import ValRule
from gptkit.errors import UsageError
from gptkit.objectives.preference_losses import policy_logps

N_WORDS = 5  # words in a prompt: a reply has 1 to N_WORDS of them
ASK = "first few: "
LOSSES = ("sigmoid", "hinge", "robust", "ipo", "ipo_per_token", "simpo", "orpo")
VARIANTS = ("shorter", "longer")  # which reply of each pair is chosen
# How often the SFT replies have 1, 2, ... N_WORDS words: every count, the middle one most often, so that the
# chat model's greedy replies stop in the middle (after 3 words the stop is likelier than going on: 4 / 7),
# with room to grow shorter and longer
SFT_COUNTS = (1, 2, 4, 2, 1)


def prompt_words(rng: random.Random) -> list[str]:
    """N_WORDS distinct made-up words of three letters, in random order. Every prompt is as long, so a reply's
    k-th character is the prompt's at one fixed distance: a copy the 2-layer chat model learns in a few hundred
    steps (with words of 2 or 3 letters it had not begun to copy after 600)."""
    words = made_up_words(N_WORDS, rng, lo=3, hi=3)
    rng.shuffle(words)
    return words


def prompt(words: list[str]) -> str:
    return ASK + " ".join(words)


def reply(words: list[str], count: int) -> str:
    """The prompt's first `count` words."""
    return " ".join(words[:count])


def is_right(prompt_text: str, reply_text: str) -> bool:
    """Whether the reply answers the prompt: its first words, one to all of them, separated by single spaces."""
    words = prompt_text.removeprefix(ASK).split(" ")
    return any(reply_text == reply(words, count) for count in range(1, len(words) + 1))


def sft_conversation(rng: random.Random) -> dict:
    """A prompt and a right reply of 1 to N_WORDS words, the count drawn by SFT_COUNTS."""
    words = prompt_words(rng)
    count = rng.choices(range(1, N_WORDS + 1), weights=SFT_COUNTS)[0]
    return {"messages": [{"role": "user", "content": prompt(words)},
                         {"role": "assistant", "content": reply(words, count)}]}


def length_pair(rng: random.Random) -> tuple[str, str, str]:
    """(prompt, shorter, longer): two right replies, their word counts two distinct draws from 1 to N_WORDS
    (the shorter is the start of the longer)."""
    words = prompt_words(rng)
    few, many = sorted(rng.sample(range(1, N_WORDS + 1), 2))
    return prompt(words), reply(words, few), reply(words, many)


def write(out: Path, n_sft: int, n_pairs: int, seed: int) -> dict[str, Path]:
    """sft.jsonl (n_sft conversations) and the n_pairs pairs twice, the shorter reply chosen (shorter.jsonl)
    and the longer (longer.jsonl), in out."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    files = {"sft": out / "sft.jsonl", **{v: out / f"{v}.jsonl" for v in VARIANTS}}
    files["sft"].write_text("".join(json.dumps(sft_conversation(rng)) + "\n" for _ in range(n_sft)))
    pairs = [length_pair(rng) for _ in range(n_pairs)]
    for variant in VARIANTS:
        rows = [{"prompt": p, "chosen": s, "rejected": lg} if variant == "shorter" else
                {"prompt": p, "chosen": lg, "rejected": s} for p, s, lg in pairs]
        files[variant].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


def unseen_prompts(out: Path, n: int, seed: int) -> list[str]:
    """n prompts that neither the conversations nor the pairs hold."""
    seen = {json.loads(line)["messages"][0]["content"] for line in (out / "sft.jsonl").read_text().splitlines()}
    seen |= {json.loads(line)["prompt"] for line in (out / "shorter.jsonl").read_text().splitlines()}
    rng = random.Random(seed + 1)
    prompts: list[str] = []
    while len(prompts) < n:
        if (p := prompt(prompt_words(rng))) not in seen:
            prompts.append(p)
            seen.add(p)
    return prompts


# --train

BLOCK = 64  # a prompt (at most 34 tokens with the template's) and a reply of up to 28 (the longest right one: 19)


def greedy_lengths(ckpt: Path, prompts: list[str], max_new_tokens: int) -> dict[str, float]:
    """The greedy replies' mean length in tokens (the char tokenizer: characters), mean word count, the share
    that are right answers, and the share cut off at max_new_tokens."""
    replies = greedy_replies(ckpt, prompts, max_new_tokens)
    n = len(replies)
    return {"length": sum(len(r) for r in replies) / n, "words": sum(len(r.split()) for r in replies) / n,
            "right": sum(is_right(p, r) for p, r in zip(prompts, replies)) / n,
            "run-on": sum(len(r) >= max_new_tokens for r in replies) / n}


@torch.no_grad()
def pair_scores(ckpt: Path, sft: Path, data: Path) -> dict[str, float]:
    """How the model orders the val pairs, three ways: "summed" and "per token", the share of the decided
    pairs whose chosen reply's log-probability rose more (fell less) than the rejected one's from the chat
    model's, summed over the reply's tokens (DPO's implicit reward: sigmoid, hinge, robust, ipo) or averaged
    over them (ipo_per_token's); "likelier", the share whose chosen reply the model alone finds likelier (what
    it would rather say). And the model's mean log-probabilities of the chosen and the rejected replies (nats,
    summed over each reply). NaN where every pair ties (the chat model against itself)."""
    model, ref = load_model(str(ckpt))[0], load_model(str(sft))[0]
    wins = {"summed": 0, "per token": 0, "likelier": 0}
    ties = dict.fromkeys(wins, 0)
    chosen = rejected = n = 0.0
    for batch in ValPairs(data, "val", batch_size=64, block_size=BLOCK):
        B = len(batch)
        pi, rho = policy_logps(model, batch), policy_logps(ref, batch)
        tokens = (batch.y != -1).sum(-1)
        margins = {"summed": (pi - rho)[:B] - (pi - rho)[B:],
                   "per token": ((pi - rho) / tokens)[:B] - ((pi - rho) / tokens)[B:],
                   "likelier": pi[:B] - pi[B:]}
        for name, margin in margins.items():
            wins[name] += int((margin > 0).sum())
            ties[name] += int((margin == 0).sum())
        chosen, rejected, n = chosen + float(pi[:B].sum()), rejected + float(pi[B:].sum()), n + B
    return {**{name: wins[name] / (n - ties[name]) if n > ties[name] else float("nan") for name in wins},
            "chosen": chosen / n, "rejected": rejected / n}


def run_seed(args, seed: int, out: Path) -> dict[tuple[str, str], dict[str, float]]:
    """The chat model and every (variant, loss) run of one seed: each model's figures, the chat model's under
    (variant, "SFT"), and the val pairs' mean reply lengths under (variant, "pairs")."""
    files = write(out, args.sft, args.pairs, seed)
    data = out / "data"
    threads = [f"--threads={args.threads}"]
    sft = train_chat_model(files["sft"], data, out, block=BLOCK, steps=args.sft_steps, extra=tuple(threads))
    prompts = unseen_prompts(out, args.chat_prompts, seed)
    before = greedy_lengths(sft, prompts, args.max_new_tokens)
    figures = {}
    for variant in VARIANTS:
        pairs = prepare_pairs(files[variant], sft, data, variant, block=BLOCK)
        figures[variant, "SFT"] = {**pair_scores(sft, sft, pairs), **before}
        figures[variant, "pairs"] = val_lengths(files[variant])
        for loss in args.losses:
            anchor = 0 if loss == "orpo" else args.nll_weight  # orpo has its own NLL term
            settings = [f"--dpo_loss={loss}", f"--dpo_beta={args.beta}", f"--dpo_nll_weight={anchor}",
                        f"--learning_rate={args.learning_rate}", *threads]
            if loss == "robust":
                settings.append(f"--dpo_label_smoothing={args.robust_smoothing}")
            dpo = out / f"{variant}_{loss}"
            seconds, _ = dpo_run(sft, pairs, dpo, steps=args.dpo_steps, batch_size=args.batch_size,
                                 eval_interval=args.dpo_steps, settings=settings)
            figures[variant, loss] = {**pair_scores(dpo / "last.pt", sft, pairs),
                                      **greedy_lengths(dpo / "last.pt", prompts, args.max_new_tokens)}
            print(f"seed {seed}, {variant} preferred, {loss}: {args.dpo_steps} steps in {seconds:.0f} s", flush=True)
    return figures


def val_lengths(pairs_file: Path) -> dict[str, float]:
    """The val pairs' mean chosen and rejected reply lengths in characters (the val split's rows, as
    prepare/preference.py split them)."""
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    rule = ValRule.for_documents(0.1, len(rows))
    val = [r for i, r in enumerate(rows) if rule.split(i) == "val"]
    return {"chosen": sum(len(r["chosen"]) for r in val) / len(val),
            "rejected": sum(len(r["rejected"]) for r in val) / len(val), "n": len(val)}


COLUMNS = (("summed", "{:.1%}"), ("per token", "{:.1%}"), ("likelier", "{:.1%}"), ("chosen", "{:.2f}"), ("rejected", "{:.2f}"),
           ("length", "{:.1f}"), ("words", "{:.2f}"), ("right", "{:.0%}"), ("run-on", "{:.0%}"))


def cell(values: list[float], fmt: str) -> str:
    """One figure, or the median and the range of several (one per seed); "-" where there is none."""
    values = [v for v in values if v == v]  # NaN: not measured
    if not values:
        return "-"
    mid = fmt.format(statistics.median(values))
    return mid if len(values) == 1 else f"{mid} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def table(per_seed: list[dict[tuple[str, str], dict[str, float]]], losses: list[str]) -> str:
    """The results as one Markdown table per variant."""
    lines = []
    for variant in VARIANTS:
        pairs = [f[variant, "pairs"] for f in per_seed]
        lines.append(f"\n{variant} reply preferred: the {pairs[0]['n']} val pairs' chosen replies "
                     f"{cell([p['chosen'] for p in pairs], '{:.1f}')} tokens, rejected "
                     f"{cell([p['rejected'] for p in pairs], '{:.1f}')}\n")
        lines.append("| model | " + " | ".join(name for name, _ in COLUMNS) + " |")
        lines.append("|---|" + "--:|" * len(COLUMNS))
        for model in ("SFT", *losses):
            cells = [cell([f[variant, model][name] for f in per_seed], fmt) for name, fmt in COLUMNS]
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(prog="python -m benchmarks.dpo_length", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-dpo-length", help="folder for the files (and --train's runs)")
    parser.add_argument("--sft", type=int, default=20_000, help="SFT conversations")
    parser.add_argument("--pairs", type=int, default=4_000, help="preference pairs (train and val)")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                        help="a comma list: each seed its own files, chat model and runs (OUT/seedN with several)")
    parser.add_argument("--train", action="store_true", help="then SFT -> each loss on each variant, and the table")
    parser.add_argument("--losses", type=lambda s: s.split(","), default=list(LOSSES),
                        help=f"--train: a comma list of dpo_loss values (default all: {','.join(LOSSES)})")
    parser.add_argument("--sft_steps", type=int, default=600, help="--train: SFT steps (32 conversations each)")
    parser.add_argument("--dpo_steps", type=int, default=100, help="--train: DPO steps of each run")
    parser.add_argument("--batch_size", type=int, default=32, help="--train: pairs per DPO step")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="--train: the DPO runs' peak rate")
    parser.add_argument("--beta", type=float, default=0.1, help="--train: dpo_beta of every loss (TRL's default)")
    parser.add_argument("--nll_weight", type=float, default=0.0,
                        help="--train: dpo_nll_weight of every loss but orpo (which has its own NLL term)")
    parser.add_argument("--robust_smoothing", type=float, default=0.1,
                        help="--train: dpo_label_smoothing of the robust loss")
    parser.add_argument("--chat_prompts", type=int, default=100, help="--train: greedy replies to unseen prompts")
    parser.add_argument("--max_new_tokens", type=int, default=28, help="--train: a greedy reply's longest")
    parser.add_argument("--threads", type=int, default=1, help="--train: torch threads of every process")
    args = parser.parse_args(argv)
    if args.sft < 1 or args.pairs < 10:
        raise UsageError("--sft must be at least 1 and --pairs at least 10 (a tenth are held out)")
    unknown = [loss for loss in args.losses if loss not in LOSSES]
    if unknown:
        raise UsageError(f"--losses: unknown {', '.join(unknown)}; choose among {', '.join(LOSSES)}")
    root = Path(args.out).resolve()
    outs = {seed: root / f"seed{seed}" if len(args.seeds) > 1 else root for seed in args.seeds}
    if not args.train:
        for seed, out in outs.items():
            files = write(out, args.sft, args.pairs, seed)
            print(f"wrote {', '.join(str(p) for p in files.values())} ({args.sft:,} conversations, "
                  f"{args.pairs:,} pairs)")
        return
    torch.set_num_threads(args.threads)
    per_seed = [run_seed(args, seed, out) for seed, out in outs.items()]
    seeds = ", ".join(str(s) for s in args.seeds)
    print(f"\nseed{'s' if len(args.seeds) > 1 else ''} {seeds}: each model on the val pairs and its greedy replies "
          f"to {args.chat_prompts} unseen prompts (a cell with several seeds: median (range)); each DPO run "
          f"{args.dpo_steps} steps of {args.batch_size} pairs at learning rate {args.learning_rate:g}, beta "
          f"{args.beta:g}, nll_weight {args.nll_weight:g}")
    print(table(per_seed, args.losses), flush=True)


if __name__ == "__main__":
    main()
