"""The one command for whoever has a GPU: the GPU figures BENCHMARKS.md lacks, measured in one go.

    PYTHONPATH=. python benchmarks/gpu_check.py --dry_run   # the plan: each part, its seconds, what it runs
    PYTHONPATH=. python benchmarks/gpu_check.py --out benchmarks/gpu_check_2026-11-26.json   # one H100 / H200
    PYTHONPATH=. python benchmarks/gpu_check.py --smoke --out /tmp/smoke.json   # a rehearsal on the CPU
    PYTHONPATH=. python benchmarks/gpu_check.py --parts=plan,serve,train_more --total_s=480   # the other parts

It runs from a fresh clone on a machine with only torch, numpy, tiktoken, tqdm, pytest and transformers
(nothing is installed): this file imports only Python's standard library (and gptkit.cli, which does too),
and every part runs scripts as subprocesses, each with a time limit, so that a crash or a hang loses that run
only. The device is read first, on its own budget; then each asked part gets its planned seconds (measured on
the H200 run of 2026-11-26, see BUDGETS), scaled to --total_s (8 minutes by default), plus what earlier parts
left unused. A --total_s that would give a part less than its floor is refused before anything runs, naming
the least that fits; --dry_run prints the plan and runs nothing. The parts, in order (the default run: device
to decode; every figure of its summary is measured in it):

  device       the device and its versions (torch, CUDA, cuDNN, Triton), and the measured dense bf16 peak: an
               8192 x 8192 x 8192 bf16 matmul timed, in TFLOP/s, beside the datasheet's (gptkit/metrics.py)
  tests        the tests marked cuda, which skip without a CUDA GPU (pytest -m cuda on the files holding them): the
               graphed training step against the plain one among them
  train        bench.py's training rows: GPT-2 124M without biases (gpt2nobias: the shape nanoGPT's bench.py
               times) at micro-batch 12 as train.py runs it and as one CUDA graph. Each run has --keep_going and
               writes its rows as it goes: a run stopped at its limit keeps the rows it finished
  nanogpt      nanoGPT's own code beside ours, in this call on this device (shared/anchors/nanoGPT in the
               checkout or beside it, or --nanogpt; "no anchor" without it): its bench.py (the denominator of the
               speed-up at 12 x 1024) and its train_shakespeare_char until its first val loss <= --val_loss (or
               step 1,750), with each evaluation's wall seconds from its start and its median ms per iteration
  shakespeare  python train.py configs/shakespeare.py until its first val loss <= 1.47 (--val_loss): the time
               from the process' start (metrics.jsonl's elapsed_s, which counts from it) and the wall's; then
               the run is stopped. The text comes from --shakespeare_text, data/shakespeare_char,
               shared/data/tinyshakespeare.txt (in the checkout or beside it), or a download; it is prepared in
               a temporary folder
  steps        the same small model's ms per step over steps 101-200 (after the graphed run's warm-up and
               capture) and 1,401-1,500 (no evaluations between), as train.py runs it and with
               --cuda_graphs=True: is the step flat, and what do graphs give
  decode       bench.py's batch-1 decode rows, eager (beside transformers' eager generate) then compiled (with
               the compile time), and the 1,000-token prefill
  plan         (not in the default run) python -m benchmarks.plan_memory --device=cuda: the plan's peak memory
               against the allocator's
  serve        (not in the default run) benchmarks/serve_load.py, where starlette, uvicorn and openai are
               installed (else skipped)
  train_more   (not in the default run) bench.py's other training rows: micro-batches 32 and 16; each block
               compiled on its own; compile's autotuned kernels; the optimizer step compiled; GPT-2 with biases,
               the modern model

It writes --out, a JSON file (rewritten after every part): the date, the command, the device, torch, the git
commit, the budgets; every part's status (ok, failed, timeout or skipped), seconds, time budget and reason, and
its runs (command, exit code, seconds); every bench.py row, each with mfu_measured_peak (MFU against the
measured peak, beside mfu against the datasheet's); the tests' outcomes, the Shakespeare runs, the plan's rows;
and a summary against BENCHMARKS.md's targets. Beside it, the log (--log): every subprocess's output.

--smoke runs the same parts on the CPU in about a minute or two (tiny models, a few steps,
configs/shakespeare_cpu.py shrunk, val loss 3.6, nanoGPT's training shrunk and without its bench.py, which
needs CUDA): a rehearsal of the machinery, none of its figures means anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gptkit import cli  # (standard library only)

ROOT = Path(__file__).resolve().parents[1]

# The parts' time in seconds, from the H200 run of 2026-11-26 (../shared/gpu/2026-11-26/gpu_check.log): a part's
# budget (what it is planned to need) and its floor (below which it could not give its first figure), on a GPU
# and in --smoke. Measured there: the device read 5 s (torch's import and CUDA's start, ~8 s on a cold start); the
# CUDA tests 26 s; a bench.py training row ~29 s (87.5 s for three in one process, its compile ~20 s each);
# decode 74 s (eager with transformers beside it 47 s, compiled 27 s); configs/shakespeare.py to val 1.47 60 s;
# the memory plan 38 s; serving GPT-2's shape compiles 6 buckets at ~12 s each before its load. Not measured
# yet, estimated: the tests now hold the engine's compiled buckets (~25 s) and the graphed training step (~10 s)
# besides those 26 s; the steps part (two 1,500-step runs of the 12.6 ms/step model, ~30 s each with the start
# and compile); nanoGPT (its bench.py ~30 s with its compile; its train_shakespeare_char ~57 s to step 1,750).
# The device read comes first, on its own budget: no other part's share can skip it.
@dataclass(frozen=True)
class Budget:
    gpu: float  # seconds planned on a GPU
    gpu_floor: float  # the least it is started with on a GPU
    smoke: float  # ... and in --smoke
    smoke_floor: float

    def of(self, smoke: bool) -> tuple[float, float]:
        return (self.smoke, self.smoke_floor) if smoke else (self.gpu, self.gpu_floor)


DEVICE_BUDGET = Budget(15, 10, 25, 15)
BUDGETS = {"tests": Budget(70, 45, 30, 20), "train": Budget(70, 60, 50, 25), "decode": Budget(78, 50, 40, 20),
           "shakespeare": Budget(62, 55, 60, 30), "steps": Budget(65, 40, 45, 20),
           "nanogpt": Budget(90, 60, 40, 15),
           # not in the default run (--parts=...,plan,serve,train_more): their figures are not in its summary
           "plan": Budget(45, 40, 10, 5), "serve": Budget(160, 90, 10, 5), "train_more": Budget(200, 35, 10, 5)}
DEFAULT_PARTS = ("tests", "train", "nanogpt", "shakespeare", "steps", "decode")  # (in PARTS' order)
DEFAULT_TOTAL_S = {False: 480.0, True: 300.0}  # on a GPU, and in --smoke
# A run is not started with less time than this left in its part (it would only import torch and be stopped).
MIN_RUN_S = 8
# How long a stopped run has to exit after SIGTERM before it is killed (twice that is kept back from the
# budgets, so that stopping the last run still ends within --total_s).
GRACE_S = 5

# bench.py's training runs in the default run, the most decisive: nanoGPT's shape (no biases) at 12 x 1024, plain
# and as one CUDA graph, against nanoGPT's bench.py. (The attention kernels are left out: at 12 x 1024 the
# default, cuDNN's, was the fastest on the H200.)
TRAIN_RUNS = (
    ("nanoGPT's shape (no biases) at 12, plain and as one CUDA graph",
     ["--models=gpt2nobias", "--batch_size=12", "--cuda_graphs=False,True"]),
)
# ... and the rest, the train_more part (--parts=train_more, with its own time): first the larger micro-batches
# (32 gave the best tokens/s on the H200).
TRAIN_MORE_RUNS = (
    ("micro-batches 32, 16", ["--models=gpt2nobias", "--batch_size=32,16"]),
    ("each block compiled on its own", ["--models=gpt2nobias", "--batch_size=12", "--compile_scope=blocks"]),
    ("compile's autotuned kernels", ["--models=gpt2nobias", "--batch_size=12",
                                     "--compile_mode=max-autotune-no-cudagraphs"]),
    ("the optimizer step compiled", ["--models=gpt2nobias", "--batch_size=12", "--compile_optimizer=True"]),
    ("GPT-2 with biases, the modern model", ["--models=gpt2,modern", "--batch_size=12"]),
)
# ... and their stand-ins in --smoke: the tiny model, eager (compiling on a CPU takes minutes).
SMOKE_TRAIN_RUNS = (
    ("tiny, with and without biases, and as one CUDA graph (skipped: no CUDA)",
     ["--models=tinynobias,tiny", "--batch_size=2,4", "--cuda_graphs=False,True"]),
    ("attention kernels", ["--models=tinynobias", "--batch_size=2", "--sdpa=flash,cudnn"]),
)
SMOKE_TRAIN_MORE_RUNS = (("tiny, blocks compiled on their own", ["--models=tinynobias", "--batch_size=2"]),)
# The steps part: train.py's options for each run (a run each), its log interval, and the two steps whose ms/step
# (each over the log interval before it) it reports. The early window starts after the graphed run's warm-up
# steps and capture (gptkit/cudagraph.py: 3 warm-up steps, captured at the 4th), which the first interval holds.
STEP_RUNS = (("as train.py runs it", []), ("one CUDA graph", ["--cuda_graphs=True"]))
STEP_LOG, STEP_AT = 100, (200, 1500)
SMOKE_STEP_LOG, SMOKE_STEP_AT = 50, (100, 300)
# (eager, with transformers' eager generate of the same shape beside it: the reference eager decoding must meet)
DECODE_RUNS = (("eager", ["--compile=False", "--hf_reference"]), ("compiled", ["--compile=True"]))
SMOKE_DECODE_RUNS = (("eager", ["--compile=False", "--hf_reference"]),)

# nanoGPT, run beside ours in the same call (its own code, from shared/anchors/nanoGPT): its bench.py (GPT-2 124M
# without biases at 12 x 1024, compiled, random tokens) and its train_shakespeare_char config, stopped at the first
# val loss at or below --val_loss or at step 1,750 (its best val, ~1.473 on an H200, came there).
NANOGPT_FILES = ("bench.py", "train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")
NANOGPT_BENCH = ("bench.py", "--real_data=False", "--compile=True")
NANOGPT_TRAIN = ("train.py", "config/train_shakespeare_char.py", "--max_iters=1750")
# ... in --smoke: no bench.py (it needs CUDA), its training shrunk to seconds on the CPU
SMOKE_NANOGPT_TRAIN = ("train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                       "--dtype=float32", "--max_iters=60", "--eval_interval=20", "--eval_iters=2", "--log_interval=5",
                       "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=32", "--batch_size=8",
                       "--learning_rate=3e-3", "--warmup_iters=5")
NANOGPT_MS_LINE = re.compile(r"^time per iteration: (?P<ms>[\d.]+)ms, MFU: (?P<mfu>-?[\d.]+)%", re.M)
NANOGPT_EVAL_LINE = re.compile(r"^step (?P<step>\d+): train loss (?P<train>[\d.]+), val loss (?P<val>[\d.]+)", re.M)
NANOGPT_ITER_LINE = re.compile(r"^iter (?P<step>\d+): loss [\d.]+, time (?P<ms>[\d.]+)ms", re.M)

# BENCHMARKS.md's GPU targets (vs_nanogpt: x nanoGPT's bench.py tokens/s, measured in the same call).
TARGETS = {"vs_nanogpt": 1.15, "tokens_per_s": {"H200": 600_000, "H100": 550_000}, "decode_tokens_per_s": 4000,
           "prefill_ms": 10.0, "plan_error": 0.20, "shakespeare_s": 30.0, "small_step_ms": 4.0}
SERVE_PACKAGES = ("starlette", "uvicorn", "openai")


# ----------------------------------------------------------------------------- running things


@dataclass
class Run:
    """One subprocess: what ran, how it ended (ok, failed, timeout, or stopped: ended by its watcher once it
    had what was wanted), and its output (also in the log)."""

    label: str
    command: str
    status: str
    returncode: int | None
    seconds: float
    output: str

    def record(self) -> dict:
        return {"label": self.label, "command": self.command, "status": self.status,
                "returncode": self.returncode, "seconds": round(self.seconds, 1)}


class Check:
    """The state of one gpu_check: where it writes, the clock, the report, and the running of subprocesses."""

    def __init__(self, args):
        self.smoke = args.smoke
        self.out, self.log_path = Path(args.out), Path(args.log)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        self.log = open(self.log_path, "ab")  # appending: the runs write to the same file
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.started = time.monotonic()
        self.deadline = self.started + args.total_s - 2 * GRACE_S
        self.budgets = args.budgets  # (parse_args' plan)
        # where each part's time ends if every part before it used its whole budget: a part that ends early
        # leaves its time to the next
        ends, self.planned_end = self.started, {}
        for name, budget in self.budgets.items():
            ends += budget
            self.planned_end[name] = ends
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    "PYTHONUNBUFFERED": "1"}
        tiktoken_files = ROOT / "shared" / "data" / "tiktoken_cache"  # GPT-2's BPE, for a machine with no network
        if tiktoken_files.is_dir():
            self.env.setdefault("TIKTOKEN_CACHE_DIR", str(tiktoken_files))
        if args.smoke:  # tiny models on a small shared CPU: one thread each runs fastest
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": ["benchmarks/gpu_check.py", *args.argv],
                       "smoke": args.smoke, "total_s": args.total_s, "elapsed_s": 0.0, "device": {},
                       "budgets_s": {name: round(b) for name, b in self.budgets.items()},
                       "torch": None, "git": git_version(), "parts": {}, "rows": [], "summary": {}}
        self.part_end = self.deadline
        self.run_offset = 0  # where the running subprocess' output starts in the log

    def left(self) -> float:
        """Seconds the current part may still use: its budget, within the whole check's."""
        return min(self.part_end, self.deadline) - time.monotonic()

    def note(self, text: str) -> None:
        self.log.write(text.encode())
        self.log.flush()

    def run(self, label: str, command: list[str], watch: Callable[[], bool] | None = None,
            env: dict[str, str] | None = None, cwd: Path = ROOT) -> Run | None:
        """Run `command` in the checkout (or `cwd`; with `env` added to the environment), its output into the
        log, until it exits, the part's time is up (timeout), or `watch` (called every half second; it may
        read output_so_far()) says it has what it needs (stopped). None when too little time is left to start
        it."""
        limit = self.left()
        if limit < MIN_RUN_S:
            return None
        text = shlex.join(command)
        self.note(f"\n===== {label}: {text}  (time limit {limit:.0f} s)\n")
        offset = self.run_offset = self.log.tell()
        t0 = time.monotonic()
        # its own process group, so that stopping it stops what it started too (compile workers, a server)
        proc = subprocess.Popen(command, cwd=cwd, env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        status = None
        try:
            while status is None:
                time.sleep(0.5)
                if proc.poll() is not None:
                    status = "ok" if proc.returncode == 0 else "failed"
                elif watch is not None and watch():
                    status = "stopped"
                elif time.monotonic() - t0 > limit:
                    status = "timeout"
        finally:  # (also on Ctrl-C: no run is left behind)
            if proc.poll() is None:
                stop(proc)
        seconds = time.monotonic() - t0
        self.note(f"----- {label}: {status}, exit code {proc.returncode}, {seconds:.1f} s\n")
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            output = f.read().decode(errors="replace")
        run = Run(label, text, status, proc.returncode, seconds, output)
        print(f"  {label}: {status} ({seconds:.0f} s)", flush=True)
        return run

    def output_so_far(self) -> str:
        """What the running subprocess has written to the log so far."""
        with open(self.log_path, "rb") as f:
            f.seek(self.run_offset)
            return f.read().decode(errors="replace")

    def python(self, *args: str) -> list[str]:
        return python(*args)

    def write(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.started, 1)
        partial = self.out.with_name(self.out.name + ".partial")
        partial.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        os.replace(partial, self.out)

    def close(self) -> None:
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def stop(proc: subprocess.Popen) -> None:
    """End a run and everything it started (its process group: compile workers, servers): SIGTERM, then
    SIGKILL after GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def git_version() -> dict:
    """The checkout's commit and whether tracked files differ from it (None where git cannot say)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def outcome(runs: list[Run | None], labels: list[str]) -> tuple[str, str | None]:
    """A part's status and reason from its runs (None: not started for lack of time): failed if one failed,
    timeout if one was stopped at the time limit or never started, else ok."""
    failed = [label for run, label in zip(runs, labels) if run is not None and run.status == "failed"]
    late = [label for run, label in zip(runs, labels) if run is None or run.status == "timeout"]
    if failed:
        return "failed", f"failed (see the log): {'; '.join(failed)}"
    if late:
        return "timeout", f"stopped at or not reached within the time budget: {'; '.join(late)}"
    return "ok", None


def read_rows(path: Path) -> list[dict]:
    """bench.py's rows from its --json file (those written before a crash or a stop), or none."""
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


# ----------------------------------------------------------------------------- the parts


def device_command(smoke: bool, out: Path) -> list[str]:
    return python(str(Path(__file__).resolve().relative_to(ROOT)), "--child=peak", f"--child_out={out}",
                  *(["--smoke"] if smoke else []))


def part_device(check: Check, args) -> dict:
    """The device, the versions and the measured dense peak, from a child process (this one imports no torch)."""
    out = check.tmp / "peak.json"
    run = check.run("device and matmul peak", device_command(check.smoke, out))
    info = json.loads(out.read_text()) if out.is_file() else {}
    check.report["device"] = info
    check.report["torch"] = info.get("torch")
    runs = [run]
    if shutil.which("nvidia-smi") and not check.smoke:  # the driver, clocks and other processes, into the log
        runs.append(check.run("nvidia-smi", ["nvidia-smi"]))
    status, reason = outcome(runs[:1], ["the matmul peak"])
    if status == "ok" and not check.smoke and not info.get("cuda_available"):
        status, reason = "failed", "no CUDA device here (torch.cuda.is_available() is False)"
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs if r], "peak": info.get("peak")}


