"""The one command for whoever has a GPU: the GPU figures BENCHMARKS.md lacks, measured in one go.

    PYTHONPATH=. python benchmarks/gpu_check.py --dry_run   # the plan: each part, its seconds, its need, what it runs
    PYTHONPATH=. python benchmarks/gpu_check.py             # one H100 / H200 (JSON and log into $OUT, or benchmarks/)
    PYTHONPATH=. python benchmarks/gpu_check.py --smoke --out /tmp/smoke.json   # a rehearsal on the CPU
    PYTHONPATH=. python benchmarks/gpu_check.py --parts=nanogpt_train,steps --total_s=400   # parts not in the default

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
        PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_check.py

(The check runs even where the install failed: it then says which package is missing and skips the parts that
need it. The commit comes from git where .git is there, else from $GPU_CHECK_COMMIT or shared/COMMIT: the
commit, then "dirty" where tracked files differed from it.) `--dry_run`, and the run at its start, say in one line what is
missing (tiny Shakespeare's text, nanoGPT's code, a package), before any part would try a download; a part
whose package is missing is skipped, saying so, rather than failing after its minutes.

It runs from a fresh clone on a machine with only torch, numpy, tiktoken, tqdm, crc32c, pytest and transformers
(nothing is installed): this file imports only Python's standard library (and gptkit.cli and
benchmarks/gpu_readings.py, which do too), and every part runs scripts as subprocesses, each with a time limit,
so that a crash or a hang loses that run only. The device is read first, on its own budget; then each asked part
gets its planned seconds, scaled to --total_s (by default what the default parts need: 9.6 minutes), plus what
earlier parts left unused: a part may run until where its time would end had every part before it used its
whole budget. What a part needs is added up from its commands with the H200 figures (H200, one table, the slower
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
"""

from __future__ import annotations

import argparse
import ast
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import gpu_readings  # (standard library only, as gptkit.cli)
from gptkit import cli  # (standard library only)

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Figure:
    value: float
    where: str  # which run's files it was read from (11-26: ../shared/gpu/2026-11-26/; 11-28: benchmarks/gpu/...)


# What the parts' commands take on an H200, in one table: each figure the slower of the two H200 runs, of
# 2026-11-26 (../shared/gpu/2026-11-26/: gpu_check.log, gpu_check.json, README.md) and of 2026-11-28
# (benchmarks/gpu/2026-11-28/: gpu_check.log and .json, the default run; rerun.log, a second call), or, where no
# run has measured it, estimated, and said so. The second machine's host was slower: Python's and CUDA's start,
# compiles and every launch-bound step took 1.3-2x the first's (nanoGPT's iter lines 15-17 ms against 8), and
# three parts ran out of budgets made from the first run alone. run_needs() adds the figures up for each run of
# a part, from the very commands the part runs (start + compile + steps x ms per step); the default budgets hold
# NEED_MARGIN x what the default parts need (tests/test_gpu_check.py fails where one does not), so that a change
# to a part cannot silently starve it.
H200 = {
    "torch_start_s": Figure(9.0, "11-28 gpu_check.log, device: a python with torch, CUDA's start and the matmul "
                                 "peak, 10.0 s, less the peak's 1 s of warm-up (11-26: 4.5 s in all)"),
    "pytest_start_s": Figure(6.5, "11-28 gpu_check.log, CUDA tests, the others: 42.0 s, pytest's own count 36.0 s"),
    "train_start_s": Figure(13.3, "11-28 rerun.log: train.py's config printed 13.3 s after its start (11-26: ~10.4 s "
                                  "to its clock's start)"),
    "train_eval_compile_s": Figure(19.0, "11-28 gpu_check.json, shakespeare: the step-0 evaluation done 29.1 s into "
                                         "train.py's clock, ~32.5 s after its start, less the start (11-26: 10.3 s)"),
    "train_compile_s": Figure(20.3, "11-28 gpu_check.json, shakespeare: the step-250 evaluation at 53.9 s = 29.1 s + "
                                    "250 steps x ~13.5 ms + one evaluation (1.2 s) + the step's compile (11-26: "
                                    "13.5 s; 11-28 rerun.log, graphed: 16.1 s)"),
    "train_compiles_warm_s": Figure(10.5, "11-28 gpu_check.log, steps: 32.0 s for 1,500 graphed steps and 40.5 s for "
                                          "1,500 plain ones, after the shakespeare part: start + both compiles (from "
                                          "inductor's cache, warm from that part's run of the same model) + steps"),
    "train_eval_s": Figure(1.2, "11-28 gpu_check.json, shakespeare: evaluations 4.6 s apart, 250 steps (~3.4 s) "
                                "and one evaluation of 200 batches (11-26: 0.8 s)"),
    "train_ms": Figure(14.0, "11-28 gpu_check.log, shakespeare: configs/shakespeare.py's ms/step as train.py runs "
                             "it, 12.6-16.7 (steps part 10.9-13.2; 11-26: 9-12.6)"),
    "train_graphed_ms": Figure(5.5, "11-28 gpu_check.log, steps: --cuda_graphs=True, 5.8 ms/step over steps 1-100 "
                                    "(warm-up and capture), 5.30-5.32 from then on; rerun.log 5.4-5.5"),
    "train_val_step": Figure(1750, "the first val <= 1.47: at step 1,500 on 11-26 (1.4673); nanoGPT's at 1,750 on "
                                   "11-28 (1.4777 at 1,500), and ours matched its val at steps 250 and 500"),
    "prepare_s": Figure(1.0, "gpu_check.log: prepare/shakespeare_char.py, 1.0 s (both runs)"),
    "bench_start_s": Figure(13.3, "as train_start_s (bench.py's imports and CUDA's start; 11-26: 9.5 s)"),
    "bench_row_s": Figure(31.0, "11-28 gpu_check.log, train: two gpt2nobias rows in one bench.py, 75.0 s, less the "
                                "start: a row's compile (~20 s) and its timed steps (11-26: 26 s)"),
    "decode_eager_s": Figure(28.0, "estimate: the compiled run (41.0 s on 11-28) less its compile (15.8 s), with 200 "
                                   "eager tokens (6.25 ms each) for 200 compiled (1.22 ms); with transformers' "
                                   "reference it took 47.0-47.5 s"),
    "decode_compiled_s": Figure(41.0, "11-28 gpu_check.log, decode: compiled (its compile 15.8 s), 41.0 s (11-26: "
                                      "27 s)"),
    "hf_reference_s": Figure(19.5, "11-28 gpu_check.log, decode: the eager run with transformers' eager generate "
                                   "beside it, 47.0-47.5 s, less decode_eager_s"),
    "decode_window_s": Figure(19.0, "estimate: each further decode window (K tokens a graph), compiled afresh as "
                                    "bench.py compiles every row (15.8 s on 11-28) and timed (~3 s)"),
    "profile_s": Figure(3.0, "estimate: torch.profiler over a few timed steps or tokens, and its table, per row"),
    "plan_s": Figure(37.5, "11-26 gpu_check.log, memory plan: 37.5 s"),
    "readings_s": Figure(1.0, "estimate: NVML's readings through nvidia-smi, three queries of ~0.1-0.3 s at the "
                              "start (pynvml's take milliseconds)"),
    "graph_tests_s": Figure(64.0, "11-28 gpu_check.log: tests/test_cudagraph_cuda.py's five tests, 54.4 s by "
                                  "pytest's count, ~4 s for the eager pair with dropout since added, and ~5 s "
                                  "(estimate) for the compiled dropout captured alone, since added"),
    "decode_window_tests_s": Figure(55.0, "estimate: tests/test_decode_window.py's two CUDA tests, each compiling "
                                          "(mode reduce-overhead) a tiny model's step and window for two samplings, "
                                          "or the engine's buckets: ~2x test_generate's decode graph test (19 s)"),
    "fp8_tests_s": Figure(30.0, "estimate: tests/test_fp8.py's two CUDA tests, 150 training steps of a small GPT "
                                "and one compile (fullgraph)"),
    "generate_loader_tests_s": Figure(19.0, "11-26 gpu_check.log, CUDA tests: test_generate's decode graph and "
                                            "test_loader's batches, 25.5 s, less pytest's start"),
    "engine_tests_s": Figure(10.0, "11-28 gpu_check.log: test_engine's, test_prefix_cache's, test_generate's and "
                                   "test_loader's CUDA tests, 36.0 s together; the rest after the 19 s above, split"),
    "prefix_tests_s": Figure(7.0, "as engine_tests_s: test_prefix_cache's graphed buckets with reuse, inductor's "
                                  "cache warm from test_engine"),
    "other_test_file_s": Figure(20.0, "estimate: a file of CUDA tests not named above"),
    "nanogpt_prepare_s": Figure(2.0, "estimate: its prepare.py on the 1.1M characters (1.0 s on both machines)"),
    "nanogpt_bench_s": Figure(49.0, "11-28 gpu_check.log: its bench.py, 48.5 s (26.68 ms/iter; 11-26: 26.35)"),
    "nanogpt_to_val_s": Figure(94.7, "11-28 rerun.log: its train_shakespeare_char's val 1.4696 at step 1,750, 94.7 s "
                                     "from its start (1.4777 at step 1,500, 87.9 s; 11-26: ~54 s on the faster host)"),
    "nanogpt_start_s": Figure(37.0, "11-28 gpu_check.json, nanogpt: its step-0 evaluation 37.0 s after its start "
                                    "(rerun.log 30.3 s; 11-26: ~19 s)"),
    "nanogpt_compile_s": Figure(20.6, "11-28 gpu_check.json, nanogpt: its step-250 evaluation at 64.6 s = 37.0 s + "
                                      "250 x 17.2 ms + an evaluation (2.7 s) + the training step's compile"),
    "nanogpt_ms": Figure(17.2, "11-28 gpu_check.json, nanogpt: the median of its iter lines (rerun.log 15.2; "
                               "11-26: ~8.0)"),
    "nanogpt_eval_s": Figure(2.7, "11-28 gpu_check.json, nanogpt: evaluations 7.0 s apart, 250 iterations (4.3 s) "
                                  "and one evaluation (11-26: ~1.6 s)"),
    "nanogpt_eval_interval": Figure(250, "nanoGPT's config/train_shakespeare_char.py: eval_interval = 250"),
    "serve_s": Figure(150.0, "estimate: GPT-2's shape compiles 6 buckets at ~12 s each before its load, then 8 s for "
                             "each of 3 client levels, eager and compiled"),
}


