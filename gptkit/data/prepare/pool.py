"""Run a function over a stream of tasks on worker processes, results in the tasks' order, a bounded number ahead.

    for task, result in ordered_map(encode_task, tasks, workers=8, initializer=init, initargs=(spec,)):
        write(result)                                   # same results, same order, whatever `workers` is

Processes, not threads, because they paid (preliminary, 2-core VM at load 1-2; benchmarks/prepare_scale.py,
BENCHMARKS.md). tiktoken releases the GIL while it encodes, so threads scale too, but the Python around it
(reading, decoding UTF-8, finding cuts, converting ids, writing) makes them contend: on 1 GB of text (337M
GPT-2 tokens) two processes ran 1.90x as fast as one (5.64 vs 2.97M tokens/s) for the same CPU time
(113.4 vs 113.1 s), two threads 1.73x (4.86 vs 2.81M) for 10% more CPU (131.6 vs 119.4 s). Processes also
scale whatever a tokenizer does with the GIL. Their price: each worker holds its own tokenizer (peak RSS 238 MB
with two workers, 69 MB in one process) and takes about a second to start (100 MB: processes 1.35x, threads
up to 1.8x), so small inputs are tokenised in the parent (``workers <= 1``).

Workers are started with "spawn" (the same on Linux, macOS and Windows, and safe in a parent that has
threads, e.g. train.py with torch loaded); each builds its state once (the tokenizer) in ``initializer``.
Results are consumed in submission order and at most ``ahead`` tasks are submitted and not yet consumed, so
memory holds a fixed number of tasks whatever the length of the stream. A worker whose parent was killed
(kill -9) notices and exits instead of lingering.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from gptkit.errors import UserError

T = TypeVar("T")
R = TypeVar("R")

EXECUTOR = "process"  # or "thread": kept only so the benchmark can measure the choice above


class WorkerError(UserError):
    """A worker process died without a Python error: killed (out of memory?) or unable to start."""


def ordered_map(
    fn: Callable[[T], R],
    tasks: Iterable[T],
    workers: int,
    *,
    initializer: Callable[..., None] | None = None,
    initargs: tuple = (),
    ahead: int | None = None,
) -> Iterator[tuple[T, R]]:
    """Yield (task, fn(task)) for each task in order. workers <= 1 runs everything in this process (after
    calling initializer here); otherwise `workers` processes share the work with at most `ahead` (default
    2 per worker) tasks in flight. A task's exception is raised here, in order, and stops the rest."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        for task in tasks:
            yield task, fn(task)
        return
    ahead = ahead or 2 * workers
    if EXECUTOR == "thread":
        if initializer is not None:
            initializer(*initargs)
        pool: Any = ThreadPoolExecutor(workers)
    else:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(os.getpid(), initializer, initargs))
    pending: deque[tuple[T, Future]] = deque()
    try:
        for task in tasks:
            pending.append((task, pool.submit(fn, task)))
            if len(pending) >= ahead:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    except BrokenProcessPool:
        raise WorkerError(
            "a worker process died (killed, or out of memory?), or could not start (a script that starts workers "
            "needs `if __name__ == \"__main__\":`); run the same command again to continue, or use --num_proc 1"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _start_worker(parent: int, initializer: Callable[..., None] | None, initargs: tuple) -> None:
    # Ctrl-C reaches every process of the terminal's group: the parent handles it and shuts the pool down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


def _exit_with_parent(parent: int) -> None:
    """A parent killed with SIGKILL never tells its pool to stop, and the workers would wait for tasks
    forever: exit once the parent is gone (the worker is re-parented)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