CUDA_ONLY = re.compile(r"pytest\.mark\.cuda\b")  # the marker tests/ci_skips.py defines


def cuda_test_files() -> list[str]:
    """The test files holding a test marked cuda (it needs a CUDA GPU)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if CUDA_ONLY.search(p.read_text()))


def junit_results(path: Path) -> list[dict]:
    """Each test's outcome (passed, failed, error, skipped) and message, from pytest's --junitxml file."""
    results = []
    for case in ET.parse(path).iter("testcase"):
        result = {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": "passed", "message": None}
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                result.update(outcome=name, message=cli.one_line(element.get("message") or "")[:300])
                break
        results.append(result)
    return results


def tests_command(xml: Path, files: list[str]) -> list[str]:
    return python("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda", f"--junitxml={xml}", *files)


def part_tests(check: Check, args) -> dict:
    files = cuda_test_files()
    if not files:
        return {"status": "skipped", "reason": "no test file holds a test that skips without CUDA", "runs": []}
    xml = check.tmp / "junit.xml"
    # The tests' conftest asks tiktoken for GPT-2's BPE files at start, a download where they are not cached;
    # the CUDA tests need none, and on a machine without network the attempt could wait long for an answer. A
    # proxy that refuses at once makes it fail at once (those tests then skip, saying why).
    offline = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    run = check.run("CUDA tests", tests_command(xml, files), env=offline)
    results = junit_results(xml) if xml.is_file() else []
    status, reason = outcome([run], ["pytest -m cuda " + " ".join(files)])
    counts = {o: sum(r["outcome"] == o for r in results) for o in ("passed", "failed", "error", "skipped")}
    if status == "failed" and counts["failed"] + counts["error"]:
        reason = "failed: " + ", ".join(r["test"] for r in results if r["outcome"] in ("failed", "error"))
    return {"status": status, "reason": reason, "runs": [run.record()] if run else [], "counts": counts,
            "results": results}


def bench_command(options: list[str], extra: list[str], path: Path) -> list[str]:
    return python("bench.py", *options, *extra, "--keep_going", f"--json={path}")


def bench_runs(kind: str, smoke: bool) -> tuple[tuple, list[str]]:
    """A bench.py part's runs ((what, options) each) and the options they share."""
    if kind in ("train", "train_more"):
        options = ["--device=cpu", "--skip_decode", "--warmup=1", "--repeats=2"] if smoke else ["--device=cuda",
                                                                                               "--skip_decode"]
        runs = {("train", False): TRAIN_RUNS, ("train", True): SMOKE_TRAIN_RUNS,
                ("train_more", False): TRAIN_MORE_RUNS, ("train_more", True): SMOKE_TRAIN_MORE_RUNS}[kind, smoke]
        return runs, options
    if smoke:
        return SMOKE_DECODE_RUNS, ["--device=cpu", "--models=tiny", "--skip_train", "--skip_nocache", "--decode_batch=1",
                                   "--decode_tokens=16", "--decode_repeats=2", "--prefill_tokens=64"]
    return DECODE_RUNS, ["--device=cuda", "--models=gpt2", "--skip_train", "--skip_nocache", "--decode_batch=1"]