def h200(name: str) -> float:
    return H200[name].value


@dataclass(frozen=True)
class Budget:
    gpu: float  # seconds planned on a GPU (at least what the part needs there: run_needs)
    gpu_floor: float  # the least it is started with on a GPU
    smoke: float  # ... and in --smoke
    smoke_floor: float

    def of(self, smoke: bool) -> tuple[float, float]:
        return (self.smoke, self.smoke_floor) if smoke else (self.gpu, self.gpu_floor)


# The device read comes first, on its own budget: no other part's share can skip it (4.5 s on 2026-11-26, 10.0 s
# with the matmul's 1 s of warm-up on 2026-11-28's slower host; now NVML's readings, 3 s of warm-up and two shapes).
DEVICE_BUDGET = Budget(18, 12, 25, 15)
# Each default part's budget is at least NEED_MARGIN x what its commands need on an H200 (run_needs; the test of
# the plan fails where one is not), so that a part measured as slow as the slower host was still ends in time.
NEED_MARGIN = 1.1
BUDGETS = {"decode": Budget(74, 50, 40, 20), "train": Budget(141, 90, 50, 25), "nanogpt": Budget(55, 50, 10, 5),
           "shakespeare": Budget(82, 60, 60, 30), "tests": Budget(182, 80, 30, 20),
           # not in the default run (--parts=...): each with its own time
           "nanogpt_train": Budget(120, 60, 40, 15), "steps": Budget(140, 50, 45, 20),
           "decode_more": Budget(53, 30, 10, 5), "plan": Budget(42, 40, 10, 5), "serve": Budget(165, 90, 10, 5),
           "train_more": Budget(280, 35, 10, 5)}
DEFAULT_PARTS = ("decode", "train", "nanogpt", "shakespeare", "tests")  # (in PARTS' order)
DEFAULT_TOTAL_S = {False: 578.0, True: 300.0}  # on a GPU (the default parts' budgets), and in --smoke
# A run is not started with less time than this left in its part (it would only import torch and be stopped).
MIN_RUN_S = 8
# How long a stopped run has to exit after SIGTERM before it is killed (twice that is kept back from the
# budgets, so that stopping the last run still ends within --total_s).
GRACE_S = 5
# The matmul peak: PEAK_WARMUP_S of warm-up on the first shape (ten products, ~15 ms, read 725 TFLOP/s on the
# H200 against the 788-798 that H200s give once their clocks are up, and 1 s read 607 on the slower host of
# 2026-11-28, with nothing to say why), then each shape timed for ~PEAK_TIMED_S while NVML is read on a thread;
# the second shape gets PEAK_SHAPE_WARMUP_S of its own first. The first is the denominator of mfu_measured_peak.
PEAK_WARMUP_S = {False: 3.0, True: 0.1}
PEAK_SHAPE_WARMUP_S = {False: 0.5, True: 0.05}
PEAK_TIMED_S = {False: 1.0, True: 0.1}
# (m, k, n) of each product: 8192^3, and GPT-2's MLP up-projection at 12 x 1024 tokens (in --smoke, on the CPU in
# float32, shapes a CPU times in a moment)
PEAK_SHAPES = {False: (("8192^3", (8192, 8192, 8192)), ("GPT-2's 12,288 x 768 x 3,072", (12288, 768, 3072))),
               True: (("512^3", (512, 512, 512)), ("GPT-2's shape / 16", (768, 48, 192)))}

# bench.py's training runs in the default run, the most decisive first: (what, options, extra), where the last
# `extra` rows of a run are measured if the part's time holds them (they are not in its need; a run stopped after
# its other rows is "stopped", not a timeout). First nanoGPT's shape (no biases) at 12 x 1024 as one CUDA graph,
# profiled (kernel time by kind), the head in bf16 and in FP8, the loss by slices (the default), then, as time
# allows, the same two over all the logits at once (bench.py's product: the loss varies slower than the head);
# then the larger micro-batches (32 gave the best tokens/s on 2026-11-26), the most likely best first. The step
# as train.py runs it (not graphed: 0.5 ms slower at 12 x 1024 on 2026-11-28) is in train_more. A flag that this
# checkout's bench.py lacks is left out, saying so.
TRAIN_RUNS = (
    ("the profiled step at 12 x 1024 as one CUDA graph: the head in bf16 and in FP8, the loss by slices, then whole",
     ["--models=gpt2nobias", "--batch_size=12", "--cuda_graphs=True", "--profile_step=True",
      "--loss_chunk=default,plain", "--fp8_head=False,True"], 2),
    ("micro-batches 32, 24, 16 as one CUDA graph", ["--models=gpt2nobias", "--batch_size=32,24,16", "--cuda_graphs=True"],
     2),
)
# ... and the rest, the train_more part (--parts=train_more, with its own time)
TRAIN_MORE_RUNS = (
    ("12 x 1024 as train.py runs it (not graphed)", ["--models=gpt2nobias", "--batch_size=12"], 0),
    ("each block compiled on its own", ["--models=gpt2nobias", "--batch_size=12", "--compile_scope=blocks"], 0),
    ("compile's autotuned kernels", ["--models=gpt2nobias", "--batch_size=12",
                                     "--compile_mode=max-autotune-no-cudagraphs"], 0),
    ("the optimizer step compiled", ["--models=gpt2nobias", "--batch_size=12", "--compile_optimizer=True"], 0),
    ("GPT-2 with biases, the modern model", ["--models=gpt2,modern", "--batch_size=12"], 0),
)
# ... and their stand-ins in --smoke: the tiny model, eager (compiling on a CPU takes minutes); one run, as on a
# GPU, its CUDA graph and cuDNN attention rows skipped (no CUDA) and reported so, its rows profiled (not the FP8
# head: CUDA only).
SMOKE_TRAIN_RUNS = (
    ("tiny, with and without biases, cuDNN's attention and one CUDA graph (skipped: no CUDA)",
     ["--models=tinynobias,tiny", "--batch_size=2", "--sdpa=default,cudnn", "--cuda_graphs=False,True",
      "--profile_step=True"], 0),
)
SMOKE_TRAIN_MORE_RUNS = (("tiny, blocks compiled on their own", ["--models=tinynobias", "--batch_size=2"], 0),)
# bench.py's variant options: a comma list each, one row per combination (run_needs counts the rows; a decode
# row per window).
BENCH_VARIANTS = ("--models", "--batch_size", "--sdpa", "--compile_mode", "--compile_optimizer", "--compile_scope",
                  "--cuda_graphs", "--loss_chunk", "--fp8_head", "--decode_window")
# The steps part (--parts=steps, not in the default run): train.py's options for each run (a run each, the graphed
# one first: its late window is the figure the part exists for), its log interval, and the two steps whose
# ms/step (each over the log interval before it) it reports: the early window starts after the graphed run's
# warm-up steps and capture (gptkit/cudagraph.py: 3 warm-up steps, captured at the 4th), which the first interval
# holds; the late one is the last that every run reached, at most the second.
STEP_RUNS = (("one CUDA graph", ["--cuda_graphs=True"]), ("as train.py runs it", []))
STEP_LOG, STEP_AT = 100, (200, 1000)
SMOKE_STEP_LOG, SMOKE_STEP_AT = 20, (40, 120)
# The shakespeare part's options on top of configs/shakespeare.py's (--smoke: of the CPU config's, shrunk, and
# without the CUDA graph): the fastest way to its val loss (the graphed step, 2.1-2.4x the plain one's speed on
# the H200 of 2026-11-28, the same val loss at step 1,500), with its saves in the background, so that the
# pinned-memory copy and the writer thread run beside a captured step on a GPU. Then, where the part's time
# (with what earlier parts left) holds its need, train.py as it runs by default, to the same val loss: the pair
# that decides --cuda_graphs' default.
SHAKESPEARE_OPTIONS = ("--async_save=True", "--cuda_graphs=True")


def shakespeare_options(smoke: bool) -> tuple[str, ...]:
    return tuple(o for o in SHAKESPEARE_OPTIONS if not (smoke and o.startswith("--cuda_graphs")))


# The decode part: batch-1 decoding compiled, in windows of K tokens a CUDA graph (a row each, K=1 the per-token
# step; the last two if time holds them), each row profiled (host and GPU microseconds per token), and the
# 1,000-token prefill. Eager decoding and transformers' eager generate beside it (--hf_reference) are the
# decode_more part (ours was 1.28x transformers' on the H200 of 2026-11-28).
DECODE_RUNS = (("compiled, in windows of 1, 16, 8, 32 tokens, profiled",
                ["--compile=True", "--decode_window=1,16,8,32", "--profile_decode=True"], 2),)
DECODE_MORE_RUNS = (("eager, beside transformers' eager generate", ["--compile=False", "--hf_reference"], 0),)
SMOKE_DECODE_RUNS = (("eager, in windows of 1 and 4 tokens, profiled",
                      ["--compile=False", "--hf_reference", "--decode_window=1,4", "--profile_decode=True"], 0),)
# The tests part: tests/test_cudagraph_cuda.py first, on its own (the graphed step, its capture compiled and
# beside an asynchronous save), then the files of the newest CUDA code (the decode window, the FP8 head), then,
# where the part's time holds them, the other files holding CUDA tests (they passed on 2026-11-28); a test
# running longer than CUDA_TEST_LIMIT_S is stopped (its outcome: timeout) and pytest goes on with the rest.
GRAPH_TESTS = "tests/test_cudagraph_cuda.py"
NEW_TESTS = ("tests/test_decode_window.py", "tests/test_fp8.py")
CUDA_TEST_LIMIT_S = 90
CUDA_TEST_FILE_S = {GRAPH_TESTS: "graph_tests_s", "tests/test_decode_window.py": "decode_window_tests_s",
                    "tests/test_fp8.py": "fp8_tests_s", "tests/test_generate.py": "generate_loader_tests_s",
                    "tests/test_loader.py": None, "tests/test_engine.py": "engine_tests_s",
                    "tests/test_prefix_cache.py": "prefix_tests_s"}  # (None: in another's)

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
# The Python packages (beyond the standard library) each part's commands need. A part one of whose packages is
# not installed is skipped, saying which, instead of failing after its minutes (a GPU image may lack one of the
# project's dependencies: crc32c, carried as a wheel by the launch command above). tests/test_gpu_check.py
# checks that train.py, bench.py and the CUDA test files import no other of the project's dependencies.
# (transformers, for decode's reference row only, is not one: without it that bench.py run keeps its eager
# rows and ends on its one-line error, and the compiled run goes on.)
OURS = ("torch", "numpy", "tiktoken", "tqdm", "crc32c")  # train.py, bench.py, prepare/, the tests
PART_MODULES = {"device": ("torch",), "tests": (*OURS, "pytest"), "train": OURS, "nanogpt": ("torch", "numpy"),
                "nanogpt_train": ("torch", "numpy"), "shakespeare": OURS, "steps": OURS, "decode": OURS,
                "decode_more": OURS, "plan": OURS, "serve": (*OURS, *SERVE_PACKAGES), "train_more": OURS}
