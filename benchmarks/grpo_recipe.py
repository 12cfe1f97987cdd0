"""The README's GRPO recipe, run as written and measured: worked additions written and prepared, the SFT stage
(configs/arithmetic_sft.py) at one or more lengths, the held-out greedy accuracy of each (eval.py --task
checker), then GRPO (configs/grpo_arithmetic.py) from the SFT checkpoint whose accuracy is closest to 40%,
with several seeds side by side; a table of the held-out accuracy by step (each run's val_reward).

    python -m benchmarks.grpo_recipe                                      # the configs as they are
    python -m benchmarks.grpo_recipe --seeds 3 --threads 1                # BENCHMARKS.md's table
    python -m benchmarks.grpo_recipe --sft_iters 1500,3000 --seeds 3      # SFT lengths, each run whole
    python -m benchmarks.grpo_recipe --problems 2000 --sft_iters 20 --grpo_iters 4 --tiny   # seconds
    python -m benchmarks.grpo_recipe --sft_from out-grpo-recipe/sft-config --grpo_set="--learning_rate=3e-4"
                                                                          # GRPO only, a setting changed

Every stage is the command a user types (train.py, eval.py, prepare/text.py) in a process of its own, with the
settings that change given on its command line (--out_dir, --max_iters, --threads, and with --tiny a tiny
model; --sft_set and --grpo_set add settings of one's own to a stage, to try a change before it goes into the
configs); the seeds' GRPO runs run --jobs at a time, each with --threads threads. Everything goes under --work.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gptkit import cli

REPO = Path(__file__).resolve().parents[1]
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--eval_iters=2"]


def parse(argv):
    p = cli.ArgumentParser(prog="python -m benchmarks.grpo_recipe", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="out-grpo-recipe")
    p.add_argument("--problems", type=int, default=100_000, help="worked problems for the SFT stage")
    p.add_argument("--sft_iters", default="", help="comma list of SFT lengths ('' = the config's)")
    p.add_argument("--grpo_iters", type=int, default=0, help="GRPO steps, its schedule ending there (0 = the config's)")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--eval_prompts", type=int, default=0, help="held-out prompts (0 = the config's)")
    p.add_argument("--tiny", action="store_true", help="a tiny model: a check that the recipe runs")
    p.add_argument("--task", default="", help="the task file ('' = the GRPO config's grpo_task)")
    p.add_argument("--sft_from", default="", help="an SFT run of this benchmark to start GRPO from (skips "
                                                   "the SFT stage; its dataset is the one in data/ beside it)")
    p.add_argument("--sft_set", default="", help="extra train.py settings for the SFT stage, space-separated")
    p.add_argument("--grpo_set", default="", help="extra train.py settings for the GRPO stage, space-separated")
    p.add_argument("--jobs", type=int, default=1, help="GRPO seeds run at once (1: one after another, for a "
                                                       "shared machine)")
    return p.parse_args(argv)


def run(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)


def wait(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    for proc, log in procs:
        if proc.wait():
            raise cli.UserError(f"{' '.join(map(str, proc.args[1:3]))} failed: see {log}")


def accuracy(ckpt: Path, work: Path, args) -> float:
    log = work / f"eval-{ckpt.name}.log"
    wait([(run(["eval.py", f"--ckpt={ckpt}", "--task=checker", f"--device={args.device}",
                *([f"--checker_task={args.task}"] if args.task else []),
                f"--threads={args.threads}", *([f"--limit={args.eval_prompts}"] if args.eval_prompts else [])],
               log), log)])
    return json.loads(log.read_text().strip().splitlines()[-1])["accuracy"]


@cli.entry_point()
def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    text, data = work / "arithmetic.txt", work / "data"
    if args.sft_from:  # (a run of this benchmark: its dataset beside it)
        data = Path(args.sft_from).resolve().parent / "data"
    task = [f"--grpo_task={args.task}"] if args.task else []
    if not args.sft_from:
        wait([(run([args.task or "tasks/arithmetic.py", str(args.problems), str(text)], work / "write.log"),
               work / "write.log")])
        wait([(run(["prepare/text.py", f"--input={text}", "--name=arithmetic", "--tokenizer=char",
                    f"--data_root={data}", "--overwrite=True"], work / "prepare.log"), work / "prepare.log")])
    common = [f"--dataset={data / 'arithmetic'}", f"--device={args.device}", f"--threads={args.threads}",
              "--overwrite=True"]
    tiny = TINY if args.tiny else []
    lengths = [int(x) for x in args.sft_iters.split(",") if x] or [None]
    sft = {}
    procs = []
    for n in [] if args.sft_from else lengths:
        out = work / f"sft-{n or 'config'}"
        over = [f"--max_iters={n}", f"--lr_decay_iters={n}", f"--eval_interval={n}"] if n else []
        procs.append((run(["train.py", "configs/arithmetic_sft.py", f"--out_dir={out}", *common, *tiny, *over,
                           *args.sft_set.split()], work / f"{out.name}.log"), work / f"{out.name}.log"))
        sft[n] = out
    wait(procs)
    if args.sft_from:
        sft = {None: Path(args.sft_from).resolve()}
    sft_acc = {n: accuracy(out, work, args) for n, out in sft.items()}
    start = min(sft_acc, key=lambda n: abs(sft_acc[n] - 0.4))
    sft_seconds = time.perf_counter() - began
    procs, grpo = [], []
    for seed in range(args.seeds):
        out = work / f"grpo-seed{seed}"
        over = [f"--max_iters={args.grpo_iters}", f"--lr_decay_iters={args.grpo_iters}"] if args.grpo_iters else []
        if args.eval_prompts:
            over.append(f"--grpo_eval_prompts={args.eval_prompts}")
        procs.append((run(["train.py", "configs/grpo_arithmetic.py", f"--init_from={sft[start]}", f"--out_dir={out}",
                           f"--seed={seed}", *common, *task, *over, *(["--eval_iters=2"] if args.tiny else []),
                           *args.grpo_set.split()], work / f"{out.name}.log"), work / f"{out.name}.log"))
        grpo.append(out)
        if len(procs) >= args.jobs:
            wait(procs)
            procs = []
    wait(procs)
    curves = []
    for out in grpo:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        curves.append({r["step"]: r["val_reward"] for r in rows if "val_reward" in r})
    seconds = time.perf_counter() - began
    print(f"GRPO recipe on {args.device}, {args.threads} thread(s) a run; SFT on {args.problems:,} problems: "
          + ", ".join(f"{n or 'config'} steps -> {a:.1%}" for n, a in sft_acc.items())
          + f" held-out; GRPO from the {start or 'config'}-step model, {args.seeds} seed(s); "
          f"{sft_seconds:.0f} s to the SFT models, {seconds:.0f} s in all")
    spread = args.seeds > 1  # the seeds' median and range beside them
    print("| step | " + " | ".join(f"seed {s}" for s in range(args.seeds)) + (" | median (range)" if spread else "")
          + " |")
    print("|---|" + "---|" * (args.seeds + spread))
    for step in sorted(curves[0]):
        values = [c.get(step, float("nan")) for c in curves]
        row = [f"{v:.1%}" for v in values]
        if spread:
            row.append(f"{statistics.median(values):.1%} ({min(values):.1%}-{max(values):.1%})")
        print(f"| {step} | " + " | ".join(row) + " |")
    return {"sft": sft_acc, "start": start, "curves": curves, "seconds": seconds}


if __name__ == "__main__":
    main()