def bench_part(check: Check, kind: str, runs: tuple, options: list[str]) -> dict:
    """bench.py once per group of rows (`runs`: (what, options)), most wanted first, with --keep_going and
    --json; the rows join the report, each with the group's name in "run"."""
    done = []
    for i, (label, extra) in enumerate(runs):
        path = check.tmp / f"{kind}_{i}.json"
        run = check.run(f"{kind}: {label}", bench_command(options, extra, path))
        done.append(run)
        for row in read_rows(path):
            check.report["rows"].append({"run": f"{kind}: {label}", **row})
    status, reason = outcome(done, [label for label, _ in runs])
    return {"status": status, "reason": reason, "runs": [r.record() for r in done if r]}


def part_train(check: Check, args) -> dict:
    return bench_part(check, "train", *bench_runs("train", check.smoke))


def part_train_more(check: Check, args) -> dict:
    return bench_part(check, "train_more", *bench_runs("train_more", check.smoke))


def part_decode(check: Check, args) -> dict:
    return bench_part(check, "decode", *bench_runs("decode", check.smoke))


def shakespeare_text(given: str | None) -> Path | None:
    """A local copy of tiny Shakespeare: --shakespeare_text, or shared/data/tinyshakespeare.txt in the checkout
    or beside it; None when there is none."""
    candidates = [Path(given)] if given else [ROOT / "shared/data/tinyshakespeare.txt",
                                              ROOT.parent / "shared/data/tinyshakespeare.txt"]
    return next((p for p in candidates if p.is_file()), None)