# Where a launcher that can send only the working tree writes the commit (.git may not travel): the commit, then
# "dirty" where tracked files differed from it. The variable wins over the file.
COMMIT_ENV, COMMIT_FILE = "GPU_CHECK_COMMIT", "COMMIT"


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
        """What the JSON keeps of a run; one that failed or was stopped at its limit, with its last lines."""
        kept = {"label": self.label, "command": self.command, "status": self.status,
                "returncode": self.returncode, "seconds": round(self.seconds, 1)}
        return kept | ({"last_lines": last_lines(self.output)} if self.status in ("failed", "timeout") else {})


def last_lines(output: str, n: int = 5) -> list[str]:
    """The last n lines a run printed that say something (progress bars' carriage returns cut to their end)."""
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in output.splitlines()]
    return [line[:300] for line in lines if line.strip()][-n:]


class Check:
    """The state of one gpu_check: where it writes, the clock, the report, and the running of subprocesses."""

    def __init__(self, args):
        self.smoke = args.smoke
        self.out, self.log_path = Path(args.out), Path(args.log)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
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
        tiktoken_files = shared_path("data/tiktoken_cache")  # GPT-2's BPE, for a machine with no network
        if tiktoken_files is not None:
            self.env.setdefault("TIKTOKEN_CACHE_DIR", str(tiktoken_files))
        if args.smoke:  # tiny models on a small shared CPU: one thread each runs fastest
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": ["benchmarks/gpu_check.py", *args.argv],
                       "smoke": args.smoke, "total_s": args.total_s, "elapsed_s": 0.0, "device": {},
                       "budgets_s": {name: round(b) for name, b in self.budgets.items()},
                       "needs_s": None if args.smoke else {name: round(part_need(name)) for name in self.budgets},
                       "missing": args.missing, "torch": None, "git": git_version(), "readings": {}, "parts": {},
                       "rows": [], "summary": {}}
        self.part_end = self.deadline
        self.run_offset = 0  # where the running subprocess' output starts in the log

    def left(self) -> float:
        """Seconds the current part may still use: its budget, within the whole check's."""
        return min(self.part_end, self.deadline) - time.monotonic()

    def share(self, own: float, later: float) -> float:
        """A run's time limit: the part's time less what the runs after it need (`later`), but at least its own
        need where the part has that much (the runs come most wanted first)."""
        return max(own, self.left() - later)

    def note(self, text: str) -> None:
        self.log.write(text.encode())
        self.log.flush()

    def run(self, label: str, command: list[str], watch: Callable[[], bool | str | None] | None = None,
            env: dict[str, str] | None = None, cwd: Path = ROOT, limit_s: float | None = None) -> Run | None:
        """Run `command` in the checkout (or `cwd`; with `env` added to the environment), its output into the
        log, until it exits, the part's time (or `limit_s`, if less) is up (timeout), or `watch` (called every
        half second; it may read output_so_far()) says it has what it needs (True: stopped) or names the status
        to stop it with. None when too little time is left to start it."""
        limit = self.left() if limit_s is None else min(self.left(), limit_s)
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
                elif watch is not None and (verdict := watch()):
                    status = verdict if isinstance(verdict, str) else "stopped"
                elif time.monotonic() - t0 > limit:
                    status = "timeout"
        finally:  # (also on Ctrl-C: no run is left behind)
            if proc.poll() is None:
                stop(proc)
        seconds = time.monotonic() - t0
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            output = f.read().decode(errors="replace")
        newline = "" if not output or output.endswith("\n") else "\n"  # (a run stopped mid-line: pytest -v)
        self.note(f"{newline}----- {label}: {status}, exit code {proc.returncode}, {seconds:.1f} s\n")
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

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def write(self) -> None:
        """The JSON, rewritten whole (beside it first, then moved: never half a file) after every part and every
        bench.py run, with the summary of what is measured so far: a check cut short (the call's limit, a
        crash) keeps what it measured."""
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        try:
            add_measured_mfu(self.report)
            self.report["summary"] = summarise(self.report, self.smoke)
        except Exception as e:  # (a bug of the summary's must not cost the rows)
            self.report["summary"] = {"error": f"{type(e).__name__}: {cli.one_line(e)}"[:300]}
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
    """The checkout's commit and whether tracked files differ from it: from git, or where .git did not travel
    (a copy of the working tree only) from $GPU_CHECK_COMMIT or shared/COMMIT, written before the run by whoever
    launched it (the commit, then "dirty" where tracked files differed); None where nothing says."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit:
        status = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": commit, "dirty": None if status is None else bool(status), "from": "git"}
    file = shared_path(COMMIT_FILE)
    for text, source in ((os.environ.get(COMMIT_ENV), f"${COMMIT_ENV}"),
                         (file.read_text() if file is not None and file.is_file() else None, str(file))):
        words = (text or "").split()
        if words and re.fullmatch(r"[0-9a-f]{7,40}", words[0]):
            return {"commit": words[0], "dirty": "dirty" in words[1:], "from": source}
    return {"commit": None, "dirty": None, "from": None}


def shared_path(relative: str) -> Path | None:
    """A file or folder of the project's shared data (tiny Shakespeare, GPT-2's BPE files, nanoGPT's code, the
    commit): in shared/ inside the checkout (where a launcher copies it for a machine that gets the working tree
    only) or beside the checkout; None where neither has it."""
    return next((p for p in (ROOT / "shared" / relative, ROOT.parent / "shared" / relative) if p.exists()), None)


def missing_modules(parts) -> dict[str, list[str]]:
    """Each package that the asked parts import and this Python lacks, with those parts."""
    missing: dict[str, list[str]] = {}
    for part in parts:
        for module in PART_MODULES[part]:
            if importlib.util.find_spec(module) is None:
                missing.setdefault(module, []).append(part)
    return missing


def missing_line(args, parts) -> str | None:
    """What the asked parts would look for and not find here, in one line (None: nothing): packages (those parts
    are skipped), tiny Shakespeare's text (prepared data aside, its parts would try a download, and nanoGPT is
    skipped), nanoGPT's code ("no anchor")."""
    said = [f"the package {module} ({', '.join(names)} skipped)" for module, names in missing_modules(parts).items()]
    if {"shakespeare", "steps", "nanogpt_train"} & set(parts) and shakespeare_text(args.shakespeare_text) is None:
        prepared = (ROOT / "data" / "shakespeare_char" / "meta.json").is_file()
        download = [p for p in ("shakespeare", "steps") if p in parts and not prepared]
        said.append("tiny Shakespeare's text, shared/data/tinyshakespeare.txt or --shakespeare_text=PATH ("
                    + "; ".join(([f"{', '.join(download)} would download it"] if download else [])
                                + (["nanogpt_train skipped"] if "nanogpt_train" in parts else [])) + ")")
    anchored = [p for p in ("nanogpt", "nanogpt_train") if p in parts]
    if anchored and nanogpt_dir(args.nanogpt) is None:
        said.append(f"nanoGPT's code, shared/anchors/nanoGPT or --nanogpt=PATH ({', '.join(anchored)} skipped: no "
                    f"anchor)")
    if not said:
        return None
    return (f"missing: {'; '.join(said)}. (shared/ in the checkout or beside it; the launch command in "
            f"benchmarks/gpu_check.py copies it and carries the package)")


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
    """NVML's readings of the GPU as the check starts (clocks, power, temperature, throttle reasons, other
    processes: benchmarks/gpu_readings.py, here, before anything has warmed it), then the device, the versions
    and the measured dense peaks at two shapes with the readings taken while each ran, from a child process
    (this one imports no torch)."""
    reading = gpu_readings.read()
    check.report["readings"] = {"start": reading, "line": gpu_readings.line(reading)}
    check.note(f"\n===== NVML's readings at the start: {check.report['readings']['line']}\n")
    print(f"  readings: {check.report['readings']['line']}", flush=True)
    out = check.tmp / "peak.json"
    run = check.run("device and matmul peaks", device_command(check.smoke, out))
    info = json.loads(out.read_text()) if out.is_file() else {}
    check.report["device"] = info
    check.report["torch"] = info.get("torch")
    status, reason = outcome([run], ["the matmul peak"])
    if status == "ok" and not check.smoke and not info.get("cuda_available"):
        status, reason = "failed", "no CUDA device here (torch.cuda.is_available() is False)"
    return {"status": status, "reason": reason, "runs": [run.record()] if run else [], "peak": info.get("peak"),
            "peaks": info.get("peaks")}


def marks_cuda(source: str) -> bool:
    """Whether a test file holds a test marked cuda (the marker tests/ci_skips.py defines): a test function
    decorated @pytest.mark.cuda, or the module's pytestmark (a test's text inside a string does not count)."""
    def is_cuda(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "cuda" and ast.unparse(n) == "pytest.mark.cuda"
                   for n in ast.walk(node))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            if is_cuda(node.value):
                return True
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and any(is_cuda(d) for d in node.decorator_list):
            return True
    return False


def cuda_test_files() -> list[str]:
    """The test files holding a test marked cuda (it needs a CUDA GPU)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if marks_cuda(p.read_text()))


OTHER_TESTS = "CUDA tests: the others"  # (the group run where the part's time holds it: OPTIONAL_RUNS)


def cuda_test_runs() -> list[tuple[str, list[str]]]:
    """The tests part's pytest runs, in order: the graphed training step's file on its own, then the newest
    code's (NEW_TESTS), then the others."""
    files = cuda_test_files()
    groups = (("CUDA tests: the graphed training step", [f for f in files if f == GRAPH_TESTS]),
              ("CUDA tests: the decode window, the FP8 head", [f for f in files if f in NEW_TESTS]),
              (OTHER_TESTS, [f for f in files if f != GRAPH_TESTS and f not in NEW_TESTS]))
    return [(label, chosen) for label, chosen in groups if chosen]


