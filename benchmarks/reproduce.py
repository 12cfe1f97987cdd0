"""The README's headline comparisons, rerun on this machine: quoted against measured, each with its range, and a
quoted figure outside the measured range flagged.

    python benchmarks/reproduce.py --quick        # ~15 minutes on 2 cores (2 rounds, shorter cells)
    python benchmarks/reproduce.py                # the full run: 3 rounds, every cell >= 10 s (~40 minutes)
    python benchmarks/reproduce.py --parts serve --llama_server build/llama-native/bin/llama-server
    python benchmarks/reproduce.py --nanogpt ../shared/anchors/nanoGPT

The comparisons (--parts picks some) and what each needs:
    decode  CPU decode, GPT-2 small's shape, batch 1: --quantize=float32 and int8 against llama.cpp's f32 and
            q8_0 (benchmarks/cpu_decode.py; llama.cpp through llama-cpp-python: pip install -e ".[llama]")
    serve   serve.py (int8) against llama-server (q8_0), 64 slots each, 1 / 4 / 16 / 64 streaming clients
            (benchmarks/serve_load.py; llama-server built by `bash benchmarks/llama_server.sh`)
    train   the quick start's ms/step, train.py against nanoGPT's train.py, torch's default threads, an idle
            machine (benchmarks/train_threads.py; nanoGPT's checkout: ../shared/anchors/nanoGPT or --nanogpt)
    loss    the modern recipe's time to GPT-2's recipe's val losses, 1.80 and 1.65, as a share of the GPT-2
            recipe's whole run (benchmarks/time_to_loss.py)
A part whose system is missing prints one line saying how to get it, and the rest still run.

Every part runs its systems interleaved over rounds (benchmarks/rounds.py). A ratio's measured range is that
of its rounds' own ratios; "at parity" where the two systems' ranges overlap. The quoted figures are CLAIMS
below, the one place they are kept: the README and BENCHMARKS.md quote each claim's text word for word
(tests/test_readme_claims.py checks it). A quoted range that does not meet the measured one is flagged
OUTSIDE. A busy machine's figures are not a quiet one's: the load average is printed at the start and end.

--train_args (key=value settings for every train.py run of the train and loss parts) and --n_layer (the
served model's layers) shrink the runs for a rehearsal; the figures are then not the claims' and are flagged.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file from anywhere: the scripts and gptkit are in the checkout

from benchmarks.rounds import DEFAULT_ROUNDS, MIN_SECONDS, QUICK_SECONDS, Spread, verdict  # noqa: E402
from gptkit import cli  # noqa: E402
from gptkit.errors import UserError  # noqa: E402

PARTS = ("decode", "serve", "train", "loss")
QUIET_2CORE = "a quiet 2-core VM (AMD EPYC)"
SHARED_2CORE = "a 2-core VM shared with other jobs, preliminary"
LLAMA_SERVER = "build/llama-server/bin/llama-server"  # where benchmarks/llama_server.sh builds it
NANOGPT = REPO.parent / "shared" / "anchors" / "nanoGPT"
TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


class ReproduceError(UserError):
    """A bad option."""


@dataclass(frozen=True)
class Claim:
    """A headline figure as the README and BENCHMARKS.md quote it: `text` word for word, its range low-high
    (low == high: one figure), and the machine it was measured on."""

    key: str
    part: str
    what: str
    text: str
    low: float
    high: float
    machine: str = QUIET_2CORE


# The quoted figures: the README and BENCHMARKS.md say each `text` (tests/test_readme_claims.py). Ratios are
# gptkit's speed over the other system's; the loss claims are shares of the GPT-2 recipe's wall time.
CLAIMS = (
    Claim("decode-float32", "decode", "CPU decode, GPT-2 small's shape, batch 1: float32 / llama.cpp f32",
          "float32 1.04-1.24x llama.cpp's f32", 1.04, 1.24),
    Claim("decode-int8", "decode", "CPU decode, GPT-2 small's shape, batch 1: int8 / llama.cpp q8_0",
          "int8 0.99-1.17x its q8_0", 0.99, 1.17),
    Claim("serve-1", "serve", "serve.py int8 / llama-server q8_0 tokens/s, 1 client",
          "1 client 0.84-1.03x", 0.84, 1.03),
    Claim("serve-4", "serve", "serve.py int8 / llama-server q8_0 tokens/s, 4 clients",
          "4 clients 1.43x", 1.43, 1.43),
    Claim("serve-16", "serve", "serve.py int8 / llama-server q8_0 tokens/s, 16 clients",
          "16 clients 0.91-1.01x", 0.91, 1.01),
    Claim("serve-64", "serve", "serve.py int8 / llama-server q8_0 tokens/s, 64 clients",
          "64 clients 0.91-1.08x", 0.91, 1.08),
    Claim("train-nanogpt", "train", "quick start's steps/s, train.py / nanoGPT, torch's default threads, idle",
          "1.02x nanoGPT's steps/s", 1.02, 1.02, "an idle 2-core VM (AMD EPYC)"),
    Claim("loss-1.80", "loss", "modern recipe to val 1.80, share of GPT-2 recipe's run (wall s)",
          "1.80 in 0.33-0.36x of that time", 0.33, 0.36, SHARED_2CORE),
    Claim("loss-1.65", "loss", "modern recipe to val 1.65, share of GPT-2 recipe's run (wall s)",
          "1.65 in 0.74-0.83x", 0.74, 0.83, SHARED_2CORE),
)


@dataclass
class Measured:
    """A claim measured here: the rounds' ratios (None: a target never reached), and the two systems' own
    figures where the claim compares two (for the parity verdict)."""

    claim: Claim
    ratios: list[float] | None
    ours: list[float] | None = None
    theirs: list[float] | None = None


def check(m: Measured) -> tuple[str, str, str]:
    """(measured cell, verdict, flag) for one claim: the flag is 'ok' where the quoted range meets the measured
    one, else 'OUTSIDE'."""
    if not m.ratios:
        return "not reached", "-", "OUTSIDE"
    s = Spread.of(m.ratios)
    cell = f"{s.median:.2f}x" if len(m.ratios) == 1 else f"{s.median:.2f}x ({s.low:.2f}-{s.high:.2f})"
    word = verdict(m.ours, m.theirs) if m.ours and m.theirs and len(m.ours) > 1 else "-"
    meets = s.low <= m.claim.high and m.claim.low <= s.high
    return cell, word, "ok" if meets else "OUTSIDE"


def quoted(c: Claim) -> str:
    return f"{c.low:.2f}x" if c.low == c.high else f"{c.low:.2f}-{c.high:.2f}x"


def report(measured: list[Measured], skipped: list[str]) -> str:
    """The table: quoted (and where) against measured here, the verdict and the flag; then the skipped parts'
    lines."""
    lines = ["| comparison | quoted (measured on) | measured here: median (range) | verdict | check |",
             "|---|---|---|---|---|"]
    for m in measured:
        cell, word, flag = check(m)
        lines.append(f"| {m.claim.what} | {quoted(m.claim)} ({m.claim.machine}) | {cell} | {word} | {flag} |")
    return "\n".join(lines + [f"skipped: {line}" for line in skipped])


# ----------------------------------------------------------------------------- the parts


def run_script(script: str, argv: list[str], json_path: Path) -> object:
    """benchmarks/SCRIPT with argv and --json, in a process of its own (its table and log go to this one's
    output); what it wrote to the JSON file. A failed run is a one-line error naming it."""
    cmd = [sys.executable, f"benchmarks/{script}", *argv]
    cmd.insert(cmd.index("--") if "--" in cmd else len(cmd), f"--json={json_path}")  # before train.py's settings
    print(f"$ {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
    if subprocess.run(cmd, cwd=REPO).returncode != 0:
        raise ReproduceError(f"benchmarks/{script} failed (its output is above); the parts before it are lost")
    return json.loads(json_path.read_text())


def run_decode(args: argparse.Namespace, work: Path) -> list[Measured]:
    from gptkit import cpu_decode

    variant = [args.variant] if args.variant else cpu_decode.runnable_variants()[:1]  # (sample.py's, serve.py's)
    rows = run_script("cpu_decode.py", ["--models=gpt2", "--engines=gptkit,llama.cpp", f"--repeats={args.rounds}",
                                        f"--min_seconds={args.min_seconds}",
                                        f"--new_tokens={64 if args.quick else 256}"]
                      + ([f"--variants={variant[0]}"] if variant else []), work / "decode.json")
    llama = {r["weights"]: r["decodes"] for r in rows if r["engine"].startswith("llama.cpp") and r["decodes"]}
    out = []
    for key, fmt, same in (("decode-float32", "float32", "f32"), ("decode-int8", "int8", "q8_0")):
        ours = next((r["decodes"] for r in rows if r["engine"].startswith("gptkit")
                     and r["weights"].startswith(f"packed {fmt}")), [])
        out.append(measured(key, ours, llama.get(same, [])))
    return out


def run_serve(args: argparse.Namespace, work: Path) -> list[Measured]:
    levels = (1, 4, 16, 64)
    servers = run_script("serve_load.py", [
        "--model=gpt2-random", f"--clients={','.join(map(str, levels))}", "--max_batch=64",
        f"--requests={1 if args.quick else 2}", "--max_tokens=64", f"--rounds={args.rounds}",
        f"--min_seconds={args.min_seconds}", "--serve_args=--quantize=int8 --threads=2", "--llama_type=q8_0",
        f"--llama_server={args.llama_server}"] + ([f"--n_layer={args.n_layer}"] if args.n_layer else []),
        work / "serve.json")
    ours, theirs = servers[0]["tokens_per_s"], servers[-1]["tokens_per_s"] if len(servers) > 1 else {}
    return [measured(f"serve-{n}", ours.get(str(n), []), theirs.get(str(n), [])) for n in levels]


def run_train(args: argparse.Namespace, work: Path) -> list[Measured]:
    cells = run_script("train_threads.py", [
        f"--steps={20 if args.quick else 50}", "--neighbours=0", "--settings=torch", f"--nanogpt={args.nanogpt}",
        f"--repeats={args.rounds}", f"--out={work}", *([f"--text={TEXT}"] if TEXT.is_file() else []), "--",
        *shlex.split(args.train_args)], work / "train.json")
    ms = {c["program"]: [r["ms"] for r in c["runs"]] for c in cells if c["setting"] == "torch"}
    return [measured("train-nanogpt", [1000 / m for m in ms.get("train.py", []) if m],
                     [1000 / m for m in ms.get("nanoGPT", []) if m])]


def run_loss(args: argparse.Namespace, work: Path) -> list[Measured]:
    text = ["--input", str(TEXT)] if TEXT.is_file() else []  # else prepare downloads it
    subprocess.run([sys.executable, "prepare/shakespeare_char.py", f"--out_dir={work / 'data' / 'shakespeare_char'}",
                    *text], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    rounds = 1 if args.quick else args.rounds  # a pair of runs is ~5 minutes on 2 cores
    shares = run_script("time_to_loss.py", [f"--repeats={rounds}", "--targets=1.80,1.65", f"--out={work / 'runs'}",
                                            "--", f"--data_root={work / 'data'}", *shlex.split(args.train_args)],
                        work / "loss.json")
    by_target = {s["target"]: s["rounds"] for s in shares if s["config"] == "shakespeare_cpu_modern.py"}
    return [Measured(claim(f"loss-{t:.2f}"), by_target.get(t)) for t in (1.80, 1.65)]


def measured(key: str, ours: list[float], theirs: list[float]) -> Measured:
    """A two-system claim from each system's rounds (paired by round: the rounds both ran)."""
    pairs = [(a, b) for a, b in zip(ours, theirs) if a and b]
    return Measured(claim(key), [a / b for a, b in pairs] or None, [a for a, _ in pairs], [b for _, b in pairs])