def read_metrics(path: Path) -> list[dict]:
    """The complete lines of a metrics.jsonl that is still being written."""
    try:
        text = path.read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def shakespeare_data(check: Check, args) -> tuple[Path | None, list[Run], str | None]:
    """The data_root holding shakespeare_char (data/ if prepared there, else prepared once into the check's
    temporary folder), the runs that made it, and why there is none."""
    data_root = ROOT / "data"
    if (data_root / "shakespeare_char" / "meta.json").is_file():
        return data_root, [], None
    data_root = check.tmp / "data"
    if (data_root / "shakespeare_char" / "meta.json").is_file():
        return data_root, [], None
    text = shakespeare_text(args.shakespeare_text)
    prepare = check.python("prepare/shakespeare_char.py", f"--out_dir={data_root / 'shakespeare_char'}",
                           *([f"--input={text}"] if text else []))  # without a copy: a download
    run = check.run("prepare shakespeare_char", prepare)
    if run is not None and run.status == "ok":
        return data_root, [run], None
    why = "no time left" if run is None else f"{run.status}, see the log"
    return None, [run] if run else [], (f"could not prepare tiny Shakespeare ({why}): pass --shakespeare_text=PATH, "
                                        f"or put the text at shared/data/tinyshakespeare.txt")


def shakespeare_command(smoke: bool, data_root: Path, out_dir: Path, *extra: str) -> list[str]:
    """train.py on configs/shakespeare.py (in --smoke: the CPU config, shrunk), writing into out_dir."""
    if smoke:
        command = python("train.py", "configs/shakespeare_cpu.py", "--max_iters=200", "--eval_interval=10",
                               "--eval_iters=2", "--log_interval=10", "--n_layer=2", "--n_head=2", "--n_embd=64",
                               "--block_size=32", "--warmup_iters=5", "--learning_rate=3e-3")
    else:
        command = python("train.py", "configs/shakespeare.py")
    return command + [f"--out_dir={out_dir}", "--overwrite=True", f"--data_root={data_root}", *extra]


def steps_command(smoke: bool, data_root: Path, out_dir: Path, extra: list[str]) -> list[str]:
    """A run of the steps part: no evaluations, a log line every STEP_LOG steps, until the last of STEP_AT."""
    log, at = (SMOKE_STEP_LOG, SMOKE_STEP_AT) if smoke else (STEP_LOG, STEP_AT)
    return shakespeare_command(smoke, data_root, out_dir, f"--max_iters={at[-1]}", "--eval_interval=1000000",
                               "--eval_iters=1", f"--log_interval={log}", *extra)


def part_steps(check: Check, args) -> dict:
    """The small model's ms per step early (over the log interval before STEP_AT[0], after the graphed run's
    warm-up and capture) and late in a long run without evaluations, as train.py runs it and as one CUDA graph
    (skipped on the CPU, where there is no graph to capture)."""
    data_root, runs, why = shakespeare_data(check, args)
    if data_root is None:
        return {"status": "skipped", "runs": [r.record() for r in runs], "reason": why}
    at = SMOKE_STEP_AT if check.smoke else STEP_AT
    results, done = [], []
    for label, extra in STEP_RUNS:
        if check.smoke and extra:
            results.append({"run": label, "skipped": "--smoke: no CUDA graph on the CPU"})
            continue
        out_dir = check.tmp / f"steps_{len(done)}"
        command = steps_command(check.smoke, data_root, out_dir, extra)
        run = check.run(f"steps: {label}", command)
        done.append(run)
        ms = {e["step"]: e["ms_per_step"] for e in read_metrics(out_dir / "metrics.jsonl")
              if e.get("ms_per_step") is not None}
        results.append({"run": label, "ms_per_step": {str(step): ms.get(step) for step in at},
                        "late_over_early": ms[at[-1]] / ms[at[0]] if at[-1] in ms and at[0] in ms else None})
    status, reason = outcome(done, [label for label, extra in STEP_RUNS if not (check.smoke and extra)])
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs + done if r], "steps": results}