def tests_command(files: list[str], done: list[str] = ()) -> list[str]:
    """pytest on the CUDA tests of `files`, each outcome on its own line as the test ends (--verbosity=1: the
    project's addopts say -q), the tests in `done` left out."""
    return python("-m", "pytest", "--verbosity=1", "-rfE", "-p", "no:cacheprovider", "-m", "cuda",
                  *[f"--deselect={test}" for test in done], *files)


# pytest -v: a test's node id when it starts, its outcome on the same line when it ends; -rfE's summary at the end
TEST_LINE = re.compile(r"^(?P<test>\S+::\S+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
                       r"(?: \((?P<why>.*)\))?(?:\s+\[\s*\d+%\])?\s*$", re.M)
TEST_FAILURE = re.compile(r"^(?:FAILED|ERROR) (?P<test>\S+::\S+)(?: - (?P<message>.*))?$", re.M)
RUNNING_TEST = re.compile(r"(?:^|\n)(?P<test>\S+::\S+) *$")


def read_outcomes(output: str) -> dict[str, dict]:
    """Each test's outcome (passed, failed, error, skipped, ...) and message, from pytest -v's lines (a failure
    in a teardown after a pass counts) and its short summary (the failures' messages, at the end)."""
    found: dict[str, dict] = {}
    for m in TEST_LINE.finditer(output):
        outcome = m["outcome"].lower()
        kept = found.get(m["test"])
        if kept is None or outcome in ("failed", "error"):
            found[m["test"]] = {"test": m["test"], "outcome": outcome, "message": m["why"]}
    for m in TEST_FAILURE.finditer(output):
        if m["test"] in found and m["message"]:
            found[m["test"]]["message"] = cli.one_line(m["message"])[:300]
    return found


def running_test(output: str) -> str | None:
    """The test pytest -v is running: its node id on the last line, not yet followed by an outcome."""
    m = RUNNING_TEST.search(output[-2000:])
    return m["test"] if m else None


class PerTestLimit:
    """A watch over pytest -v (Check.run): which test is running and since when; once one has run past
    limit_s, it stops the run with the status timeout, naming that test in `hung`."""

    def __init__(self, check: Check, limit_s: float):
        self.check, self.limit_s = check, limit_s
        self.current: str | None = None
        self.since = time.monotonic()
        self.hung: str | None = None

    def __call__(self) -> str | None:
        running = running_test(self.check.output_so_far())
        now = time.monotonic()
        if running != self.current:
            self.current, self.since = running, now
        if running is not None and now - self.since > self.limit_s:
            self.hung = running
            return "timeout"
        return None


def run_tests(check: Check, label: str, files: list[str], limit_s: float, env: dict[str, str] | None = None,
              test_limit_s: float = CUDA_TEST_LIMIT_S, cwd: Path = ROOT) -> tuple[list[Run], dict[str, dict]]:
    """pytest on `files` (run in `cwd`, its rootdir: -v names the tests by their node ids there) within limit_s,
    each test within test_limit_s: a test past it is stopped (its outcome timeout) and pytest starts again on
    the tests that have no outcome yet. Every outcome printed before a stop is kept; the runs, and each test's
    outcome."""
    end = time.monotonic() + limit_s
    runs: list[Run] = []
    results: dict[str, dict] = {}
    while True:
        clock = PerTestLimit(check, test_limit_s)
        run = check.run(label, tests_command(files, list(results)), clock, env=env, cwd=cwd,
                        limit_s=end - time.monotonic())
        if run is None:
            return runs, results
        runs.append(run)
        known = set(results)
        results.update(read_outcomes(run.output))
        cut = clock.hung or (clock.current if run.status == "timeout" else None)
        if cut is not None and cut not in results:
            why = f"no outcome within {test_limit_s:g} s" if clock.hung else "running when the part's time was up"
            results[cut] = {"test": cut, "outcome": "timeout", "message": f"{why}: stopped"}
        if clock.hung is None or clock.hung in known:  # (a test left out that ran again: no loop)
            return runs, results


def part_tests(check: Check, args) -> dict:
    groups = cuda_test_runs()
    if not groups:
        return {"status": "skipped", "reason": "no test file holds a test that skips without CUDA", "runs": []}
    # The tests' conftest asks tiktoken for GPT-2's BPE files at start, a download where they are not cached;
    # the CUDA tests need none, and on a machine without network the attempt could wait long for an answer. A
    # proxy that refuses at once makes it fail at once (those tests then skip, saying why).
    # (COLUMNS: pytest -v cuts a line, a skip's reason first, at the terminal's width, 80 in a file)
    offline = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "COLUMNS": "250"}
    needs = [need for _, need in run_needs("tests", check.smoke)]
    counted = [0.0 if label in OPTIONAL_RUNS else need for (label, _), need in zip(groups, needs)]
    runs: list[Run] = []
    results: dict[str, dict] = {}
    not_started, not_run = [], []
    for i, (label, files) in enumerate(groups):
        if label in OPTIONAL_RUNS and check.left() < needs[i]:
            not_run.append(f"{label} ({', '.join(files)}): not enough time left ({check.left():.0f} s; it needs "
                           f"{needs[i]:.0f} s): --parts=tests runs them")
            continue
        done, found = run_tests(check, label, files, check.share(needs[i], sum(counted[i + 1:])), offline)
        runs += done
        results.update(found)
        if not done:
            not_started.append(label)
    counts = {o: sum(r["outcome"] == o for r in results.values())
              for o in ("passed", "failed", "error", "skipped", "timeout")}
    bad = [r["test"] for r in results.values() if r["outcome"] in ("failed", "error")]
    late = [r["test"] for r in results.values() if r["outcome"] == "timeout"]
    broken = [r.label for r in runs if r.status == "failed"]  # (without a failed test: collection, an import)
    status, reason = "ok", None
    if bad:
        status, reason = "failed", "failed: " + ", ".join(bad) + (f"; timeout: {', '.join(late)}" if late else "")
    elif broken:
        status, reason = "failed", f"pytest failed (see the log): {'; '.join(broken)}"
    elif late or not_started:
        status, reason = "timeout", "; ".join(([f"timeout: {', '.join(late)}"] if late else [])
                                             + ([f"not reached: {'; '.join(not_started)}"] if not_started else []))
    elif not_run:
        reason = "; ".join(not_run)
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs], "counts": counts,
            "results": list(results.values()), "not_run": not_run}


def bench_command(options: list[str], extra: list[str], path: Path) -> list[str]:
    return python("bench.py", *options, *extra, "--keep_going", f"--json={path}")


def bench_flags() -> set[str] | None:
    """The options this checkout's bench.py accepts: the fields of its BenchConfig, read from its source (this
    script imports no torch); None where that cannot be read (then every option is passed as written)."""
    try:
        tree = ast.parse((ROOT / "bench.py").read_text())
    except (OSError, SyntaxError):
        return None
    config = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "BenchConfig"), None)
    if config is None:
        return None
    return {node.target.id for node in config.body if isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)}


def accepted(options: list[str], flags: set[str] | None) -> tuple[list[str], list[str]]:
    """`options` split into those bench.py accepts and those it lacks (left out: a checkout older than the
    flag); with flags None, all accepted."""
    def known(option: str) -> bool:
        return flags is None or option.removeprefix("--").split("=", 1)[0] in flags

    return [o for o in options if known(o)], [o for o in options if not known(o)]


def bench_table(kind: str, smoke: bool) -> tuple[tuple, list[str]]:
    """A bench.py part's runs as written ((what, options, extra rows) each), and the options they share."""
    if kind in ("train", "train_more"):
        options = ["--device=cpu", "--skip_decode", "--warmup=1", "--repeats=2"] if smoke else ["--device=cuda",
                                                                                               "--skip_decode"]
        runs = {("train", False): TRAIN_RUNS, ("train", True): SMOKE_TRAIN_RUNS,
                ("train_more", False): TRAIN_MORE_RUNS, ("train_more", True): SMOKE_TRAIN_MORE_RUNS}[kind, smoke]
        return runs, options
    if smoke:
        return SMOKE_DECODE_RUNS, ["--device=cpu", "--models=tiny", "--skip_train", "--skip_nocache",
                                   "--decode_batch=1", "--decode_tokens=16", "--decode_repeats=2", "--prefill_tokens=64"]
    return (DECODE_MORE_RUNS if kind == "decode_more" else DECODE_RUNS,
            ["--device=cuda", "--models=gpt2", "--skip_train", "--skip_nocache", "--decode_batch=1"])


def bench_runs(kind: str, smoke: bool) -> tuple[list[tuple[str, list[str], int]], list[str]]:
    """A bench.py part's runs ((what, options, extra rows) each: the last `extra` rows measured if time holds
    them), each with only the options this bench.py accepts, and the options they share."""
    runs, options = bench_table(kind, smoke)
    flags = bench_flags()
    kept = []
    for label, extra, optional in runs:
        usable = accepted(extra, flags)[0]
        kept.append((label, usable, min(optional, bench_rows(options + usable) - 1)))
    return kept, options


def bench_lacking(kind: str, smoke: bool) -> list[str]:
    """The options of a bench.py part's runs that this checkout's bench.py lacks (left out of its commands)."""
    flags = bench_flags()
    return sorted({o.split("=")[0] for _, extra, _ in bench_table(kind, smoke)[0] for o in accepted(extra, flags)[1]})


