"""Files that must never be seen half-written, and the lock that keeps two runs out of one out_dir.

    with atomic_write(path) as tmp:      # write tmp (a sibling path) any way you like
        torch.save(state, tmp)           # -> fsync, then renamed over `path`; on failure tmp is removed

    with OutDirLock(out_dir):            # a second run into out_dir fails at once, naming this one
        ...

Nothing here imports torch or numpy.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from gptkit.errors import UserError

try:  # POSIX
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; once the block has written it, flush it to disk and rename it
    over `path` (a rename is atomic on one file system). If the block fails, the temporary file is removed
    and `path` keeps its old content: a crash or a full disk never leaves a half-written file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


class OutDirBusyError(UserError):
    """Another live run holds the out_dir."""


class OutDirLock:
    """An exclusive lock on a run folder for the lifetime of a run, held by one process (rank 0).

    The lock is an OS file lock (flock) on `out_dir/.lock`, which also records who holds it (pid, host, start
    time) for the error message. The OS releases the lock when its process dies however it dies (kill -9,
    a crash, a power loss), so a lock file left behind by a dead run is recognised as stale: the next run
    takes it over and says so.
    """

    NAME = ".lock"

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / self.NAME
        self._fd: int | None = None
        self.notice: str | None = None  # set when a stale lock was taken over

    def acquire(self) -> OutDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_lock(fd):
                holder = _describe(_read_holder(fd))
                os.close(fd)
                raise OutDirBusyError(
                    f"{self.path.parent}/ is in use by another run ({holder}); wait for it to finish or stop it, "
                    f"or choose another --out_dir"
                )
            # The previous holder may have removed the file between our open and our lock: then we locked a
            # file that no longer has this name, and must start again on the new one.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read_holder(fd)
        if previous:
            self.notice = (f"took over the lock of {self.path.parent}/ left by a run that is gone "
                           f"({_describe(previous)})")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # Remove the name first, then drop the lock: a waiting run never sees our record as stale.
        self.path.unlink(missing_ok=True)
        os.close(self._fd)  # closing releases the OS lock
        self._fd = None

    def __enter__(self) -> OutDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except OSError:
        return False


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