def part_shakespeare(check: Check, args) -> dict:
    """train.py on shakespeare_char until its first evaluation at or below args.val_loss."""
    data_root, runs, why = shakespeare_data(check, args)
    if data_root is None:
        return {"status": "skipped", "runs": [r.record() for r in runs], "reason": why}
    out_dir = check.tmp / "shakespeare_out"
    command = shakespeare_command(check.smoke, data_root, out_dir)
    metrics, started = out_dir / "metrics.jsonl", time.monotonic()
    reached: dict = {}

    def watch() -> bool:
        if reached:
            return True
        lines = read_metrics(metrics)
        hit = next((e for e in lines if e.get("val_loss") is not None and e["val_loss"] <= args.val_loss), None)
        if hit:
            rates = [e for e in lines if e.get("tokens_per_s") is not None and e["step"] <= hit["step"]]
            reached.update(step=hit["step"], val_loss=hit["val_loss"], elapsed_s=hit["elapsed_s"],
                           wall_s=round(time.monotonic() - started, 1), last_rates=rates[-1] if rates else None)
        return bool(reached)

    run = check.run(f"train.py until val <= {args.val_loss}", command, watch)
    runs.append(run)
    watch()  # what it wrote just before it ended
    evals = [{k: e[k] for k in ("step", "val_loss", "elapsed_s")} for e in read_metrics(metrics) if "val_loss" in e]
    result = {"runs": [r.record() for r in runs if r], "val_threshold": args.val_loss, "reached": reached or None,
              "evaluations": evals}
    if reached:
        return {"status": "ok", "reason": None, **result}
    best = min((e["val_loss"] for e in evals), default=None)
    status = "timeout" if run is None or run.status == "timeout" else "failed"
    return {"status": status, "reason": f"train.py ended ({run.status if run else 'not started'}) before val <= "
                                        f"{args.val_loss}; best val {best}", **result}


def nanogpt_dir(given: str | None) -> Path | None:
    """nanoGPT's own code: --nanogpt, or shared/anchors/nanoGPT in the checkout or beside it; None without."""
    candidates = [Path(given)] if given else [ROOT / "shared/anchors/nanoGPT", ROOT.parent / "shared/anchors/nanoGPT"]
    return next((p for p in candidates if all((p / name).is_file() for name in NANOGPT_FILES)), None)


def nanogpt_commands(smoke: bool) -> list[tuple[str, list[str]]]:
    """nanoGPT's runs, each (what, command), run in a copy of its folder (its scripts read ./data, ./config)."""
    if smoke:
        return [("nanoGPT train_shakespeare_char (shrunk)", python(*SMOKE_NANOGPT_TRAIN))]
    return [("nanoGPT bench.py", python(*NANOGPT_BENCH)), ("nanoGPT train_shakespeare_char", python(*NANOGPT_TRAIN))]


def nanogpt_results(output: str) -> dict:
    """What nanoGPT's scripts printed: bench.py's ms per iteration and MFU; train.py's evaluations (step, train
    and val loss) and the median of its iter lines' ms from step 100 on (its first steps compile)."""
    bench = NANOGPT_MS_LINE.search(output)
    evals = [{"step": int(m["step"]), "train_loss": float(m["train"]), "val_loss": float(m["val"])}
             for m in NANOGPT_EVAL_LINE.finditer(output)]
    iters = [(int(m["step"]), float(m["ms"])) for m in NANOGPT_ITER_LINE.finditer(output)]
    late = sorted(ms for step, ms in iters if step >= 100) or sorted(ms for _, ms in iters[1:])
    return {"bench_ms": float(bench["ms"]) if bench else None, "bench_mfu": float(bench["mfu"]) / 100 if bench else None,
            "evaluations": evals, "iter_ms_median": late[len(late) // 2] if late else None}


def part_nanogpt(check: Check, args) -> dict:
    """nanoGPT beside ours in this call: its bench.py (the denominator of vs_nanogpt) and its
    train_shakespeare_char until its first val loss <= --val_loss (or step 1,750), timed from its start."""
    source = nanogpt_dir(args.nanogpt)
    if source is None:
        return {"status": "skipped", "runs": [], "reason": "no anchor: nanoGPT's code is not at "
                "shared/anchors/nanoGPT (in the checkout or beside it); pass --nanogpt=PATH"}
    copy = check.tmp / "nanoGPT"
    for name in NANOGPT_FILES:  # (the files alone: the folder's own modes may be read-only)
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, copy / name)
    text = shakespeare_text(args.shakespeare_text)
    runs, result, env = [], {}, {"PYTHONPATH": ""}  # nanoGPT's own model.py, not ours
    if text is None:
        return {"status": "skipped", "runs": [], "reason": "no tiny Shakespeare text for nanoGPT's data: pass "
                "--shakespeare_text=PATH, or put it at shared/data/tinyshakespeare.txt"}
    shutil.copyfile(text, copy / "data/shakespeare_char/input.txt")  # (its prepare.py downloads it otherwise)
    # its prepare.py imports requests, which it needs only for the download
    stub = "import runpy, sys, types\ntry:\n    import requests\nexcept ImportError:\n    sys.modules['requests'] = " \
           "types.ModuleType('requests')\nrunpy.run_path('data/shakespeare_char/prepare.py', run_name='__main__')"
    prepare = check.run("nanoGPT prepare shakespeare_char", python("-c", stub), env=env, cwd=copy)
    runs.append(prepare)
    labels = ["nanoGPT's prepare.py"]
    if prepare is not None and prepare.status == "ok":
        for label, command in nanogpt_commands(check.smoke):
            training = "train.py" in command
            started, seen = time.monotonic(), {}

            def watch(seen=seen, started=started) -> bool:  # each evaluation's wall seconds from the start
                evals = nanogpt_results(check.output_so_far())["evaluations"]
                for e in evals:
                    seen.setdefault(e["step"], round(time.monotonic() - started, 1))
                return any(e["val_loss"] <= args.val_loss for e in evals)

            run = check.run(label, command, watch if training else None, env=env, cwd=copy)
            runs.append(run)
            labels.append(label)
            found = nanogpt_results(run.output) if run else {}
            if training and run:
                evals = [{**e, "wall_s": seen.get(e["step"])} for e in found["evaluations"]]
                hit = next((e for e in evals if e["val_loss"] <= args.val_loss), None)
                best = min(evals, key=lambda e: e["val_loss"], default=None)
                result["train"] = {"command": shlex.join(command), "evaluations": evals, "reached": hit, "best": best,
                                   "iter_ms_median": found["iter_ms_median"]}
            elif run:
                result["bench"] = {"command": shlex.join(command), "ms": found["bench_ms"], "mfu": found["bench_mfu"]}
    status, reason = outcome(runs, labels)
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs if r], **result}


PLAN_ROW = re.compile(r"^(?P<shape>\S.*?)\s+(?P<batch>\d+)\s+(?P<plan>[\d,]+) MiB\s+(?P<allocator>[\d,]+) MiB"
                      r"\s+(?P<error>[+-]\d+(?:\.\d+)?)%")
PLAN_FAILED = re.compile(r"^(?P<what>\S+): failed$")


