"""Training on a busy CPU: ms per step of the quick start (configs/shakespeare_cpu.py, a fixed number of steps)
with each thread setting, while 0, 1 and 2 busy neighbours run, and nanoGPT's train.py beside it.

    python benchmarks/train_threads.py                                       # ~30-60 min on 2 cores
    python benchmarks/train_threads.py --nanogpt ../shared/anchors/nanoGPT   # + nanoGPT's rows
    python benchmarks/train_threads.py --steps 4 --neighbours 0,1 --repeats 1 -- --n_layer=1   # a rehearsal

Settings (the rows; --settings picks them):
    torch    torch's default, one thread per core (what nanoGPT runs with): train.py --threads=N, N torch's
             own count (read from a fresh process)
    auto     train.py's default, --threads=0: the cores other processes leave free, measured at its start
             (runs.jsonl records the count it chose: shown beside the time)
    1        --threads=1
    passive  torch's default count with OMP_WAIT_POLICY=PASSIVE in the run's environment: GNU OpenMP's
             threads go to sleep as soon as they wait, instead of spinning first and taking the time of the
             process whose core they share (a setting read only when the OpenMP runtime starts, so it can only
             be given in the environment)
With --nanogpt PATH, nanoGPT's own train.py runs the same model (its config/train_shakespeare_char.py shrunk to
the quick start's shape: 4 layers, 4 heads, 128 wide, context 64, batch 12, no dropout, no bias; float32, no
compile) with each setting given the only way it takes one, the environment: torch (nothing set),
OMP_NUM_THREADS=N (auto: the count gptkit.threads.choose_threads gives just before the run, with the neighbours
busy; 1: one), OMP_WAIT_POLICY=PASSIVE. Its data is made by its own data/shakespeare_char/prepare.py from the
same text, in a work folder (nothing is written into PATH).

A neighbour is a plain spin loop, `while True: pass` in a Python process of its own: one core kept busy all
the time, the same load at every run. A second training run would be the more common neighbour, but its load
follows its own thread count and phases, and it competes for memory bandwidth too; the spin loop isolates
what the thread setting acts on (threads that wait for a core another process holds). The neighbours start a
second before each run (so that auto's measurement sees them) and are stopped after it.

Every cell runs --repeats times (3), in rounds whose order of programs and settings is rotated each round
(benchmarks/rounds.py); the table gives each cell's median with its range over the rounds and, with nanoGPT,
train.py's steps/s over nanoGPT's at each setting, taken round by round: median (range), "at parity" where
the two programs' ranges overlap. A run's ms/step is the median of the logged steps' times: train.py's metrics.jsonl (ms_per_step, every step logged;
its first step, compile and warm-up, is left out as train.py leaves it out of its rates), nanoGPT's
"iter N: ... time X ms" lines (iter 0, which holds its first evaluation, left out). Evaluations are reduced to
one batch and happen only at the start and the end, outside the timed steps. Extra arguments after `--` go
to every run of both programs (key=value settings both read, e.g. -- --n_layer=1 --n_embd=32).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: gptkit from this checkout

from benchmarks.rounds import DEFAULT_ROUNDS, cell, ratio_cell, rotation, verdict  # noqa: E402
from gptkit import cli  # noqa: E402
from gptkit.errors import UserError  # noqa: E402
from gptkit.threads import choose_threads, plural  # noqa: E402

SETTINGS = ("torch", "auto", "1", "passive")
CONFIG = "configs/shakespeare_cpu.py"
# nanoGPT's baby Shakespeare config, shrunk to the quick start's model, batch and optimizer (configs/shakespeare_cpu.py)
NANOGPT_SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, dropout=0.0, bias=False,
                     gradient_accumulation_steps=1, learning_rate=1e-3, beta2=0.99, min_lr=1e-4)
SPIN = "while True: pass"
NANOGPT_TIME = re.compile(r"^iter (\d+): loss [-\d.naif]+, time ([\d.]+)ms", re.MULTILINE)


class BenchError(UserError):
    """A setting the benchmark does not know, or a run that failed (its log's last lines say why)."""


def child_env(setting: str, chosen: int | None = None) -> dict:
    """The environment of one run: this one's without OMP_NUM_THREADS (torch's default is the point of the
    'torch' rows), plus what the setting puts there (nanoGPT's only way to take a setting)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["PYTHONUNBUFFERED"] = "1"
    if setting == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if chosen is not None:
        env["OMP_NUM_THREADS"] = str(chosen)
    return env


def train_py_threads(setting: str, torch_threads: int | None) -> int:
    """train.py's --threads for a setting: torch's count for torch and passive, 0 (auto), or the number."""
    if setting == "auto":
        return 0
    return torch_threads if setting in ("torch", "passive") else int(setting)


def run_logged(cmd: list[str], cwd: Path, env: dict, log: Path) -> str:
    """Run a command with its output in `log`; return the output, or raise with its last lines."""
    with open(log, "w") as f:
        res = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    if res.returncode:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise BenchError(f"{' '.join(cmd[:3])} ... failed (exit {res.returncode}; log {log}): {tail}")
    return text


def ours(setting: str, steps: int, work: Path, name: str, torch_threads: int | None, extra: list[str]) -> dict:
    """One train.py run of the quick start: its median ms/step and the thread count it ran with."""
    out = work / name
    cmd = [sys.executable, "train.py", CONFIG, f"--out_dir={out}", "--overwrite=True", f"--max_iters={steps}",
           "--warmup_iters=0", "--log_interval=1", "--eval_iters=1", f"--eval_interval={steps}",
           f"--data_root={work / 'data'}", f"--threads={train_py_threads(setting, torch_threads)}", *extra]
    run_logged(cmd, REPO, child_env(setting), work / f"{name}.log")
    times = [m["ms_per_step"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if m.get("ms_per_step") is not None]
    threads = json.loads((out / "runs.jsonl").read_text().splitlines()[-1])["threads"]["n"]
    return {"ms": statistics.median(times) if times else None, "threads": threads}


def nanogpt(setting: str, steps: int, work: Path, name: str, torch_threads: int | None, extra: list[str]) -> dict:
    """One run of nanoGPT's train.py (copied with its model into work/nanogpt/) on the same model."""
    if setting == "auto":  # measured now, with the neighbours busy, as train.py measures at its start
        chosen = choose_threads()[0]
    else:
        chosen = None if setting in ("torch", "passive") else int(setting)
    shape = [f"--{k}={v}" for k, v in NANOGPT_SHAPE.items()]
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *shape, f"--out_dir={work / name}",
           "--device=cpu", "--compile=False", "--dtype=float32", f"--max_iters={steps}", f"--lr_decay_iters={steps}",
           "--warmup_iters=0", "--log_interval=1", "--eval_iters=1", f"--eval_interval={steps + 1}", *extra]
    text = run_logged(cmd, work / "nanogpt", child_env(setting, chosen), work / f"{name}.log")
    times = [float(ms) for it, ms in NANOGPT_TIME.findall(text) if int(it) > 0]
    return {"ms": statistics.median(times) if times else None, "threads": chosen or torch_threads}


