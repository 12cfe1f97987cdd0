"""The one command for whoever has a GPU: the GPU figures BENCHMARKS.md lacks, measured in one go.

    python -m benchmarks.gpu_check --dry_run   # the plan: each part, its seconds, its need, what it runs
    python -m benchmarks.gpu_check             # one H100 / H200 (JSON and log into $OUT, or benchmarks/)
    python -m benchmarks.gpu_check --smoke --out /tmp/smoke.json   # a rehearsal on the CPU
    python -m benchmarks.gpu_check --parts=nanogpt_train,steps --total_s=400   # parts not in the default

(from the checkout's root, which `python -m` puts on the path).

On a machine that gets the working tree only (this project's GPU machines: the checkout's files and a shared/
folder inside it travel; ../shared, .git and the network do not, and the image may lack one of the project's
packages: crc32c), copy what the parts read into shared/ first, with the commit and a wheel of crc32c:

    mkdir -p shared/wheels && cp -r --no-preserve=mode ../shared/data ../shared/anchors shared/
    git rev-parse HEAD > shared/COMMIT; git diff --quiet HEAD || echo dirty >> shared/COMMIT
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d shared/wheels crc32c==2.9.post0

then run this one command there (one call of at most 10 minutes: the default run ends within its 578 s, 9.6
minutes; $OUT, where it is set, gets the JSON and the log):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site shared/wheels/*.whl; \
        PYTHONPATH=/tmp/site:. python3 -m benchmarks.gpu_check

(The check runs even where the install failed: it then says which package is missing and skips the parts that
need it. The commit comes from git where .git is there, else from $GPU_CHECK_COMMIT or shared/COMMIT: the
commit, then "dirty" where tracked files differed from it.) `--dry_run`, and the run at its start, say in one line what is
missing (tiny Shakespeare's text, nanoGPT's code, a package), before any part would try a download; a part
whose package is missing is skipped, saying so, rather than failing after its minutes.

It runs from a fresh clone on a machine with only torch, numpy, tiktoken, tqdm, crc32c, pytest and transformers
(nothing is installed): this package imports only Python's standard library (and gptkit.cli and
benchmarks/gpu_readings.py, which do too), and every part runs scripts as subprocesses, each with a time limit,
so that a crash or a hang loses that run only. The device is read first, on its own budget; then each asked part
gets its planned seconds, scaled to --total_s (by default what the default parts need: 9.6 minutes), plus what
earlier parts left unused: a part may run until where its time would end had every part before it used its
whole budget. What a part needs is added up from its commands with the H200 figures (figures.py's H200, one table, the slower
of the runs of 2026-11-26 and 2026-11-28, estimates said so: start + compile + steps x ms per step), and every
default part's budget is at least NEED_MARGIN (1.1) x that; within a part each run may use the part's time less
what the runs after it need. A bench.py run's last rows may be measured only as time allows (not in its need: a
run stopped after its other rows is "stopped", not a timeout), and some runs start only where the part's time
left holds them (OPTIONAL_RUNS, the shakespeare part's second run). A --total_s that would give a part less than
its floor is refused before anything runs, naming the least that fits; --dry_run prints the plan and runs
nothing. bench.py's newer options (--decode_window, --profile_decode, --profile_step, --fp8_head) are passed only
where this checkout's bench.py has them (read from its BenchConfig); one it lacks is left out, and --dry_run and
the part say so. The parts, in order (the default run: device to tests):

  device       NVML's readings at the start (benchmarks/gpu_readings.py: SM and memory clocks and their max, power
               draw and limit, temperature, throttle reasons by name, other processes on the GPU; through pynvml,
               else nvidia-smi, else "missing" in one line), the device and its versions (torch, CUDA, cuDNN,
               Triton), and the dense bf16 peak measured after 3 s of warm-up at two shapes, 8192^3 (the
               denominator of mfu_measured_peak) and GPT-2's 12,288 x 768 x 3,072, each with NVML read during it
               (clocks, power, heat, throttle reasons), in TFLOP/s beside the datasheet's (gptkit/metrics.py)
  decode       bench.py's batch-1 compiled decode of GPT-2's shape in windows of K tokens a CUDA graph launch
               (--decode_window=1,16,8,32: 8 and 32 as time allows), each row profiled (--profile_decode: host and
               GPU microseconds per token), and the 1,000-token prefill; the summary: the best K against 4,000
               tokens/s, and K=1's host and GPU microseconds a token
  train        bench.py's training rows of GPT-2 124M without biases (gpt2nobias: the shape nanoGPT's bench.py
               times), as one CUDA graph: at 12 x 1024 profiled (--profile_step: ms per step by kernel kind) with
               the head in bf16 and in FP8 (--fp8_head=False,True), the loss by slices (the default) and then, as
               time allows, over all the logits at once (--loss_chunk=default,plain); micro-batches 32, 24, 16
               (24 and 16 as time allows). Each run has --keep_going and writes its rows as it goes: a run stopped at its limit keeps
               the rows it finished; a row that failed fails the part, named
  nanogpt      nanoGPT's bench.py beside ours, in this call on this device (shared/anchors/nanoGPT in the checkout
               or beside it, or --nanogpt; "no anchor" without it, "nanoGPT failed: ..." with its last lines where
               it ran and failed): the denominator of the speed-up of the best row at 12 x 1024
  shakespeare  python train.py configs/shakespeare.py --async_save=True --cuda_graphs=True (the fastest way, its
               saves in the background beside the captured step) until its first val loss <= 1.47 (--val_loss):
               the time from the process' start (metrics.jsonl's elapsed_s, which counts from it) and the wall's,
               and train.py's start-up trace (runs.jsonl's start); then stopped, and, where the part's time left
               holds it, the same as train.py runs it by default, to the same val loss (the pair that decides
               --cuda_graphs' default). The text comes from --shakespeare_text, data/shakespeare_char,
               shared/data/tinyshakespeare.txt (in the checkout or beside it), or a download; it is prepared in
               a temporary folder
  tests        the tests marked cuda, which skip without a CUDA GPU: tests/test_cudagraph_cuda.py on its own (the
               graphed training step against the plain one, eager and compiled with dropout, a compiled dropout
               captured alone, a NaN, an asynchronous save), then tests/test_decode_window.py and
               tests/test_fp8.py, then, where the part's time left holds them, the other files (last of the
               default parts, it gets what the parts before it left). pytest -v prints each outcome as the test
               ends, so a run stopped keeps every outcome so far; a test past CUDA_TEST_LIMIT_S is stopped (its
               outcome timeout) and pytest goes on with the tests not run yet
  nanogpt_train (not in the default run: its figure, 94.7 s to val 1.4696 on 2026-11-28's host, is recorded
               and in the summary) nanoGPT's train_shakespeare_char until its first val loss <= --val_loss (or
               step 1,750), with each evaluation's wall seconds from its start and its median ms per iteration
  steps        (not in the default run) the same small model's ms per step, with --cuda_graphs=True first and
               then as train.py runs it, over steps 101-200 (after the graphed run's warm-up and capture) and
               901-1,000 (no evaluations between), or the last window before it that both runs reached
  decode_more  (not in the default run) eager batch-1 decoding, beside transformers' eager generate
               (--hf_reference): ours over theirs, and with the compiled rows the tokens from which compiling pays
  plan         (not in the default run) python -m benchmarks.plan_memory --device=cuda: the plan's peak memory
               against the allocator's
  serve        (not in the default run) benchmarks/serve_load.py, where starlette, uvicorn and openai are
               installed (else skipped)
  train_more   (not in the default run) bench.py's other training rows: 12 x 1024 as train.py runs it (not
               graphed); each block compiled on its own; compile's autotuned kernels; the optimizer step
               compiled; GPT-2 with biases, the modern model

It writes --out, a JSON file, rewritten whole after every part and every bench.py run, with the summary of what
is measured so far (so a check cut short, by the call's limit say, keeps every row it measured; SIGTERM stops
the running subprocess and the JSON says where the check was cut): the date, the
command, the device, torch, the git commit, the budgets and needs, what was missing, NVML's readings; every
part's status (ok, failed, timeout or skipped), seconds, time budget and reason, and its runs (command, exit
code, seconds, and the last lines of one that failed); every bench.py row, each with mfu_measured_peak (MFU
against the measured peak, beside mfu against the datasheet's); the tests' outcomes, the Shakespeare runs, the
plan's rows; and a summary against BENCHMARKS.md's targets. Beside it, the log (--log): every subprocess's output.

--smoke runs the same parts on the CPU in about a minute (tiny models, a few steps, configs/shakespeare_cpu.py
shrunk, val loss 3.6, no nanoGPT bench.py, which needs CUDA, nor the FP8 head): a rehearsal of the machinery,
none of its figures means anything.

This file is the driver (the arguments, the parts in order within their budgets, the JSON after each, SIGTERM);
budgets.py holds the plan (budgets, needs, --dry_run's table), figures.py the H200 figures, check.py the clock
and the running of subprocesses, summary.py the figures against the targets, and each part has its own file
(device, decode, gpt2_step: train and train_more, nanogpt, shakespeare, steps, cuda_tests, memory_plan,
serving; bench_runs.py for what the bench.py parts share), with its commands, their needs and its --dry_run lines.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from benchmarks.gpu_check import budgets, device, nanogpt
from benchmarks.gpu_check.budgets import DEFAULT_PARTS, DEFAULT_TOTAL_S, PARTS
from benchmarks.gpu_check.check import Check
from benchmarks.gpu_check.common import NOT_ASKED, ROOT
from benchmarks.gpu_check.summary import print_summary
from gptkit import cli  # (standard library only)


def do_part(check: Check, name: str, args) -> dict:
    """One part within its budget (and the time earlier parts left unused); an error of the check's own (a
    bug) fails that part only."""
    budget = check.budgets[name]
    check.part_end = max(time.monotonic() + budget, check.planned_end[name])
    t0 = time.monotonic()
    lacking = [module for module in budgets.PART_MODULES[name] if importlib.util.find_spec(module) is None]
    print(f"{name} (up to {check.left():.0f} s{'; skipped' if lacking else ''})", flush=True)
    try:
        if lacking:
            result = {"status": "skipped", "runs": [], "reason": f"needs {', '.join(lacking)}, not installed here "
                      f"(a wheel carried in shared/wheels: see the launch command in python -m benchmarks.gpu_check --help)"}
        else:
            result = PARTS[name](check, args)
    except Exception as e:
        check.note(f"\n===== gpu_check's own error in part {name}\n{traceback.format_exc()}")
        result = {"status": "failed", "reason": f"gpu_check: {type(e).__name__}: {cli.one_line(e)}"[:300], "runs": []}
    return {"status": result.pop("status"), "seconds": round(time.monotonic() - t0, 1), "budget_s": round(budget),
            "reason": result.pop("reason"), **result}


def parse_args(argv: list[str] | None):
    p = cli.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help="the JSON file (default: gpu_check_DATE.json in $OUT where that is set, else in benchmarks/)")
    p.add_argument("--log", default=None, help="the log of every subprocess (default: --out with .log)")
    p.add_argument("--smoke", action="store_true", help="rehearse every part on the CPU in about a minute")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated parts to run (default {','.join(DEFAULT_PARTS)}), from: "
                        f"{', '.join(PARTS)} (device always runs, first)")
    p.add_argument("--total_s", type=float, default=None,
                   help=f"seconds for the whole check, shared by the parts (default {DEFAULT_TOTAL_S[False]:g}; "
                        f"--smoke {DEFAULT_TOTAL_S[True]:g}); one too short for a part's floor is refused")
    p.add_argument("--dry_run", action="store_true",
                   help="print each part, its budget at --total_s, its need and what it runs, and what is missing "
                        "here, then exit without running")
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
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks"  # ($OUT: what comes back)
    args.out = args.out or str(folder / f"gpu_check_{time.strftime('%Y-%m-%d')}.json")
    args.log = args.log or str(Path(args.out).with_suffix(".log"))
    args.total_s = args.total_s if args.total_s is not None else DEFAULT_TOTAL_S[args.smoke]
    args.val_loss = args.val_loss if args.val_loss is not None else (3.6 if args.smoke else 1.47)
    if args.shakespeare_text and not Path(args.shakespeare_text).is_file():
        raise cli.UsageError(f"--shakespeare_text: {args.shakespeare_text} is not a file")
    if args.nanogpt and nanogpt.nanogpt_dir(args.nanogpt) is None:
        raise cli.UsageError(f"--nanogpt: {args.nanogpt} does not hold nanoGPT's {', '.join(nanogpt.NANOGPT_FILES)}")
    if args.child is None:
        args.budgets = budgets.make_plan(args.parts, args.total_s, args.smoke)  # (a UsageError before anything runs)
        args.missing = budgets.missing_line(args, list(args.budgets))
        args.needs = None if args.smoke else {name: round(budgets.part_need(name)) for name in args.budgets}
    return args


def interrupt(signum, frame) -> None:
    """SIGTERM's handler while the check runs: as Ctrl-C."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