def plan_rows(output: str) -> tuple[list[dict], list[str]]:
    """benchmarks/plan_memory.py's table: its rows (shape, batch, plan and allocator MiB, the plan's error as a
    fraction) and the shapes it says failed."""
    rows, failed = [], []
    for line in output.splitlines():
        if m := PLAN_ROW.match(line):
            rows.append({"shape": m["shape"], "batch": int(m["batch"]), "plan_mib": int(m["plan"].replace(",", "")),
                         "allocator_mib": int(m["allocator"].replace(",", "")), "error": float(m["error"]) / 100})
        elif m := PLAN_FAILED.match(line.strip()):
            failed.append(m["what"])
    return rows, failed


PLAN_COMMAND = python("-m", "benchmarks.plan_memory", "--device=cuda")
SERVE_COMMAND = python("benchmarks/serve_load.py", "--model=gpt2-random", "--compile=False,True", "--clients=1,16,64",
                       "--max_batch=64", "--requests=2", "--seconds=8", "--max_tokens=128")


def part_plan(check: Check, args) -> dict:
    if check.smoke:
        return {"status": "skipped", "runs": [], "reason": "smoke: benchmarks.plan_memory's CPU shapes take "
                "minutes; on a GPU it measures GPT-2 124M at micro-batches 8, 16, 32"}
    run = check.run("memory plan", PLAN_COMMAND)
    rows, failed = plan_rows(run.output) if run else ([], [])
    status, reason = outcome([run], ["python -m benchmarks.plan_memory --device=cuda"])
    if status == "ok" and (failed or not rows):
        status, reason = "failed", f"plan_memory: {', '.join(failed) or 'no rows'} failed (see the log)"
    return {"status": status, "reason": reason, "runs": [run.record()] if run else [], "rows": rows}


def part_serve(check: Check, args) -> dict:
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return {"status": "skipped", "runs": [], "reason": f"serving needs {', '.join(SERVE_PACKAGES)} "
                f"(pip install -e '.[serve,dev]'); not installed here: {', '.join(missing)}"}
    if check.smoke:
        return {"status": "skipped", "runs": [], "reason": "smoke: serving is not rehearsed on the CPU"}
    # GPT-2 small's shape, 64 rows, eager and compiled (the compiled one's buckets compile before its figures).
    # (The char model's figures are known from the H200 run of 2026-11-26: flat past 16 clients.)
    gpt2 = check.run("serve.py under load, GPT-2's shape", SERVE_COMMAND)
    runs = [r for r in (gpt2,) if r]
    status, reason = outcome([gpt2], ["benchmarks/serve_load.py --model=gpt2-random"])
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs],
            "output": [line for r in runs for line in r.output.splitlines()[-12:]]}


# The parts in the order they run: the device first, then the most decisive.
PARTS: dict[str, Callable] = {"device": part_device, "tests": part_tests, "train": part_train,
                              "nanogpt": part_nanogpt, "shakespeare": part_shakespeare, "steps": part_steps,
                              "decode": part_decode, "plan": part_plan, "serve": part_serve,
                              "train_more": part_train_more}


# ----------------------------------------------------------------------------- the plan


def make_plan(parts: list[str], total_s: float, smoke: bool) -> dict[str, float]:
    """Each part's budget in seconds, in the order they run: the device read's own, then the asked parts' shares
    of the rest of --total_s (less 2 x GRACE_S for stopping the last run), in proportion to their planned times.
    A --total_s that would give a part less than its floor is refused here, before anything runs."""
    device = DEVICE_BUDGET.of(smoke)[0]
    asked = [name for name in PARTS if name in parts and name != "device"]
    planned = {name: BUDGETS[name].of(smoke)[0] for name in asked}
    usable = total_s - 2 * GRACE_S - device
    scale = usable / sum(planned.values()) if planned else 1.0
    # the least --total_s at which every asked part gets its floor
    need = 2 * GRACE_S + device + sum(planned.values()) * max(
        [BUDGETS[name].of(smoke)[1] / planned[name] for name in asked], default=0)
    if total_s < need - 0.5:
        short = [name for name in asked if planned[name] * scale < BUDGETS[name].of(smoke)[1]] or ["device"]
        raise cli.UsageError(f"--total_s={total_s:g} is too short for --parts={','.join(asked)}: {', '.join(short)} "
                             f"would get less than the least it needs; use --total_s={math.ceil(need)} or more, or "
                             f"fewer --parts (--dry_run shows the plan)")
    return {"device": device, **{name: planned[name] * scale for name in asked}}


def plan_commands(name: str, smoke: bool, args) -> list[str]:
    """What a part runs, as text (paths in the check's temporary folder shown as TMP): --dry_run's column."""
    tmp, show = Path("TMP"), (lambda command: shlex.join(["python", *command[1:]]))
    if name == "device":
        return [show(device_command(smoke, tmp / "peak.json")), *(["nvidia-smi"] if not smoke else [])]
    if name == "tests":
        files = cuda_test_files()
        return [show(tests_command(tmp / "junit.xml", files)) if files else "nothing: no test skips without CUDA"]
    if name in ("train", "train_more", "decode"):
        runs, options = bench_runs(name, smoke)
        return [show(bench_command(options, extra, tmp / f"{name}_{i}.json")) for i, (_, extra) in enumerate(runs)]
    if name == "shakespeare":
        return [show(shakespeare_command(smoke, tmp / "data", tmp / "shakespeare_out"))
                + f"  (stopped at the first val <= {args.val_loss})"]
    if name == "steps":
        return [show(steps_command(smoke, tmp / "data", tmp / f"steps_{i}", extra)) for i, (_, extra) in
                enumerate(STEP_RUNS) if not (smoke and extra)]
    if name == "nanogpt":
        where = nanogpt_dir(args.nanogpt)
        if where is None:
            return ["no anchor: nanoGPT's code not found (shared/anchors/nanoGPT; --nanogpt=PATH)"]
        return [f"(in a copy of {where}) " + show(command) for _, command in nanogpt_commands(smoke)]
    if name == "plan":
        return [show(PLAN_COMMAND)] if not smoke else ["nothing in --smoke"]
    if name == "serve":
        return [show(SERVE_COMMAND)] if not smoke else ["nothing in --smoke"]
    raise KeyError(name)


def format_plan(budgets: dict[str, float], args) -> str:
    """--dry_run's table: each part, its budget and floor in seconds, and what it runs."""
    lines = [f"gpu_check plan{' --smoke' if args.smoke else ''} at --total_s={args.total_s:g}:",
             f"{'part':<12}{'budget':>8}{'floor':>7}  runs"]
    for name, budget in budgets.items():
        floor = (DEVICE_BUDGET if name == "device" else BUDGETS[name]).of(args.smoke)[1]
        commands = plan_commands(name, args.smoke, args)
        lines.append(f"{name:<12}{budget:>6.0f} s{floor:>5.0f} s  {commands[0]}")
        lines += [f"{'':<29}{command}" for command in commands[1:]]
    lines.append(f"{'(stopping)':<12}{2 * GRACE_S:>6.0f} s{'':>7}  kept back to stop the last run")
    lines.append(f"{'total':<12}{sum(budgets.values()) + 2 * GRACE_S:>6.0f} s")
    return "\n".join(lines)


