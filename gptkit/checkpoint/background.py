"""Saving a checkpoint without stopping the training loop for the write: the state is copied to CPU memory
(pinned, on a GPU, so that the copy runs at the bus' speed and in order with the steps on the device), and a
background thread checksums and writes the copy while the steps go on. Under FSDP, torch.distributed.checkpoint's
async_save does the same for each process' shards.

    with CheckpointSaver(background=True) as saver:   # leaving the block waits for the pending write
        ...
        saver.save(state, out_dir / "last.pt")         # returns once the state is copied
        saver.save_sharded(folder, record, model, optimizer)   # under FSDP (every process)

What a synchronous save guarantees holds here too: the file is written atomically with its checksums (a crash
mid-write leaves the previous checkpoint, whole), and saves happen in order: a save waits for the one before it
to finish. A write that fails is raised by the next call to save() or wait(), or printed when the block ends on
another error. With background=False, save() is save_checkpoint itself.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from gptkit.checkpoint.file import save_checkpoint
from gptkit.checkpoint.sharded import save_sharded


class CheckpointSaver:
    """One run's checkpoint writes, in order, each in the background (background=True) or in the caller."""

    def __init__(self, background: bool = False):
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}  # the CPU copies, kept for the next save (same shapes)
        self._future = None  # under FSDP: DCP's async_save future of this process' shards

    # ---- single-file checkpoints

    def save(self, obj: dict, path: str | Path, done: Callable[[], None] | None = None) -> None:
        """Save `obj` to `path` as save_checkpoint does; in the background, return once it is copied. `done`:
        called once the file is written (in the background: by the writing thread)."""
        self.wait()
        done = done or (lambda: None)
        if not self.background:
            save_checkpoint(obj, path)
            done()
            return
        snapshot, ready = self._copy(obj)
        self._start(lambda: (ready() if ready else None, save_checkpoint(snapshot, path), done()))

    def _copy(self, obj):
        """The nest `obj` with each tensor replaced by a CPU copy (tensors sharing their storage and view share
        their copy, as torch.save would store them once), and a function that waits for the copies from a GPU
        (None when there is none): they run in order with the device's work, so the steps that follow cannot
        change what is copied."""
        seen: dict[tuple, torch.Tensor] = {}
        devices: set[torch.device] = set()
        kept = self._buffers
        self._buffers = {}  # this save's buffers only: a state of another shape does not keep the old ones

        def copy(t: torch.Tensor) -> torch.Tensor:
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
            if t.numel() and key in seen:
                return seen[key]
            t = t.detach()
            slot = (len(seen), t.dtype, tuple(t.shape))
            buf = kept.get(slot)
            if buf is None or buf.is_pinned() != (t.device.type == "cuda"):
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            self._buffers[slot] = buf
            if t.device.type == "cuda":
                devices.add(t.device)
            buf.copy_(t, non_blocking=t.device.type == "cuda")
            seen[key] = buf
            return buf

        def walk(x):
            if isinstance(x, torch.Tensor):
                return copy(x)
            if isinstance(x, dict):
                return {k: walk(v) for k, v in x.items()}
            if isinstance(x, list):
                return [walk(v) for v in x]
            if isinstance(x, tuple):
                return tuple(walk(v) for v in x)
            return x  # numbers, strings, None: immutable

        snapshot = walk(obj)
        if not devices:
            return snapshot, None
        events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return snapshot, lambda: [e.synchronize() for e in events]

    # ---- sharded checkpoints (FSDP)

    def save_sharded(self, path: str | Path, record: dict | None, model: torch.nn.Module, optimizer, *,
                     adapters_only: bool = False, done: Callable[[], None] | None = None) -> None:
        """save_sharded (gptkit/checkpoint/sharded.py), every process at once; in the background, DCP's
        async_save stages each process' shards to CPU memory and writes them from a thread, and rank 0 (which
        passes `record`) finishes the folder (checksums, record, renames) in the background once every process
        has written. `done`: called on rank 0 once the folder is in place."""
        self.wait()
        done = done or (lambda: None)
        if not self.background:
            save_sharded(path, record, model, optimizer, adapters_only=adapters_only)
            if record is not None:
                done()
            return
        future, finish = save_sharded(path, record, model, optimizer, adapters_only=adapters_only,
                                      asynchronous=True)
        self._future = future
        if finish is not None:
            self._start(lambda: (future.result(), finish(), done()))

    # ---- waiting

    def _start(self, work) -> None:
        def run():
            try:
                work()
            except BaseException as e:  # raised in the caller's thread by the next save() or wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=False)
        self._thread.start()

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the pending write (if any) is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._future is not None:
            self._future.result()
            self._future = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def __enter__(self) -> CheckpointSaver:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wait()
            return
        try:  # leaving on another error: the pending write still completes, and its own failure is printed
            self.wait()
        except BaseException as e:
            print(f"error: the checkpoint being written in the background failed too: {e}", file=sys.stderr)