def claim(key: str) -> Claim:
    return next(c for c in CLAIMS if c.key == key)


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def why_skipped(part: str, args: argparse.Namespace) -> str | None:
    """The one line saying why a part cannot run here and how to make it run, or None."""
    if part == "decode" and not llama_cpp_installed():
        return 'decode beside llama.cpp: llama-cpp-python is not installed (pip install -e ".[llama]")'
    if part == "serve" and not Path(args.llama_server).is_file():
        return (f"serving beside llama-server: no {args.llama_server} (bash benchmarks/llama_server.sh builds it; "
                f"--llama_server PATH)")
    if part == "train" and not (Path(args.nanogpt) / "train.py").is_file():
        return (f"training beside nanoGPT: no nanoGPT checkout at {args.nanogpt} (--nanogpt PATH: a clone of "
                f"github.com/karpathy/nanoGPT)")
    return None


RUNS = {"decode": run_decode, "serve": run_serve, "train": run_train, "loss": run_loss}


@cli.entry_point()
def main(argv: list[str] | None = None) -> list[Measured]:
    """Prints the table; returns what was measured."""
    p = cli.ArgumentParser(prog="benchmarks/reproduce.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 rounds, cells of >= 2 s, shorter decodes and runs, "
                   "one pair of time-to-loss runs: ~15 minutes on 2 cores, the time-to-loss pair 5 of them")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every comparison (default 3; --quick 2)")
    p.add_argument("--min_seconds", type=float, default=None, help="a cell's least seconds of work (default 10; "
                   "--quick 2)")
    p.add_argument("--variant", default="", help="gptkit's CPU kernels for the decode and serve parts (default: "
                   "the best this CPU runs, as sample.py and serve.py pick; e.g. avx2 beside a llama.cpp built for "
                   "AVX2, where its build for this CPU's every instruction cannot run)")
    p.add_argument("--llama_server", default=LLAMA_SERVER, help="llama-server's binary for the serve part")
    p.add_argument("--nanogpt", default=str(NANOGPT), help="nanoGPT's checkout for the train part")
    p.add_argument("--train_args", default="", help="more settings for every train.py run (a rehearsal: e.g. "
                   "\"--n_layer=1 --max_iters=6\"; the figures are then not the claims')")
    p.add_argument("--n_layer", type=int, default=None, help="the served model's layers (a rehearsal)")
    p.add_argument("--out", default="", help="work folder (default: a new temporary folder)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or not set(parts) <= set(PARTS):
        raise ReproduceError(f"--parts {args.parts!r}: comma-separated, of {', '.join(PARTS)}")
    args.rounds = args.rounds or (2 if args.quick else DEFAULT_ROUNDS)
    args.min_seconds = (QUICK_SECONDS if args.quick else MIN_SECONDS) if args.min_seconds is None else args.min_seconds
    if args.rounds < 1 or args.min_seconds < 0 or (args.n_layer is not None and args.n_layer < 1):
        raise ReproduceError("--rounds and --n_layer must be >= 1, --min_seconds >= 0")
    if args.variant:
        from gptkit import cpu_decode

        if args.variant not in cpu_decode.runnable_variants():
            raise ReproduceError(f"--variant {args.variant!r}: this CPU runs {', '.join(cpu_decode.runnable_variants()) or 'none'}")
        os.environ[cpu_decode.VARIANT_ENV] = args.variant  # serve.py, started by serve_load.py, reads it
    root = Path(args.out or tempfile.mkdtemp(prefix="reproduce-")).resolve()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"reproduce: {', '.join(parts)}; {args.rounds} rounds, cells >= {args.min_seconds:g} s; "
          + (f"gptkit's {args.variant} kernels; " if args.variant else "")
          + f"{os.cpu_count()} CPUs, load average {load}; work folder {root}", flush=True)
    measured, skipped = [], []
    for part in parts:
        why = why_skipped(part, args)
        if why:
            print(f"skipped: {why}", flush=True)
            skipped.append(why)
            continue
        (root / part).mkdir(parents=True, exist_ok=True)
        measured += RUNS[part](args, root / part)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nquoted against measured here (load average {load} at the end):\n")
    print(report(measured, skipped))
    return measured


if __name__ == "__main__":
    main()