def do_part(check: Check, name: str, args) -> dict:
    """One part within its budget (and the time earlier parts left unused); an error of this script's own (a
    bug) fails that part only."""
    budget = check.budgets[name]
    check.part_end = max(time.monotonic() + budget, check.planned_end[name])
    t0 = time.monotonic()
    print(f"{name} (up to {check.left():.0f} s)", flush=True)
    try:
        result = PARTS[name](check, args)
    except Exception as e:
        check.note(f"\n===== gpu_check's own error in part {name}\n{traceback.format_exc()}")
        result = {"status": "failed", "reason": f"gpu_check: {type(e).__name__}: {cli.one_line(e)}"[:300], "runs": []}
    return {"status": result.pop("status"), "seconds": round(time.monotonic() - t0, 1), "budget_s": round(budget),
            "reason": result.pop("reason"), **result}


# ----------------------------------------------------------------------------- the summary


def add_measured_mfu(report: dict) -> None:
    """Each row's MFU against the measured dense peak (the peak part's), beside bench.py's datasheet one."""
    peak = (report["device"].get("peak") or {}).get("tflops_measured")
    for row in report["rows"]:
        ok = peak and row.get("flops_per_token") and row.get("tokens_per_s")
        row["mfu_measured_peak"] = row["flops_per_token"] * row["tokens_per_s"] / (peak * 1e12) if ok else None


def figure(value, target, met) -> dict:
    return {"value": value, "target": target, "met": met if value is not None else None}


def summarise(report: dict, smoke: bool) -> dict:
    """The figures BENCHMARKS.md's GPU targets ask for, each with its target and whether it was met."""
    rows = [r for r in report["rows"] if r.get("status") == "ok"]
    train = [r for r in rows if r["kind"] == "train"]
    nobias = "tinynobias" if smoke else "gpt2nobias"
    at_12 = [r for r in train if r["model"] == nobias and r["batch_size"] == (2 if smoke else 12)]
    best_12 = min(at_12, key=lambda r: r["ms"], default=None)
    best = max((r for r in train if r["model"] in (nobias, nobias.removesuffix("nobias"))),
               key=lambda r: r["tokens_per_s"], default=None)
    name = report["device"].get("name") or ""
    floor = next((v for k, v in TARGETS["tokens_per_s"].items() if k in name), None)
    decode = [r for r in rows if r["kind"] == "decode" and r["compile"] and r["batch_size"] == 1]
    reference = [r for r in rows if r["kind"] == "decode" and r.get("model", "").endswith("(transformers)")]
    eager = [r for r in rows if r["kind"] == "decode" and not r["compile"] and r["batch_size"] == 1
             and r.get("kv_cache", True) and r not in reference]
    vs_hf = (max(r["tokens_per_s"] for r in eager) / reference[0]["tokens_per_s"]) if eager and reference else None
    # sample.py --compile=auto's threshold (gptkit/generate.py's DECODE_COMPILE_COST): the compile time, and the
    # milliseconds the compiled step saves per token; it compiles from compile_s / saved tokens on.
    saved_ms = (min(r["ms"] for r in eager) - min(r["ms"] for r in decode)) if decode and eager else None
    compile_s = decode[0].get("compile_s") if decode else None
    prefill = [r for r in rows if r["kind"] == "prefill"]
    plan = report["parts"].get("plan", {}).get("rows") or []
    shakespeare = report["parts"].get("shakespeare", {}).get("reached")
    steps = {s["run"]: s for s in report["parts"].get("steps", {}).get("steps") or [] if "ms_per_step" in s}
    last = str((SMOKE_STEP_AT if smoke else STEP_AT)[-1])
    late = [(s["ms_per_step"][last], s["late_over_early"]) for s in steps.values()
            if s["ms_per_step"].get(last) is not None]
    best_late = min(late, default=None)
    nanogpt = report["parts"].get("nanogpt", {})
    nanogpt_ms = (nanogpt.get("bench") or {}).get("ms")
    nanogpt_train = nanogpt.get("train") or {}
    nanogpt_val = nanogpt_train.get("reached") or nanogpt_train.get("best")
    no_anchor = "no anchor: " + (nanogpt.get("reason") or "nanoGPT's bench.py gave no time (see the log)")

    def variant(r):
        return {k: r.get(k) for k in ("model", "batch_size", "sdpa", "compile_mode", "compile_optimizer",
                                      "compile_scope", "cuda_graphs")}

    speedup = nanogpt_ms / best_12["ms"] if best_12 and nanogpt_ms else None
    summary = {
        "train_12x1024_no_bias": figure(speedup, TARGETS["vs_nanogpt"], speedup and speedup >= TARGETS["vs_nanogpt"])
        | {"ms": best_12 and best_12["ms"], "nanogpt_ms": nanogpt_ms, "variant": best_12 and variant(best_12),
           "note": "x nanoGPT's bench.py tokens/s, run in this call on this device" if nanogpt_ms else no_anchor},
        "train_best_tokens_per_s": figure(best and best["tokens_per_s"], floor,
                                          floor and best and best["tokens_per_s"] >= floor)
        | {"variant": best and variant(best), "mfu_datasheet": best and best["mfu"],
           "mfu_measured_peak": best and best.get("mfu_measured_peak")},
        "decode_compiled_batch1_tokens_per_s": figure(
            max((r["tokens_per_s"] for r in decode), default=None), TARGETS["decode_tokens_per_s"],
            any(r["tokens_per_s"] >= TARGETS["decode_tokens_per_s"] for r in decode))
        | {"compile_s": compile_s},
        "decode_eager_vs_transformers": figure(vs_hf, 1.0, vs_hf and vs_hf >= 1.0)
        | {"note": "our eager batch-1 decode's tokens/s over transformers' eager generate, same shape and dtype"},
        "decode_compile_cost": figure(
            round(compile_s / (saved_ms / 1000)) if compile_s and saved_ms and saved_ms > 0 else None, None, None)
        | {"compile_s": compile_s, "saved_ms_per_token": saved_ms,
           "note": "value: the tokens from which compiling pays; (compile_s, saved_ms_per_token) is "
                   "gptkit/generate.py's DECODE_COMPILE_COST['cuda']"},
        "prefill_ms": figure(min((r["ms"] for r in prefill), default=None), TARGETS["prefill_ms"],
                             any(r["ms"] < TARGETS["prefill_ms"] for r in prefill))
        | {"prompt_tokens": prefill[0]["seq_len"] if prefill else None},
        "shakespeare_s_to_val": figure(shakespeare and shakespeare["elapsed_s"], TARGETS["shakespeare_s"],
                                       shakespeare and shakespeare["elapsed_s"] <= TARGETS["shakespeare_s"])
        | {"val_loss": shakespeare and shakespeare["val_loss"], "step": shakespeare and shakespeare["step"],
           "wall_s": shakespeare and shakespeare["wall_s"], "nanogpt": nanogpt_val,
           "note": "seconds from train.py's process start; nanogpt: its train_shakespeare_char in this call, the "
                   "first val at or below the threshold (else its best), with the wall seconds from its start"
                   if nanogpt_val else no_anchor},
        "shakespeare_ms_per_step_late": figure(best_late and best_late[0], TARGETS["small_step_ms"],
                                               best_late and best_late[0] <= TARGETS["small_step_ms"])
        | {"late_over_early": best_late and best_late[1], "runs": steps,
           "nanogpt_iter_ms": nanogpt_train.get("iter_ms_median"),
           "note": f"ms/step over the {last}th step's log interval, the fastest way (steps part); flat: "
                   f"late_over_early <= 1.1; nanogpt_iter_ms: the median of its iter lines in this call"},
    }
    if "plan" in report["parts"] and report["parts"]["plan"]["status"] != "skipped":
        summary["plan_worst_error"] = figure(max((abs(r["error"]) for r in plan), default=None), TARGETS["plan_error"],
                                             bool(plan) and all(abs(r["error"]) <= TARGETS["plan_error"] for r in plan))
    return summary