def prepare(work: Path, text: Path | None, nanogpt_path: Path | None) -> None:
    """The character-level Shakespeare dataset for train.py (prepare/shakespeare_char.py, from `text` or
    downloaded) and, with nanoGPT, a copy of its scripts and its own preparation of the same text."""
    data = work / "data" / "shakespeare_char"
    cmd = [sys.executable, "prepare/shakespeare_char.py", f"--out_dir={data}", *([f"--input={text}"] if text else [])]
    run_logged(cmd, REPO, dict(os.environ), work / "prepare.log")
    if nanogpt_path is None:
        return
    text = text or data / "input.txt"  # (downloaded there by the prepare script)
    folder = work / "nanogpt"
    (folder / "data" / "shakespeare_char").mkdir(parents=True, exist_ok=True)
    (folder / "config").mkdir(exist_ok=True)
    for name in ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py"):
        if not (nanogpt_path / name).is_file():
            raise BenchError(f"--nanogpt {nanogpt_path}: no {name} there; give the folder of nanoGPT's checkout")
        shutil.copy(nanogpt_path / name, folder / name)
    shutil.copy(text, folder / "data" / "shakespeare_char" / "input.txt")
    run_logged([sys.executable, "data/shakespeare_char/prepare.py"], folder, dict(os.environ), work / "nanogpt-prepare.log")


def torch_default_threads() -> int:
    """torch's own thread count in a fresh process without OMP_NUM_THREADS: one per core."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@contextlib.contextmanager
def neighbours_busy(n: int):
    """n spin loops keeping n cores busy inside the block (started a second before it, stopped after it, each
    by its own process)."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        if spinners:
            time.sleep(1.0)
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def table(results: dict, neighbours: list[int], rows: list[tuple[str, str]]) -> str:
    """Markdown: a row per (program, setting), a column per neighbour count; ms/step, the median of the
    repeats with their range (and the threads). With nanoGPT's rows, a line per setting and neighbour count
    with train.py's speed against nanoGPT's (its ms/step over ours), per repeat: median (range) and the verdict."""
    head = "| program | setting | " + " | ".join(f"{n} busy: ms/step (threads)" for n in neighbours) + " |"
    lines = [head, "|---|---|" + "--:|" * len(neighbours)]
    for program, setting in rows:
        cells = []
        for n in neighbours:
            runs = results.get((program, setting, n), [])
            ms = [r["ms"] for r in runs if r["ms"] is not None]
            threads = sorted({r["threads"] for r in runs})
            cells.append(f"{cell(ms, 1)} ({'/'.join(map(str, threads))})" if ms else "n/a")
        lines.append(f"| {program} | {setting} | " + " | ".join(cells) + " |")
    versus = [f"train.py {setting}, {n} busy: {ratio_cell(ours, theirs, word=False)} nanoGPT's steps/s, "
              f"{verdict(ours, theirs)}"
              for setting in dict.fromkeys(s for _, s in rows) for n in neighbours
              for ours, theirs in [speed_pair(results, setting, n)] if ours]
    return "\n".join(lines + ([""] + versus if versus else []))


