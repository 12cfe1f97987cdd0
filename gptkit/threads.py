"""torch's CPU threads: how many a script computes with, chosen once at its start (train.py, eval.py, sample.py,
chat.py, serve.py all ask here), and a few words saying why.

    threads = resolve_threads(cfg.threads, rt.device_type)   # --threads N, else OMP_NUM_THREADS, else auto
    print(threads.describe())        # e.g. "1 thread (auto: 2 cores, 1.0 busy with other processes; --threads ...)"
    with threads.applied():          # torch.set_num_threads for the block; the count before it back afterwards
        ...

Why fewer threads than cores. torch splits each product over its threads (GNU OpenMP's team) and waits for
the slowest at its end; a thread whose core another process is using runs only when the system gives it a
turn, so every product waits for it, and the threads that finished spin while they wait, taking time from
that other process too. With one busy neighbour on 2 cores the quick start's steps were seen to go from
~40 ms to 200-2,300 ms with torch's default (one thread per core), against ~80 ms with one thread
(benchmarks/train_threads.py measures it: BENCHMARKS.md, "Training on a busy CPU"). So auto takes the cores
this process may run on less those other processes keep busy, measured now (choose_threads), at least one.

OMP_NUM_THREADS, when set, wins over auto (torch read it at its start; torchrun sets it to 1 for each of
several processes on a machine unless it is set); --threads wins over both.

On a GPU (CUDA, MPS) the model computes on the device: the CPU's threads run the host's side (one kernel launch
after another, the loader's copies), where torch's CPU team is hardly used, so their count barely matters and
nothing is measured: auto keeps torch's own count, which --threads still sets when given.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Threads:
    """The thread count a script runs with: `n` (None: torch's own count, left as it is: a GPU run's auto),
    `why`, a few words on how it was chosen, and whether auto chose it."""

    n: int | None
    why: str
    auto: bool = False

    @property
    def count(self) -> int:
        """The number of threads torch computes with (once applied)."""
        return torch.get_num_threads() if self.n is None else self.n

    def describe(self) -> str:
        """For a start-up line: '2 threads (auto: 2 cores, 0.0 busy with other processes; --threads to choose)'."""
        return f"{plural(self.count)} ({self.why}{'; --threads to choose' * self.auto})"

    def record(self) -> dict:
        """For runs.jsonl: the number and why."""
        return {"n": self.count, "why": self.why}

    @contextlib.contextmanager
    def applied(self) -> Iterator[Threads]:
        """torch's thread count set to `n` inside the block (nothing done when n is None) and the count before
        it back afterwards: a script's main() called from Python leaves the caller's count as it was."""
        before = torch.get_num_threads()
        if self.n is not None:
            torch.set_num_threads(self.n)
        try:
            yield self
        finally:
            if self.n is not None:
                torch.set_num_threads(before)


def resolve_threads(threads: int, device_type: str, seconds: float = 0.25) -> Threads:
    """--threads (threads > 0) as given, at most one per core (said); else on the CPU OMP_NUM_THREADS when set (torch read it at start),
    else choose_threads(); else (a GPU) torch's own count. Raises ValueError for a negative count."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = auto), got {threads}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:  # (more threads than cores only wait for each other)
        return Threads(cores, f"--threads={threads} is more than the {cores} cores this process may run on: "
                              f"using {cores}")
    if threads:
        return Threads(threads, "--threads")
    if device_type != "cpu":
        return Threads(None, f"torch's own count: on {device_type} the device computes", auto=True)
    if os.environ.get("OMP_NUM_THREADS"):
        return Threads(torch.get_num_threads(), "OMP_NUM_THREADS")
    return Threads(*choose_threads(seconds), auto=True)


def plural(n: int) -> str:
    """'1 thread', '2 threads'."""
    return f"{n} thread{'s' * (n != 1)}"


def choose_threads(seconds: float = 0.25) -> tuple[int, str]:
    """The number of torch threads for this process, and a few words saying why: the cores this process may
    run on less those that other processes keep busy, at least one (the module's docstring says why).

    "Busy" is measured now, over `seconds`, from /proc/stat (Linux): the load average is a minute-long
    moving average, which right after another job ends still counts its cores as taken. Elsewhere the
    1-minute load average stands in."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = busy_cores(seconds)
    if busy is not None:
        why = f"auto: {cores} core{'s' * (cores != 1)}, {busy:.1f} busy with other processes"
    else:
        try:
            busy = os.getloadavg()[0]
        except (OSError, AttributeError):  # not on this platform (Windows)
            busy = 0.0
        why = f"auto: {cores} core{'s' * (cores != 1)}, load average {busy:.1f}"
    return max(1, min(cores, round(cores - busy))), why


def _cpu_times() -> tuple[int, int, int] | None:
    """(busy, total, cpus) from /proc/stat's first line (all CPUs, in clock ticks: busy is all but idle and
    iowait), or None where there is no /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        ticks = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks), cpus
    except (OSError, ValueError, IndexError):  # none here, or not the layout Linux writes: the load average then
        return None


def busy_cores(seconds: float = 0.25) -> float | None:
    """How many of the machine's cores are busy over the next `seconds` (this process waits meanwhile, so
    they are other processes'), or None where /proc/stat cannot tell."""
    before = _cpu_times()
    if before is None:
        return None
    time.sleep(seconds)
    after = _cpu_times()
    if after is None:
        return None
    total = after[1] - before[1]
    return 0.0 if total <= 0 else (after[0] - before[0]) / total * after[2]
