"""Time to a validation loss, side by side: GPT-2's recipe (configs/shakespeare_cpu.py) and the modern recipe
(configs/shakespeare_cpu_modern.py), run one after the other on the same machine, each from a fresh out_dir.

    python benchmarks/time_to_loss.py                        # 3 interleaved rounds: ~15 minutes on 2 CPU cores
    python benchmarks/time_to_loss.py --repeats=1            # one run of each: ~5 minutes
    python benchmarks/time_to_loss.py --read OUT_DIR ...     # only the table, from runs already made

Each run's metrics.jsonl gives val loss against
    wall s   elapsed_s of the evaluation's line: seconds since training began, evaluations included;
    train s  the training steps alone: the sum of the logged ms/step over the steps before that evaluation.
For each target it reports the first evaluation at or below it (so the figure is rounded up to the next
evaluation), and the modern run's time as a fraction of the first config's whole run. The configs run in
--repeats rounds (3), the order rotated each round (benchmarks/rounds.py); the table's figures are the rounds'
medians, and below it each config's time to each target as a share of the first config's whole run, taken
round by round (a slow round slows both): median (range). Extra arguments after `--` go to both train.py runs
(e.g. -- --max_iters=500).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: gptkit from this checkout

from benchmarks.rounds import DEFAULT_ROUNDS, interleave, ratio_cell  # noqa: E402
from gptkit import cli  # noqa: E402

CONFIGS = ("configs/shakespeare_cpu.py", "configs/shakespeare_cpu_modern.py")


def read_run(out_dir: Path) -> dict:
    """The evaluations of a run as (step, val_loss, wall_s, train_s) rows, from its metrics.jsonl."""
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    evals, train_s, last_step = [], 0.0, 0
    for entry in lines:
        if "val_loss" in entry:
            evals.append((entry["step"], entry["val_loss"], entry["elapsed_s"], train_s))
        elif entry.get("ms_per_step") is not None:  # (the first line may have no rate: warm-up only)
            train_s += entry["ms_per_step"] / 1000 * (entry["step"] - last_step)
            last_step = entry["step"]
        elif "loss" in entry:
            last_step = entry["step"]
    return {"name": out_dir.name, "evals": evals}


def time_to(run: dict, target: float) -> tuple[int, float, float] | None:
    """(step, wall s, train s) of the first evaluation at or below target, or None."""
    return next(((s, w, t) for s, v, w, t in run["evals"] if v <= target), None)


def summarise(runs: list[dict], targets: list[float]) -> dict:
    """Medians over the repeats of one config: final val loss, wall and train seconds, time to each target."""
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = {"final_val": med([r["evals"][-1][1] for r in runs]), "wall": med([r["evals"][-1][2] for r in runs]),
           "train": med([r["evals"][-1][3] for r in runs]), "process": med([r.get("process_s") for r in runs]),
           "reached": {}}
    for target in targets:
        hits = [time_to(r, target) for r in runs]
        hit = [h for h in hits if h is not None]
        out["reached"][target] = None if len(hit) < len(runs) else tuple(med([h[i] for h in hit]) for i in range(3))
    return out


def table(names: list[str], summaries: list[dict], targets: list[float], repeats: int) -> str:
    base = summaries[0]
    head = "| config | final val | wall s | train s | " + " | ".join(
        f"val <= {t:.2f}: step, wall s, train s" for t in targets) + " |"
    lines = [head, "|" + "---|" * (4 + len(targets))]
    for name, s in zip(names, summaries):
        cells = []
        for t in targets:
            hit = s["reached"][t]
            cells.append("not reached" if hit is None else
                         f"{hit[0]:.0f}, {hit[1]:.0f} ({hit[1] / base['wall']:.0%}), {hit[2]:.0f} "
                         f"({hit[2] / base['train']:.0%})")
        lines.append(f"| {name} | {s['final_val']:.3f} | {s['wall']:.0f} | {s['train']:.0f} | " + " | ".join(cells)
                     + " |")
    note = (f"medians of {repeats} interleaved runs; " if repeats > 1 else "") + (
        f"percentages: of {names[0]}'s whole run (wall s / train s)")
    return "\n".join(lines) + f"\n({note})"


def shares(base: list[dict], other: list[dict], target: float) -> list[float] | None:
    """Round by round: other's wall s to reach target over base's whole run's wall s (None where a round of
    other never reached it)."""
    out = []
    for b, o in zip(base, other):
        hit = time_to(o, target)
        if hit is None:
            return None
        out.append(hit[1] / b["evals"][-1][2])
    return out


def shares_lines(names: list[str], runs: list[list[dict]], targets: list[float]) -> tuple[list[str], dict]:
    """The lines under the table: each config's time to each target, as a share of the first config's whole
    run, per round: median (range); and the rounds' shares by (config name, target)."""
    lines, out = [], {}
    for name, other in zip(names[1:], runs[1:]):
        for t in targets:
            rounds = shares(runs[0], other, t)
            out[(name, t)] = rounds
            lines.append(f"{name}: val <= {t:.2f} not reached in every round" if rounds is None else
                         f"{name}: val <= {t:.2f} in {ratio_cell(rounds, [1.0] * len(rounds), word=False)} of "
                         f"{names[0]}'s whole run (wall s)")
    return lines, out


def run_config(config: str, out_dir: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "train.py", config, f"--out_dir={out_dir}", "--overwrite=True", *extra]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(out_dir.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    run = read_run(out_dir)
    run["process_s"] = time.perf_counter() - t0
    s, v, w, _ = run["evals"][-1]
    print(f"  step {s}: val {v:.4f} after {w:.0f} s of training ({run['process_s']:.0f} s with start-up)", flush=True)
    return run


@cli.entry_point()
def main(argv: list[str] | None = None) -> dict:
    """Prints the table; returns the rounds' shares by (config name, target), as shares_lines gives them."""
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated config files; the first is the "
                                                                 "baseline the others are compared with")
    p.add_argument("--targets", default="1.80,1.65", help="comma-separated val losses")
    p.add_argument("--repeats", type=int, default=DEFAULT_ROUNDS, help="rounds: runs of each config, "
                   "interleaved (the order rotated each round)")
    p.add_argument("--out", default=None, help="folder for the runs (default: a new temporary folder)")
    p.add_argument("--json", default="", help="also write the rounds' shares (config, target, rounds) to this "
                   "file (benchmarks/reproduce.py reads it)")
    p.add_argument("--read", nargs="+", default=None, metavar="OUT_DIR",
                   help="no runs: the table from these out_dirs, one per config, in --configs order")
    args = p.parse_args(own)
    configs = args.configs.split(",")
    targets = [float(t) for t in args.targets.split(",")]
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.read:
        names = [Path(d).name for d in args.read]
        runs = [[read_run(Path(d))] for d in args.read]
        print(table(names, [summarise(r, targets) for r in runs], targets, 1))
        lines, out = shares_lines(names, runs, targets)
        print("\n".join(lines))
        return out
    root = Path(args.out or tempfile.mkdtemp(prefix="time_to_loss-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: list[list[dict]] = [[] for _ in configs]
    for r, i in interleave(range(len(configs)), args.repeats):  # the order rotated each round
        runs[i].append(run_config(configs[i], root / f"{Path(configs[i]).stem}-{r}", extra))
    names = [Path(c).name for c in configs]
    print(table(names, [summarise(r, targets) for r in runs], targets, args.repeats))
    lines, out = shares_lines(names, runs, targets)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps([{"config": name, "target": t, "rounds": rounds}
                                               for (name, t), rounds in out.items()], indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
