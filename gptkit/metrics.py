"""One run's numbers: metrics.jsonl, Weights & Biases, and the printed log lines with tokens/s, MFU and ETA.

    metrics = Metrics(out_dir, ...)          # on every rank; only the master writes and prints
    metrics.start_timing()                   # after the first (compile, warm-up) step
    metrics.log_step(step, loss, ...)        # every log_interval steps
    metrics.log_eval(step, val_loss, ...)

metrics.jsonl has one JSON object per line: training lines (step, loss, lr, grad_norm, the objective's own
metrics if it has any, ms_per_step, tokens_per_s, mfu, peak_mem_mb, epoch) and evaluation lines (step, val_loss, best_val_loss, the
objective's own metrics over the val set prefixed val_, and with hellaswag_interval set, hellaswag_acc and
hellaswag_acc_norm). A metric whose name has a slash is another tool's name for one (DPO's TRL names,
rewards/chosen...): a valid JSON key, in metrics.jsonl and W&B, left off the printed line, which shows ours.
A metric with no value that time (DPO's accuracy while every pair ties) is null there and
"n/a" in the log. `python plot.py OUT_DIR` draws them. Every line
also has elapsed_s: wall-clock seconds since `started` (train.py: the process start, so imports, CUDA's start
and compilation count), evaluations included: the time to a loss as a user's clock reads it.
MFU is the model's FLOPs per token (gptkit/plan/__init__.py's flops_per_token, the formula `train.py --plan` uses) times
tokens/s, over the GPU's peak from PEAK_FLOPS below.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from gptkit.errors import UserError
from gptkit.threads import choose_threads

# Peak dense tensor-core FLOP/s from the vendors' datasheets (their sparsity figures halved): (name,
# bf16/fp16, TF32). A float32 run on CUDA multiplies in TF32 (setup_runtime turns it on), whose dense peak is
# half the bf16 one on all of these (H100 SXM 495 vs 989, H100 PCIe 378 vs 756, A100 156 vs 312, L40S 183 vs
# 362, B200 1,100 vs 2,250 TFLOP/s). Matched against the CUDA device name as whole words, most specific
# first: "H100 NVL" before "H100", "L40S" before "L40" (and "L4" never matches "L40"). A GPU not listed
# reports MFU as n/a.
PEAK_FLOPS = (
    ("GH200", 989e12, 495e12), ("H200 NVL", 835e12, 418e12), ("H200", 989e12, 495e12),
    ("H100 NVL", 835e12, 418e12), ("H100 PCIe", 756e12, 378e12), ("H100", 989e12, 495e12),
    ("H800 PCIe", 756e12, 378e12), ("H800", 989e12, 495e12), ("B200", 2250e12, 1100e12),
    ("A100 PCIe", 312e12, 156e12), ("A100", 312e12, 156e12), ("A800 PCIe", 312e12, 156e12),
    ("A800", 312e12, 156e12), ("L40S", 362e12, 183e12), ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 60e12), ("A10G", 125e12, 62.5e12), ("A10", 125e12, 62.5e12),
    ("RTX 4090", 165e12, 82.6e12), ("RTX 3090", 71e12, 35.6e12), ("A6000", 155e12, 77.4e12),
)
# Words after the model number that name a variant with its own, lower clocks (a PCIe card): "H200 NVL" must
# not get the H200's figure. Such a name matches only an entry that names the variant, or none (A100 PCIe is
# listed for that, with the A100's figures).
VARIANTS = ("NVL", "PCIe")


def peak_flops_for(name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The dense peak of a GPU by its CUDA name for a run in `dtype` (float32: the TF32 peak), or None when it
    is not in the table."""
    variants = "|".join(VARIANTS)
    for key, bf16, tf32 in PEAK_FLOPS:
        pattern = re.escape(key).replace(r"\ ", r"[\s-]")
        if not key.endswith(VARIANTS):  # "H200" must not take "NVIDIA H200 NVL"
            pattern += rf"(?![\s-]({variants})($|[\s-]))"
        if re.search(rf"(^|[\s-]){pattern}($|[\s-])", name, re.IGNORECASE):
            return tf32 if dtype == torch.float32 else bf16
    return None


def peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The peak FLOP/s that MFU divides by, for a run on `device` computing in `dtype` (None: not a GPU
    of the table)."""
    if device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(device), dtype)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if platform.system() == "Linux":  # peak resident set size of the process (kB on Linux)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return float("nan")


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def shown(value: float, spec: str) -> str:
    """A metric in a log line: "n/a" for NaN (a metric with no value this time, as DPO's accuracy when every
    pair ties)."""
    return "n/a" if math.isnan(value) else format(value, spec)


class Metrics:
    """Owns the run's record: appends to metrics.jsonl and W&B, prints the log lines, and times the steps.

    Rates (ms/step, tokens/s, MFU) and the ETA leave out the run's first step, which compiles and warms up:
    timing starts with `start_timing()`, and is restarted after every evaluation. The ETA uses the median
    step time of the recent log intervals, so one slow interval does not swing it.

    Steps that become far slower than the first ones (the median of the recent intervals SLOWDOWN times the
    early ones', each over at least EARLY_STEPS steps) get one note, once: on the CPU (`cpu_threads`: the run's
    thread count) other processes on the same cores are the usual cause, and fewer threads the remedy
    (gptkit/threads.py says why), so the note names the --threads to continue with.
    """

    def __init__(self, out_dir: str | Path, *, master: bool, tokens_per_step: int, flops_per_token: float,
                 peak_flops: float | None, world_size: int, max_iters: int, device: torch.device,
                 wandb_run=None, answers_only: bool = False, started: float | None = None,
                 log_interval: int = 1, cpu_threads: int | None = None):
        self.path = Path(out_dir) / "metrics.jsonl"
        # A chat dataset's loss is over the assistant's replies only: the log lines say so ("answer loss"), and
        # metrics.jsonl's entries carry "loss_on": "answers".
        self.label = "answer loss" if answers_only else "loss"
        self.tag = {"loss_on": "answers"} if answers_only else {}
        self.master, self.wandb_run, self.device = master, wandb_run, device
        self.tokens_per_step, self.max_iters = tokens_per_step, max_iters
        self.flops_per_step = flops_per_token * tokens_per_step
        self.peak = peak_flops * world_size if peak_flops else None
        self.timing = False  # off until the first step is done
        self.t0, self.steps = 0.0, 0  # the clock of the current interval and the steps timed in it
        self.recent_step_times: list[float] = []  # seconds per step of the recent log intervals
        # the first intervals' (EARLY_STEPS steps at least), kept for the slowdown's note; the intervals logged
        self.early_step_times: list[float] = []
        self.early_steps = self.intervals = 0
        self.cpu_threads, self.slowdown_said = cpu_threads, cpu_threads is None  # (no note off the CPU)
        # entries carry elapsed_s, wall seconds since `started` (a time.perf_counter() value; default: now)
        self.created = time.perf_counter() if started is None else started
        # Slow steps (a GPU-sized config on a CPU) get a short progress line between the log lines: after the
        # run's first step when it took seconds, then whenever PROGRESS_EVERY seconds passed without a line.
        self.log_interval, self.step, self.first_step = log_interval, 0, True
        self.last_line = time.perf_counter()  # when the last line was printed

    def start_timing(self) -> None:
        """Start (or restart) the step clock: after the first step, and after each evaluation."""
        self.timing, self.t0, self.steps = True, time.perf_counter(), 0

    def step_done(self) -> None:
        if self.timing:
            self.steps += 1
        self.step += 1
        first, self.first_step = self.first_step, False
        waited = time.perf_counter() - self.last_line
        if (self.master and self.step % self.log_interval and self.step < self.max_iters
                and (waited >= PROGRESS_EVERY or (first and waited >= FIRST_STEP_NOTE))):
            print(f"step {self.step}/{self.max_iters} done ({waited:.1f} s since the last line; the loss is "
                  f"logged every {self.log_interval} steps)", flush=True)
            self.last_line = time.perf_counter()

    def record(self, entry: dict) -> None:
        if not self.master:
            return
        # A metric with no value (NaN: DPO's accuracy when every pair ties) is null, as JSON has no NaN.
        entry = {**{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in entry.items()},
                 "elapsed_s": round(time.perf_counter() - self.created, 3)}
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in entry.items() if k != "step" and v is not None}, step=entry["step"])

    def log_eval(self, step: int, val_loss: float, best_val_loss: float, improved: bool,
                 extra: dict[str, float] | None = None) -> None:
        """`extra`: more scores of this evaluation (e.g. hellaswag_acc_norm), recorded and printed beside it."""
        extra = extra or {}
        self.step, self.last_line = step, time.perf_counter()
        self.record({"step": step, "val_loss": val_loss, "best_val_loss": best_val_loss, **self.tag, **extra})
        if self.master:
            more = "".join(f" | {key} {shown(value, '.4f')}" for key, value in extra.items() if "/" not in key)
            print(f"step {step}: val {self.label} {val_loss:.4f}" + (" (best so far)" if improved else "") + more,
                  flush=True)

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float, epoch: float,
                 extra: dict[str, float] | None = None) -> None:
        """Record and print one training step's numbers (`loss`, `grad_norm` already read from the device);
        `extra`: the objective's own metrics (gptkit/step.py), recorded and printed after the gradient norm."""
        rates = self._rates()
        self.step, self.last_line = step, time.perf_counter()
        extra = extra or {}
        entry = {"step": step, "loss": loss, **self.tag, "lr": lr, "grad_norm": grad_norm, **extra, **rates,
                 "peak_mem_mb": peak_memory_mb(self.device), "epoch": epoch}
        self.record(entry)
        if not self.master:
            return
        if rates["ms_per_step"] is None:
            speed = "timing starts after the first step"
        else:
            mfu = f"{rates['mfu'] * 100:.1f}%" if rates["mfu"] is not None else "n/a"
            median = statistics.median(self.recent_step_times)
            speed = (f"{rates['ms_per_step']:.1f} ms/step | {rates['tokens_per_s']:,.0f} tok/s | MFU {mfu} | "
                     f"ETA {format_duration(median * (self.max_iters - step))}")
        own = "".join(f" | {name} {shown(value, '.4g')}" for name, value in extra.items() if "/" not in name)
        print(f"step {step}/{self.max_iters} | {self.label} {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.3f}{own} | "
              f"{speed} | mem {entry['peak_mem_mb']:,.0f} MB", flush=True)
        note = self._slowdown_note()
        if note:
            print(f"note: {note}", flush=True)

    def _rates(self) -> dict:
        """ms/step, tokens/s and MFU over the steps timed since the last log line (None before any)."""
        if not self.steps:
            return {"ms_per_step": None, "tokens_per_s": None, "mfu": None}
        now = time.perf_counter()
        dt = (now - self.t0) / self.steps
        if self.early_steps < EARLY_STEPS or len(self.early_step_times) < MIN_INTERVALS:
            self.early_step_times.append(dt)
            self.early_steps += self.steps
        self.t0, self.steps = now, 0
        self.recent_step_times = (self.recent_step_times + [dt])[-RECENT_INTERVALS:]
        self.intervals += 1
        mfu = self.flops_per_step / dt / self.peak if self.peak else None
        return {"ms_per_step": dt * 1000, "tokens_per_s": self.tokens_per_step / dt, "mfu": mfu}

    def _slowdown_note(self) -> str | None:
        """The note, once, when the recent intervals' median step time is SLOWDOWN times the early ones' (as
        many intervals each, none in both); None otherwise."""
        n = len(self.early_step_times)
        if self.slowdown_said or self.early_steps < EARLY_STEPS or n < MIN_INTERVALS or self.intervals < 2 * n:
            return None
        early = statistics.median(self.early_step_times)
        recent = statistics.median(self.recent_step_times[-n:])
        if recent < SLOWDOWN * early:
            return None
        self.slowdown_said = True
        slower = (f"steps now take {recent * 1000:,.0f} ms, {recent / early:.1f}x the first ones' "
                  f"{early * 1000:,.0f} ms")
        if self.cpu_threads == 1:
            return f"{slower}: other processes are likely using the core this run computes on"
        fewer = max(1, min(self.cpu_threads - 1, choose_threads()[0]))  # the cores left free now
        return (f"{slower}: other processes are likely using the cores this run's {self.cpu_threads} threads "
                f"compute on, and each product waits for its slowest thread; fewer threads run faster then: stop "
                f"(Ctrl-C saves last.pt) and go on with --init_from=resume --threads={fewer}")

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