def print_summary(report: dict) -> None:
    print("\nparts:")
    for name, part in report["parts"].items():
        print(f"  {name:<12}{part['status']:<9}{part['seconds']:>6.0f} s  {part['reason'] or ''}")
    print("summary:")
    for name, entry in report["summary"].items():
        value = entry["value"]
        shown = "n/a" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
        met = {True: "met", False: "NOT met", None: ""}[entry["met"]]
        target = "" if entry["target"] is None else f" (target {entry['target']:,})"
        print(f"  {name:<38}{shown:>12}{target} {met}")


# ----------------------------------------------------------------------------- the child: device and peak


def child_peak(smoke: bool) -> dict:
    """The device, its versions and its measured dense peak: a square matmul (bf16 8192 on a GPU; float32 512
    on the CPU in --smoke) timed over 50 runs after 10 (the clocks up), in TFLOP/s."""
    import torch

    from gptkit.metrics import peak_flops_for

    info = {"python": platform.python_version(), "torch": str(torch.__version__), "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    on_gpu = info["cuda_available"] and not smoke
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                    cudnn=torch.backends.cudnn.version())
    elif smoke:
        info.update(name=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads())
    else:
        return info
    device, dtype, n = ("cuda", torch.bfloat16, 8192) if on_gpu else ("cpu", torch.float32, 512)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(10):
        a @ b
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(50):
        a @ b
    sync()
    seconds = (time.perf_counter() - t0) / 50
    datasheet = peak_flops_for(info["name"], dtype) if on_gpu else None
    info["peak"] = {"dtype": str(dtype).removeprefix("torch."), "n": n, "tflops_measured": 2 * n**3 / seconds / 1e12,
                    "tflops_datasheet": datasheet / 1e12 if datasheet else None}
    return info


# ----------------------------------------------------------------------------- the command line


def parse_args(argv: list[str] | None):
    p = cli.ArgumentParser(prog="gpu_check.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="the JSON file (default: benchmarks/gpu_check_DATE.json)")
    p.add_argument("--log", default=None, help="the log of every subprocess (default: --out with .log)")
    p.add_argument("--smoke", action="store_true", help="rehearse every part on the CPU in about a minute")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated parts to run (default {','.join(DEFAULT_PARTS)}), from: "
                        f"{', '.join(PARTS)} (device always runs, first)")
    p.add_argument("--total_s", type=float, default=None,
                   help=f"seconds for the whole check, shared by the parts (default {DEFAULT_TOTAL_S[False]:g}; "
                        f"--smoke {DEFAULT_TOTAL_S[True]:g}); one too short for a part's floor is refused")
    p.add_argument("--dry_run", action="store_true",
                   help="print each part, its budget at --total_s and what it runs, then exit without running")
    p.add_argument("--nanogpt", default=None,
                   help="nanoGPT's code, run beside ours (default: shared/anchors/nanoGPT in the checkout or beside it)")
    p.add_argument("--val_loss", type=float, default=None,
                   help="the shakespeare part stops at the first val loss at or below this (default 1.47; --smoke 3.6)")
    p.add_argument("--shakespeare_text", default=None, help="a local copy of tiny Shakespeare's input.txt")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.parts = [part.strip() for part in args.parts.split(",")]
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        raise cli.UsageError(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    args.out = args.out or str(ROOT / "benchmarks" / f"gpu_check_{time.strftime('%Y-%m-%d')}.json")
    args.log = args.log or str(Path(args.out).with_suffix(".log"))
    args.total_s = args.total_s if args.total_s is not None else DEFAULT_TOTAL_S[args.smoke]
    args.val_loss = args.val_loss if args.val_loss is not None else (3.6 if args.smoke else 1.47)
    if args.shakespeare_text and not Path(args.shakespeare_text).is_file():
        raise cli.UsageError(f"--shakespeare_text: {args.shakespeare_text} is not a file")
    if args.nanogpt and nanogpt_dir(args.nanogpt) is None:
        raise cli.UsageError(f"--nanogpt: {args.nanogpt} does not hold nanoGPT's {', '.join(NANOGPT_FILES)}")
    if args.child is None:
        args.budgets = make_plan(args.parts, args.total_s, args.smoke)  # (a UsageError before anything runs)
    return args


@cli.entry_point()
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child == "peak":
        Path(args.child_out).write_text(json.dumps(child_peak(args.smoke)))
        return {}
    if args.dry_run:
        print(format_plan(args.budgets, args))
        return {}
    check = Check(args)
    print(f"gpu_check{' --smoke (CPU rehearsal)' if args.smoke else ''}: up to {args.total_s:.0f} s; "
          f"JSON {args.out}, log {args.log}", flush=True)
    try:
        no_device = None
        for name in PARTS:
            if name not in args.budgets:
                part = {"status": "skipped", "seconds": 0.0, "budget_s": 0, "reason": "not in --parts", "runs": []}
            elif no_device:
                part = {"status": "skipped", "seconds": 0.0, "budget_s": 0, "reason": no_device, "runs": []}
            else:
                part = do_part(check, name, args)
            check.report["parts"][name] = part
            if name == "device" and not args.smoke and not check.report["device"].get("cuda_available"):
                no_device = ("no CUDA device here: run it on a GPU, or --smoke for the CPU rehearsal"
                             if check.report["device"] else "the device could not be read (see the log)")
            check.write()
        add_measured_mfu(check.report)
        check.report["summary"] = summarise(check.report, args.smoke)
        check.write()
    finally:
        check.close()
    print_summary(check.report)
    print(f"wrote {args.out} and {args.log}")
    if no_device:
        raise cli.UserError(f"{no_device} (the parts are marked skipped in {args.out})")
    return check.report


if __name__ == "__main__":
    main()
