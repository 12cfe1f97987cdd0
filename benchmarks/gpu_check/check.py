"""The state of one gpu_check: where it writes, its clock (each part's time, and the whole check's), the report
(the JSON, rewritten whole as each run ends) and the running of subprocesses within their time, each in its
own process group so that stopping one stops what it started."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_check import common
from benchmarks.gpu_check.summary import add_measured_mfu, summarise
from gptkit import cli  # (standard library only)

# A run is not started with less time than this left in its part (it would only import torch and be stopped).
MIN_RUN_S = 8
# How long a stopped run has to exit after SIGTERM before it is killed (twice that is kept back from the
# budgets, so that stopping the last run still ends within --total_s).
GRACE_S = 5


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
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(common.ROOT), os.environ.get("PYTHONPATH")]))}
        tiktoken_files = common.shared_path("data/tiktoken_cache")  # GPT-2's BPE, for a machine with no network
        if tiktoken_files is not None:
            self.env.setdefault("TIKTOKEN_CACHE_DIR", str(tiktoken_files))
        if args.smoke:  # tiny models on a small shared CPU: one thread each runs fastest
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": ["python -m benchmarks.gpu_check", *args.argv],
                       "smoke": args.smoke, "total_s": args.total_s, "elapsed_s": 0.0, "device": {},
                       "budgets_s": {name: round(b) for name, b in self.budgets.items()},
                       "needs_s": args.needs,
                       "missing": args.missing, "torch": None, "git": common.git_version(), "readings": {}, "parts": {},
                       "rows": [], "summary": {}}
        self.part_end = self.deadline
        # how often a run is looked at (its exit, its watcher, its time): --smoke's runs take a few seconds each,
        # so their ends are seen sooner there
        self.poll_s = 0.1 if args.smoke else 0.5
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
            env: dict[str, str] | None = None, cwd: Path = common.ROOT, limit_s: float | None = None) -> Run | None:
        """Run `command` in the checkout (or `cwd`; with `env` added to the environment), its output into the
        log, until it exits, the part's time (or `limit_s`, if less) is up (timeout), or `watch` (called every
        poll_s, half a second on a GPU; it may read output_so_far()) says it has what it needs (True: stopped)
        or names the status to stop it with. None when too little time is left to start it."""
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
                time.sleep(self.poll_s)
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
        return common.python(*args)

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