def bench_part(check: Check, kind: str, runs: list, options: list[str]) -> dict:
    """bench.py once per group of rows (`runs`: (what, options, extra rows)), most wanted first, with --keep_going
    and --json; the rows join the report as each run ends (the JSON rewritten), each with the group's name in
    "run". A run stopped at its limit after all but its extra rows is "stopped" (what it was for is measured).
    A row that failed (which --keep_going reports as a row and bench.py's exit code hides) fails the part, named
    with its reason."""
    needs = [need for _, need in run_needs(kind, check.smoke)]
    done, failed_rows, cut = [], [], []
    for i, (label, extra, optional) in enumerate(runs):
        path = check.tmp / f"{kind}_{i}.json"
        run = check.run(f"{kind}: {label}", bench_command(options, extra, path),
                        limit_s=check.share(needs[i], sum(needs[i + 1:])))
        rows = read_rows(path)
        wanted = bench_rows(options + extra)  # (its rows of the part's kind: a decode run's prefill row aside)
        measured = sum(row.get("kind") == ("train" if kind.startswith("train") else "decode") for row in rows)
        if run is not None and run.status == "timeout" and optional and measured >= wanted - optional:
            run.status = "stopped"  # (its last rows were measured as time allowed)
            cut.append(f"{label}: {measured} of {wanted} rows (the last {optional} as time allowed)")
        done.append(run)
        for row in rows:
            check.report["rows"].append({"run": f"{kind}: {label}", **row})
            if row.get("status") == "failed":
                failed_rows.append(f"{row_name(row)}: {str(row.get('reason'))[:200]}")
        check.write()  # (a check cut short keeps these rows)
    status, reason = outcome(done, [label for label, _, _ in runs])
    if failed_rows:
        rows = f"failed rows: {'; '.join(failed_rows)}"
        status, reason = "failed", rows if reason is None else f"{rows}; {reason}"
    lacking = bench_lacking(kind, check.smoke)
    return {"status": status, "reason": reason, "runs": [r.record() for r in done if r], "cut_short": cut,
            "lacking_flags": lacking}


def row_name(row: dict) -> str:
    """A bench.py row in a few words: its kind and model, micro-batch, and what its variant changes."""
    words = [row.get("kind", "?"), str(row.get("model")), f"batch {row.get('batch_size')}"]
    defaults = {"sdpa": "default", "compile_mode": "default", "compile_scope": "model", "compile_optimizer": False,
                "cuda_graphs": False, "fp8_head": False, "decode_window": 1}
    words += [f"{key}={row[key]}" for key, default in defaults.items() if row.get(key, default) != default]
    if row.get("kind") != "train" and "compile" in row:
        words.append("compiled" if row["compile"] else "eager")
    return " ".join(words)


def part_train(check: Check, args) -> dict:
    return bench_part(check, "train", *bench_runs("train", check.smoke))


def part_train_more(check: Check, args) -> dict:
    return bench_part(check, "train_more", *bench_runs("train_more", check.smoke))


def part_decode(check: Check, args) -> dict:
    return bench_part(check, "decode", *bench_runs("decode", check.smoke))


def part_decode_more(check: Check, args) -> dict:
    return bench_part(check, "decode_more", *bench_runs("decode_more", check.smoke))


def shakespeare_text(given: str | None) -> Path | None:
    """A local copy of tiny Shakespeare: --shakespeare_text, or shared/data/tinyshakespeare.txt in the checkout
    or beside it; None when there is none."""
    if given:
        return Path(given) if Path(given).is_file() else None
    return shared_path("data/tinyshakespeare.txt")


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
    warm-up and capture) and late in a long run without evaluations (over the interval before STEP_AT[1], or
    the last interval that every run reached), with --cuda_graphs=True first (skipped on the CPU, where there is
    no graph to capture) and as train.py runs it. Each run may use the part's time less what the next needs."""
    data_root, runs, why = shakespeare_data(check, args)
    if data_root is None:
        return {"status": "skipped", "runs": [r.record() for r in runs], "reason": why}
    log, at = (SMOKE_STEP_LOG, SMOKE_STEP_AT) if check.smoke else (STEP_LOG, STEP_AT)
    wanted = [(label, extra) for label, extra in STEP_RUNS if not (check.smoke and extra)]
    needs = [need for _, need in run_needs("steps", check.smoke)][-len(wanted):]  # (less the data's preparation)
    results, done = [], []
    for label, extra in STEP_RUNS:
        if (label, extra) not in wanted:
            results.append({"run": label, "skipped": "--smoke: no CUDA graph on the CPU"})
            continue
        i = len(done)
        out_dir = check.tmp / f"steps_{i}"
        command = steps_command(check.smoke, data_root, out_dir, extra)
        done.append(check.run(f"steps: {label}", command, limit_s=check.share(needs[i], sum(needs[i + 1:]))))
        ms = {e["step"]: e["ms_per_step"] for e in read_metrics(out_dir / "metrics.jsonl")
              if e.get("ms_per_step") is not None and e["step"] % log == 0}
        results.append({"run": label, "ms_per_step": {str(step): ms[step] for step in sorted(ms)}})
    status, reason = outcome(done, [label for label, _ in wanted])
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs + done if r],
            "windows": step_windows(results, at, log), "steps": results}


def step_windows(results: list[dict], at: tuple[int, int], log: int) -> dict:
    """The windows the steps part compares (first and last step of each): the early one, before at[0], and the
    late one, before at[1] or else the last log step after at[0] that every run with figures reached (a run
    with none, one that failed at once, does not take the other's away: without a common window each run's
    late one is its own last). Each run's ms/step over them (early_ms, late_ms at late_step, and their ratio)
    is added to its result."""
    measured = [r for r in results if r.get("ms_per_step")]
    reached = [set(map(int, r["ms_per_step"])) for r in measured]
    late = max((step for step in set.intersection(*reached) if at[0] < step <= at[1]), default=None) if reached else None
    for r in results:
        if "ms_per_step" not in r:
            continue
        steps = set(map(int, r["ms_per_step"]))
        own = late or max((step for step in steps if at[0] < step <= at[1]), default=None)
        early, last = r["ms_per_step"].get(str(at[0])), r["ms_per_step"].get(str(own))
        r.update(late_step=own, early_ms=early, late_ms=last, late_over_early=last / early if early and last else None)
    return {"early": [at[0] - log + 1, at[0]], "late": [late - log + 1, late] if late else None,
            "late_wanted": [at[1] - log + 1, at[1]]}


def train_until_val(check: Check, args, label: str, command: list[str], out_dir: Path) -> tuple[Run | None, dict]:
    """train.py (`command`, writing into out_dir) until its first evaluation at or below args.val_loss, then
    stopped: the run, and what it reached (step, val_loss, elapsed_s from its process start, wall_s), its
    evaluations and its start-up trace (runs.jsonl's start: imports, device, data, model, ...)."""
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

    run = check.run(label, command, watch)
    watch()  # what it wrote just before it ended
    evals = [{k: e[k] for k in ("step", "val_loss", "elapsed_s")} for e in read_metrics(metrics) if "val_loss" in e]
    return run, {"command": shlex.join(command), "reached": reached or None, "evaluations": evals,
                 "start": start_trace(out_dir)}


def start_trace(out_dir: Path) -> dict | None:
    """train.py's start-up trace from its runs.jsonl (the last invocation's "start": seconds per phase)."""
    try:
        lines = (out_dir / "runs.jsonl").read_text().splitlines()
        return json.loads(lines[-1]).get("start") if lines else None
    except (OSError, ValueError):
        return None


def part_shakespeare(check: Check, args) -> dict:
    """train.py on shakespeare_char, the fastest way (SHAKESPEARE_OPTIONS), until its first evaluation at or below
    args.val_loss; then, where the part's time left holds what it needs, as train.py runs it by default, to the
    same val loss (--smoke: not again, the run being that already)."""
    data_root, runs, why = shakespeare_data(check, args)
    if data_root is None:
        return {"status": "skipped", "runs": [r.record() for r in runs], "reason": why}
    options = shakespeare_options(check.smoke)
    command = shakespeare_command(check.smoke, data_root, check.tmp / "shakespeare_out", *options)
    run, result = train_until_val(check, args, f"train.py {' '.join(options)} until val <= {args.val_loss}", command,
                                  check.tmp / "shakespeare_out")
    runs.append(run)
    result = {"val_threshold": args.val_loss, **result}
    plain: dict = {"skipped": "--smoke: the run above is train.py as it runs by default"} if check.smoke else {}
    need = plain_shakespeare_need()
    if not check.smoke and result["reached"] and check.left() < need:
        plain = {"skipped": f"not enough time left: {check.left():.0f} s, and it needs {need:.0f} s"}
    elif not check.smoke and result["reached"]:
        command = shakespeare_command(check.smoke, data_root, check.tmp / "shakespeare_plain", "--async_save=True")
        plain_run, plain = train_until_val(check, args, f"train.py as it runs by default until val <= "
                                                        f"{args.val_loss}", command, check.tmp / "shakespeare_plain")
        runs.append(plain_run)
        plain["status"] = plain_run.status if plain_run else "not started"
    elif not check.smoke:
        plain = {"skipped": "the run above did not reach the val loss"}
    result = {"runs": [r.record() for r in runs if r], **result, "plain": plain}
    if result["reached"]:
        return {"status": "ok", "reason": None, **result}
    best = min((e["val_loss"] for e in result["evaluations"]), default=None)
    status = "timeout" if run is None or run.status == "timeout" else "failed"
    return {"status": status, "reason": f"train.py ended ({run.status if run else 'not started'}) before val <= "
                                        f"{args.val_loss}; best val {best}", **result}


def nanogpt_dir(given: str | None) -> Path | None:
    """nanoGPT's own code: --nanogpt, or shared/anchors/nanoGPT in the checkout or beside it; None without."""
    candidates = [Path(given)] if given else [ROOT / "shared/anchors/nanoGPT", ROOT.parent / "shared/anchors/nanoGPT"]
    return next((p for p in candidates if all((p / name).is_file() for name in NANOGPT_FILES)), None)


def nanogpt_commands(smoke: bool, part: str = "nanogpt") -> list[tuple[str, list[str]]]:
    """nanoGPT's runs of a part (nanogpt: its bench.py, which needs CUDA, so none in --smoke; nanogpt_train: its
    train_shakespeare_char, shrunk in --smoke), each (what, command), run in a copy of its folder (its scripts
    read ./data, ./config)."""
    if part == "nanogpt":
        return [] if smoke else [("nanoGPT bench.py", python(*NANOGPT_BENCH))]
    if smoke:
        return [("nanoGPT train_shakespeare_char (shrunk)", python(*SMOKE_NANOGPT_TRAIN))]
    return [("nanoGPT train_shakespeare_char", python(*NANOGPT_TRAIN))]


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
    """nanoGPT's bench.py beside ours in this call (the denominator of vs_nanogpt: GPT-2 124M without biases at
    12 x 1024, compiled, random tokens), from a copy of its folder."""
    if check.smoke:
        return {"status": "skipped", "runs": [], "reason": "--smoke: nanoGPT's bench.py needs CUDA",
                "bench": {"skipped": "--smoke: nanoGPT's bench.py needs CUDA"}}
    return nanogpt_part(check, args, "nanogpt")


