"""What the parts share that is not the running of subprocesses (benchmarks/gpu_check/check.py): the checkout's
root, a command's Python, the project's shared data (in the checkout or beside it), an option's value in a
command, the files bench.py and train.py write as they go, and the commit. Python's standard library only."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_ASKED = "not in --parts"  # (a part's reason where it was not asked for)
# Where a launcher that can send only the working tree writes the commit (.git may not travel): the commit, then
# "dirty" where tracked files differed from it. The variable wins over the file.
COMMIT_ENV, COMMIT_FILE = "GPU_CHECK_COMMIT", "COMMIT"


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def shown(command: list[str]) -> str:
    """A command as --dry_run shows it: `python` for this Python's path."""
    return shlex.join(["python", *command[1:]])


def shared_path(relative: str) -> Path | None:
    """A file or folder of the project's shared data (tiny Shakespeare, GPT-2's BPE files, nanoGPT's code, the
    commit): in shared/ inside the checkout (where a launcher copies it for a machine that gets the working tree
    only) or beside the checkout; None where neither has it."""
    return next((p for p in (ROOT / "shared" / relative, ROOT.parent / "shared" / relative) if p.exists()), None)


def shakespeare_text(given: str | None) -> Path | None:
    """A local copy of tiny Shakespeare: --shakespeare_text, or shared/data/tinyshakespeare.txt in the checkout
    or beside it; None when there is none."""
    if given:
        return Path(given) if Path(given).is_file() else None
    return shared_path("data/tinyshakespeare.txt")


def option(command: list[str] | tuple[str, ...], name: str) -> str | None:
    """The value of --name=VALUE in a command (the last one wins, as in every script here), or None."""
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")]
    return values[-1] if values else None


def read_rows(path: Path) -> list[dict]:
    """bench.py's rows from its --json file (those written before a crash or a stop), or none."""
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


def read_metrics(path: Path) -> list[dict]:
    """The complete lines of a metrics.jsonl that is still being written."""
    try:
        text = path.read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


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

