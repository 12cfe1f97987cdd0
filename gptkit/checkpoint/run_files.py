"""A run's files in its out_dir until its first checkpoint is written: nothing already saved is lost by a run
that fails or stops before it has saved anything, and a run refused before its first step leaves nothing new.

    files = RunFiles(out_dir, new=cfg.init_from != "resume")   # rank 0, holding out_dir's lock
    files.begin()             # before the run writes config.json and runs.jsonl: the old run's files set aside
    files.saved()             # its first checkpoint is written: the old run's files are removed
    files.failed(trained)     # an error or a stop before that: the old run's files are back, this run's gone
    files.remove_if_empty()   # after the lock is released: an out_dir this run created and left empty

A new run (--overwrite=True, or an out_dir holding an earlier run's logs without checkpoints) moves the earlier
run's checkpoints (best.pt, last.pt, sharded best/ and last/ with what a killed save left) and logs
(metrics.jsonl, runs.jsonl, config.json) into out_dir/replaced-TIME/, said in one line, instead of deleting
them: removed once this run's first checkpoint is written, moved back if it fails or stops before. A resumed
run appends to runs.jsonl and metrics.jsonl and rewrites config.json: put back as they were if it ends before
its first step.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from gptkit.checkpoint.layout import OLD, TMP

LOGS = ("metrics.jsonl", "runs.jsonl", "config.json")


def run_paths(out_dir: Path) -> list[Path]:
    """Every file and folder of a run in out_dir that a new run replaces."""
    paths = [out_dir / f"{name}.pt" for name in ("last", "best")]
    paths += [out_dir / f"{name}{suffix}" for name in ("last", "best") for suffix in ("", TMP, OLD)]
    return paths + [out_dir / name for name in LOGS]


class RunFiles:
    """Rank 0's record of what this run changed in out_dir before its first checkpoint (the module's
    docstring)."""

    def __init__(self, out_dir: str | Path, new: bool):
        self.out, self.new = Path(out_dir), new
        self.existed = self.out.is_dir()  # (before the lock creates it)
        self.aside: Path | None = None  # where the earlier run's files wait, while they do
        self.logs: dict[str, bytes | None] = {}  # a resumed run's logs as they were
        self.metrics_size: int | None = None
        self.settled = self.began = False

    def begin(self) -> None:
        self.began = True
        if not self.new:
            self.logs = {name: (self.out / name).read_bytes() if (self.out / name).is_file() else None
                         for name in ("runs.jsonl", "config.json")}
            metrics = self.out / "metrics.jsonl"  # (appended to: only its length is kept)
            self.metrics_size = metrics.stat().st_size if metrics.is_file() else None
            return
        present = [p for p in run_paths(self.out) if p.exists()]
        if not present:
            return
        aside = self.out / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 2
        while aside.exists():
            aside, n = aside.with_name(f"{aside.name.split('.')[0]}.{n}"), n + 1
        aside.mkdir()
        for p in present:
            os.replace(p, aside / p.name)
        self.aside = aside
        names = ", ".join(p.name + "/" * p.is_dir() for p in sorted(aside.iterdir()))
        print(f"note: the earlier run's files in {self.out}/ ({names}) are set aside in {aside}/: removed once "
              f"this run saves its first checkpoint, put back if it fails or stops before", flush=True)

    def saved(self) -> None:
        """This run's first checkpoint is written: the earlier run's files go."""
        if self.settled:
            return
        self.settled = True
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
            print(f"note: this run's first checkpoint is saved: the earlier run's files set aside in "
                  f"{self.aside}/ are removed", flush=True)

    def failed(self, trained: bool) -> None:
        """This run ends (an error, a stop) before its first checkpoint. `trained`: whether a step finished
        (a new run without an earlier one keeps its logs then, the record of what happened)."""
        if self.settled or not self.began:  # (not begun: this run wrote nothing)
            return
        self.settled = True
        if self.aside is not None:
            for p in run_paths(self.out):  # this run's, in their way
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
            for p in self.aside.iterdir():
                os.replace(p, self.out / p.name)
            self.aside.rmdir()
            print(f"note: this run saved no checkpoint: the earlier run's files are back in {self.out}/ (this "
                  f"run's logs are dropped)", flush=True)
        elif trained:
            return
        elif self.new:
            for name in LOGS:
                (self.out / name).unlink(missing_ok=True)
        else:
            for name, content in self.logs.items():
                if content is None:
                    (self.out / name).unlink(missing_ok=True)
                else:
                    (self.out / name).write_bytes(content)
            metrics = self.out / "metrics.jsonl"
            if self.metrics_size is None:
                metrics.unlink(missing_ok=True)
            elif metrics.is_file():
                os.truncate(metrics, self.metrics_size)

    def remove_if_empty(self) -> None:
        """After a failure, and the lock released: an out_dir this run created and left empty goes."""
        if not self.existed and self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()