def part_nanogpt_train(check: Check, args) -> dict:
    """nanoGPT's train_shakespeare_char beside ours (--parts=nanogpt_train: its figure is recorded, see
    H200's nanogpt_to_val_s), until its first val loss <= --val_loss (or step 1,750), timed from its start."""
    return nanogpt_part(check, args, "nanogpt_train")


def nanogpt_part(check: Check, args, name: str) -> dict:
    """A nanoGPT part's runs from a copy of its folder, with its own model.py (not ours); for its training, its
    prepare.py on tiny Shakespeare first."""
    source = nanogpt_dir(args.nanogpt)
    if source is None:
        return {"status": "skipped", "runs": [], "reason": "no anchor: nanoGPT's code is not at "
                "shared/anchors/nanoGPT (in the checkout or beside it); pass --nanogpt=PATH"}
    training = name == "nanogpt_train"
    text = shakespeare_text(args.shakespeare_text)
    if training and text is None:
        return {"status": "skipped", "runs": [], "reason": "no anchor: no tiny Shakespeare text for nanoGPT's data: "
                "pass --shakespeare_text=PATH, or put it at shared/data/tinyshakespeare.txt"}
    copy = check.tmp / "nanoGPT"
    for file in NANOGPT_FILES:  # (the files alone: the folder's own modes may be read-only)
        (copy / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / file, copy / file)
    env = {"PYTHONPATH": ""}  # nanoGPT's own model.py, not ours
    needs = [need for _, need in run_needs(name, check.smoke)]  # (its prepare.py first, for the training)
    runs: list[Run | None] = []
    labels: list[str] = []
    if training:
        shutil.copyfile(text, copy / "data/shakespeare_char/input.txt")  # (its prepare.py downloads it otherwise)
        # its prepare.py imports requests, which it needs only for the download
        stub = "import runpy, sys, types\ntry:\n    import requests\nexcept ImportError:\n    sys.modules['requests'] " \
               "= types.ModuleType('requests')\nrunpy.run_path('data/shakespeare_char/prepare.py', run_name='__main__')"
        runs.append(check.run("nanoGPT prepare shakespeare_char", python("-c", stub), env=env, cwd=copy,
                              limit_s=check.share(needs[0], sum(needs[1:]))))
        labels.append("nanoGPT's prepare.py")
    result: dict = {}
    if not runs or (runs[0] is not None and runs[0].status == "ok"):
        for i, (label, command) in enumerate(nanogpt_commands(check.smoke, name), start=len(runs)):
            started, seen = time.monotonic(), {}

            def watch(seen=seen, started=started) -> bool:  # each evaluation's wall seconds from the start
                evals = nanogpt_results(check.output_so_far())["evaluations"]
                for e in evals:
                    seen.setdefault(e["step"], round(time.monotonic() - started, 1))
                return any(e["val_loss"] <= args.val_loss for e in evals)

            run = check.run(label, command, watch if training else None, env=env, cwd=copy,
                            limit_s=check.share(needs[i], sum(needs[i + 1:])))
            runs.append(run)
            labels.append(label)
            found = nanogpt_results(run.output) if run else nanogpt_results("")
            record = {"command": shlex.join(command), "status": run.status if run else "not started"}
            if training:
                evals = [{**e, "wall_s": seen.get(e["step"])} for e in found["evaluations"]]
                hit = next((e for e in evals if e["val_loss"] <= args.val_loss), None)
                best = min(evals, key=lambda e: e["val_loss"], default=None)
                result["train"] = record | {"evaluations": evals, "reached": hit, "best": best,
                                            "iter_ms_median": found["iter_ms_median"]}
            else:
                result["bench"] = record | {"ms": found["bench_ms"], "mfu": found["bench_mfu"]}
    status, reason = outcome(runs, labels)
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs if r], **result}


def nanogpt_note(part: dict, key: str) -> str | None:
    """Why the summary has no nanoGPT figure from its `key` run ("bench" or "train"), in one line: "no anchor:
    ..." where nanoGPT was not run, "nanoGPT failed: ..." with its last lines where it ran (or its preparation)
    and gave none; None where it gave one."""
    record = part.get(key) or {}
    if record.get("ms") or record.get("reached") or record.get("best"):
        return None
    if not part or part.get("status") == "skipped":
        return "no anchor: " + ((part or {}).get("reason") or "nanoGPT was not run").removeprefix("no anchor: ")
    if "skipped" in record:
        return "no anchor: " + record["skipped"]
    label = {"bench": "bench.py", "train": "train_shakespeare_char"}[key]
    ran = next((r for r in part.get("runs", []) if r["command"] == record.get("command")), None)
    failed = ran if ran and ran.get("last_lines") else next((r for r in part.get("runs", []) if r.get("last_lines")),
                                                            None)
    if failed is not None:
        how = f"{failed['label']} {failed['status']} (exit code {failed['returncode']}, {failed['seconds']:.0f} s)"
        return f"nanoGPT failed: {how}; its last lines: " + " | ".join(failed["last_lines"])
    if ran is not None:
        return f"nanoGPT failed: its {label} gave no figure ({ran['status']}; see the log)"
    return f"nanoGPT failed: its {label} did not run ({part.get('reason') or record.get('status') or 'see the log'})"


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
                       "--max_batch=64", "--requests=2", "--seconds=8", "--max_tokens=128",
                       "--rounds=1", "--min_seconds=0")  # (one round: the part's budget, not a ratio's range)


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


# The parts in the order they run: the device first, then the most decisive; the tests last of the default
# parts, so that the time the parts before them left unused lets their last files run too.
PARTS: dict[str, Callable] = {"device": part_device, "decode": part_decode, "train": part_train,
                              "nanogpt": part_nanogpt, "shakespeare": part_shakespeare, "tests": part_tests,
                              "nanogpt_train": part_nanogpt_train, "steps": part_steps, "decode_more": part_decode_more,
                              "plan": part_plan, "serve": part_serve, "train_more": part_train_more}


# ----------------------------------------------------------------------------- the plan


def option(command: list[str] | tuple[str, ...], name: str) -> str | None:
    """The value of --name=VALUE in a command (the last one wins, as in every script here), or None."""
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")]
    return values[-1] if values else None


def config_value(path: str, key: str) -> float:
    """A number set in one of configs/ (plain `key = value` lines)."""
    m = re.search(rf"^{key}\s*=\s*([\d.]+)", (ROOT / path).read_text(), re.M)
    if m is None:
        raise KeyError(f"{path} sets no {key}")
    return float(m[1])


def train_py_need(command: list[str], steps: float, evals: float, eval_batches: float, warm: bool = False) -> float:
    """train.py on configs/shakespeare.py's model: its start, the evaluation's and the training step's compiles
    (`warm`: from inductor's cache, an earlier run having compiled the same model), `steps` steps (as one CUDA
    graph where the command says so) and `evals` evaluations of `eval_batches` batches."""
    compiles = h200("train_compiles_warm_s") if warm else h200("train_eval_compile_s") + h200("train_compile_s")
    ms = h200("train_graphed_ms" if "--cuda_graphs=True" in command else "train_ms")
    return h200("train_start_s") + compiles + steps * ms / 1000 + evals * h200("train_eval_s") * eval_batches / 200


def bench_rows(options: list[str]) -> int:
    """How many rows a bench.py command times: one per combination of its variant options' comma lists."""
    return math.prod(len((option(options, name.removeprefix("--")) or "x").split(",")) for name in BENCH_VARIANTS)


def run_needs(name: str, smoke: bool = False) -> list[tuple[str, float]]:
    """What each run of a part needs on an H200, added up from the figures of H200 for the very commands the part
    runs, in the order it runs them (each 0 in --smoke: the CPU rehearsal's runs share their part's time as
    they come). A bench.py run's extra rows (measured if time holds them) are not in it; a run in
    OPTIONAL_RUNS is, but not in part_need."""
    if name == "device":
        timed = PEAK_WARMUP_S[False] + PEAK_SHAPE_WARMUP_S[False] + len(PEAK_SHAPES[False]) * PEAK_TIMED_S[False]
        needs = [("NVML's readings", h200("readings_s")), ("device and matmul peak", h200("torch_start_s") + timed)]
    elif name == "tests":
        def file_s(path: str) -> float:
            figure = CUDA_TEST_FILE_S.get(path, "other_test_file_s")
            return h200(figure) if figure else 0.0

        needs = [(label, h200("pytest_start_s") + sum(map(file_s, files))) for label, files in cuda_test_runs()]
    elif name in ("train", "train_more"):
        runs, options = bench_runs(name, smoke)
        needs = [(label, h200("bench_start_s") + (bench_rows(options + extra) - optional)
                  * (h200("bench_row_s") + profiled(extra))) for label, extra, optional in runs]
    elif name in ("decode", "decode_more"):
        runs, options = bench_runs(name, smoke)
        needs = []
        for label, extra, optional in runs:
            windows = len((option(extra, "decode_window") or "1").split(",")) - optional
            compiled = "--compile=True" in extra
            needs.append((label, h200("decode_compiled_s" if compiled else "decode_eager_s")
                          + (windows - 1) * h200("decode_window_s") + windows * profiled(extra)
                          + ("--hf_reference" in extra) * h200("hf_reference_s")))
    elif name == "shakespeare":
        command = shakespeare_command(smoke, Path("data"), Path("out"), *shakespeare_options(smoke))
        needs = [("prepare shakespeare_char", h200("prepare_s")), ("train.py until val", to_val_need(command))]
    elif name == "steps":
        needs = [("prepare shakespeare_char", h200("prepare_s"))]
        for label, extra in STEP_RUNS:
            if not (smoke and extra):
                command = steps_command(smoke, Path("data"), Path("out"), extra)
                needs.append((label, train_py_need(command, float(option(command, "max_iters")), 2,
                                                   float(option(command, "eval_iters")))))
    elif name in ("nanogpt", "nanogpt_train"):
        needs = [("nanoGPT prepare shakespeare_char", h200("nanogpt_prepare_s"))] if name == "nanogpt_train" else []
        for label, command in nanogpt_commands(smoke, name):
            if "bench.py" in command:
                needs.append((label, h200("nanogpt_bench_s")))
            else:
                steps = float(option(command, "max_iters"))
                evals = steps // float(option(command, "eval_interval") or h200("nanogpt_eval_interval"))
                needs.append((label, h200("nanogpt_start_s") + h200("nanogpt_compile_s")
                              + steps * h200("nanogpt_ms") / 1000 + evals * h200("nanogpt_eval_s")))
    elif name == "plan":
        needs = [("memory plan", h200("plan_s"))]
    elif name == "serve":
        needs = [("serve.py under load", h200("serve_s"))]
    else:
        raise KeyError(name)
    return [(label, 0.0 if smoke else seconds) for label, seconds in needs]