class LineProgress:
    """Progress as plain lines, for a log that is not a terminal (where tqdm's bar would not show): the first
    line once the work has taken `delay` seconds, then one every PROGRESS_EVERY seconds."""

    def __init__(self, what: str, total: int, unit: str, delay: float = 3.0):
        self.what, self.total, self.unit = what, total, unit
        self.start = time.perf_counter()
        self.next = self.start + delay

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now >= self.next and done < self.total:
            print(f"{self.what}: {done}/{self.total} {self.unit} ({now - self.start:.0f} s)", flush=True)
            self.next = now + PROGRESS_EVERY


# Seconds without a printed line after which a slow run prints a progress line; and the first step's time
# above which it says that the step is done (a GPU-sized step on a CPU takes seconds).
PROGRESS_EVERY, FIRST_STEP_NOTE = 30.0, 5.0
# The slowdown's note (Metrics): recent steps this many times slower than the first ones; the steps (and log
# intervals) each median is taken over at least; the recent intervals kept (the ETA's median too).
SLOWDOWN, EARLY_STEPS, MIN_INTERVALS, RECENT_INTERVALS = 3.0, 20, 3, 20


def start_wandb(project: str, run_name: str, config: dict, out_dir: str | Path | None = None):
    """A W&B run, or a one-line error that says how to fix the usual causes. Its local files go to
    out_dir/wandb/ (beside the run's other files), unless WANDB_DIR says where."""
    import wandb

    folder = None
    if out_dir is not None and not os.environ.get("WANDB_DIR"):
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(project=project, name=run_name, config=config, dir=folder)
    except Exception as e:  # not logged in, no network, ...: wandb raises many types
        raise UserError(f"could not start Weights & Biases ({type(e).__name__}: {str(e).splitlines()[0]}); "
                        f"run `wandb login`, set WANDB_MODE=offline, or drop --wandb_log") from None
