"""files.py: atomic writes and the out_dir lock (busy, released, stale after a killed holder)."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gptkit.files import OutDirBusyError, OutDirLock, atomic_write

REPO = Path(__file__).resolve().parents[1]


def test_atomic_write_replaces_only_when_complete(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    with atomic_write(path) as tmp:
        tmp.write_text("new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_a_held_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    with OutDirLock(tmp_path / "out"):
        with pytest.raises(OutDirBusyError) as e:
            OutDirLock(tmp_path / "out").acquire()
        message = str(e.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "choose another --out_dir" in message and "\n" not in message
    # released: the lock file is gone and the folder can be locked again
    assert not (tmp_path / "out" / ".lock").exists()
    with OutDirLock(tmp_path / "out") as lock:
        assert lock.notice is None


HOLD = """
import sys, time
from gptkit.files import OutDirLock
lock = OutDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_notice(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutDirBusyError, match=f"pid {holder.pid} "):
            OutDirLock(out).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # no chance to clean up: the lock file stays behind
        holder.wait()
    assert (out / ".lock").exists()
    with OutDirLock(out) as lock:
        assert lock.notice is not None and f"pid {holder.pid} " in lock.notice and "gone" in lock.notice
