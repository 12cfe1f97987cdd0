"""The one way a script fails: a user error is one `error: ...` line on stderr and exit code 1; a bug keeps
its traceback.

    class DataError(UserError): ...          # every module's own error type derives from UserError

    @cli.entry_point(oom_hint="lower --batch_size")
    def main(argv=None): ...

    if __name__ == "__main__":
        main()

Nothing here imports torch: the prepare scripts use it too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Callable

from gptkit.errors import UsageError, UserError

EXIT_ERROR = 1  # every script, every kind of user error (bad option, missing file, no network, ...)
QUIET_WAIT_S = 30.0  # _leave_quietly


def one_line(text: object) -> str:
    """Collapse a (library's) message to a single line, so errors keep the one-line contract."""
    return " ".join(str(text).split())


def describe_os_error(e: OSError) -> str:
    """'No space left on device: out/last.pt' rather than '[Errno 28] No space left on device: ...'."""
    reason = e.strerror or one_line(e)
    return f"{reason}: {e.filename}" if e.filename else reason


def entry_point(oom_hint: str = "use a smaller batch or model") -> Callable:
    """Wrap a script's `main(argv=None)`: user errors and OS errors become the one-line exit, Ctrl-C a short
    'interrupted', a closed stdout pipe (`| head`) a quiet exit; anything else is a bug and keeps its
    traceback. `oom_hint` completes the out-of-GPU-memory message. Under torchrun an error that every process
    meets alike (UserError.every_rank) is said by the first process of each machine (LOCAL_RANK 0) only; the
    others exit with the same code, quietly."""

    def wrap(main: Callable) -> Callable:
        @functools.wraps(main)
        def wrapped(argv: list[str] | None = None):
            try:
                return main(argv)
            except UserError as e:
                if e.every_rank and os.environ.get("LOCAL_RANK", "0") != "0":
                    _leave_quietly()
                fail(one_line(e))
            except BrokenPipeError:
                # The reader left. Pointing stdout at /dev/null keeps Python's final flush of the unwritten
                # text from raising (and printing) the same error again at exit.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                sys.exit(EXIT_ERROR)
            except OSError as e:  # an unwritable folder, a full disk, a missing file
                fail(describe_os_error(e))
            except KeyboardInterrupt:
                sys.exit("\ninterrupted")
            except Exception as e:
                if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch
                    fail(f"out of GPU memory; {oom_hint}")
                raise

        return wrapped

    return wrap


def fail(message: str) -> None:
    """The one-line exit."""
    _tell_torchrun(f"error: {message}")
    sys.exit(f"error: {message}")


def _leave_quietly() -> None:
    """A process of a torchrun job that meets the error its machine's first process says. Under torchrun it
    waits (QUIET_WAIT_S at most) for torchrun to stop it once that process has failed: exiting at once, it
    could be first, and torchrun would stop the process that says the error before it has.

    Its line for torchrun's summary is written when it leaves (stopped by torchrun, or at the end of the wait),
    not when it meets the error: torchrun names the failure with the earliest time as the root cause, and a
    process that met the error a second before the first one would otherwise be named instead of it."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        sys.exit(EXIT_ERROR)

    def leave(*_):
        _tell_torchrun("the same error as local rank 0's")
        os._exit(EXIT_ERROR)  # (from a signal handler too: no exit handlers to run twice)

    signal.signal(signal.SIGTERM, leave)
    time.sleep(QUIET_WAIT_S)
    leave()


def _tell_torchrun(message: str) -> None:
    """Under torchrun, the failure's line in the file torchrun reads for each process that fails, so its summary
    of the failures shows it instead of a link to its docs (torchrun still raises its own traceback: it does for
    any process that exits with an error)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            # (torchrun's own layout, whose "py_callstack" its summary shows: here the line, as there is no bug)
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    except OSError:  # a summary without our line: the line above it still says it
        pass


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line is a UsageError: the same one-line `error:` and exit code as every
    other mistake (argparse alone prints the usage and exits with 2)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")