def speed_pair(results: dict, setting: str, n: int) -> tuple[list[float], list[float]]:
    """train.py's and nanoGPT's steps/s at one setting and neighbour count, repeat by repeat (both ran in each
    repeat), or ([], []) where either is missing."""
    ours = [r["ms"] for r in results.get(("train.py", setting, n), [])]
    theirs = [r["ms"] for r in results.get(("nanoGPT", setting, n), [])]
    pairs = [(a, b) for a, b in zip(ours, theirs) if a and b]
    return [1000 / a for a, _ in pairs], [1000 / b for _, b in pairs]


@cli.entry_point()
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = cli.ArgumentParser(prog="benchmarks/train_threads.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50, help="training steps per run (each logged)")
    p.add_argument("--neighbours", default="0,1,2", help="comma-separated numbers of busy neighbours (spin loops)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated: {', '.join(SETTINGS)} or a "
                                                                  "thread count")
    p.add_argument("--nanogpt", default="", help="nanoGPT's checkout (e.g. ../shared/anchors/nanoGPT): its rows too")
    p.add_argument("--text", default="", help="tiny Shakespeare's text (default: ../shared/data/tinyshakespeare.txt "
                                              "where present, else downloaded)")
    p.add_argument("--repeats", type=int, default=DEFAULT_ROUNDS, help="rounds: runs of each cell, interleaved (the "
                   "programs' and settings' order rotated each round); the median and range are shown")
    p.add_argument("--out", default="", help="work folder (default: a new temporary folder)")
    p.add_argument("--json", default="", help="also write every run's figures to this file")
    args = p.parse_args(own)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS and not (s.isdigit() and int(s) > 0)]
    if bad or not settings:
        raise BenchError(f"--settings {args.settings!r}: use {', '.join(SETTINGS)} or positive thread counts")
    try:
        neighbours = [int(n) for n in args.neighbours.split(",")]
    except ValueError:
        raise BenchError(f"--neighbours {args.neighbours!r}: comma-separated counts, e.g. 0,1,2") from None
    if min(neighbours) < 0 or args.steps < 3 or args.repeats < 1:
        raise BenchError("--neighbours must be >= 0, --steps >= 3 and --repeats >= 1")
    shared_text = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
    text = Path(args.text) if args.text else (shared_text if shared_text.is_file() else None)
    nanogpt_path = Path(args.nanogpt).resolve() if args.nanogpt else None
    work = Path(args.out or tempfile.mkdtemp(prefix="train_threads-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    prepare(work, text, nanogpt_path)
    # torch's own count (a fresh process importing torch: a second or two) only where a row runs with it
    torch_threads = torch_default_threads() if {"torch", "passive"} & set(settings) else None
    default = f"torch's default {torch_threads} threads, " if torch_threads else ""
    print(f"train_threads: {os.cpu_count()} CPUs, {default}{args.steps} steps a run; "
          f"work folder {work}", flush=True)
    programs = [("train.py", ours)] + ([("nanoGPT", nanogpt)] if nanogpt_path else [])
    rows = [(program, setting) for program, _ in programs for setting in settings]
    results: dict[tuple[str, str, int], list[dict]] = {}
    cells = [(pr, s) for pr in programs for s in settings]
    for r in range(args.repeats):
        for n in neighbours:
            for (program, run), setting in rotation(cells, r):  # the order rotated each round
                name = f"{program.replace('.py', '')}-{setting}-{n}busy-{r}"
                with neighbours_busy(n):
                    figure = run(setting, args.steps, work, name, torch_threads, extra)
                results.setdefault((program, setting, n), []).append(figure)
                print(f"  {program} {setting}, {n} busy: {figure['ms'] or float('nan'):,.1f} ms/step "
                      f"({plural(figure['threads'])})", flush=True)
    print(table(results, neighbours, rows))
    if args.json:
        Path(args.json).write_text(json.dumps([{"program": k[0], "setting": k[1], "neighbours": k[2], "runs": v}
                                               for k, v in results.items()], indent=2) + "\n")
    return {f"{k[0]} {k[1]} {k[2]}": v for k, v in results.items()}


if __name__ == "__main__":
    main()