@cli.entry_point()
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child == "peak":
        Path(args.child_out).write_text(json.dumps(device.child_peak(args.smoke)))
        return {}
    if args.dry_run:
        print("\n".join(filter(None, [args.missing, budgets.format_plan(args.budgets, args)])))
        return {}
    check = Check(args)
    print(f"gpu_check{' --smoke (CPU rehearsal)' if args.smoke else ''}: up to {args.total_s:.0f} s; "
          f"JSON {args.out}, log {args.log}", flush=True)
    if args.missing:  # (before any part would look for it, or try a download)
        print(args.missing, flush=True)
    # SIGTERM (a time limit around the whole call) as Ctrl-C: the running subprocess is stopped, and the JSON
    # says where the check was cut before it exits
    terminated = signal.signal(signal.SIGTERM, interrupt)
    name = None
    try:
        no_device = None
        for name in PARTS:
            if name not in args.budgets:
                part = {"status": "skipped", "seconds": 0.0, "budget_s": 0, "reason": NOT_ASKED, "runs": []}
            elif no_device:
                part = {"status": "skipped", "seconds": 0.0, "budget_s": 0, "reason": no_device, "runs": []}
            else:
                part = do_part(check, name, args)
            check.report["parts"][name] = part
            if name == "device" and not args.smoke and not check.report["device"].get("cuda_available"):
                no_device = ("no CUDA device here: run it on a GPU, or --smoke for the CPU rehearsal"
                             if check.report["device"] else "the device could not be read (see the log)")
            check.write()  # (after every part: what it measured is on disk before the next starts)
    except KeyboardInterrupt as e:
        check.report["cut_short"] = (f"interrupted ({e or 'Ctrl-C'}) {check.elapsed():.0f} s in, during the part "
                                     f"{name}: its rows so far and every earlier part's are here")
        check.write()
        raise
    finally:
        signal.signal(signal.SIGTERM, terminated)
        check.close()
    print_summary(check.report)
    print(f"wrote {args.out} and {args.log}")
    if no_device:
        raise cli.UserError(f"{no_device} (the parts are marked skipped in {args.out})")
    return check.report