# Runs that start only where their part's time left holds what they need, and are not in the part's need: the
# older CUDA test files (the tests part, last, gets what every part before it left unused).
OPTIONAL_RUNS = {OTHER_TESTS}


def profiled(options: list[str]) -> float:
    """The profiler's seconds per row, where a bench.py run profiles its rows."""
    return h200("profile_s") if "--profile_step=True" in options or "--profile_decode=True" in options else 0.0


def to_val_need(command: list[str], warm: bool = False) -> float:
    """train.py on configs/shakespeare.py (`command`) until its val loss reaches the threshold, by the H200's
    figures: the step it came at, with an evaluation every eval_interval."""
    steps = h200("train_val_step")
    evals = steps // config_value("configs/shakespeare.py", "eval_interval") + 1
    return train_py_need(command, steps, evals, config_value("configs/shakespeare.py", "eval_iters"), warm=warm)


def plain_shakespeare_need() -> float:
    """The shakespeare part's second run, as train.py runs it by default (compiling from inductor's cache, warm
    from the graphed run of the same model): started only where the part's time left holds this."""
    return to_val_need(shakespeare_command(False, Path("data"), Path("out"), "--async_save=True"), warm=True)


def part_need(name: str) -> float:
    """What a part's commands need on an H200, by the figures of H200 (its budget should hold it): its runs'
    needs but those of OPTIONAL_RUNS."""
    return sum(seconds for label, seconds in run_needs(name) if label not in OPTIONAL_RUNS)


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
        return ["NVML's readings (pynvml, else nvidia-smi --query-gpu=... and --query-compute-apps=...)",
                show(device_command(smoke, tmp / "peak.json"))]
    if name == "tests":
        groups = cuda_test_runs()
        return [show(tests_command(files)) + ("  (if the part's time left holds it)" if label in OPTIONAL_RUNS else "")
                for label, files in groups] or ["nothing: no test skips without CUDA"]
    if name in ("train", "train_more", "decode", "decode_more"):
        runs, options = bench_runs(name, smoke)
        lacking = bench_lacking(name, smoke)
        return [show(bench_command(options, extra, tmp / f"{name}_{i}.json"))
                + (f"  (the last {optional} row(s) if time holds them)" if optional else "")
                for i, (_, extra, optional) in enumerate(runs)] + (
            [f"(left out: {', '.join(lacking)}, which this checkout's bench.py lacks)"] if lacking else [])
    if name == "shakespeare":
        graphed = show(shakespeare_command(smoke, tmp / "data", tmp / "shakespeare_out", *shakespeare_options(smoke)))
        plain = show(shakespeare_command(smoke, tmp / "data", tmp / "shakespeare_plain", "--async_save=True"))
        return [f"{graphed}  (stopped at the first val <= {args.val_loss})"] + (
            [] if smoke else [f"{plain}  (then, if the part's time left holds its {plain_shakespeare_need():.0f} s)"])
    if name == "steps":
        return [show(steps_command(smoke, tmp / "data", tmp / f"steps_{i}", extra)) for i, (_, extra) in
                enumerate(STEP_RUNS) if not (smoke and extra)]
    if name in ("nanogpt", "nanogpt_train"):
        where = nanogpt_dir(args.nanogpt)
        if where is None:
            return ["no anchor: nanoGPT's code not found (shared/anchors/nanoGPT; --nanogpt=PATH)"]
        return [f"(in a copy of {where}) " + show(command) for _, command in nanogpt_commands(smoke, name)] or [
            "nothing in --smoke (its bench.py needs CUDA)"]
    if name == "plan":
        return [show(PLAN_COMMAND)] if not smoke else ["nothing in --smoke"]
    if name == "serve":
        return [show(SERVE_COMMAND)] if not smoke else ["nothing in --smoke"]
    raise KeyError(name)


# What the default run leaves out since budgets hold 1.1x each part's need, each with its own --parts=NAME.
LEFT_OUT = ("nanogpt_train (nanoGPT's time to val 1.47, recorded: 94.7 s on 2026-11-28), steps (the small model's "
            "ms/step early and late), decode_more (eager decoding beside transformers'), train_more (the step at "
            "12 x 1024 not graphed, blocks compiled, autotune, the optimizer compiled, GPT-2 with biases, the modern "
            "model), plan, serve")


def format_plan(budgets: dict[str, float], args) -> str:
    """--dry_run's table: each part, its budget and floor in seconds, what its commands need on an H200 (by the
    figures of H200; not in --smoke) and the budget over it, and what it runs; then what the default run
    leaves out."""
    lines = [f"gpu_check plan{' --smoke' if args.smoke else ''} at --total_s={args.total_s:g}:",
             f"{'part':<14}{'budget':>8}{'floor':>7}{'need':>7}{'x need':>7}  runs"]
    for name, budget in budgets.items():
        floor = (DEVICE_BUDGET if name == "device" else BUDGETS[name]).of(args.smoke)[1]
        need = part_need(name)
        shown = ("-", "-") if args.smoke else (f"{need:.0f} s", f"{budget / need:.2f}" if need else "-")
        commands = plan_commands(name, args.smoke, args)
        lines.append(f"{name:<14}{budget:>6.0f} s{floor:>5.0f} s{shown[0]:>7}{shown[1]:>7}  {commands[0]}")
        lines += [f"{'':<45}{command}" for command in commands[1:]]
    lines.append(f"{'(stopping)':<14}{2 * GRACE_S:>6.0f} s{'':>21}  kept back to stop the last run")
    lines.append(f"{'total':<14}{sum(budgets.values()) + 2 * GRACE_S:>6.0f} s")
    if set(budgets) == {"device", *DEFAULT_PARTS}:
        lines.append(f"not in the default run: {LEFT_OUT}")
    return "\n".join(lines)


def do_part(check: Check, name: str, args) -> dict:
    """One part within its budget (and the time earlier parts left unused); an error of this script's own (a
    bug) fails that part only."""
    budget = check.budgets[name]
    check.part_end = max(time.monotonic() + budget, check.planned_end[name])
    t0 = time.monotonic()
    lacking = [module for module in PART_MODULES[name] if importlib.util.find_spec(module) is None]
    print(f"{name} (up to {check.left():.0f} s{'; skipped' if lacking else ''})", flush=True)
    try:
        if lacking:
            result = {"status": "skipped", "runs": [], "reason": f"needs {', '.join(lacking)}, not installed here "
                      f"(a wheel carried in shared/wheels: see the launch command in benchmarks/gpu_check.py)"}
        else:
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


def bench_variant(row: dict) -> dict:
    """A bench.py training row's variant: what the summary says it measured."""
    return {k: row.get(k) for k in ("model", "batch_size", "sdpa", "compile_mode", "compile_optimizer",
                                    "compile_scope", "cuda_graphs", "fp8_head", "loss_slice_rows")}


def peak_figure(peak: dict | None) -> dict:
    """A matmul peak of the device part: TFLOP/s beside the datasheet's, with NVML's readings taken during it."""
    peak = peak or {}
    value = peak.get("tflops_measured")
    return figure(value, peak.get("tflops_datasheet"), None) | {
        "shape": peak.get("shape"), "clocks": peak.get("clocks"),
        "line": peak.get("clocks_line") and f"during it: {peak['clocks_line']}"}


def decode_summary(rows: list[dict]) -> dict:
    """Batch-1 compiled decoding: the best window's tokens/s against the target, every window's, and K=1's host
    and GPU microseconds per token (--profile_decode)."""
    compiled = [r for r in rows if r["kind"] == "decode" and r["compile"] and r["batch_size"] == 1]
    best = max(compiled, key=lambda r: r["tokens_per_s"], default=None)
    by_window = {str(r.get("decode_window", 1)): r["tokens_per_s"] for r in compiled}
    k1 = next((r for r in compiled if r.get("decode_window", 1) == 1), None) or {}
    target = TARGETS["decode_tokens_per_s"]
    return figure(best and best["tokens_per_s"], target, best and best["tokens_per_s"] >= target) | {
        "decode_window": best and best.get("decode_window", 1), "by_window": by_window,
        "compile_s": k1.get("compile_s"), "k1_host_us_per_token": k1.get("host_us_per_token"),
        "k1_gpu_us_per_token": k1.get("gpu_us_per_token"),
        "note": "the best decode window (K tokens a CUDA graph launch); K=1's host and GPU microseconds a token"}


def shakespeare_summary(report: dict) -> dict:
    """configs/shakespeare.py to the val loss from the process start: the graphed run, the plain one where it
    ran, train.py's start-up trace, and nanoGPT's: from nanogpt_train where it ran, else its recorded figure."""
    part = report["parts"].get("shakespeare", {})
    shakespeare, plain = part.get("reached"), (part.get("plain") or {})
    nanogpt = report["parts"].get("nanogpt_train", {})
    nanogpt_train = nanogpt.get("train") or {}
    nanogpt_val = nanogpt_train.get("reached") or nanogpt_train.get("best")
    recorded = H200["nanogpt_to_val_s"]
    if nanogpt_val is None and (not nanogpt or nanogpt.get("reason") == NOT_ASKED):
        nanogpt_val = {"wall_s": recorded.value, "val_loss": 1.4696, "step": 1750, "recorded": recorded.where}
        note = ("seconds from train.py's process start; nanogpt: its train_shakespeare_char's, recorded (not run: "
                "--parts=nanogpt_train runs it)")
    else:
        note = nanogpt_note(nanogpt, "train") or ("seconds from train.py's process start; nanogpt: its "
                                                  "train_shakespeare_char in this call, the first val at or below "
                                                  "the threshold (else its best), with the wall seconds from its start")
    value = shakespeare and shakespeare["elapsed_s"]
    plain_reached = plain.get("reached") or {}
    return figure(value, TARGETS["shakespeare_s"], shakespeare and value <= TARGETS["shakespeare_s"]) | {
        "val_loss": shakespeare and shakespeare["val_loss"], "step": shakespeare and shakespeare["step"],
        "wall_s": shakespeare and shakespeare["wall_s"], "start": part.get("start"),
        "plain_elapsed_s": plain_reached.get("elapsed_s"), "plain_step": plain_reached.get("step"),
        "plain_start": plain.get("start"), "plain_note": plain.get("skipped"), "nanogpt": nanogpt_val,
        "note": note}


