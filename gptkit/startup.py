"""Where a run's start goes: the seconds from the process' start to its config line, by phase (the imports, the
config, the device's start, the data's first read, the model's build, the rest of the setup: the batch size, the
wrappers, the loader and the optimizer; the compile comes with the first step, after), printed by
train.py as one line before its config and kept in runs.jsonl ("start"), so that a slow start on some machine
is named by a figure (BENCHMARKS.md, "The second run": train.py printed its config 13.3 s after its start on
one H200 host).

One trace per process at a time, begun by train.py's main (a run set up from Python without it records
nothing): `begin()`, then `mark(phase)` at the end of each phase, each phase's seconds counted on the process'
own clock (gptkit/runtime.py's process_elapsed, which counts the interpreter's start and the imports too).
"""

from __future__ import annotations

import torch

from gptkit.runtime import process_elapsed

_PHASES: dict[str, float] | None = None  # the trace begun by begin(): phase -> seconds, in order
_LAST = 0.0  # the process' age at the last mark


def begin() -> None:
    """Start the trace: its first phase, "imports", is the process' age now (the interpreter's start and every
    import before the script's main)."""
    global _PHASES, _LAST
    _LAST = process_elapsed()
    _PHASES = {"imports": round(_LAST, 2)}


def mark(phase: str, device: torch.device | None = None) -> None:
    """End `phase` now. With a CUDA `device`, wait for it first, so that its start (the context, made lazily)
    is counted in this phase, not the next."""
    global _LAST
    if _PHASES is None:
        return
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    now = process_elapsed()
    _PHASES[phase] = round(_PHASES.get(phase, 0.0) + now - _LAST, 2)
    _LAST = now


def record() -> dict[str, float] | None:
    """The trace so far, phase -> seconds (None: no trace begun)."""
    return dict(_PHASES) if _PHASES is not None else None


def line() -> str:
    """The trace as one line: `start: 13.3 s (imports 3.6 s, config 0.0 s, device 5.1 s, ...)`, the seconds from
    the process' start to the last mark."""
    phases = record()
    if phases is None:
        return "start: not traced"
    return (f"start: {sum(phases.values()):.1f} s (" + ", ".join(f"{name} {seconds:.1f} s"
                                                             for name, seconds in phases.items()) + ")")