def summarise(report: dict, smoke: bool) -> dict:
    """The figures BENCHMARKS.md's GPU targets ask for, each with its target and whether it was met, and the
    readings that tell whether the device gave its best."""
    rows = [r for r in report["rows"] if r.get("status") == "ok"]
    train = [r for r in rows if r["kind"] == "train"]
    nobias = "tinynobias" if smoke else "gpt2nobias"
    at_12 = [r for r in train if r["model"] == nobias and r["batch_size"] == (2 if smoke else 12)]
    best_12 = min(at_12, key=lambda r: r["ms"], default=None)
    default_12 = next((r for r in at_12 if r.get("profile") and not r.get("fp8_head")), None)  # (the bf16 head's)
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
    k1 = [r for r in decode if r.get("decode_window", 1) == 1]
    saved_ms = (min(r["ms"] for r in eager) - min(r["ms"] for r in k1)) if k1 and eager else None
    compile_s = k1[0].get("compile_s") if k1 else None
    prefill = [r for r in rows if r["kind"] == "prefill"]
    plan = report["parts"].get("plan", {}).get("rows") or []
    steps_part = report["parts"].get("steps", {})
    steps = {s["run"]: s for s in steps_part.get("steps") or [] if "ms_per_step" in s}
    late = [(s["late_ms"], s["late_over_early"]) for s in steps.values() if s.get("late_ms") is not None]
    best_late = min(late, default=None)
    window = (steps_part.get("windows") or {}).get("late")
    nanogpt = report["parts"].get("nanogpt", {})
    nanogpt_ms = (nanogpt.get("bench") or {}).get("ms")
    nanogpt_iter = ((report["parts"].get("nanogpt_train") or {}).get("train") or {}).get("iter_ms_median")
    readings = report.get("readings") or {}
    tests = report["parts"].get("tests") or {}
    counts = tests.get("counts") or {}

    speedup = nanogpt_ms / best_12["ms"] if best_12 and nanogpt_ms else None
    summary = {
        "gpu_readings": figure(None, None, None) | {"line": readings.get("line"), "start": readings.get("start")},
        "matmul_peak_8192_tflops": peak_figure((report["device"].get("peaks") or [None])[0]),
        "matmul_gpt2_mlp_tflops": peak_figure((report["device"].get("peaks") or [None, None])[-1]),
        "train_12x1024_no_bias": figure(speedup, TARGETS["vs_nanogpt"], speedup and speedup >= TARGETS["vs_nanogpt"])
        | {"ms": best_12 and best_12["ms"], "nanogpt_ms": nanogpt_ms, "variant": best_12 and bench_variant(best_12),
           "tokens_per_s": best_12 and best_12["tokens_per_s"], "profile": best_12 and best_12.get("profile"),
           "profile_default": default_12 and default_12.get("profile"),
           "rows": [{**bench_variant(r), "ms": r["ms"], "vs_nanogpt": nanogpt_ms / r["ms"] if nanogpt_ms else None}
                    for r in at_12],
           "note": nanogpt_note(nanogpt, "bench") or "the best row at 12 x 1024: x nanoGPT's bench.py tokens/s, run "
                                                     "in this call on this device"},
        "train_best_tokens_per_s": figure(best and best["tokens_per_s"], floor,
                                          floor and best and best["tokens_per_s"] >= floor)
        | {"variant": best and bench_variant(best), "mfu_datasheet": best and best["mfu"],
           "mfu_measured_peak": best and best.get("mfu_measured_peak"),
           "at_12_tokens_per_s": best_12 and best_12["tokens_per_s"],
           "note": "the best micro-batch that fits, beside the best row at 12 x 1024 (at_12_tokens_per_s)"},
        "decode_compiled_batch1_tokens_per_s": decode_summary(rows),
        "decode_eager_vs_transformers": figure(vs_hf, 1.0, vs_hf and vs_hf >= 1.0)
        | {"note": "our eager batch-1 decode's tokens/s over transformers' eager generate, same shape and dtype"
                   + ("" if reference else "; not measured: the default run leaves it to --parts=decode_more "
                      "(1.28 on the H200 of 2026-11-28)")},
        "decode_compile_cost": figure(
            round(compile_s / (saved_ms / 1000)) if compile_s and saved_ms and saved_ms > 0 else None, None, None)
        | {"compile_s": compile_s, "saved_ms_per_token": saved_ms,
           "note": "value: the tokens from which compiling pays; (compile_s, saved_ms_per_token) is "
                   "gptkit/generate.py's DECODE_COMPILE_COST['cuda'] (needs the eager rows: --parts=decode_more)"},
        "prefill_ms": figure(min((r["ms"] for r in prefill), default=None), TARGETS["prefill_ms"],
                             any(r["ms"] < TARGETS["prefill_ms"] for r in prefill))
        | {"prompt_tokens": prefill[0]["seq_len"] if prefill else None},
        "shakespeare_s_to_val": shakespeare_summary(report),
        "shakespeare_ms_per_step_late": figure(best_late and best_late[0], TARGETS["small_step_ms"],
                                               best_late and best_late[0] <= TARGETS["small_step_ms"])
        | {"late_over_early": best_late and best_late[1], "runs": steps, "window": window,
           "nanogpt_iter_ms": nanogpt_iter,
           "note": "ms/step over the late window (steps window[0]-window[1], the last that both runs reached), "
                   "the fastest way (the steps part, --parts=steps); flat: late_over_early <= 1.1; nanogpt_iter_ms: "
                   "the median of its iter lines (--parts=nanogpt_train)"},
        "cuda_tests_passed": figure(counts.get("passed") if counts else None, None,
                                    None if not counts else not (counts.get("failed") or counts.get("error")))
        | {"counts": counts, "not_run": tests.get("not_run")},
    }
    if "plan" in report["parts"] and report["parts"]["plan"]["status"] != "skipped":
        summary["plan_worst_error"] = figure(max((abs(r["error"]) for r in plan), default=None), TARGETS["plan_error"],
                                             bool(plan) and all(abs(r["error"]) <= TARGETS["plan_error"] for r in plan))
    return summary


def print_summary(report: dict) -> None:
    print("\nparts:")
    for name, part in report["parts"].items():
        print(f"  {name:<14}{part['status']:<9}{part['seconds']:>6.0f} s  {part['reason'] or ''}")
    print("summary:")
    for name, entry in report["summary"].items():
        if not isinstance(entry, dict) or "value" not in entry:
            print(f"  {name:<38}{entry}")
            continue
        value = entry["value"]
        shown = "" if value is None and entry.get("line") else "n/a" if value is None else (
            f"{value:,.0f}" if value >= 100 else f"{value:.3g}")
        met = {True: "met", False: "NOT met", None: ""}[entry["met"]]
        target = "" if entry["target"] is None else f" (target {entry['target']:,})"
        print(f"  {name:<38}{shown:>12}{target} {met}")
        if entry.get("line"):
            print(f"  {'':<38}{entry['line']}")


# ----------------------------------------------------------------------------- the child: device and peak


def child_peak(smoke: bool) -> dict:
    """The device, its versions and its measured dense peaks (bf16 on a GPU; float32 on the CPU in --smoke): after
    PEAK_WARMUP_S of warm-up (the clocks up), each of PEAK_SHAPES timed for ~PEAK_TIMED_S in batches, NVML read
    on a thread meanwhile (gpu_readings.Sampler), in TFLOP/s. "peak" is the first shape's (8192^3: the
    denominator of mfu_measured_peak), "peaks" every shape's."""
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
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    datasheet = peak_flops_for(info["name"], dtype) if on_gpu else None
    index = torch.cuda.current_device() if on_gpu else 0
    info["peaks"] = []

    def products(a, b, count: int) -> float:  # (the host waits: the products counted are those the device has done)
        t0 = time.perf_counter()
        for _ in range(count):
            a @ b
        sync()
        return time.perf_counter() - t0

    for i, (name, (m, k, n)) in enumerate(PEAK_SHAPES[smoke]):
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        warmup_s = PEAK_WARMUP_S[smoke] if i == 0 else PEAK_SHAPE_WARMUP_S[smoke]
        warm, warmup_products, spent = time.perf_counter() + warmup_s, 0, 0.0
        while time.perf_counter() < warm:
            spent += products(a, b, 10)
            warmup_products += 10
        batch = max(10, round(warmup_products / max(spent, 1e-9) * PEAK_TIMED_S[smoke] / 5))  # five timed batches
        with gpu_readings.Sampler(index) as sampler:
            seconds = sum(products(a, b, batch) for _ in range(5)) / (5 * batch)
        clocks = sampler.summary()
        info["peaks"].append({"shape": name, "mkn": [m, k, n], "dtype": str(dtype).removeprefix("torch."),
                              "tflops_measured": 2 * m * k * n / seconds / 1e12,
                              "tflops_datasheet": datasheet / 1e12 if datasheet else None,
                              "warmup_s": warmup_s, "warmup_products": warmup_products, "timed_products": 5 * batch,
                              "clocks": clocks, "clocks_line": gpu_readings.sampled_line(clocks)})
        del a, b
    info["peak"] = {"n": PEAK_SHAPES[smoke][0][1][0], **info["peaks"][0]}
    return info


# ----------------------------------------------------------------------------- the command line


def parse_args(argv: list[str] | None):
    p = cli.ArgumentParser(prog="gpu_check.py", description=__doc__,
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
    if args.nanogpt and nanogpt_dir(args.nanogpt) is None:
        raise cli.UsageError(f"--nanogpt: {args.nanogpt} does not hold nanoGPT's {', '.join(NANOGPT_FILES)}")
    if args.child is None:
        args.budgets = make_plan(args.parts, args.total_s, args.smoke)  # (a UsageError before anything runs)
        args.missing = missing_line(args, list(args.budgets))
    return args


NOT_ASKED = "not in --parts"  # (a part's reason where it was not asked for)


def interrupt(signum, frame) -> None:
    """SIGTERM's handler while the check runs: as Ctrl-C."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


@cli.entry_point()
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child == "peak":
        Path(args.child_out).write_text(json.dumps(child_peak(args.smoke)))
        return {}
    if args.dry_run:
        print("\n".join(filter(None, [args.missing, format_plan(args.budgets, args)])))
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


if __name__ == "__main__":
    main()
